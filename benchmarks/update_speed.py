"""Seconds per DreamerV3 update: ours (TF2 + XLA) vs RLlib's built-in torch DreamerV3, and FLOPs.

Usage:
    python benchmarks/update_speed.py --quick          # nano, vectors, discrete: a smoke test
    python benchmarks/update_speed.py                  # every setting below (long: ~1.5 h)
    python benchmarks/update_speed.py --sizes XS S --inputs image --actions discrete \\
        --updates 5 --no-torch

Settings: model sizes (`--sizes`, default nano micro XS S) × inputs (`--inputs`: `vector`,
CartPole-shaped 4-dim floats; `image`, 64×64×3 uint8) × actions (`--actions`: `discrete`, 2
one-hot actions; `continuous`, a 2-dim Box in [-1, 1]), with B=16, T=64, H=15.

Both sides run in this process on the same random batches, each through its RLlib Learner's
`update()` (numpy batch in, one world-model, critic and actor step and the critic EMA out); the
median over `--updates` calls after warm-up is reported. The optimizers' step counters are
checked to make sure each call is exactly one update. RLlib's side needs torch (the `[bench]`
extra) and is skipped without it or with `--no-torch`; it runs with as many torch threads as
this process may use cores, and with RLlib's defaults (no torch.compile). RLlib's pipeline
feeds images as float32 in [-1, 1] (its Atari wrapper normalises them), ours as uint8.

Ours is also timed as the bare compiled update function, whose matmul and convolution FLOPs are
counted from XLA's optimized HLO (`benchmarks/flops.py`); dividing gives the achieved GFLOP/s,
compared with the fp32 matmul peak of this machine measured at start-up (an XLA-compiled
N×N matmul, `--peak-size`). Getting the HLO compiles the update once more (`--no-flops` skips
it). RLlib's FLOPs for the same update are counted too, by `torch.utils.flop_counter` over one
more update after its timing (`their_flops`): it multiplies the one-hot latents and actions into
dense matmuls, where ours sums kernel rows, so it counts more (XS vector, 2026-12-05: 143.9 vs
62.9 GFLOP). `their_flops_per_our_s` divides that count by our seconds: the GFLOP/s a dense
implementation would need to run as fast as ours (a figure of merit, not a hardware rate;
`..._of_peak` compares it with the peak). The first line is the peak, then one JSON line per
setting, printed as soon as it is measured: `ours_s` / `theirs_s` (Learner.update medians),
`ratio` (ours / theirs), `speedup` (theirs / ours), `ours_fn_s` (bare update), `flops`,
`gflops`, `peak_gflops`, `fraction_of_peak`, `their_flops`, `their_flops_per_our_s` (and
`_of_peak`), `*_first_call_s` (tracing + compiling), `traces` (1: never re-traced),
`loadavg_1m` (other processes skew timings: run on a quiet machine).
"""

import argparse
import gc
import json
import os
import sys
import time
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import gymnasium as gym  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from flops import compiled_flops  # noqa: E402
from ray.rllib.core import DEFAULT_MODULE_ID  # noqa: E402
from ray.rllib.policy.sample_batch import MultiAgentBatch, SampleBatch  # noqa: E402
from ray.rllib.utils.metrics import NUM_ENV_STEPS_SAMPLED_LIFETIME  # noqa: E402

from rllib_dreamerv3 import DreamerV3Config  # noqa: E402
from rllib_dreamerv3.spaces import action_dim, obs_storage_dtype  # noqa: E402
from rllib_dreamerv3.update import batch_signature  # noqa: E402

IMAGE_SHAPE = (64, 64, 3)
QUICK = {
    "sizes": ["nano"],
    "inputs": ["vector"],
    "actions": ["discrete"],
    "updates": 5,
    "peak_size": 2048,
}
FULL = {
    "sizes": ["nano", "micro", "XS", "S"],
    "inputs": ["vector", "image"],
    "actions": ["discrete", "continuous"],
    "updates": 10,
    "peak_size": 4096,
}


def log(message):
    print(message, file=sys.stderr, flush=True)


def num_cores():
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


