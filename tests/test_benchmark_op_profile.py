"""benchmarks/op_profile.py reads per-operation XLA times out of a profiler trace."""

import json
import os
import subprocess
import sys

BENCHMARKS = os.path.join(os.path.dirname(__file__), "..", "benchmarks")

SCRIPT = """
import json, sys
sys.path.insert(0, sys.argv[1])
import op_profile  # sets XLA_FLAGS before TensorFlow compiles anything
import tensorflow as tf
fn = tf.function(lambda a, b: a @ b, jit_compile=True, autograph=False)
a, b = tf.ones([256, 512]), tf.ones([512, 128])
fn(a, b)
seconds, ops = op_profile.profile_ops(fn, (a, b), runs=4)
print(json.dumps({"seconds": seconds, "ops": ops}))
"""


def _run(script):
    """Run `script` in a fresh interpreter (op_profile must set XLA_FLAGS before TensorFlow
    compiles anything) and return the JSON of its last line."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    out = subprocess.run(
        [sys.executable, "-c", script, BENCHMARKS],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_profile_ops_sees_the_matmul_once_per_run():
    result = _run(SCRIPT)
    assert result["seconds"] > 0
    ops = result["ops"]
    assert ops, "no XLA operations found in the trace"
    matmuls = {
        name: v
        for name, v in ops.items()
        if any(key in name.lower() for key in ("dot", "matmul", "ynn"))
    }
    assert matmuls, f"no matmul among {sorted(ops)}"
    assert all(calls == 1.0 and ms > 0 for ms, calls in matmuls.values()), matmuls


TIMELINE = """
import json, sys
sys.path.insert(0, sys.argv[1])
import op_profile
import tensorflow as tf
fn = tf.function(lambda a, b: tf.tanh(a @ b) @ tf.transpose(b), jit_compile=True,
                 autograph=False)
a, b = tf.ones([512, 512]), tf.ones([512, 256])
fn(a, b)
print(json.dumps(op_profile.busy_timeline(fn, (a, b), segments=4)))
"""


def test_busy_timeline_cuts_one_run_into_segments():
    result = _run(TIMELINE)
    assert result["wall_ms"] > 0
    segments = result["segments"]
    assert len(segments) == 4
    assert [s["start_ms"] for s in segments] == sorted(s["start_ms"] for s in segments)
    for s in segments:
        assert 0.0 <= s["busy_two"] <= s["busy_one"] <= 1.0
    assert max(s["busy_one"] for s in segments) > 0.5
    kinds = {kind.lower() for s in segments for kind, _ in s["top"]}
    assert any(key in kind for kind in kinds for key in ("dot", "matmul", "ynn")), kinds
