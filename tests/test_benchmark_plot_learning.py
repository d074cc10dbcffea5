"""benchmarks/plot_learning.py reads the curves of benchmarks/learning.py's JSON lines."""

import sys

import plot_learning
import pytest


def test_read_curve_keeps_iterations_with_a_return(tmp_path):
    path = tmp_path / "run.jsonl"
    path.write_text(
        "\n".join(
            [
                '{"iteration": 1, "env_steps": 1024, "episode_return_mean": NaN}',
                "WARNING some library noise",
                '{"iteration": 2, "env_steps": 1524, "episode_return_mean": 21.5}',
                '{"dreams": ["a.png"], "obs_mse_open_loop": 0.1}',
                '{"iteration": 3, "env_steps": 2024, "episode_return_mean": null}',
                '{"iteration": 4, "env_steps": 2524, "episode_return_mean": 40.0}',
                '{"experiment": "x", "done": true, "stop": "x", "wall_s": 9.0}',
            ]
        )
    )
    assert plot_learning.read_curve(path) == ([1524, 2524], [21.5, 40.0])


def test_plot_writes_a_png(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")  # the `plot` extra
    run = tmp_path / "seed0.jsonl"
    run.write_text('{"env_steps": 1, "episode_return_mean": 1.0}\n')
    out = tmp_path / "curve.png"
    argv = [str(out), str(run), "--goal", "2", "--frames-per-step", "2", "--reference", "1:0.5"]
    monkeypatch.setattr(sys, "argv", ["plot_learning.py", *argv])
    plot_learning.main()
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
