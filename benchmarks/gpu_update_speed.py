"""Seconds per DreamerV3 update on a machine that has XLA (jaxlib) but no TensorFlow, e.g. a GPU.

Our update is one `tf.function(jit_compile=True)`: TF's XLA bridge lowers it to an HLO module,
and that module is the whole program XLA compiles and runs (observe loop, imagination, losses,
three optimizer steps, EMA). This script splits "lower" from "compile and run":

    # here, with TensorFlow (CPU is enough): write the HLO modules and what they need
    python benchmarks/gpu_update_speed.py export --out hlo_modules --sizes S XL \\
        --inputs image vector --precisions float32 bfloat16
    # there, with jax/jaxlib and numpy only (no TensorFlow, no Ray): compile with the local XLA
    # backend (the GPU if there is one) and time updates
    python benchmarks/gpu_update_speed.py replay --dir hlo_modules --updates 10

`export` writes, per setting `SIZE-INPUTS-ACTIONS-PRECISION`: `NAME.hlo.pb.gz` (the serialized
HloModuleProto, gzipped), `NAME.npz` (the batch, the seed, and every small parameter exactly) and
`NAME.json` (each parameter's shape and dtype, and for large float variables the mean and standard
deviation of their initial values, which `replay` re-draws from a normal distribution: a 100M-
parameter XL model does not travel, and timings do not depend on the weights' values).

`replay` compiles each module with jaxlib (`hlo_to_stablehlo`, as jax2tf's `call_tf` does, then
the backend's compiler), calls it `--updates` times after two warm-up calls, feeding each call's
updated variables into the next one through the module's input/output aliases (as TF's variable
updates do), and prints one JSON line per setting: median and min seconds per update, compile
seconds, and, with `export --count-flops`, the update's matmul and convolution FLOPs (counted from
XLA:CPU's optimized HLO by `flops.py`) and the achieved TFLOP/s. The first lines give the device
and its matmul peaks measured in the same run (8192³ matmuls in float32 at full precision, float32
at XLA's default precision — TF32 on NVIDIA GPUs, which TF also allows by default — and bfloat16).
`xla_cost_analysis_flops` is XLA's own estimate, which on GPUs leaves out library calls (cuBLAS,
cuDNN). With `--check` it also compares the replayed metrics with those `export --exact` recorded
from TF's own call of the update (same variables, batch and seed; small sizes only). With
`--profile N` it traces N more updates with jax's profiler and reports, per device, the kernel
count, how busy the device was over that wall time and the operations that took the most time.

The HLO is what TF lowers for its CPU device; TF on a GPU lowers the same ops through the same
bridge, so the replay runs the program TF would run there, but compiled by jaxlib's XLA, which is
newer than TF's: compiler changes count in the figures. On CPU, jaxlib 0.10.2's XLA ran nano as
fast as TF 2.21 does and S about 4× slower, so compare replayed figures with replayed figures.
"""

import argparse
import gzip
import json
import os
import re
import sys
import time

import numpy as np

EXACT_MAX_ELEMENTS = 4096  # parameters up to this size travel exactly, larger ones as (mean, std)
_ALIAS = re.compile(r"\{(\d+)\}:\s*\((\d+),\s*\{\}")


def log(message):
    print(message, file=sys.stderr, flush=True)


# --- export (TensorFlow) --------------------------------------------------------------------------
def _variable_key(tensor):
    """The unique resource name of a variable handle (`name="w/0"` in its repr)."""
    match = re.search(r'name="([^"]+)"', repr(tensor))
    if match is None:
        raise RuntimeError(f"cannot read the resource name of {tensor!r}")
    return match.group(1)


def _aliases(hlo_text):
    """`[(output index, parameter index)]` from the module header's `input_output_alias`."""
    header = hlo_text.split("\n", 1)[0]
    if "input_output_alias" not in header:
        return []
    section = header.split("input_output_alias=", 1)[1].split("entry_computation_layout", 1)[0]
    return [(int(o), int(p)) for o, p in _ALIAS.findall(section)]