# --- spaces and batches ---------------------------------------------------------------------------
def make_spaces(inputs, actions, args):
    """`(our observation space, RLlib's observation space, action space)`."""
    if inputs == "image":
        ours = gym.spaces.Box(0, 255, IMAGE_SHAPE, np.uint8)
        theirs = gym.spaces.Box(-1.0, 1.0, IMAGE_SHAPE, np.float32)
    else:
        ours = theirs = gym.spaces.Box(-np.inf, np.inf, (args.obs_dim,), np.float32)
    if actions == "discrete":
        action_space = gym.spaces.Discrete(args.num_actions)
    else:
        action_space = gym.spaces.Box(-1.0, 1.0, (args.num_actions,), np.float32)
    return ours, theirs, action_space


def random_batch(rng, B, T, inputs, action_space, obs_dim):
    """A `[B, T, ...]` numpy batch in our replay format (episode starts and ends at ~2 %)."""
    if inputs == "image":
        obs = rng.integers(0, 256, (B, T) + IMAGE_SHAPE, dtype=np.uint8)
    else:
        obs = rng.normal(size=(B, T, obs_dim)).astype(np.float32)
    if isinstance(action_space, gym.spaces.Discrete):
        actions = np.eye(action_space.n, dtype=np.float32)[rng.integers(0, action_space.n, (B, T))]
    else:
        actions = rng.uniform(-1, 1, (B, T) + action_space.shape).astype(np.float32)
    is_first = rng.random((B, T)) < 0.02
    is_first[:, 0] = True
    return {
        "obs": obs,
        "actions": actions,
        "rewards": rng.normal(size=(B, T)).astype(np.float32),
        "is_first": is_first,
        "is_terminal": rng.random((B, T)) < 0.02,
    }


def their_batch(batch):
    """The same data in the format RLlib's DreamerV3 Learner reads from its replay buffer."""
    out = {key: value for key, value in batch.items() if key != "is_terminal"}
    out["is_terminated"] = batch["is_terminal"]
    if batch["obs"].dtype == np.uint8:
        out["obs"] = batch["obs"].astype(np.float32) / 127.5 - 1.0
    return out


def as_multi_agent(batch):
    B, T = batch["rewards"].shape
    return MultiAgentBatch({DEFAULT_MODULE_ID: SampleBatch(batch)}, env_steps=B * T)


def timed(fn, n):
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def time_learner_updates(learner, batches, n):
    """`(first call s, [n timed calls s], calls made)` of `learner.update` over `batches`.

    The first call (tracing, compiling) and one warm-up call are not among the timed ones.
    """
    calls = 0

    def update():
        nonlocal calls
        learner.update(
            batch=batches[calls % len(batches)], timesteps={NUM_ENV_STEPS_SAMPLED_LIFETIME: calls}
        )
        calls += 1

    start = time.perf_counter()
    update()
    first_call = time.perf_counter() - start
    update()  # warm-up
    times = timed(update, n)
    return first_call, times, calls


# --- the matmul peak ------------------------------------------------------------------------------
def matmul_peak_gflops(n, reps=5):
    """Best GFLOP/s of an XLA-compiled fp32 `[n, n] @ [n, n]` (and of TF's own kernel)."""
    a = tf.random.normal([n, n])
    b = tf.random.normal([n, n])
    flops = 2.0 * n**3
    result = {}
    for name, jit in (("xla", True), ("tf", False)):
        matmul = tf.function(lambda x, y: x @ y, jit_compile=jit)
        matmul(a, b).numpy()  # compile / warm up
        best = min(timed(lambda: matmul(a, b).numpy(), reps))  # noqa: B023 (called right here)
        result[name] = flops / best / 1e9
    return result


