"""Seconds per DreamerV3 update (median after warm-up), one JSON line per setting.

Usage: python benchmarks/update_speed.py [--sizes nano micro XS] [--updates 20]
       [--obs-dim 4] [--num-actions 2] [--continuous] [--no-jit]

Defaults: CartPole-shaped inputs (4-dim observations, 2 discrete actions), B=16, T=64, H=15.
Each line: size, seconds of the first (compiling) call, median/min seconds of the next
`--updates` calls, and the trace count (1 means no re-tracing).
"""

import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from rllib_dreamerv3 import DreamerV3Config  # noqa: E402
from rllib_dreamerv3.model import DreamerV3Model  # noqa: E402
from rllib_dreamerv3.model_sizes import get_model_size  # noqa: E402
from rllib_dreamerv3.tf_rllib import make_adam  # noqa: E402
from rllib_dreamerv3.update import batch_signature, make_update_fn  # noqa: E402


def random_batch(rng, B, T, obs_dim, num_actions, continuous):
    if continuous:
        actions = rng.uniform(-1, 1, (B, T, num_actions))
    else:
        actions = np.eye(num_actions)[rng.integers(0, num_actions, (B, T))]
    return {"obs": rng.normal(size=(B, T, obs_dim)).astype(np.float32),
            "actions": actions.astype(np.float32),
            "rewards": np.ones((B, T), np.float32),
            "is_first": rng.random((B, T)) < 0.02, "is_terminal": rng.random((B, T)) < 0.02}


def measure(size, args):
    config = DreamerV3Config().training(model_size=size)
    B, T = config.batch_size_B, config.batch_length_T
    model = DreamerV3Model(args.obs_dim, args.num_actions, not args.continuous,
                           get_model_size(size))
    optimizers = {
        "world_model": make_adam(config.world_model_lr, config.world_model_adam_eps,
                                 model.world_model.trainable_variables),
        "actor": make_adam(config.actor_lr, config.actor_adam_eps,
                           model.actor.trainable_variables),
        "critic": make_adam(config.critic_lr, config.critic_adam_eps,
                            model.critic.trainable_variables),
    }
    signature = batch_signature((args.obs_dim,), tf.float32, args.num_actions, B, T)
    update = make_update_fn(model, optimizers, config, signature, jit_compile=not args.no_jit)
    rng = np.random.default_rng(0)
    batches = [random_batch(rng, B, T, args.obs_dim, args.num_actions, args.continuous)
               for _ in range(4)]
    start = time.perf_counter()
    float(update(batches[0], tf.constant([0, 0]))["L_world_model"])
    first = time.perf_counter() - start
    times = []
    for i in range(args.updates):
        start = time.perf_counter()
        float(update(batches[i % 4], tf.constant([0, i + 1]))["L_world_model"])
        times.append(time.perf_counter() - start)
    return {"size": size, "B": B, "T": T, "H": config.horizon_H,
            "actions": "continuous" if args.continuous else "discrete",
            "jit_compile": not args.no_jit, "first_call_s": round(first, 2),
            "median_s": round(float(np.median(times)), 4),
            "min_s": round(float(np.min(times)), 4), "updates": args.updates,
            "traces": update.experimental_get_tracing_count()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["nano", "micro", "XS"])
    parser.add_argument("--updates", type=int, default=20)
    parser.add_argument("--obs-dim", type=int, default=4)
    parser.add_argument("--num-actions", type=int, default=2)
    parser.add_argument("--continuous", action="store_true")
    parser.add_argument("--no-jit", action="store_true")
    args = parser.parse_args()
    for size in args.sizes:
        print(json.dumps(measure(size, args)), flush=True)


if __name__ == "__main__":
    main()
