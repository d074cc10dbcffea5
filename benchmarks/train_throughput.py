"""End-to-end training throughput: env steps/s and updates/s of `algo.train()`, ours vs RLlib's.

Usage:
    python benchmarks/train_throughput.py                       # CartPole, nano, ratio 1024
    python benchmarks/train_throughput.py --size XS --env-runners 1
    python benchmarks/train_throughput.py --env ALE/Pong-v5 --size XS --no-torch
    python benchmarks/train_throughput.py --config '{"weights_sync_interval": 4}'

Both algorithms train on the same env with the same size, `B`, `T`, `H` and training ratio, in
this process, one after the other. Each first runs `--warmup-iterations` iterations (random
warm-up, tracing and compiling), then `--iterations` timed ones of `--steps` env steps each
(`min_sample_timesteps_per_iteration`). Printed, one JSON line per algorithm and a last one
comparing them:

- `env_steps_per_s`, `updates_per_s`: over the timed `algo.train()` calls (wall clock).
- `breakdown_ms_per_update`: where a training step's time goes, per update, from timers wrapped
  around the pieces every DreamerV3 training step has (each piece's time excludes the pieces it
  calls): `sample` (EnvRunners stepping the envs, adding to the replay buffer), `replay`
  (drawing the replay batch), `update_compiled` (the Learner's `_update`: the compiled update
  and its metric logging), `update_overhead` (the rest of `LearnerGroup.update`: batch
  conversion, the Learner's metrics reduce), `weight_sync` (`EnvRunnerGroup.sync_weights`),
  `metrics` (`MetricsLogger.aggregate` calls of the Algorithm), `other` (the rest of
  `training_step`), `iteration_overhead` (the rest of `train()`: results, counters).
- `bare_update_s`: the median `Learner.update()` on a replay batch of the same run (after
  training), the figure `benchmarks/update_speed.py` compares; `end_to_end_fraction` is the
  share of the wall clock that this bare update would take.

The last line has `speedup_end_to_end` (ours over theirs, env steps/s) and
`speedup_bare_update`. RLlib's side needs torch (`pip install -e ".[bench]"`); `--no-torch`
skips it. Run on a quiet machine: other processes skew every figure (`loadavg_1m` is printed).
"""

import argparse
import contextlib
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
from ray.rllib.utils.metrics import NUM_ENV_STEPS_SAMPLED_LIFETIME  # noqa: E402
from update_speed import time_learner_updates  # noqa: E402

PIECES = (
    "sample",
    "replay",
    "update_compiled",
    "update_overhead",
    "weight_sync",
    "metrics",
    "other",
)


class Timers:
    """Exclusive wall time per piece: a wrapped call's time minus that of wrapped calls inside."""

    def __init__(self):
        self.seconds = dict.fromkeys(PIECES + ("training_step",), 0.0)
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


def instrument(algo, timers, sample_attributes):
    """Wrap the pieces of `algo`'s training step; `sample_attributes`: (object, name) pairs
    that sample from the EnvRunners and fill the replay buffer."""
    for obj, attribute in sample_attributes:
        timers.wrap(obj, attribute, "sample")
    timers.wrap(algo.replay_buffer, "sample", "replay")
    timers.wrap(algo.learner_group, "update", "update_overhead")
    timers.wrap(local_learner(algo), "_update", "update_compiled")
    timers.wrap(algo.env_runner_group, "sync_weights", "weight_sync")
    timers.wrap(algo.metrics, "aggregate", "metrics")
    timers.wrap(algo, "training_step", "training_step")
    last_batch = {}
    update = algo.learner_group.update

    def keep_batch(*args, **kwargs):
        last_batch["batch"] = kwargs.get("batch")
        return update(*args, **kwargs)

    algo.learner_group.update = keep_batch
    return last_batch


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
    # The training-step timer is the outermost wrap: its exclusive time is `other`.
    seconds["other"] += seconds.pop("training_step")
    _, times, _ = time_learner_updates(
        local_learner(algo), [last_batch["batch"]], args.bare_updates
    )
    bare = float(np.median(times))
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
        "bare_update_s": round(bare, 4),
        "end_to_end_fraction": round(bare * updates / wall, 3),
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(out), flush=True)
    algo.stop()
    return out