# --- ours -----------------------------------------------------------------------------------------
def measure_ours(size, obs_space, action_space, batches, args):
    config = (
        DreamerV3Config()
        .environment(observation_space=obs_space, action_space=action_space)
        .training(model_size=size, jit_compile=not args.no_jit)
    )
    try:
        learner = config.build_learner(spaces={DEFAULT_MODULE_ID: (obs_space, action_space)})
    except ValueError as err:  # an observation space the model does not support (yet)
        return {"ours_skipped": str(err).splitlines()[0][:300]}
    first_call, times, calls = time_learner_updates(
        learner, [as_multi_agent(b) for b in batches], args.updates
    )

    # The bare compiled update (no RLlib plumbing), on the same batches. The Learner has no
    # public handle on it: this benchmark reads the private attribute.
    update_fn = learner._update_fn
    signature = batch_signature(
        obs_space.shape,
        tf.as_dtype(obs_storage_dtype(obs_space)),
        action_dim(action_space),
        config.batch_size_B,
        config.batch_length_T,
    )
    inputs_list = [
        {key: tf.constant(b[key], spec.dtype) for key, spec in signature.items()} for b in batches
    ]
    seed = tf.constant([0, 1], tf.int32)

    def fn_update():
        nonlocal calls
        update_fn(inputs_list[calls % len(batches)], seed)["L_world_model"].numpy()
        calls += 1

    fn_update()  # warm-up
    fn_times = timed(fn_update, args.updates)
    steps = int(learner.get_optimizer(DEFAULT_MODULE_ID, "world_model").iterations.numpy())
    if steps != calls:
        raise RuntimeError(f"ours: {calls} update calls made {steps} optimizer steps")
    result = {
        "ours_s": median(times),
        "ours_min_s": round(min(times), 4),
        "ours_fn_s": median(fn_times),
        "ours_first_call_s": round(first_call, 2),
        "traces": learner.num_traces,
    }
    if not args.no_jit and not args.no_flops:
        count = compiled_flops(update_fn, inputs_list[0], seed)
        result.update(
            flops=count.total,
            flops_conv=count.convolution,
            flops_exact=count.exact,
            loops=[f"{name}:{trip}" for name, trip in count.loops],
        )
        if not count.exact:  # what the count missed: loops counted once, opaque kernels
            result["flops_missed"] = sorted(set(count.unresolved_loops + count.custom_calls))
    return result


# --- RLlib's torch DreamerV3 ----------------------------------------------------------------------
def measure_theirs(size, obs_space, action_space, batches, args):
    import torch
    from ray.rllib.algorithms.dreamerv3 import DreamerV3Config as RLlibDreamerV3Config

    ours = DreamerV3Config()
    config = (
        RLlibDreamerV3Config()
        .framework("torch")
        .environment(observation_space=obs_space, action_space=action_space)
        .training(
            model_size=size,
            batch_size_B=ours.batch_size_B,
            batch_length_T=ours.batch_length_T,
            horizon_H=ours.horizon_H,
            gamma=ours.gamma,
            world_model_lr=ours.world_model_lr,
            actor_lr=ours.actor_lr,
            critic_lr=ours.critic_lr,
        )
        .learners(num_learners=0)
    )
    learner = config.build_learner(spaces={DEFAULT_MODULE_ID: (obs_space, action_space)})
    their_batches = [as_multi_agent(their_batch(b)) for b in batches]
    first_call, times, calls = time_learner_updates(learner, their_batches, args.their_updates)
    result = {
        "theirs_s": median(times),
        "theirs_min_s": round(min(times), 4),
        "theirs_first_call_s": round(first_call, 2),
        "torch_threads": torch.get_num_threads(),
    }
    if not args.no_flops:  # one more update, under torch's FLOP counter (after the timing)
        from torch.utils.flop_counter import FlopCounterMode

        with FlopCounterMode(display=False) as counter:
            learner.update(
                batch=their_batches[0], timesteps={NUM_ENV_STEPS_SAMPLED_LIFETIME: calls}
            )
        calls += 1
        result["their_flops"] = int(counter.get_total_flops())
    optimizer = learner.get_optimizer(DEFAULT_MODULE_ID, "world_model")
    steps = int(optimizer.state[optimizer.param_groups[0]["params"][0]]["step"])
    if steps != calls:
        raise RuntimeError(f"RLlib: {calls} update calls made {steps} optimizer steps")
    return result


def median(times):
    return round(float(np.median(times)), 4)


