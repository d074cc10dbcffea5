"""Seconds per DreamerV3 update with 1 and with N data-parallel Learners, and the all-reduce's.

Usage:
    python benchmarks/multi_learner_speed.py --quick           # nano, 2 Learners, 5 updates
    python benchmarks/multi_learner_speed.py --sizes micro XS --learners 2 --updates 20

For each model size (vector observations like CartPole's, 2 discrete actions, B=16, T=64,
H=15 unless overridden), one JSON line with the median seconds of `LearnerGroup.update` on
the same random replay batches:

- `local_xla_s`: one local Learner, XLA-compiled (`num_learners=0`, the default);
- `local_graph_s`: the same without XLA (`jit_compile=False`): the graph that several
  Learners run, because XLA does not compile TF's collectives on CPUs;
- `learners_<N>_s`: N remote Learners (`num_learners=N`), each on B/N rows, gradients
  all-reduced; `threads_per_learner` TF threads each (default: this machine's cores / N);
- `allreduce_<N>_s`: the collectives of one update alone (the three gradient all-reduces,
  the returns' all-gather and the metrics' all-reduce, on tensors of the update's sizes),
  compiled and run by the N Learners at once.

On a machine with fewer cores than Learners × threads the Learners share cores: the figures
then show the cost of synchronising, not a speed-up. `loadavg_1m`: other processes skew
timings, run on a quiet machine.
"""

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import gymnasium as gym  # noqa: E402
import numpy as np  # noqa: E402
import ray  # noqa: E402
from ray.rllib.core import DEFAULT_MODULE_ID  # noqa: E402

from rllib_dreamerv3 import DreamerV3Config  # noqa: E402
from rllib_dreamerv3.algorithm import learner_batches  # noqa: E402


def num_cores():
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def random_batch(rng, batch_size, length, obs_dim, num_actions):
    is_first = rng.random((batch_size, length)) < 0.02
    is_first[:, 0] = True
    return {
        "obs": rng.normal(size=(batch_size, length, obs_dim)).astype(np.float32),
        "actions": np.eye(num_actions, dtype=np.float32)[
            rng.integers(0, num_actions, (batch_size, length))
        ],
        "rewards": rng.normal(size=(batch_size, length)).astype(np.float32),
        "is_first": is_first,
        "is_terminal": rng.random((batch_size, length)) < 0.02,
    }


def time_updates(group, batches, num_learners, updates):
    def update(i):
        group.update(**learner_batches(batches[i % len(batches)], num_learners))

    update(0)  # tracing (and compiling)
    update(1)  # warm-up
    times = []
    for i in range(updates):
        start = time.perf_counter()
        update(i)
        times.append(time.perf_counter() - start)
    return round(statistics.median(times), 4)


def _time_collectives(learner, repeats):
    """Run on each Learner: the median seconds of one update's collectives, compiled."""
    import tensorflow as tf

    from rllib_dreamerv3.update import ACTOR, CRITIC, WORLD_MODEL

    group, cfg = learner.collective, learner.config
    model = learner.module[DEFAULT_MODULE_ID].model
    parts = {WORLD_MODEL: model.world_model, ACTOR: model.actor, CRITIC: model.critic}
    grads = [[tf.ones_like(v) for v in net.trainable_variables] for net in parts.values()]
    rows = cfg.batch_size_B // group.group_size * cfg.batch_length_T
    returns = tf.ones([cfg.horizon_H, rows])
    metrics = [tf.ones([]) for _ in range(40)]

    @tf.function(autograph=False)
    def collectives():
        out = [group.all_reduce_mean([*g, tf.ones([])]) for g in grads]
        out.append(group.all_gather(returns))
        out.append(group.all_reduce_mean(metrics))
        return tf.add_n([tf.reduce_sum(tf.nest.flatten(o)[0]) for o in out])

    collectives()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        collectives().numpy()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(size, args):
    if __name__ != "__main__":  # imported (a test): Learners cannot import this file
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    obs_space = gym.spaces.Box(-np.inf, np.inf, (args.obs_dim,), np.float32)
    action_space = gym.spaces.Discrete(args.num_actions)
    spaces = {DEFAULT_MODULE_ID: (obs_space, action_space)}
    base = DreamerV3Config().training(
        model_size=size,
        batch_size_B=args.batch_size,
        batch_length_T=args.batch_length,
        horizon_H=args.horizon,
    )
    rng = np.random.default_rng(0)
    batches = [
        random_batch(rng, args.batch_size, args.batch_length, args.obs_dim, args.num_actions)
        for _ in range(3)
    ]
    result = {"size": size, "B": args.batch_size, "T": args.batch_length, "H": args.horizon}
    for name, jit in (("local_xla_s", True), ("local_graph_s", False)):
        group = base.copy().training(jit_compile=jit).build_learner_group(spaces=spaces)
        try:
            result[name] = time_updates(group, batches, 0, args.updates)
        finally:
            group.shutdown()
    for num in args.learners:
        threads = args.threads_per_learner or max(1, num_cores() // num)
        config = base.copy().training(tf_num_threads=threads)
        config.learners(num_learners=num, num_cpus_per_learner=max(1, num_cores() // num))
        group = config.build_learner_group(spaces=spaces)
        try:
            result[f"learners_{num}_s"] = time_updates(group, batches, num, args.updates)
            result["threads_per_learner"] = threads
            if num >= 2:
                times = group.foreach_learner(
                    lambda learner: _time_collectives(learner, args.updates)
                )
                result[f"allreduce_{num}_s"] = round(max(t.get() for t in times), 4)
        finally:
            group.shutdown()
    result["loadavg_1m"] = round(os.getloadavg()[0], 2)
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="nano, 2 Learners, 5 updates")
    parser.add_argument("--sizes", nargs="+", default=["nano", "micro", "XS"])
    parser.add_argument("--learners", nargs="+", type=int, default=[2])
    parser.add_argument("--updates", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--batch-length", type=int, default=64)
    parser.add_argument("--horizon", type=int, default=15)
    parser.add_argument("--obs-dim", type=int, default=4)
    parser.add_argument("--num-actions", type=int, default=2)
    parser.add_argument("--threads-per-learner", type=int, default=None)
    args = parser.parse_args()
    if args.quick:
        args.sizes, args.learners, args.updates = ["nano"], [2], 5
    for num in args.learners:
        if num < 2 or args.batch_size % num:
            parser.error(f"--learners {num}: need >= 2 Learners that divide --batch-size.")
    ray.init(
        num_cpus=max(num_cores(), *args.learners),
        include_dashboard=False,
        runtime_env={"env_vars": {"TF_CPP_MIN_LOG_LEVEL": "3"}},
    )
    try:
        for size in args.sizes:
            print(json.dumps(measure(size, args)), flush=True)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
