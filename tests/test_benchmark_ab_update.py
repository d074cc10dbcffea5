"""benchmarks/ab_update.py: interleaved timing, its summary, and how variants are named."""

import os

import ab_update
import pytest


class FakeClock:
    """A clock that each fake step advances by its own duration."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_interleaved_times_every_variant_in_turn_and_summarizes_per_round_medians():
    clock, order = FakeClock(), []
    durations = {
        "base": iter([1.0, 1.0, 9.0, 2.0, 2.0, 2.0]),  # round medians 1.0, 2.0
        "fast": iter([0.5, 3.0, 0.5, 2.5, 2.5, 2.5]),
    }  # round medians 0.5, 2.5

    def step_of(name):
        def step():
            order.append(name)
            clock.now += next(durations[name])

        return step

    times = ab_update.interleaved(
        {n: step_of(n) for n in durations}, rounds=2, per_round=3, clock=clock
    )
    assert order == ["base"] * 3 + ["fast"] * 3 + ["base"] * 3 + ["fast"] * 3
    assert times == {"base": [1.0, 2.0], "fast": [0.5, 2.5]}
    assert ab_update.summarize(times) == {
        "median_of_rounds": {"base": 1.5, "fast": 1.5},
        "rounds_faster_than_base": {"fast": 1},
    }


def test_load_patch_from_a_file_and_from_a_module(tmp_path):
    path = tmp_path / "patch.py"
    path.write_text("def mine():\n    return lambda: None\n")
    name, patch = ab_update.load_patch(f"try={path}:mine")
    assert name == "try" and callable(patch())
    name, patch = ab_update.load_patch("m=os.path:join")
    assert name == "m" and patch is os.path.join


@pytest.mark.parametrize(
    "spec, message",
    [
        ("nofunction=patch.py", "NAME=FILE.py:FUNCTION"),
        ("base=os.path:join", "other than 'base'"),
        ("x=/no/such/file.py:f", "no file"),
        ("x=os.path:no_such_function", "no function"),
    ],
)
def test_load_patch_rejects_bad_specs_naming_the_fix(spec, message):
    with pytest.raises(ValueError, match=message):
        ab_update.load_patch(spec)


def test_main_needs_a_variant():
    with pytest.raises(SystemExit):
        ab_update.main(["nano"])
