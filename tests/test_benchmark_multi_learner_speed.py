"""`benchmarks/multi_learner_speed.py` prints one JSON line per size with every figure."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow  # two Learner processes: minutes on a 2-core machine
def test_multi_learner_speed_smoke_run_prints_the_figures():
    script = os.path.join(ROOT, "benchmarks", "multi_learner_speed.py")
    proc = subprocess.run(
        [sys.executable, script, "--smoke"], capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["size"] == "nano" and (result["B"], result["T"], result["H"]) == (4, 8, 3)
    for key in ("local_xla_s", "local_graph_s", "learners_2_s", "allreduce_2_s"):
        assert result[key] > 0, key
