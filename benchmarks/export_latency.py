"""Latency of one policy step: the exported SavedModel vs the RLModule the EnvRunners use.

Backs docs/performance.md: the table of *Exported policy (SavedModel)*.

Usage: python benchmarks/export_latency.py [--env CartPole-v1] [--size XS] [--batch 1 16]
       [--steps 300]

Builds an untrained module of the given size (latency does not depend on the weights), exports
it, and times `step` (greedy) of the loaded SavedModel and the module's `forward_inference` for
each batch size, after a warm-up. Prints one JSON line per batch size, and the SavedModel's
size on disk.
"""

import tempfile

import common
import numpy as np
import tensorflow as tf
from ray.rllib.core.columns import Columns

from rllib_dreamerv3 import DreamerV3Config
from rllib_dreamerv3.env_runner import make_env
from rllib_dreamerv3.export import ServedPolicy, saved_model_bytes
from rllib_dreamerv3.rl_module import IS_FIRST


def seconds_per_call(fn, steps):
    common.timed(fn, 20)  # warm-up
    return sum(common.timed(fn, steps)) / steps


def main():
    parser = common.parser(__doc__)
    parser.add_argument("--env", default="CartPole-v1")
    parser.add_argument("--size", default="XS")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    common.emit(common.machine())
    config = DreamerV3Config().environment(args.env).training(model_size=args.size)
    env = make_env(config)  # ALE ids: the paper's Atari env (64x64 frames)
    module = config.get_rl_module_spec(env=env).build()
    out = tempfile.mkdtemp(prefix="dreamerv3_export_")
    served = ServedPolicy(module)
    tf.saved_model.save(served, out, signatures=served.signatures())
    size = saved_model_bytes(out)
    policy = tf.saved_model.load(out)
    for batch in args.batch:
        obs = np.stack([env.observation_space.sample() for _ in range(batch)])
        first = np.zeros(batch, bool)
        state = {k: np.repeat(v[None], batch, 0) for k, v in module.get_initial_state().items()}
        module_batch = {Columns.OBS: obs, Columns.STATE_IN: state, IS_FIRST: first}
        served_state = policy.initial_state(tf.constant(batch))
        served_inputs = {"obs": tf.constant(obs), "is_first": tf.constant(first), **served_state}
        common.emit(
            {
                "env": args.env,
                "size": args.size,
                "batch": batch,
                "saved_model_s": seconds_per_call(
                    lambda inputs=served_inputs: policy.step(**inputs), args.steps
                ),
                "rl_module_s": seconds_per_call(
                    lambda batch=module_batch: module.forward_inference(batch), args.steps
                ),
                "saved_model_mb": round(size / 1e6, 3),
            }
        )


if __name__ == "__main__":
    main()
