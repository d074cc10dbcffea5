"""benchmarks/gpu_update_speed.py: our update lowered to HLO here, replayed by jaxlib elsewhere."""

import gzip
import json
import os
import subprocess
import sys

import numpy as np
import pytest

BENCHMARKS = os.path.join(os.path.dirname(__file__), "..", "benchmarks")
sys.path.insert(0, BENCHMARKS)

import gpu_update_speed as gus  # noqa: E402

HEADER = (
    "HloModule a_inference_update_1__.9, input_output_alias={ {3}: (6, {}, may-alias), "
    "{4}: (9, {}, may-alias) }, entry_computation_layout={(f32[2]{0})->(f32[])}"
)


def test_aliases_are_read_from_the_module_header():
    assert gus._aliases(HEADER + "\n\nENTRY ...") == [(3, 6), (4, 9)]
    assert gus._aliases("HloModule m, entry_computation_layout={()->()}\n") == []


def test_host_params_are_exact_constant_or_redrawn_with_the_recorded_moments():
    meta = {
        "params": [
            {"shape": [3], "dtype": "float32", "exact": True},
            {"shape": [64, 64], "dtype": "float32", "exact": False, "mean": 1.0, "std": 0.0},
            {"shape": [400, 500], "dtype": "float32", "exact": False, "mean": 0.5, "std": 2.0},
            {"shape": [2, 64, 64, 3], "dtype": "uint8", "exact": False, "uniform_uint8": True},
            {"shape": [], "dtype": "int64", "exact": True},
        ]
    }
    exact = {"p0": np.array([1.0, 2.0, 3.0], np.float32), "p4": np.array(7, np.int64)}
    values = gus._host_params(meta, exact, np.random.default_rng(0))
    np.testing.assert_array_equal(values[0], exact["p0"])
    assert values[1].dtype == np.float32 and np.all(values[1] == 1.0)
    assert values[2].shape == (400, 500) and values[2].dtype == np.float32
    assert abs(values[2].mean() - 0.5) < 0.02 and abs(values[2].std() - 2.0) < 0.02
    assert values[3].dtype == np.uint8 and values[3].shape == (2, 64, 64, 3)
    assert values[3].min() < 10 and values[3].max() > 245
    assert values[4] == 7 and values[4].dtype == np.int64


def _run(command, *args):
    """`gpu_update_speed.py COMMAND ARGS` in a subprocess; its stdout (it must succeed)."""
    out = subprocess.run(
        [sys.executable, os.path.join(BENCHMARKS, "gpu_update_speed.py"), command, *args],
        capture_output=True,
        text=True,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def _export_nano(out_dir, *extra):
    return _run(
        "export",
        "--out",
        str(out_dir),
        "--sizes",
        "nano",
        "--inputs",
        "vector",
        "--precisions",
        "float32",
        *extra,
    )


def test_export_writes_a_module_whose_parameters_and_aliases_match_the_update(tmp_path):
    _export_nano(tmp_path)
    name = "nano-vector-discrete-float32"
    meta = json.loads((tmp_path / f"{name}.json").read_text())
    with gzip.open(tmp_path / f"{name}.hlo.pb.gz", "rb") as f:
        proto = f.read()
    assert len(proto) > 10_000
    # the batch (actions, is_first, is_terminal, obs, rewards) and the seed come first ...
    params = meta["params"]
    assert meta["num_batch_params"] == 6
    assert [p["shape"] for p in params[:6]] == [
        [16, 64, 2],
        [16, 64],
        [16, 64],
        [16, 64, 4],
        [16, 64],
        [2],
    ]
    assert all(p["exact"] for p in params[:6])
    # ... then every variable: the model's (the EMA critic's too) and two Adam slots for each
    # trained one
    float_params = sum(int(np.prod(p["shape"])) for p in params[6:] if p["dtype"] == "float32")
    assert 2 * meta["num_parameters"] < float_params < 3 * meta["num_parameters"]
    # every variable the update writes is aliased to one output, after the 26 metrics
    aliases = meta["aliases"]
    assert len(meta["metric_names"]) == 26 and "L_world_model" in meta["metric_names"]
    assert "skipped_world_model" in meta["metric_names"]
    assert len(aliases) > 100
    assert sorted(o for o, _ in aliases) == list(range(26, 26 + len(aliases)))
    assert all(6 <= p < len(params) for _, p in aliases)
    assert len({p for _, p in aliases}) == len(aliases)
    npz = np.load(tmp_path / f"{name}.npz")
    assert {f"p{i}" for i, p in enumerate(params) if p["exact"]} == set(npz.files)


def test_replay_reproduces_tfs_own_update(tmp_path):
    """Needs jax (not a dependency): the replayed metrics equal TF's call of the update."""
    pytest.importorskip("jax")
    _export_nano(tmp_path, "--exact")
    stdout = _run("replay", "--dir", str(tmp_path), "--updates", "2", "--check", "--no-peak")
    row = json.loads(stdout.strip().splitlines()[-1])
    assert "error" not in row, row
    assert row["check_max_rel_diff"] < 1e-3 and row["finite"]


def test_busy_time_is_the_union_of_overlapping_kernel_intervals():
    class Event:
        def __init__(self, start, end):
            self.start_ns, self.end_ns = start, end

    events = [Event(10, 20), Event(0, 5), Event(15, 30), Event(18, 25), Event(40, 41)]
    assert gus._busy_ns(events) == 5 + 20 + 1  # [0,5) + [10,30) + [40,41)
    assert gus._busy_ns([]) == 0
