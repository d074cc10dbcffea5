"""Runs each module of `conftest.ISOLATED_MODULES` in a fresh interpreter when the suite runs as a
whole, so that their XLA programs do not count against the suite process's memory-map limit."""

import os
import re
import subprocess
import sys

import pytest
from conftest import ISOLATED_CHILD_ENV, ISOLATED_MODULES

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.parametrize("module", ISOLATED_MODULES)
def test_module_passes_in_a_fresh_process(module, request):
    marker_expression = request.config.getoption("markexpr") or "not slow"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
        + ["-m", marker_expression, os.path.join(HERE, module)],
        capture_output=True,
        text=True,
        timeout=1500,
        cwd=os.path.dirname(HERE),
        env={**os.environ, ISOLATED_CHILD_ENV: "1"},
    )
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert re.search(r"\b[1-9]\d* passed", summary) and "failed" not in summary, summary