def export_setting(
    size, inputs, actions, precision, out_dir, exact=False, count_flops=False, seed=0
):
    """Write one setting's HLO module, parameters and metadata; returns the metadata."""
    import tensorflow as tf
    import update_speed as us
    from ray.rllib.core import DEFAULT_MODULE_ID

    from rllib_dreamerv3 import DreamerV3Config
    from rllib_dreamerv3.spaces import action_dim, obs_storage_dtype
    from rllib_dreamerv3.update import batch_signature

    name = f"{size}-{inputs}-{actions}-{precision}"
    shape_args = argparse.Namespace(obs_dim=4, num_actions=2)
    obs_space, _, action_space = us.make_spaces(inputs, actions, shape_args)
    config = (
        DreamerV3Config()
        .environment(observation_space=obs_space, action_space=action_space)
        .training(model_size=size, precision=precision)
    )
    learner = config.build_learner(spaces={DEFAULT_MODULE_ID: (obs_space, action_space)})
    update_fn = learner._update_fn  # the compiled update (no public handle: benchmark only)
    B, T = config.batch_size_B, config.batch_length_T
    signature = batch_signature(
        obs_space.shape, tf.as_dtype(obs_storage_dtype(obs_space)), action_dim(action_space), B, T
    )
    batch = us.random_batch(np.random.default_rng(seed), B, T, inputs, action_space, 4)
    inputs_tf = {key: tf.constant(batch[key], spec.dtype) for key, spec in signature.items()}
    seed_tf = tf.constant([0, 1], tf.int32)

    start = time.perf_counter()
    ir = update_fn.experimental_get_compiler_ir(inputs_tf, seed_tf)
    proto = ir(stage="hlo_serialized")
    hlo_text = ir(stage="hlo")
    lower_s = time.perf_counter() - start

    concrete = update_fn.get_concrete_function(inputs_tf, seed_tf)
    variables = {_variable_key(v.handle): v for v in concrete.graph.variables}
    flat = [t.numpy() for t in tf.nest.flatten([inputs_tf, seed_tf])]
    values = list(flat)
    for captured in concrete.captured_inputs:
        values.append(
            variables[_variable_key(captured)].numpy()
            if captured.dtype == tf.resource
            else captured.numpy()
        )
    entry = re.search(r"^ENTRY .*$", hlo_text, re.MULTILINE).group(0)
    num_hlo_params = len(re.findall(r"\barg\d+(?:\.\d+)?: ", entry.split(") -> ", 1)[0]))
    if num_hlo_params != len(values):  # the order (arguments, then captures) is TF's, unchecked
        raise RuntimeError(
            f"{name}: the HLO module takes {num_hlo_params} parameters, but the "
            f"function has {len(values)} inputs and captures"
        )

    params, exact_values = [], {}
    for i, value in enumerate(values):
        entry = {"shape": list(value.shape), "dtype": value.dtype.name}
        if value.dtype == np.uint8 and value.size > EXACT_MAX_ELEMENTS and not exact:
            entry.update(exact=False, uniform_uint8=True)  # image observations: re-drawn
        elif (
            i < len(flat)
            or exact
            or value.size <= EXACT_MAX_ELEMENTS
            or value.dtype.kind not in "f"
        ):
            entry["exact"] = True
            exact_values[f"p{i}"] = value
        else:
            as64 = value.astype(np.float64)
            entry.update(exact=False, mean=float(as64.mean()), std=float(as64.std()))
        params.append(entry)

    flops = {}
    if count_flops:  # matmul + convolution FLOPs from XLA:CPU's optimized HLO (compiles once)
        from flops import compiled_flops

        count = compiled_flops(update_fn, inputs_tf, seed_tf)
        flops = {"flops": count.total, "flops_exact": count.exact}
    metric_names = sorted(concrete.structured_outputs)
    tf_metrics = {}
    if exact:  # TF's own call (compiles and runs the update here), for `replay --check`
        metrics = update_fn(inputs_tf, seed_tf)
        tf_metrics = {k: float(metrics[k].numpy()) for k in metric_names}
    meta = {
        "name": name,
        "size": size,
        "inputs": inputs,
        "actions": actions,
        "precision": precision,
        "B": B,
        "T": T,
        "H": config.horizon_H,
        "num_batch_params": len(flat),
        "params": params,
        "aliases": _aliases(hlo_text),
        "metric_names": metric_names,
        "tf_metrics": tf_metrics,
        "num_parameters": int(
            sum(
                v.shape.num_elements()
                for v in learner.module[DEFAULT_MODULE_ID].model.trainable_variables
            )
        ),
        "exact": exact,
        "tf_version": tf.__version__,
        "lower_s": round(lower_s, 2),
        **flops,
    }
    with gzip.open(os.path.join(out_dir, f"{name}.hlo.pb.gz"), "wb", compresslevel=6) as f:
        f.write(proto)
    np.savez(os.path.join(out_dir, f"{name}.npz"), **exact_values)
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump(meta, f)
    return meta


