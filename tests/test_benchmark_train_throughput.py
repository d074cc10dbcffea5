"""benchmarks/train_throughput.py: its breakdown accounts for the whole wall clock."""

import json

import pytest
import train_throughput


def test_smoke_run_breakdown_adds_up_to_the_wall_clock(capsys):
    train_throughput.main(["--smoke", "--no-torch"])  # one update per env step
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    ours = next(line for line in lines if line.get("algorithm") == "ours")
    # The first update, at the end of the warm-up, comes one early.
    assert ours["env_steps"] >= 12 and abs(ours["updates"] - ours["env_steps"]) <= 1
    breakdown = ours["breakdown_ms_per_update"]
    assert set(breakdown) == set(train_throughput.PIECES) | {"iteration_overhead"}
    total_ms = sum(breakdown.values()) * ours["updates"]
    assert total_ms == pytest.approx(1000 * ours["wall_s"], rel=0.02)
    assert breakdown["update_compiled"] > 0 and breakdown["sample"] > 0
    # A local EnvRunner acts with the local Learner's module: nothing to sync.
    assert breakdown["weight_sync"] == 0
    assert 0 < ours["end_to_end_fraction"] < 1
