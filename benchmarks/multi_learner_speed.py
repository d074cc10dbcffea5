"""Seconds per DreamerV3 update with 1 and with N data-parallel Learners, and the all-reduce's.

Backs docs/scaling.md: the table *Seconds per update*.

Usage:
    python benchmarks/multi_learner_speed.py --sizes nano micro XS --updates 10
    python benchmarks/multi_learner_speed.py --smoke           # seconds: checks that it runs

Per model size (CartPole-shaped vectors, 2 discrete actions), one JSON line with the median
seconds of `LearnerGroup.update` on the same random batches: `local_xla_s` (one local Learner,
the default), `local_graph_s` (the same without XLA, the graph several Learners run: XLA does
not compile TF's collectives on CPUs), `learners_<N>_s` (N remote Learners on B/N rows each,
cores / N TF threads each) and `allreduce_<N>_s` (one update's collectives alone, on tensors of
the update's sizes, run by the N Learners at once).
"""

import itertools
import statistics
import time

import common
import numpy as np
import ray
from ray.rllib.core import DEFAULT_MODULE_ID

from rllib_dreamerv3 import DreamerV3Config
from rllib_dreamerv3.algorithm import learner_batches


def time_updates(group, batches, num_learners, updates):
    """Median seconds of `updates` calls of `group.update`, after tracing and a warm-up call."""
    calls = itertools.count()

    def update():
        group.update(**learner_batches(batches[next(calls) % len(batches)], num_learners))

    update()
    update()
    return common.median(common.timed(update, updates))


def _time_collectives(learner, repeats):
    """Run on each Learner (so it uses no module of this folder): the median seconds of one
    update's collectives, compiled."""
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
    obs_space, action_space = common.spaces()
    spaces = {DEFAULT_MODULE_ID: (obs_space, action_space)}
    base = DreamerV3Config().training(model_size=size, **common.update_shape(args))
    B, T, rng = args.batch_size_B, args.batch_length_T, np.random.default_rng(0)
    batches = [common.random_batch(rng, obs_space, action_space, B, T) for _ in range(3)]
    result = {"size": size, "B": B, "T": T, "H": args.horizon_H}
    graph = base.copy().training(jit_compile=False)
    configs = {"local_xla_s": (base, 0), "local_graph_s": (graph, 0)}
    for num in args.learners:
        threads = max(1, common.num_cores() // num)
        config = base.copy().training(tf_num_threads=threads)
        config.learners(num_learners=num, num_cpus_per_learner=threads)
        configs[f"learners_{num}_s"] = config, num
        result["threads_per_learner"] = threads
    for name, (config, num) in configs.items():
        group = config.build_learner_group(spaces=spaces)
        try:
            result[name] = time_updates(group, batches, num, args.updates)
            if num:  # the collectives alone, on every Learner at once
                times = group.foreach_learner(lambda lrn: _time_collectives(lrn, args.updates))
                result[f"allreduce_{num}_s"] = round(max(t.get() for t in times), 4)
        finally:
            group.shutdown()
    result["loadavg_1m"] = common.loadavg()
    return result


def main(argv=None):
    parser = common.parser(__doc__, update_args=True)
    parser.add_argument("--sizes", nargs="+", default=["nano", "micro", "XS"])
    parser.add_argument("--learners", nargs="+", type=int, default=[2])
    parser.add_argument("--updates", type=int, default=10)
    smoke = dict(common.TINY, batch_size_B=4, sizes=["nano"], updates=2)
    args = common.parse(parser, argv, smoke)
    for num in args.learners:
        if num < 2 or args.batch_size_B % num:
            parser.error(f"--learners {num}: need >= 2 Learners that divide --batch-size-B.")
    ray.init(
        num_cpus=max(common.num_cores(), *args.learners),
        include_dashboard=False,
        runtime_env={"env_vars": {"TF_CPP_MIN_LOG_LEVEL": "3"}},
    )
    try:
        common.emit(common.machine())
        for size in args.sizes:
            common.emit(measure(size, args))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
