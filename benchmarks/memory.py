"""Memory of DreamerV3 in one process: algorithms built and stopped in a loop, or one long run.

Backs the "Memory" section of docs/performance.md.

Usage: python benchmarks/memory.py cycles [--cycles 10] [--config '{jit_compile: false}']
       python benchmarks/memory.py train [--minutes 60] [--yaml tuned_examples/cartpole.yaml]
           [--every 1000] [--config '{num_env_runners: 1}'] [--seed 0]

`cycles`: builds the smallest training config (nano model, B=2, T=8, H=3, ratio 32, 32 warm-up
steps, 16 env steps per iteration, seed 0, as tests/helpers.py's `tiny_config`) on CartPole-v1,
trains two iterations, stops it, drops it and collects garbage, `--cycles` times in one
process (a notebook or a sweep re-building algorithms). One JSON line per cycle, and a line
`cycle: 0` before the first build: this process's RSS (MB) and number of memory maps
(/proc/self/maps lines), both as they are and after `malloc_trim(0)` (glibc hands freed heap
pages back: what is left is live memory, or fragmentation), and the live TF objects that a
leak would keep: `tf.function`s, concrete and atomic functions, FuncGraphs, graph ops, and the
entries of TF's gradient registry (see rllib_dreamerv3.tf_rllib.custom_gradients).

`train`: trains the YAML's example in-process (no Ray Tune; its `config` applied as in
benchmarks/learning.py, plus `--config`) for `--minutes`, whatever its stop criteria say, and
prints one JSON line each `--every` updates: the driver's RSS and memory maps, those of every
Ray actor of the algorithm (remote EnvRunners and Learners, if any; `--config
'{num_env_runners: 1}'` has one), the replay buffer's own bytes
(`result["replay_buffer"]["num_bytes"]`), the driver's growth beyond the replay buffer's since
the first line, and the TF object counts of `cycles`. Growth of `beyond_replay_mb` over an hour
is a leak in the training loop (re-traced functions, accumulating metrics or dream media).

RSS and map counts are read from /proc (Linux). On a shared machine timings are noisy; memory
much less so, though RSS moves by a few MB with the allocator.
"""

import argparse
import collections
import ctypes
import gc
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import yaml  # noqa: E402
from tensorflow.python.eager.polymorphic_function import (  # noqa: E402
    atomic_function,
    concrete_function,
    polymorphic_function,
)
from tensorflow.python.framework import func_graph, ops  # noqa: E402

from rllib_dreamerv3 import DreamerV3Config  # noqa: E402

MB = 1024 * 1024


def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: no malloc_trim
        return None


LIBC = _libc()


def proc_memory(pid="self"):
    """`{"rss_mb", "maps"}` of a process from /proc (None values if it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        with open(f"/proc/{pid}/maps") as f:
            maps = sum(1 for _ in f)
    except (OSError, StopIteration):
        return {"rss_mb": None, "maps": None}
    return {"rss_mb": round(rss / 1024, 1), "maps": maps}


def trimmed_memory():
    """This process's memory after `malloc_trim(0)` (as it is where that is unavailable)."""
    if LIBC is not None:
        LIBC.malloc_trim(0)
    return proc_memory()


def tf_objects():
    """Counts of the live TF objects that traced functions leave behind."""
    kinds = {
        "tf_functions": polymorphic_function.Function,
        "concrete_functions": concrete_function.ConcreteFunction,
        "atomic_functions": atomic_function.AtomicFunction,
        "func_graphs": func_graph.FuncGraph,
        "graph_ops": ops.Operation,
    }
    counts = collections.Counter()
    for obj in gc.get_objects():
        for name, kind in kinds.items():
            if isinstance(obj, kind):
                counts[name] += 1
    return {
        **{name: counts[name] for name in kinds},
        "gradient_registry": len(ops.gradient_registry._registry),
    }


def tiny_config():
    return (
        DreamerV3Config()
        .environment("CartPole-v1")
        .training(
            model_size="nano",
            batch_size_B=2,
            batch_length_T=8,
            horizon_H=3,
            training_ratio=32,
            num_steps_sampled_before_learning_starts=32,
            log_progress=False,
        )
        .reporting(min_sample_timesteps_per_iteration=16)
        .debugging(seed=0)
    )