def export_main(args):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    sys.path.insert(0, os.path.dirname(here))
    os.makedirs(args.out, exist_ok=True)
    for inputs in args.inputs:
        for size in args.sizes:
            for actions in args.actions:
                for precision in args.precisions:
                    meta = export_setting(
                        size,
                        inputs,
                        actions,
                        precision,
                        args.out,
                        exact=args.exact,
                        count_flops=args.count_flops,
                    )
                    log(
                        f"exported {meta['name']}: {meta['num_parameters']:,} parameters, "
                        f"{len(meta['params'])} HLO parameters, lowered in {meta['lower_s']} s"
                    )


# --- replay (jaxlib only) -------------------------------------------------------------------------
def _load_module(directory, name):
    with gzip.open(os.path.join(directory, f"{name}.hlo.pb.gz"), "rb") as f:
        proto = f.read()
    with open(os.path.join(directory, f"{name}.json")) as f:
        meta = json.load(f)
    exact = np.load(os.path.join(directory, f"{name}.npz"))
    return proto, meta, exact


def _host_params(meta, exact, rng):
    """numpy values of every HLO parameter: exact where stored, else drawn N(mean, std)."""
    import ml_dtypes  # noqa: F401 (registers bfloat16 with numpy, should a parameter need it)

    values = []
    for i, entry in enumerate(meta["params"]):
        if entry["exact"]:
            values.append(exact[f"p{i}"])
        elif entry.get("uniform_uint8"):
            values.append(rng.integers(0, 256, entry["shape"], dtype=np.uint8))
        elif entry["std"] == 0.0:
            values.append(np.full(entry["shape"], entry["mean"], entry["dtype"]))
        else:
            draw = rng.standard_normal(entry["shape"], dtype=np.float32)
            values.append((draw * entry["std"] + entry["mean"]).astype(entry["dtype"]))
    return values


_MHLO_COPY = re.compile(
    r"^(\s*%[\w#:]+ = )mhlo\.copy (%[\w#]+)(?: \{[^}]*\})? : (.+)$", re.MULTILINE
)


def _without_mhlo_copies(bytecode):
    """The module's text with each `mhlo.copy` (TF's copies of return values) as an identity
    `stablehlo.reshape`: newer jaxlibs' compilers reject the mhlo op that their own
    `hlo_to_stablehlo` emits for HLO `copy`."""
    from jax._src.interpreters import mlir as jax_mlir
    from jax._src.lib.mlir import ir

    with jax_mlir.make_ir_context():
        text = str(ir.Module.parse(bytecode))
    text = _MHLO_COPY.sub(r"\1stablehlo.reshape \2 : (\3) -> \3", text)
    if "mhlo.copy" in text:
        raise RuntimeError("an mhlo.copy in an unexpected form is left in the module")
    return text


def _compile(proto, device):
    """jaxlib's compiler for `device` on a serialized HloModuleProto (as jax2tf's call_tf does)."""
    from jax._src.lib import xla_client as xc

    try:
        from jax.extend.mlir import hlo_to_stablehlo
    except ImportError:  # older jax
        hlo_to_stablehlo = xc._xla.mlir.hlo_to_stablehlo
    mlir = _without_mhlo_copies(hlo_to_stablehlo(proto))
    options = xc.CompileOptions()
    client = device.client
    if hasattr(client, "compile_and_load"):
        return client.compile_and_load(
            mlir, executable_devices=xc.DeviceList((device,)), compile_options=options
        )
    return client.compile(mlir, compile_options=options)  # jaxlib < 0.6


def _flops(executable):
    try:
        analysis = executable.cost_analysis()
    except Exception:  # noqa: BLE001 (not every backend reports costs)
        return None
    if isinstance(analysis, list):
        analysis = analysis[0] if analysis else {}
    flops = analysis.get("flops") if analysis else None
    return float(flops) if flops else None


