"""Where one compiled update spends its time, per XLA operation (a profiling aid).

Usage: python benchmarks/op_profile.py [SIZE] [--inputs vector|image]
           [--actions discrete|continuous] [--updates N] [--top K] [--timeline SEGMENTS]

Turns on XLA:CPU's per-thunk trace events (`--xla_cpu_enable_xprof_traceme`), runs N updates
(B=16, T=64, H=15) of the compiled update under the TensorFlow profiler and prints one JSON line:
the update's seconds, then the K largest XLA operations (fusions, dots, copies ...) by their time
per update, and the same summed by kind (the name without its number), with how many times each
ran per update. Times are thread time: operations on the two threads overlap, so they add up to
more than the update's seconds, and tracing itself slows an update down by ~30 % at small sizes.
Operation names match the optimized HLO (`learner._update_fn.experimental_get_compiler_ir(batch,
seed)(stage="optimized_hlo")`), where their shapes can be looked up. This session's finds with
it: Gumbel-max sampling of the latents was 25 % of an XS update; `tf.searchsorted` in the
two-hot labels ran as slow reduce-windows.

`--timeline SEGMENTS` adds a second line: one update cut into equal spans of its wall time, with
how busy the threads were in each and what ran there (`busy_timeline`). It tells work on the
critical path from work beside it: at XS vector two operations ran at once in only ~26 % of an
update (2026-12-05), and removing ops that ran beside the observe loop's backward chain freed
thread time but no wall time.
"""

import argparse
import collections
import glob
import json
import os
import re
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_xprof_traceme=true"
).strip()
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from ray.rllib.core import DEFAULT_MODULE_ID  # noqa: E402
from tensorflow.tsl.profiler.protobuf import xplane_pb2  # noqa: E402
from update_speed import make_spaces, random_batch  # noqa: E402  (this script's folder is on sys.path)

from rllib_dreamerv3 import DreamerV3Config  # noqa: E402

_SPANS = {"ThunkExecutor::Execute", "CpuExecutable::ExecuteAsyncOnStream"}  # XLA running
_SKIP = _SPANS | {"SlinkyThreadPool::Await", "BlockUntilReady"}  # inside spans, not operations


def _kind(name):
    """An XLA operation's kind: its name without XLA's numbering (`fusion.12` -> `fusion`)."""
    return re.sub(r"(\.\d+)+$", "", name)


def _trace(fn, args, runs):
    """Run the compiled `fn(*args)` `runs` times under the profiler: `(seconds per run, events)`.

    `events`: `(thread, start_ps, duration_ps, name)` of every XLA operation, i.e. every event
    inside XLA's executable and thunk-executor spans, on whichever thread ran it (intra-op
    threads, or the caller's). Needs `--xla_cpu_enable_xprof_traceme=true` in `XLA_FLAGS`
    before TensorFlow first compiles.
    """
    with tempfile.TemporaryDirectory() as logdir:
        tf.profiler.experimental.start(logdir)
        start = time.perf_counter()
        for _ in range(runs):
            tf.nest.map_structure(lambda x: x.numpy(), fn(*args))
        seconds = (time.perf_counter() - start) / runs
        tf.profiler.experimental.stop()
        path = sorted(glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True))[-1]
        space = xplane_pb2.XSpace()
        with open(path, "rb") as f:
            space.ParseFromString(f.read())
    events = []
    for plane in space.planes:
        names = {key: meta.name for key, meta in plane.event_metadata.items()}
        for line in plane.lines:
            spans = [
                (event.offset_ps, event.offset_ps + event.duration_ps)
                for event in line.events
                if names.get(event.metadata_id) in _SPANS
            ]
            for event in line.events:
                name = names.get(event.metadata_id, "?")
                if name in _SKIP or name.startswith("ThreadpoolListener"):
                    continue
                if any(lo <= event.offset_ps < hi for lo, hi in spans):
                    events.append(
                        (
                            (plane.name, line.name),
                            line.timestamp_ns * 1000 + event.offset_ps,
                            event.duration_ps,
                            name,
                        )
                    )
    return seconds, events


def profile_ops(fn, args, runs):
    """Run the compiled `fn(*args)` `runs` times under the profiler.

    Returns `(seconds per run, {XLA op name: (ms per run, calls per run)})` (see `_trace`).
    """
    seconds, events = _trace(fn, args, runs)
    total, calls = collections.Counter(), collections.Counter()
    for _, _, duration, name in events:
        total[name] += duration / 1e9 / runs
        calls[name] += 1
    return seconds, {name: (ms, calls[name] / runs) for name, ms in total.items()}


