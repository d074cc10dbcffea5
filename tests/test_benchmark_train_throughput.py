"""benchmarks/train_throughput.py: its breakdown accounts for the whole wall clock."""

import json

import pytest
import train_throughput


def test_breakdown_adds_up_to_the_wall_clock(capsys):
    train_throughput.main(
        [
            "--batch-size-B=2",
            "--batch-length-T=8",
            "--horizon-H=3",
            "--training-ratio=16",  # B*T: one update per env step
            "--steps=6",
            "--iterations=2",
            "--warmup-iterations=1",
            "--bare-updates=2",
            "--no-torch",
            '--config={"num_steps_sampled_before_learning_starts": 32}',
        ]
    )
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    ours = next(line for line in lines if line.get("algorithm") == "ours")
    # One update per env step (the first update, at the end of the warm-up, comes one early).
    assert ours["env_steps"] >= 12 and abs(ours["updates"] - ours["env_steps"]) <= 1
    breakdown = ours["breakdown_ms_per_update"]
    assert set(breakdown) == set(train_throughput.PIECES) | {"iteration_overhead"}
    total_ms = sum(breakdown.values()) * ours["updates"]
    assert total_ms == pytest.approx(1000 * ours["wall_s"], rel=0.02)
    assert breakdown["update_compiled"] > 0 and breakdown["sample"] > 0
    # A local EnvRunner acts with the local Learner's module: nothing to sync.
    assert breakdown["weight_sync"] == 0
    assert 0 < ours["end_to_end_fraction"] < 1
