"""`benchmarks/multi_learner_speed.py` prints one JSON line per size with every figure."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args, timeout):
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "multi_learner_speed.py"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
    )


def test_multi_learner_speed_prints_the_figures():
    proc = _run(
        *("--sizes", "nano", "--updates", "2", "--batch-size", "4"),
        *("--batch-length", "8", "--horizon", "3"),
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["size"] == "nano" and (result["B"], result["T"], result["H"]) == (4, 8, 3)
    for key in ("local_xla_s", "local_graph_s", "learners_2_s", "allreduce_2_s"):
        assert result[key] > 0, key
    assert result["threads_per_learner"] >= 1


def test_multi_learner_speed_rejects_learner_counts_that_do_not_divide_the_batch():
    proc = _run("--learners", "3", "--batch-size", "16", timeout=120)
    assert proc.returncode == 2 and "--learners 3" in proc.stderr
