"""End-to-end training throughput: env steps/s and updates/s of `algo.train()`, ours vs RLlib's.

Backs docs/performance.md: *Training throughput end to end* (both tables), the summary's
`algo.train()` row, and (as `bare_update_s`) its "ours vs RLlib's `Learner.update`" rows.

Usage:
    python benchmarks/train_throughput.py                       # CartPole, nano, ratio 1024
    python benchmarks/train_throughput.py --size XS --env-runners 1
    python benchmarks/train_throughput.py --env ALE/Pong-v5 --size XS --no-torch
    python benchmarks/train_throughput.py --smoke --no-torch    # seconds: checks that it runs

Both sides train on the same env, size, B, T, H and training ratio in this process, one after
the other: `--warmup-iterations` (warm-up, compiling), then `--iterations` timed ones of
`--steps` env steps. Per side one JSON line: `env_steps_per_s`, `updates_per_s`;
`breakdown_ms_per_update`, each piece's own time less that of the pieces it calls (`sample`,
`replay`, `update_compiled`: the Learner's `_update`, `update_overhead`: the rest of
`LearnerGroup.update`, `weight_sync`, `metrics`, `other`: the rest of `training_step`,
`iteration_overhead`: the rest of `train()`); `bare_update_s`, the median `Learner.update` on a
replay batch of the run. A last line has the speedups. RLlib's side needs torch (`.[bench]`).
"""

import contextlib
import json
import sys
import time

import common
from ray.rllib.utils.metrics import NUM_ENV_STEPS_SAMPLED_LIFETIME

PIECES = tuple("sample replay update_compiled update_overhead weight_sync metrics other".split())


class Timers:
    """Exclusive wall time per piece: a wrapped call's time minus that of wrapped calls inside."""

    def __init__(self):
        self.seconds = dict.fromkeys(PIECES, 0.0)
        self._stack = []  # [name, start, seconds of wrapped calls inside]

    def wrap(self, obj, attribute, name):
        inner = getattr(obj, attribute)

        def timed(*args, **kwargs):
            self._stack.append([name, time.perf_counter(), 0.0])
            try:
                return inner(*args, **kwargs)
            finally:
                _, start, children = self._stack.pop()
                elapsed = time.perf_counter() - start
                self.seconds[name] += elapsed - children
                if self._stack:
                    self._stack[-1][2] += elapsed

        setattr(obj, attribute, timed)

    def reset(self):
        self.seconds = dict.fromkeys(self.seconds, 0.0)


def local_learner(algo):
    learner = algo.learner_group._learner
    if learner is None:
        raise SystemExit("train_throughput.py times a local Learner (num_learners=0).")
    return learner


def instrument(algo, sample_attributes):
    """`(timers, last batch)` of `algo`'s training step; `sample_attributes`: (object, name)
    pairs that sample from the EnvRunners and fill the replay buffer."""
    timers, last_batch = Timers(), {}
    for obj, attribute in sample_attributes:
        timers.wrap(obj, attribute, "sample")
    timers.wrap(algo.replay_buffer, "sample", "replay")
    timers.wrap(algo.learner_group, "update", "update_overhead")
    timers.wrap(local_learner(algo), "_update", "update_compiled")
    timers.wrap(algo.env_runner_group, "sync_weights", "weight_sync")
    timers.wrap(algo.metrics, "aggregate", "metrics")
    timers.wrap(algo, "training_step", "other")  # the outermost: its own time is the rest
    update = algo.learner_group.update

    def keep_batch(*args, **kwargs):
        last_batch["batch"] = kwargs.get("batch")
        return update(*args, **kwargs)

    algo.learner_group.update = keep_batch
    return timers, last_batch


def counters(result):
    return (
        result["env_runners"][NUM_ENV_STEPS_SAMPLED_LIFETIME],
        result.get("num_updates_lifetime")
        or result.get("num_grad_updates_lifetime")
        or result["learners"]["__all_modules__"].get("num_module_steps_trained_lifetime", 0),
    )


