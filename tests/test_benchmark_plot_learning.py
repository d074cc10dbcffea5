"""benchmarks/plot_learning.py plots the curves of benchmarks/learning.py's JSON lines."""

import sys

import plot_learning
import pytest


def test_plot_learning_reads_the_returns_and_writes_a_png(tmp_path, monkeypatch):
    run = tmp_path / "seed0.jsonl"
    lines = [
        '{"iteration": 1, "env_steps": 1024, "episode_return_mean": NaN}',
        "WARNING some library noise",
        '{"iteration": 2, "env_steps": 1524, "episode_return_mean": 21.5}',
        '{"dreams": ["a.png"], "obs_mse_open_loop": 0.1}',
        '{"iteration": 3, "env_steps": 2024, "episode_return_mean": null}',
        '{"iteration": 4, "env_steps": 2524, "episode_return_mean": 40.0}',
    ]
    run.write_text("\n".join(lines))
    assert plot_learning.read_curve(run) == ([1524, 2524], [21.5, 40.0])
    pytest.importorskip("matplotlib")  # the `plot` extra
    out = tmp_path / "curve.png"
    argv = [str(out), str(run), "--goal", "2", "--frames-per-step", "2", "--reference", "1:0.5"]
    monkeypatch.setattr(sys, "argv", ["plot_learning.py", *argv])
    plot_learning.main()
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
