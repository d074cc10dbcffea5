"""A/B timing of code variants of the compiled update, side by side in one process.

Usage: python benchmarks/ab_update.py SIZE --variant NAME=FILE.py:FUNCTION [--variant ...]
           [--inputs vector|image] [--actions discrete|continuous] [--rounds 6] [--per-round 3]

This machine's speed drifts by up to a quarter within a day, so two versions of the code are only
comparable when timed side by side. The script builds one Learner per variant in one process:
`base` (the code as it is) and one per `--variant`, whose FUNCTION (in FILE.py, or a module
`pkg.mod:FUNCTION`) is called right before that variant's Learner is built and its update traced
and compiled, and returns a callable that undoes its patch (or None), called right after; each
compiled update thus keeps its own version of the code. Then it times the bare compiled updates
(B=16, T=64, H=15, random batches) in interleaved rounds of `--per-round` calls each and prints
one JSON line: per variant the median over rounds of its per-round median seconds, and in how
many rounds it beat `base`. Example patch file (the plain reference losses against the fused
kernels, i.e. `fast_kernels=False` against the default)::

    from rllib_dreamerv3 import losses, update

    def plain():
        saved = update.kernels
        update.kernels = losses  # make_update_fn then uses the reference either way
        return lambda: setattr(update, "kernels", saved)

    # python benchmarks/ab_update.py XS --variant plain=patch.py:plain
"""

import argparse
import importlib
import importlib.util
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402


def load_patch(spec):
    """`(name, function)` from `NAME=FILE.py:FUNCTION` or `NAME=package.module:FUNCTION`."""
    name, sep, target = spec.partition("=")
    where, sep2, func = target.rpartition(":")
    if not (sep and sep2 and name and where and func) or name == "base":
        raise ValueError(
            f"--variant {spec!r}: expected NAME=FILE.py:FUNCTION or "
            "NAME=package.module:FUNCTION, with NAME other than 'base'."
        )
    if where.endswith(".py"):
        if not os.path.exists(where):
            raise ValueError(f"--variant {spec!r}: no file {where!r}.")
        module_spec = importlib.util.spec_from_file_location(f"ab_patch_{name}", where)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    if not callable(getattr(module, func, None)):
        raise ValueError(f"--variant {spec!r}: {where!r} has no function {func!r}.")
    return name, getattr(module, func)


def interleaved(steps, rounds, per_round, clock=time.perf_counter):
    """Call every `steps[name]()` `per_round` times per round, variants in turn, for `rounds`
    rounds: `{name: [median seconds of each round]}`."""
    times = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            calls = []
            for _ in range(per_round):
                start = clock()
                step()
                calls.append(clock() - start)
            times[name].append(float(np.median(calls)))
    return times


def summarize(times, base="base"):
    """`{"median_of_rounds": {name: s}, "rounds_faster_than_base": {name: count}}`."""
    return {
        "median_of_rounds": {name: round(float(np.median(t)), 4) for name, t in times.items()},
        "rounds_faster_than_base": {
            name: sum(a < b for a, b in zip(t, times[base]))
            for name, t in times.items()
            if name != base
        },
    }


def build_step(size, inputs, actions):
    """Build a Learner for the current code, compile its update; a `step()` timing one call."""
    import tensorflow as tf
    from ray.rllib.core import DEFAULT_MODULE_ID
    from update_speed import make_spaces, random_batch  # this script's folder is on sys.path

    from rllib_dreamerv3 import DreamerV3Config
    from rllib_dreamerv3.spaces import action_dim, obs_storage_dtype
    from rllib_dreamerv3.update import batch_signature

    spaces = make_spaces(inputs, actions, argparse.Namespace(obs_dim=4, num_actions=2))
    obs_space, action_space = spaces[0], spaces[2]
    config = (
        DreamerV3Config()
        .environment(observation_space=obs_space, action_space=action_space)
        .training(model_size=size)
    )
    learner = config.build_learner(spaces={DEFAULT_MODULE_ID: (obs_space, action_space)})
    signature = batch_signature(
        obs_space.shape,
        tf.as_dtype(obs_storage_dtype(obs_space)),
        action_dim(action_space),
        config.batch_size_B,
        config.batch_length_T,
    )
    rng = np.random.default_rng(0)
    batches = [
        {
            key: tf.constant(value, signature[key].dtype)
            for key, value in random_batch(
                rng, config.batch_size_B, config.batch_length_T, inputs, action_space, 4
            ).items()
        }
        for _ in range(2)
    ]
    seed = tf.constant([0, 1], tf.int32)
    update_fn = learner._update_fn  # the bare compiled update (no RLlib plumbing)
    calls = [0]

    def step():
        update_fn(batches[calls[0] % 2], seed)["L_world_model"].numpy()
        calls[0] += 1

    step()  # trace and compile while the variant's patch is applied
    step()
    return step


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
        print(f"[ab_update] built {name}", file=sys.stderr, flush=True)
    result = {
        "size": args.size,
        "inputs": args.inputs,
        "actions": args.actions,
        "rounds": args.rounds,
        "per_round": args.per_round,
    }
    result.update(summarize(interleaved(steps, args.rounds, args.per_round)))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