def matmul_peaks(n=8192, reps=10):
    """TFLOP/s of an n³ matmul on the default device: fp32 (highest), fp32 (default), bf16."""
    import jax
    import jax.numpy as jnp

    peaks = {}
    for label, dtype, precision in (
        ("float32_highest", jnp.float32, "highest"),
        ("float32_default", jnp.float32, "default"),
        ("bfloat16", jnp.bfloat16, "default"),
    ):
        a = jax.random.normal(jax.random.PRNGKey(0), (n, n), dtype)
        b = jax.random.normal(jax.random.PRNGKey(1), (n, n), dtype)
        matmul = jax.jit(lambda x, y, p=precision: jnp.matmul(x, y, precision=p))
        matmul(a, b).block_until_ready()
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            matmul(a, b).block_until_ready()
            times.append(time.perf_counter() - start)
        peaks[label] = round(2.0 * n**3 / min(times) / 1e12, 2)
    return peaks


def _busy_ns(events):
    """Length of the union of the events' [start, end) intervals."""
    total, end = 0, None
    for start, stop in sorted((e.start_ns, e.end_ns) for e in events):
        if end is None or start > end:
            total += stop - start
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    return total


def summarize_trace(trace_dir, wall_s, top=25):
    """Device time per operation from a jax profiler trace: for each device plane, how busy its
    streams were over the profiled wall time, and the `top` operations by total time."""
    import glob

    from jax.profiler import ProfileData

    paths = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True))
    if not paths:
        return {"error": f"no *.xplane.pb under {trace_dir}"}
    data = ProfileData.from_file(paths[-1])
    summary = {"planes": [plane.name for plane in data.planes]}
    for plane in data.planes:
        if not plane.name.startswith("/device:"):
            continue
        lines = {line.name: list(line.events) for line in plane.lines}
        kernels = [e for name, events in lines.items() if name.startswith("Stream") for e in events]
        ops = lines.get("XLA Ops") or kernels
        by_name = {}
        for event in ops:
            ns, count = by_name.get(event.name, (0, 0))
            by_name[event.name] = (ns + event.duration_ns, count + 1)
        ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
        summary[plane.name] = {
            "lines": {name: len(events) for name, events in lines.items()},
            "kernels": len(kernels),
            "busy_fraction": round(_busy_ns(kernels) / (wall_s * 1e9), 3) if kernels else None,
            "top_ops_ms": [[name, round(ns / 1e6, 3), count] for name, (ns, count) in ranked],
        }
    return summary


def replay_setting(executable, meta, exact, device, updates, check, profile=0, trace_dir=None):
    import jax

    values = _host_params(meta, exact, np.random.default_rng(0))
    args = [jax.device_put(v, device) for v in values]
    aliases = meta["aliases"]

    def read_metrics(outputs):  # the module's first outputs, in metric_names' order
        return {name: float(np.asarray(outputs[i])) for i, name in enumerate(meta["metric_names"])}

    def call(current):
        outputs = executable.execute(current)
        jax.block_until_ready(outputs)
        nxt = list(current)
        for out_index, param_index in aliases:
            nxt[param_index] = outputs[out_index]
        return outputs, nxt

    outputs, args_next = call(args)
    result = {}
    if check and meta["tf_metrics"]:
        got = read_metrics(outputs)
        worst = max(abs(got[k] - v) / max(abs(v), 1e-3) for k, v in meta["tf_metrics"].items())
        result["check_max_rel_diff"] = float(f"{worst:.3g}")
    args = args_next
    _, args = call(args)  # second warm-up
    times = []
    for _ in range(updates):
        start = time.perf_counter()
        outputs, args = call(args)
        times.append(time.perf_counter() - start)
    metrics = read_metrics(outputs)
    result.update(
        s_per_update=round(float(np.median(times)), 5),
        min_s=round(min(times), 5),
        L_world_model=metrics.get("L_world_model"),
        finite=bool(all(np.isfinite(v) for v in metrics.values())),
    )
    if profile:
        jax.profiler.start_trace(trace_dir)
        start = time.perf_counter()
        for _ in range(profile):
            _, args = call(args)
        wall_s = time.perf_counter() - start
        jax.profiler.stop_trace()
        result["profile"] = {
            "updates": profile,
            "wall_s": round(wall_s, 4),
            **summarize_trace(trace_dir, wall_s),
        }
    return result


