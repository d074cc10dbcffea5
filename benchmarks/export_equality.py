"""Greedy actions of an exported policy vs the checkpoint's module, step for step.

Usage: python benchmarks/export_equality.py [--env ALE/Pong-v5]
       [--env-config '{protocol: atari100k}'] [--size XS] [--steps 1000]

Trains a small run for two iterations (so the weights are not their initial values), saves a
checkpoint, exports it with `export_policy`, and plays `--steps` env steps with the module's
`forward_inference`, asking the SavedModel's `step` for its action at every step. Prints one
JSON line: equal and different actions, the SavedModel's size.
"""

import argparse
import json
import os
import tempfile

import numpy as np
import tensorflow as tf
import yaml
from ray.rllib.core.columns import Columns

from rllib_dreamerv3 import DreamerV3Config
from rllib_dreamerv3.env_runner import make_env
from rllib_dreamerv3.export import MODULE_PATH, export_policy, saved_model_bytes
from rllib_dreamerv3.rl_module import IS_FIRST, DreamerV3RLModule


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", default="ALE/Pong-v5")
    parser.add_argument("--env-config", type=yaml.safe_load, default={"protocol": "atari100k"})
    parser.add_argument("--size", default="XS")
    parser.add_argument("--steps", type=int, default=1000)
    args = parser.parse_args()
    config = (
        DreamerV3Config()
        .environment(args.env, env_config=args.env_config)
        .training(
            model_size=args.size,
            batch_size_B=2,
            batch_length_T=16,
            training_ratio=64,
            num_steps_sampled_before_learning_starts=64,
            replay_capacity=5000,
            dream_every_n_updates=0,
            log_progress=False,
        )
        .reporting(min_sample_timesteps_per_iteration=64)
        .debugging(seed=0)
    )
    algo = config.build_algo()
    try:
        algo.train()
        algo.train()
        checkpoint = algo.save_to_path(tempfile.mkdtemp(prefix="dreamerv3_ckpt_"))
    finally:
        algo.stop()
    export_dir = export_policy(checkpoint, os.path.join(tempfile.mkdtemp(), "policy"))
    size = saved_model_bytes(export_dir)
    policy = tf.saved_model.load(export_dir)
    module = DreamerV3RLModule.from_checkpoint(os.path.join(checkpoint, MODULE_PATH))
    env = make_env(config)
    obs, _ = env.reset(seed=0)
    state = {k: v[None] for k, v in module.get_initial_state().items()}
    served = policy.initial_state(tf.constant(1))
    is_first, equal, different = True, 0, 0
    for _ in range(args.steps):
        ours = module.forward_inference(
            {Columns.OBS: obs[None], Columns.STATE_IN: state, IS_FIRST: np.array([is_first])}
        )
        out = policy.step(obs=tf.constant(obs[None]), is_first=tf.constant([is_first]), **served)
        action = ours[Columns.ACTIONS].numpy()[0]
        same = np.array_equal(out.pop("action").numpy()[0], action)
        equal, different = equal + same, different + (not same)
        state, served = ours[Columns.STATE_OUT], out
        obs, _, terminated, truncated, _ = env.step(action)
        is_first = terminated or truncated
        if is_first:
            obs, _ = env.reset()
    print(
        json.dumps(
            {
                "env": args.env,
                "env_config": args.env_config,
                "action_space": repr(env.action_space),
                "size": args.size,
                "steps": args.steps,
                "equal_actions": int(equal),
                "different_actions": int(different),
                "saved_model_mb": round(size / 1e6, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