def common(args):
    return dict(
        model_size=args.size,
        training_ratio=args.training_ratio,
        batch_size_B=args.batch_size_B,
        batch_length_T=args.batch_length_T,
        horizon_H=args.horizon_H,
    )


def build_ours(args):
    from rllib_dreamerv3 import DreamerV3Config

    config = (
        DreamerV3Config()
        .environment(args.env)
        .env_runners(num_env_runners=args.env_runners)
        .training(**common(args), log_progress=False)
        .reporting(min_sample_timesteps_per_iteration=args.steps)
        .debugging(seed=args.seed)
        .update_from_dict(args.config)
    )
    algo = config.build_algo()
    timers = Timers()
    last_batch = instrument(algo, timers, [(algo, "_sample")])
    return algo, timers, last_batch


def their_env(env_id):
    """`(env, env_config)` for RLlib's side: Atari ids wrapped as its DreamerV3 Atari example
    does (64×64×3 RGB, frameskip 4 in the wrapper, sticky actions 0.25 as ours by default)."""
    if not env_id.startswith("ALE/"):
        return env_id, {}
    import gymnasium as gym
    from ray.rllib.env.wrappers.atari_wrappers import wrap_atari_for_new_api_stack
    from ray.tune.registry import register_env

    name = "rllib_wrapped_" + env_id.replace("/", "_")
    register_env(
        name,
        lambda cfg: wrap_atari_for_new_api_stack(
            gym.make("ale_py:" + env_id, **cfg), framestack=None, grayscale=False
        ),
    )
    return name, {"frameskip": 1, "repeat_action_probability": 0.25, "full_action_space": True}


def build_theirs(args):
    from ray.rllib.algorithms import dreamerv3 as their_package
    from ray.rllib.algorithms.dreamerv3 import dreamerv3 as their_module

    env, env_config = their_env(args.env)
    config = (
        their_package.DreamerV3Config()
        .framework("torch")
        .environment(env, env_config=env_config)
        .env_runners(num_env_runners=args.env_runners)
        .training(**common(args))
        .reporting(min_sample_timesteps_per_iteration=args.steps)
        .debugging(seed=args.seed)
    )
    algo = config.build_algo()
    timers = Timers()
    last_batch = instrument(
        algo, timers, [(their_module, "synchronous_parallel_sample"), (algo.replay_buffer, "add")]
    )
    return algo, timers, last_batch


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", default="CartPole-v1")
    parser.add_argument("--size", default="nano")
    parser.add_argument("--training-ratio", type=int, default=1024)
    parser.add_argument("--batch-size-B", type=int, default=16)
    parser.add_argument("--batch-length-T", type=int, default=64)
    parser.add_argument("--horizon-H", type=int, default=15)
    parser.add_argument("--env-runners", type=int, default=0)
    parser.add_argument("--steps", type=int, default=100, help="env steps per iteration")
    parser.add_argument("--iterations", type=int, default=3, help="timed iterations")
    parser.add_argument("--warmup-iterations", type=int, default=2)
    parser.add_argument("--bare-updates", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--config", type=json.loads, default={}, help="JSON dict of overrides for our config"
    )
    parser.add_argument("--no-torch", dest="torch", action="store_false")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    print(json.dumps({"settings": vars(args)}), flush=True)
    ours = run("ours", *build_ours(args), args)
    if args.torch:
        try:
            import torch
        except ImportError:
            print("[train_throughput] no torch: pip install -e '.[bench]'", file=sys.stderr)
            return
        torch.set_num_threads(len(os.sched_getaffinity(0)))
        with contextlib.redirect_stdout(sys.stderr):  # RLlib prints its replay-buffer filling
            algo, timers, last_batch = build_theirs(args)
        theirs = run("theirs", algo, timers, last_batch, args)
        print(
            json.dumps(
                {
                    "speedup_end_to_end": round(
                        ours["env_steps_per_s"] / theirs["env_steps_per_s"], 2
                    ),
                    "speedup_bare_update": round(
                        theirs["bare_update_s"] / ours["bare_update_s"], 2
                    ),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