# --- main -----------------------------------------------------------------------------------------
def measure(size, inputs, actions, peak, args):
    our_obs, their_obs, action_space = make_spaces(inputs, actions, args)
    config = DreamerV3Config()
    B, T = config.batch_size_B, config.batch_length_T
    rng = np.random.default_rng(0)
    batches = [random_batch(rng, B, T, inputs, action_space, args.obs_dim) for _ in range(4)]
    row = {
        "size": size,
        "obs": inputs,
        "obs_shape": list(our_obs.shape),
        "actions": actions,
        "action_dim": action_dim(action_space),
        "B": B,
        "T": T,
        "H": config.horizon_H,
        "jit_compile": not args.no_jit,
        "updates": args.updates,
        "loadavg_1m": os.getloadavg()[0],
    }  # other processes on the machine skew timings
    failed = False
    for side, run in (
        ("ours", lambda: measure_ours(size, our_obs, action_space, batches, args)),
        ("theirs", lambda: measure_theirs(size, their_obs, action_space, batches, args)),
    ):
        if side == "theirs" and not args.torch:
            continue
        log(f"[update_speed] {size} {inputs} {actions}: measuring {side} ...")
        try:
            row.update(run())
        except Exception as err:  # keep going: one broken setting must not end a long run
            traceback.print_exc()
            row[f"{side}_error"] = f"{type(err).__name__}: {err}"[:300]
            failed = True
        gc.collect()
    if "ours_s" in row and "theirs_s" in row:
        row["ratio"] = round(row["ours_s"] / row["theirs_s"], 4)
        row["speedup"] = round(row["theirs_s"] / row["ours_s"], 2)
    if row.get("flops"):
        row["gflops"] = round(row["flops"] / row["ours_fn_s"] / 1e9, 2)
        row["peak_gflops"] = round(peak, 2)
        row["fraction_of_peak"] = round(row["gflops"] / peak, 4)
    if row.get("their_flops") and row.get("ours_fn_s"):
        # RLlib's FLOP count of the same update (one-hot inputs as dense matmuls) over our
        # seconds: the speed a dense implementation would need to match ours.
        row["their_flops_per_our_s"] = round(row["their_flops"] / row["ours_fn_s"] / 1e9, 2)
        row["their_flops_per_our_s_of_peak"] = round(row["their_flops_per_our_s"] / peak, 4)
    print(json.dumps(row), flush=True)
    return not failed


def torch_available():
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke-test defaults: {QUICK} (explicit flags still win)",
    )
    parser.add_argument("--sizes", nargs="+", help=f"default {FULL['sizes']}")
    parser.add_argument(
        "--inputs", nargs="+", choices=["vector", "image"], help=f"default {FULL['inputs']}"
    )
    parser.add_argument(
        "--actions",
        nargs="+",
        choices=["discrete", "continuous"],
        help=f"default {FULL['actions']}",
    )
    parser.add_argument("--continuous", action="store_true", help="same as --actions continuous")
    parser.add_argument("--updates", type=int, help=f"timed updates, default {FULL['updates']}")
    parser.add_argument(
        "--their-updates", type=int, help="timed updates of RLlib's DreamerV3 (default: --updates)"
    )
    parser.add_argument("--obs-dim", type=int, default=4, help="vector observation size")
    parser.add_argument(
        "--num-actions",
        type=int,
        default=2,
        help="discrete actions, or continuous action dimensions",
    )
    parser.add_argument(
        "--no-torch", dest="torch", action="store_false", help="skip RLlib's torch DreamerV3"
    )
    parser.add_argument(
        "--no-flops", action="store_true", help="skip the FLOP counts (ours and RLlib's)"
    )
    parser.add_argument("--no-jit", action="store_true", help="ours without XLA (no FLOPs)")
    parser.add_argument("--peak-size", type=int, help="N of the N×N peak matmul")
    parser.add_argument(
        "--torch-threads",
        type=int,
        help="torch threads for RLlib's side (default: the usable cores)",
    )
    args = parser.parse_args(argv)
    defaults = QUICK if args.quick else FULL
    if args.continuous:
        args.actions = ["continuous"]
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.their_updates is None:
        args.their_updates = args.updates
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.torch and not torch_available():
        log(
            "[update_speed] torch is not installed (pip install -e '.[bench]'): "
            "RLlib's DreamerV3 is skipped."
        )
        args.torch = False
    header = {"tf": tf.__version__, "cores": num_cores(), "loadavg_1m": os.getloadavg()[0]}
    if args.torch:
        import torch

        torch.set_num_threads(args.torch_threads or num_cores())
        header["torch"] = torch.__version__
    peaks = matmul_peak_gflops(args.peak_size)
    header.update(
        {
            "matmul_peak_n": args.peak_size,
            "peak_gflops": round(peaks["xla"], 2),
            "peak_gflops_tf_kernel": round(peaks["tf"], 2),
        }
    )
    print(json.dumps(header), flush=True)
    ok = True
    for size in args.sizes:
        for inputs in args.inputs:
            for actions in args.actions:
                ok &= measure(size, inputs, actions, peaks["xla"], args)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
