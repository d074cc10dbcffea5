"""benchmarks/ab_update.py times its variants in turn, round by round."""

import ab_update


def test_interleaved_times_every_variant_in_turn_and_summarizes_per_round_medians():
    order = []
    steps = {name: (lambda name=name: order.append(name)) for name in ("base", "fast")}
    times = ab_update.interleaved(steps, rounds=2, per_round=3)
    assert order == ["base"] * 3 + ["fast"] * 3 + ["base"] * 3 + ["fast"] * 3
    assert {name: len(t) for name, t in times.items()} == {"base": 2, "fast": 2}
    assert ab_update.summarize({"base": [1.0, 2.0], "fast": [0.5, 2.5]}) == {
        "median_of_rounds": {"base": 1.5, "fast": 1.5},
        "rounds_faster_than_base": {"fast": 1},
    }
