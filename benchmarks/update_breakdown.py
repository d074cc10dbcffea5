"""Where an update's time goes: the world-model part vs imagination and actor-critic.

Usage: python benchmarks/update_breakdown.py [SIZE]     # default nano; CartPole-shaped inputs

Compiles the pieces of one update (B=16, T=64, H=15) separately with XLA and prints one JSON
line of seconds per call: world-model loss forward (`wm_fwd`); with its gradient and optimizer
step (`wm_fwd_bwd_step`); imagination forward from B·T start states (`imagine_fwd`); imagination
with the actor and critic losses, gradients and steps (`imagine_ac_fwd_bwd_steps`); the full
update (`full`). The pieces use the implementation the update uses: the fast kernels
(`fast_kernels`, the default) or the plain losses. A profiling aid: it reads private pieces of
the Learner and the update.
"""

import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import gymnasium as gym  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from ray.rllib.core import DEFAULT_MODULE_ID  # noqa: E402
from update_speed import random_batch  # noqa: E402  (this script's folder is on sys.path)

from rllib_dreamerv3 import DreamerV3Config, kernels, losses, random_ops  # noqa: E402
from rllib_dreamerv3.update import _step  # noqa: E402


def timed(fn, *args, n=20):
    """Seconds per call of `fn(*args)`, after two warm-up calls (compiling)."""
    fn(*args)
    fn(*args)
    start = time.perf_counter()
    for _ in range(n):
        out = fn(*args)
    tf.nest.map_structure(lambda x: x.numpy(), out)
    return round((time.perf_counter() - start) / n, 4)


def main(size):
    obs_space, action_space = gym.spaces.Box(-1, 1, (4,), np.float32), gym.spaces.Discrete(2)
    cfg = (
        DreamerV3Config()
        .environment(observation_space=obs_space, action_space=action_space)
        .training(model_size=size)
    )
    learner = cfg.build_learner(spaces={DEFAULT_MODULE_ID: (obs_space, action_space)})
    model = learner.module[DEFAULT_MODULE_ID].model
    optimizers = dict(learner.get_optimizers_for_module(DEFAULT_MODULE_ID))
    B, T, H = cfg.batch_size_B, cfg.batch_length_T, cfg.horizon_H
    batch = {
        key: tf.constant(value)
        for key, value in random_batch(
            np.random.default_rng(0), B, T, "vector", action_space, obs_space.shape[0]
        ).items()
    }
    seed = tf.constant([0, 1])
    compiled = tf.function(jit_compile=True, autograph=False)
    impl = kernels if cfg.fast_kernels else losses  # as in update.make_update_fn

    @compiled
    def wm_fwd(batch, seed):
        return impl.world_model_loss(model, batch, random_ops.split(seed, T), cfg)[0]

    @compiled
    def wm_fwd_bwd_step(batch, seed):
        with tf.GradientTape() as tape:
            loss = impl.world_model_loss(model, batch, random_ops.split(seed, T), cfg)[0]
        _step(
            optimizers["world_model"],
            tape,
            loss,
            model.world_model.trainable_variables,
            cfg.world_model_grad_clip,
        )
        return loss

    n = B * T
    num_categoricals, num_classes = model.world_model.stoch_shape
    h0 = tf.random.normal([n, model.world_model.initial_state(1)[0].shape[-1]])
    z0 = tf.reshape(tf.one_hot(tf.zeros([n, num_categoricals], tf.int32), num_classes), [n, -1])
    start_cont = tf.ones([n])

    @compiled
    def imagine_fwd(h, z, seed):
        return impl.imagine(model, h, z, H, random_ops.split(seed, 2 * H)).h

    @compiled
    def imagine_ac_fwd_bwd_steps(h, z, seed):
        with tf.GradientTape() as actor_tape, tf.GradientTape() as critic_tape:
            imagined = impl.imagine(model, h, z, H, random_ops.split(seed, 2 * H))
            actor_loss, critic_loss, _, _ = impl.actor_critic_losses(
                model, imagined, start_cont, cfg
            )
        _step(
            optimizers["critic"],
            critic_tape,
            critic_loss,
            model.critic.trainable_variables,
            cfg.critic_grad_clip,
        )
        _step(
            optimizers["actor"],
            actor_tape,
            actor_loss,
            model.actor.trainable_variables,
            cfg.actor_grad_clip,
        )
        return actor_loss

    print(
        json.dumps(
            {
                "size": size,
                "B": B,
                "T": T,
                "H": H,
                "wm_fwd": timed(wm_fwd, batch, seed),
                "wm_fwd_bwd_step": timed(wm_fwd_bwd_step, batch, seed),
                "imagine_fwd": timed(imagine_fwd, h0, z0, seed),
                "imagine_ac_fwd_bwd_steps": timed(imagine_ac_fwd_bwd_steps, h0, z0, seed),
                "full": timed(learner._update_fn, batch, seed),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "nano")
