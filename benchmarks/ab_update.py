"""A/B timing of code variants of the compiled update, side by side in one process.

Backs docs/performance.md: the summary's "fast kernels vs plain reference" rows, the table
*Fast kernels against the plain reference* and the A/B figures of *What makes the update fast*.

Usage: python benchmarks/ab_update.py SIZE --variant NAME=FILE.py:FUNCTION [--variant ...]
           [--inputs vector|image] [--actions discrete|continuous] [--rounds 6] [--per-round 3]

The machine's speed drifts within a day, so versions of the code are timed side by side: one
Learner per variant in this process, `base` (the code as it is) and one per `--variant`, whose
FUNCTION (in FILE.py) patches the code right before that Learner is built
and its update compiled, and returns a callable that undoes the patch (or None). The bare
compiled updates (B=16, T=64, H=15, random batches) then run in interleaved rounds of
`--per-round` calls; one JSON line gives per variant the median of its round medians, and in
how many rounds it beat `base`. Example patch file (the plain reference against the fused
kernels, i.e. `fast_kernels=False` against the default)::

    from rllib_dreamerv3 import losses, update

    def plain():
        saved = update.kernels
        update.kernels = losses  # make_update_fn then uses the reference either way
        return lambda: setattr(update, "kernels", saved)

    # python benchmarks/ab_update.py XS --variant plain=patch.py:plain
"""

import itertools
import os
import runpy

import common
import numpy as np
import tensorflow as tf
from ray.rllib.core import DEFAULT_MODULE_ID

from rllib_dreamerv3 import DreamerV3Config
from rllib_dreamerv3.spaces import action_dim, obs_storage_dtype
from rllib_dreamerv3.update import batch_signature


def load_patch(spec):
    """`(name, function)` from `NAME=FILE.py:FUNCTION`."""
    name, _, target = spec.partition("=")
    path, _, func = target.rpartition(":")
    if not (name and path.endswith(".py") and func) or name == "base":
        raise ValueError(f"--variant {spec!r}: expected NAME=FILE.py:FUNCTION, NAME not 'base'.")
    if not os.path.exists(path):
        raise ValueError(f"--variant {spec!r}: no file {path!r}.")
    function = runpy.run_path(path).get(func)
    if not callable(function):
        raise ValueError(f"--variant {spec!r}: {path!r} has no function {func!r}.")
    return name, function


def interleaved(steps, rounds, per_round):
    """Call every `steps[name]()` `per_round` times per round, variants in turn, for `rounds`
    rounds: `{name: [median seconds of each round]}`."""
    times = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            times[name].append(float(np.median(common.timed(step, per_round))))
    return times


def summarize(times, base="base"):
    """`{"median_of_rounds": {name: s}, "rounds_faster_than_base": {name: count}}`."""
    return {
        "median_of_rounds": {name: common.median(t) for name, t in times.items()},
        "rounds_faster_than_base": {
            name: sum(a < b for a, b in zip(t, times[base]))
            for name, t in times.items()
            if name != base
        },
    }


def build_step(size, inputs, actions):
    """Build a Learner for the current code, compile its update; a `step()` timing one call."""
    obs_space, action_space = common.spaces(inputs, actions)
    config = (
        DreamerV3Config()
        .environment(observation_space=obs_space, action_space=action_space)
        .training(model_size=size)
    )
    learner = config.build_learner(spaces={DEFAULT_MODULE_ID: (obs_space, action_space)})
    B, T = config.batch_size_B, config.batch_length_T
    dtype = tf.as_dtype(obs_storage_dtype(obs_space))
    signature = batch_signature(obs_space.shape, dtype, action_dim(action_space), B, T)
    rng = np.random.default_rng(0)
    batches = [
        {
            key: tf.constant(value, signature[key].dtype)
            for key, value in common.random_batch(rng, obs_space, action_space, B, T).items()
        }
        for _ in range(2)
    ]
    seed = tf.constant([0, 1], tf.int32)
    update_fn = learner._update_fn  # the bare compiled update (no RLlib plumbing)
    calls = itertools.count()

    def step():
        update_fn(batches[next(calls) % 2], seed)["L_world_model"].numpy()

    step()  # trace and compile while the variant's patch is applied
    step()
    return step


def main(argv=None):
    parser = common.parser(__doc__)
    parser.add_argument("size")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=FILE.py:FUNC")
    parser.add_argument("--inputs", choices=["vector", "image"], default="vector")
    parser.add_argument("--actions", choices=["discrete", "continuous"], default="discrete")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--per-round", type=int, default=3)
    args = parser.parse_args(argv)
    if not args.variant:
        parser.error("give at least one --variant NAME=FILE.py:FUNCTION to compare with base")
    if args.rounds < 1 or args.per_round < 1:
        parser.error("--rounds and --per-round must be at least 1")
    patches = dict([("base", None)] + [load_patch(spec) for spec in args.variant])
    steps = {}
    for name, patch in patches.items():
        undo = patch() if patch is not None else None
        try:
            steps[name] = build_step(args.size, args.inputs, args.actions)
        finally:
            if undo is not None:
                undo()
        common.log(f"[ab_update] built {name}")
    times = interleaved(steps, args.rounds, args.per_round)
    common.emit({**vars(args), **summarize(times), **common.machine()})


if __name__ == "__main__":
    main()