def busy_timeline(fn, args, segments=20, resolution_ms=0.01):
    """One run of the compiled `fn(*args)`, cut into `segments` equal spans of its wall time.

    For each span: the fraction of it during which at least one thread, and at least two
    threads, ran a traced XLA operation, and the operation kinds that ran longest in it. Wall
    time follows the operations on the critical path: work removed where a second thread is
    idle shortens the run, work removed beside it does not. An operation that splits its own
    work over threads (large matmuls and loop fusions) is traced on one thread only, so a span
    "busy on one thread" may still use every core: read `busy_two` as two operations at once.
    """
    _, events = _trace(fn, args, 1)
    start = min(begin for _, begin, _, _ in events)
    stop = max(begin + duration for _, begin, duration, _ in events)
    grid = np.arange(start, stop, resolution_ms * 1e9)
    busy = np.zeros(len(grid), np.int32)
    for thread in {thread for thread, _, _, _ in events}:
        mask = np.zeros(len(grid), bool)
        for other, begin, duration, _ in events:
            if other == thread:
                lo, hi = np.searchsorted(grid, [begin, begin + duration])
                mask[lo:hi] = True
        busy += mask
    edges = np.linspace(start, stop, segments + 1)
    rows = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        kinds = collections.Counter()
        for _, begin, duration, name in events:
            overlap = min(begin + duration, hi) - max(begin, lo)
            if overlap > 0:
                kinds[_kind(name)] += overlap / 1e9
        inside = busy[(grid >= lo) & (grid < hi)]
        rows.append(
            {
                "start_ms": round((lo - start) / 1e9, 2),
                "busy_one": round(float(np.mean(inside >= 1)), 3) if inside.size else 0.0,
                "busy_two": round(float(np.mean(inside >= 2)), 3) if inside.size else 0.0,
                "top": [[kind, round(ms, 2)] for kind, ms in kinds.most_common(4)],
            }
        )
    return {"wall_ms": round((stop - start) / 1e9, 2), "segments": rows}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("size", nargs="?", default="nano")
    parser.add_argument("--inputs", choices=["vector", "image"], default="vector")
    parser.add_argument("--actions", choices=["discrete", "continuous"], default="discrete")
    parser.add_argument("--updates", type=int, default=3)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--obs-dim", type=int, default=4)
    parser.add_argument("--num-actions", type=int, default=2)
    parser.add_argument(
        "--timeline",
        type=int,
        default=0,
        metavar="SEGMENTS",
        help="also print one update's busy timeline in this many segments (see busy_timeline)",
    )
    args = parser.parse_args(argv)

    obs_space, _, action_space = make_spaces(args.inputs, args.actions, args)
    config = (
        DreamerV3Config()
        .environment(observation_space=obs_space, action_space=action_space)
        .training(model_size=args.size)
    )
    learner = config.build_learner(spaces={DEFAULT_MODULE_ID: (obs_space, action_space)})
    batch = {
        key: tf.constant(value)
        for key, value in random_batch(
            np.random.default_rng(0),
            config.batch_size_B,
            config.batch_length_T,
            args.inputs,
            action_space,
            args.obs_dim,
        ).items()
    }
    seed = tf.constant([0, 1])
    update = learner._update_fn  # the compiled update; private, read by this profiling aid
    for _ in range(2):  # compile, warm up
        tf.nest.map_structure(lambda x: x.numpy(), update(batch, seed))
    seconds, ops = profile_ops(update, (batch, seed), args.updates)

    kinds = collections.defaultdict(lambda: [0.0, 0.0])
    for name, (ms, calls) in ops.items():
        kind = kinds[_kind(name)]
        kind[0] += ms
        kind[1] += calls
    top = sorted(ops.items(), key=lambda item: -item[1][0])[: args.top]
    top_kinds = sorted(kinds.items(), key=lambda item: -item[1][0])[: args.top]
    print(
        json.dumps(
            {
                "size": args.size,
                "inputs": args.inputs,
                "actions": args.actions,
                "traced_s_per_update": round(seconds, 4),
                "thread_ms_per_update": round(sum(ms for ms, _ in ops.values()), 1),
                "top_ops": [
                    {"op": name, "ms": round(ms, 2), "calls": round(calls, 1)}
                    for name, (ms, calls) in top
                ],
                "top_kinds": [
                    {"kind": name, "ms": round(ms, 2), "calls": round(calls, 1)}
                    for name, (ms, calls) in top_kinds
                ],
            }
        ),
        flush=True,
    )
    if args.timeline:
        print(
            json.dumps({"timeline": busy_timeline(update, (batch, seed), args.timeline)}),
            flush=True,
        )


if __name__ == "__main__":
    sys.exit(main())