def memory_line(**fields):
    raw = proc_memory()
    trimmed = trimmed_memory()
    return {
        **fields,
        "rss_mb": raw["rss_mb"],
        "maps": raw["maps"],
        "rss_trimmed_mb": trimmed["rss_mb"],
        **tf_objects(),
    }


def cycles(args):
    gc.collect()
    print(json.dumps(memory_line(cycle=0)), flush=True)
    previous = None
    for cycle in range(1, args.cycles + 1):
        start = time.perf_counter()
        algo = tiny_config().update_from_dict(args.config).build_algo()
        algo.train()
        algo.train()
        algo.stop()
        del algo
        gc.collect()
        line = memory_line(cycle=cycle, seconds=round(time.perf_counter() - start, 1))
        if previous is not None:
            line["rss_trimmed_growth_mb"] = round(
                line["rss_trimmed_mb"] - previous["rss_trimmed_mb"], 1
            )
            line["maps_growth"] = line["maps"] - previous["maps"]
        previous = line
        print(json.dumps(line), flush=True)


def actor_pids(algo):
    """`{"env_runner_1": pid, ..., "learner_0": pid}` of the algorithm's Ray actors."""
    pids = {}
    group = algo.env_runner_group
    if group is not None and group.num_remote_env_runners() > 0:
        results = group.foreach_env_runner(
            lambda runner: (runner.worker_index, os.getpid()), local_env_runner=False
        )
        pids.update({f"env_runner_{index}": pid for index, pid in results})
    learners = algo.learner_group
    if learners is not None and not learners.is_local:
        results = learners.foreach_learner(lambda learner: os.getpid())
        pids.update({f"learner_{i}": result.get() for i, result in enumerate(results)})
    return pids


def train(args):
    with open(args.yaml) as f:
        experiments = yaml.safe_load(f)
    name, spec = next(iter(experiments.items()))
    config = (
        DreamerV3Config()
        .update_from_dict({**spec.get("config", {}), **args.config})
        .environment(spec["env"])
        .debugging(seed=args.seed)
        .training(log_progress=False)
    )
    start = time.time()
    algo = config.build_algo()
    pids = actor_pids(algo)
    first = None
    next_report = 0
    try:
        while True:
            result = algo.train()
            updates = int(result.get("num_updates_lifetime") or 0)
            elapsed = time.time() - start
            done = elapsed > args.minutes * 60
            if updates < next_report and not done:
                continue
            next_report = (updates // args.every + 1) * args.every
            gc.collect()
            replay_bytes = result["replay_buffer"]["num_bytes"]
            line = memory_line(
                experiment=name,
                updates=updates,
                env_steps=int(result["env_runners"]["num_env_steps_sampled_lifetime"]),
                wall_s=round(elapsed, 1),
                replay_mb=round(replay_bytes / MB, 2),
            )
            if first is None:
                first = (line["rss_trimmed_mb"], replay_bytes)
            line["beyond_replay_mb"] = round(
                line["rss_trimmed_mb"] - first[0] - (replay_bytes - first[1]) / MB, 1
            )
            line["workers"] = {key: {"pid": pid, **proc_memory(pid)} for key, pid in pids.items()}
            print(json.dumps(line), flush=True)
            if done:
                break
    finally:
        algo.stop()
    print(json.dumps({"experiment": name, "done": True, "wall_s": round(time.time() - start)}))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    modes = parser.add_subparsers(dest="mode", required=True)
    cycle_parser = modes.add_parser("cycles", help="build, train and stop algorithms in a loop")
    cycle_parser.add_argument("--cycles", type=int, default=10)
    train_parser = modes.add_parser("train", help="one long in-process run")
    train_parser.add_argument("--minutes", type=float, default=60.0)
    train_parser.add_argument("--yaml", default=os.path.join("tuned_examples", "cartpole.yaml"))
    train_parser.add_argument("--every", type=int, default=1000, help="report every N updates")
    train_parser.add_argument("--seed", type=int, default=0)
    for sub in (cycle_parser, train_parser):
        sub.add_argument(
            "--config",
            type=yaml.safe_load,
            default={},
            help="JSON/YAML mapping of config overrides, e.g. '{jit_compile: false}'",
        )
    args = parser.parse_args()
    cycles(args) if args.mode == "cycles" else train(args)


if __name__ == "__main__":
    main()