def replay_main(args):
    from concurrent.futures import ThreadPoolExecutor

    import jax

    jax.config.update("jax_enable_x64", True)  # the modules take int64 step counters

    names = sorted(f[: -len(".json")] for f in os.listdir(args.dir) if f.endswith(".json"))
    if args.only:
        names = [n for n in names if any(part in n for part in args.only)]
    order = {"S": 0, "M": 1, "L": 2, "XL": 3}
    names.sort(key=lambda n: (n.split("-")[1], order.get(n.split("-")[0], -1), n))
    if not names:
        raise SystemExit(f"no exported modules (*.json) in {args.dir!r}: run `export` first")
    device = jax.devices()[0]
    header = {
        "device": getattr(device, "device_kind", str(device)),
        "platform": device.platform,
        "jax": jax.__version__,
        "settings": names,
    }
    emit(header, args.json)
    if not args.no_peak:
        emit({"matmul_peak_tflops": matmul_peaks(args.peak_size)}, args.json)

    loaded = {name: _load_module(args.dir, name) for name in names}
    compile_s = {}

    def compile_one(name):
        start = time.perf_counter()
        executable = _compile(loaded[name][0], device)
        compile_s[name] = round(time.perf_counter() - start, 1)
        log(f"compiled {name} in {compile_s[name]} s")
        return executable

    # Compile everything first (in parallel: XLA's GPU compiler leaves cores idle), then time
    # one setting at a time on a quiet machine.
    with ThreadPoolExecutor(max_workers=args.compile_threads) as pool:
        futures = {name: pool.submit(compile_one, name) for name in names}
        for future in futures.values():
            future.exception()
    for name in names:
        _, meta, exact = loaded[name]
        row = {"setting": name, "num_parameters": meta["num_parameters"]}
        try:
            executable = futures[name].result()
            futures[name] = None
            row["compile_s"] = compile_s[name]
            row.update(
                replay_setting(
                    executable,
                    meta,
                    exact,
                    device,
                    args.updates,
                    args.check,
                    profile=args.profile
                    if any(p in name for p in args.profile_only or [name])
                    else 0,
                    trace_dir=os.path.join(args.trace_dir, name),
                )
            )
            if meta.get("flops"):  # matmul + convolution FLOPs counted at export
                row["flops"] = meta["flops"]
                row["tflops_per_s"] = float(f"{meta['flops'] / row['s_per_update'] / 1e12:.3g}")
            # XLA's own estimate; on GPUs it misses the library calls (cuBLAS, cuDNN)
            row["xla_cost_analysis_flops"] = _flops(executable)
            del executable
        except Exception as err:  # noqa: BLE001 (report and go on with the next setting)
            row["error"] = f"{type(err).__name__}: {str(err)[:400]}"
        emit(row, args.json)


def emit(row, path):
    line = json.dumps(row)
    print(line, flush=True)
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    export = sub.add_parser("export", help="lower our update to HLO (needs TensorFlow)")
    export.add_argument("--out", required=True, help="folder for the modules")
    export.add_argument("--sizes", nargs="+", default=["S", "XL"])
    export.add_argument(
        "--inputs", nargs="+", default=["image", "vector"], choices=["image", "vector"]
    )
    export.add_argument(
        "--actions", nargs="+", default=["discrete"], choices=["discrete", "continuous"]
    )
    export.add_argument(
        "--precisions", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"]
    )
    export.add_argument(
        "--count-flops",
        action="store_true",
        help="count matmul and convolution FLOPs (compiles each update here)",
    )
    export.add_argument(
        "--exact",
        action="store_true",
        help="store every parameter exactly (for `replay --check`; small sizes)",
    )
    replay = sub.add_parser("replay", help="compile and time the modules (needs jax only)")
    replay.add_argument("--dir", required=True)
    replay.add_argument("--updates", type=int, default=10)
    replay.add_argument("--only", nargs="*", help="substrings of the setting names to run")
    replay.add_argument(
        "--check",
        action="store_true",
        help="compare the first call's metrics with TF's (needs export --exact)",
    )
    replay.add_argument("--json", help="also append the JSON lines to this file")
    replay.add_argument(
        "--profile",
        type=int,
        default=0,
        help="also trace this many updates (jax profiler) and report the device time per operation",
    )
    replay.add_argument(
        "--profile-only",
        nargs="*",
        help="substrings of the setting names to profile (default: all)",
    )
    replay.add_argument("--trace-dir", default="traces", help="where the traces go")
    replay.add_argument("--no-peak", action="store_true")
    replay.add_argument("--peak-size", type=int, default=8192)
    replay.add_argument("--compile-threads", type=int, default=4)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.command == "export":
        export_main(args)
    else:
        replay_main(args)


if __name__ == "__main__":
    main()
