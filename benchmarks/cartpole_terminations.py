"""What ends the CartPole episodes of a checkpoint's policy, and whether its world model sees it.

Backs docs/results.md: *What ends the episodes*.

Usage: python benchmarks/cartpole_terminations.py CHECKPOINT [--episodes 10] [--explore]
       [--seed 1000] [--imagine 15]

CHECKPOINT is a directory of `algo.save_to_path()` (`benchmarks/learning.py --save-checkpoint`)
of a CartPole-v1 run. One JSON line per episode (greedy unless `--explore`): its length and what
ended it, "cart" (|x| > 2.4), "pole" (|angle| > 12 degrees) or "truncated" (500 steps). For a
termination the world model also dreams the last `--imagine` steps with greedy actions from the
posterior state that many steps before the end: the decoded final cart position and the lowest
continue probability along the dream (above 0.5 throughout: the values do not foresee the end).
A last line summarises the episodes.
"""

import os

import common
import gymnasium as gym
import numpy as np
import tensorflow as tf

from rllib_dreamerv3.export import MODULE_PATH
from rllib_dreamerv3.rl_module import DreamerV3RLModule


def play(model, env, seed, explore, policy_seed):
    """One episode. Returns (length, cause, final obs, the posterior carry of every step)."""
    obs, _ = env.reset(seed=seed)
    carry, is_first, carries = model.initial_carry(1), True, []
    for t in range(10**6):
        action, carry = model.policy_step(
            carry,
            tf.constant(obs[None], tf.float32),
            tf.constant([is_first]),
            tf.constant([policy_seed, t], tf.int32),
            explore,
        )
        carries.append(carry)
        obs, _, terminated, truncated, _ = env.step(int(np.argmax(action[0])))
        is_first = False
        if terminated or truncated:
            break
    if not terminated:
        cause = "truncated"
    else:
        # past the env's own cart threshold; otherwise the pole passed its angle threshold
        cause = "cart" if abs(obs[0]) > env.unwrapped.x_threshold else "pole"
    return t + 1, cause, obs, carries


def dream(model, carry, steps):
    """Greedy imagination from `carry`: (decoded cart position at the end, lowest continue
    probability along the dream)."""
    wm, actor = model.world_model, model.actor
    h, z, _ = carry
    lowest = 1.0
    for k in range(steps):
        action = actor.dist(tf.concat([h, z], -1)).mode()
        h, z = wm.imagine_step(h, z, action, tf.constant([0, k], tf.int32))
        feat = tf.concat([h, z], -1)
        lowest = min(lowest, float(tf.sigmoid(wm.continue_logit(feat))[0]))
    return float(wm.decoder.predict(feat)[0, 0]), lowest


def main():
    parser = common.parser(__doc__)
    parser.add_argument("checkpoint")
    parser.add_argument("--episodes", type=int, default=10)
    parser.add_argument("--explore", action="store_true", help="sample actions (default: greedy)")
    parser.add_argument("--seed", type=int, default=1000, help="env seed of the first episode")
    parser.add_argument("--imagine", type=int, default=15, help="dream length before the end")
    args = parser.parse_args()
    module_path = os.path.join(args.checkpoint, MODULE_PATH)
    if not os.path.isdir(module_path):
        raise SystemExit(
            f"No RLModule under {module_path!r}: give the directory of `algo.save_to_path()`."
        )
    module = DreamerV3RLModule.from_checkpoint(os.path.abspath(module_path))
    env = gym.make("CartPole-v1")
    if module.observation_space.shape != env.observation_space.shape:
        raise SystemExit(f"{args.checkpoint!r} is not a CartPole-v1 checkpoint.")
    model = module.model
    lengths, causes = [], []
    for i in range(args.episodes):
        length, cause, obs, carries = play(model, env, args.seed + i, args.explore, i)
        line = {
            "episode": i,
            "length": length,
            "cause": cause,
            "final_x": round(float(obs[0]), 3),
            "final_angle": round(float(obs[2]), 3),
        }
        if cause != "truncated" and length >= args.imagine:
            # carries[j] has seen the observation before step j; the final one is `length`.
            dreamed_x, lowest_continue = dream(model, carries[-args.imagine], args.imagine)
            line["dreamed_final_x"] = round(dreamed_x, 3)
            line["dream_lowest_continue"] = round(lowest_continue, 3)
        common.emit(line)
        lengths.append(length)
        causes.append(cause)
    summary = {c: causes.count(c) for c in ("cart", "pole", "truncated")}
    summary.update(checkpoint=args.checkpoint, explore=args.explore, mean_length=np.mean(lengths))
    common.emit(summary)


if __name__ == "__main__":
    main()
