"""Runs `test_multi_learner.py` (marked `slow`) in a fresh interpreter as part of the default
suite: its Learner actors, TF clusters and Ray restarts stay out of the suite's own process."""

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def test_multi_learner_tests_pass_in_a_fresh_process():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-m",
            "slow",
            "-p",
            "no:cacheprovider",
            os.path.join(HERE, "test_multi_learner.py"),
        ],
        capture_output=True,
        text=True,
        timeout=1200,
        cwd=os.path.dirname(HERE),
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
    )
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "6 passed" in summary, summary
