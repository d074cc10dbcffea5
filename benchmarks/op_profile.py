"""Where one compiled update spends its time, per XLA operation (a profiling aid).

Usage: python benchmarks/op_profile.py [SIZE] [--inputs vector|image] [--actions discrete|continuous]
                                       [--updates N] [--top K]

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
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_cpu_enable_xprof_traceme=true").strip()
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from ray.rllib.core import DEFAULT_MODULE_ID  # noqa: E402
from tensorflow.tsl.profiler.protobuf import xplane_pb2  # noqa: E402

from update_speed import make_spaces, random_batch  # noqa: E402  (this script's folder is on sys.path)

from rllib_dreamerv3 import DreamerV3Config  # noqa: E402

_SPANS = {"ThunkExecutor::Execute", "CpuExecutable::ExecuteAsyncOnStream"}  # XLA running
_SKIP = _SPANS | {"SlinkyThreadPool::Await", "BlockUntilReady"}  # inside spans, not operations


def profile_ops(fn, args, runs):
    """Run the compiled `fn(*args)` `runs` times under the profiler.

    Returns `(seconds per run, {XLA op name: (ms per run, calls per run)})`, read from the
    trace's events inside XLA's executable and thunk-executor spans. Needs
    `--xla_cpu_enable_xprof_traceme=true` in `XLA_FLAGS` before TensorFlow first compiles.
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
    total, calls = collections.Counter(), collections.Counter()
    for plane in space.planes:
        names = {key: meta.name for key, meta in plane.event_metadata.items()}
        for line in plane.lines:
            # XLA's operations are the events inside its executable's or thunk executor's spans,
            # on whichever thread ran them (intra-op threads, or the caller's).
            spans = [(event.offset_ps, event.offset_ps + event.duration_ps)
                     for event in line.events if names.get(event.metadata_id) in _SPANS]
            for event in line.events:
                name = names.get(event.metadata_id, "?")
                if name in _SKIP or name.startswith("ThreadpoolListener"):
                    continue
                if any(lo <= event.offset_ps < hi for lo, hi in spans):
                    total[name] += event.duration_ps / 1e9 / runs
                    calls[name] += 1
    return seconds, {name: (ms, calls[name] / runs) for name, ms in total.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("size", nargs="?", default="nano")
    parser.add_argument("--inputs", choices=["vector", "image"], default="vector")
    parser.add_argument("--actions", choices=["discrete", "continuous"], default="discrete")
    parser.add_argument("--updates", type=int, default=3)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--obs-dim", type=int, default=4)
    parser.add_argument("--num-actions", type=int, default=2)
    args = parser.parse_args(argv)

    obs_space, _, action_space = make_spaces(args.inputs, args.actions, args)
    config = (DreamerV3Config().environment(observation_space=obs_space, action_space=action_space)
              .training(model_size=args.size))
    learner = config.build_learner(spaces={DEFAULT_MODULE_ID: (obs_space, action_space)})
    batch = {key: tf.constant(value) for key, value in random_batch(
        np.random.default_rng(0), config.batch_size_B, config.batch_length_T, args.inputs,
        action_space, args.obs_dim).items()}
    seed = tf.constant([0, 1])
    update = learner._update_fn  # the compiled update; private, read by this profiling aid
    for _ in range(2):  # compile, warm up
        tf.nest.map_structure(lambda x: x.numpy(), update(batch, seed))
    seconds, ops = profile_ops(update, (batch, seed), args.updates)

    kinds = collections.defaultdict(lambda: [0.0, 0.0])
    for name, (ms, calls) in ops.items():
        kind = kinds[re.sub(r"(\.\d+)+$", "", name)]
        kind[0] += ms
        kind[1] += calls
    top = sorted(ops.items(), key=lambda item: -item[1][0])[:args.top]
    top_kinds = sorted(kinds.items(), key=lambda item: -item[1][0])[:args.top]
    print(json.dumps({
        "size": args.size, "inputs": args.inputs, "actions": args.actions,
        "traced_s_per_update": round(seconds, 4),
        "thread_ms_per_update": round(sum(ms for ms, _ in ops.values()), 1),
        "top_ops": [{"op": name, "ms": round(ms, 2), "calls": round(calls, 1)}
                    for name, (ms, calls) in top],
        "top_kinds": [{"kind": name, "ms": round(ms, 2), "calls": round(calls, 1)}
                      for name, (ms, calls) in top_kinds],
    }), flush=True)


if __name__ == "__main__":
    sys.exit(main())