def run(name, algo, timers, last_batch, args):
    for _ in range(args.warmup_iterations):
        result = algo.train()
    steps0, updates0 = counters(result)
    timers.reset()
    start = time.perf_counter()
    for _ in range(args.iterations):
        result = algo.train()
    wall = time.perf_counter() - start
    steps, updates = counters(result)
    steps, updates = steps - steps0, updates - updates0
    seconds = dict(timers.seconds)
    seconds["iteration_overhead"] = wall - sum(seconds.values())
    learner, batch = local_learner(algo), last_batch["batch"]
    timesteps = {NUM_ENV_STEPS_SAMPLED_LIFETIME: steps0 + steps}
    learner.update(batch=batch, timesteps=timesteps)  # warm-up
    bare = common.median(
        common.timed(lambda: learner.update(batch=batch, timesteps=timesteps), args.bare_updates)
    )
    out = {
        "algorithm": name,
        "env_steps": steps,
        "updates": updates,
        "wall_s": round(wall, 2),
        "env_steps_per_s": round(steps / wall, 3),
        "updates_per_s": round(updates / wall, 3),
        "breakdown_ms_per_update": {
            key: round(1000 * value / max(1, updates), 2) for key, value in seconds.items()
        },
        "bare_update_s": bare,
        "end_to_end_fraction": round(bare * updates / wall, 3),
        "loadavg_1m": common.loadavg(),
    }
    common.emit(out)
    algo.stop()
    return out


def configure(config, args):
    """Ours or RLlib's config (its env set) with this run's settings."""
    return (
        config.env_runners(num_env_runners=args.env_runners)
        .training(
            model_size=args.size, training_ratio=args.training_ratio, **common.update_shape(args)
        )
        .reporting(min_sample_timesteps_per_iteration=args.steps)
        .debugging(seed=args.seed)
    )


def parse_args(argv=None):
    parser = common.parser(__doc__, update_args=True)
    parser.add_argument("--env", default="CartPole-v1")
    parser.add_argument("--size", default="nano")
    parser.add_argument("--training-ratio", type=int, default=1024)
    parser.add_argument("--env-runners", type=int, default=0)
    parser.add_argument("--steps", type=int, default=100, help="env steps per iteration")
    parser.add_argument("--iterations", type=int, default=3, help="timed iterations")
    parser.add_argument("--warmup-iterations", type=int, default=2)
    parser.add_argument("--bare-updates", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--config", type=json.loads, default={}, help="JSON: our config's")
    parser.add_argument("--no-torch", dest="torch", action="store_false")
    smoke = dict(common.TINY, training_ratio=16, steps=6, iterations=2, warmup_iterations=1)
    smoke.update(bare_updates=2, config={"num_steps_sampled_before_learning_starts": 32})
    return common.parse(parser, argv, smoke)


def main(argv=None):
    from rllib_dreamerv3 import DreamerV3Config

    args = parse_args(argv)
    common.emit({"settings": vars(args), **common.machine()})
    config = configure(DreamerV3Config().environment(args.env), args)
    algo = config.update_from_dict(args.config).build_algo()
    ours = run("ours", algo, *instrument(algo, [(algo, "_sample")]), args)
    if not args.torch or not common.torch_threads():
        return
    from ray.rllib.algorithms import dreamerv3 as their_package
    from ray.rllib.algorithms.dreamerv3 import dreamerv3 as their_module

    env, env_config = args.env, {}
    if env.startswith("ALE/"):  # frame skip 4 in the wrapper; sticky actions as ours by default
        env = common.rllib_atari(env)
        env_config = {"frameskip": 1, "repeat_action_probability": 0.25, "full_action_space": True}
    config = their_package.DreamerV3Config().framework("torch")
    with contextlib.redirect_stdout(sys.stderr):  # RLlib prints its replay-buffer filling
        algo = configure(config.environment(env, env_config=env_config), args).build_algo()
    sampling = [(their_module, "synchronous_parallel_sample"), (algo.replay_buffer, "add")]
    theirs = run("theirs", algo, *instrument(algo, sampling), args)
    common.emit(
        {
            "speedup_end_to_end": round(ours["env_steps_per_s"] / theirs["env_steps_per_s"], 2),
            "speedup_bare_update": round(theirs["bare_update_s"] / ours["bare_update_s"], 2),
        }
    )


if __name__ == "__main__":
    main()
