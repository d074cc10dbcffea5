"""Helpers shared by the tests of the networks, the losses and the kernels."""

import numpy as np
import tensorflow as tf

from rllib_dreamerv3 import math_ops


def normal(shape, seed, scale=1.0):
    """Float32 N(0, scale²) inputs from numpy: the same numbers in any test order (TF's op-seeded
    ops depend on the global seed and on earlier calls with the same op seed)."""
    return tf.constant((np.random.default_rng(seed).normal(size=shape) * scale).astype(np.float32))


def float64_softmax(logits):
    x = np.asarray(logits, np.float64)
    p = np.exp(x - x.max(-1, keepdims=True))
    return p / p.sum(-1, keepdims=True)


def reference_critic_loss(model, imagined, start_cont, hp):
    """`(critic loss, λ-returns)` of an imagined trajectory, term by term as the paper's critic
    learning states them, with the plain heads on every state (none receives a gradient)."""
    wm, critic = model.world_model, model.critic
    feat = tf.stop_gradient(imagined.feat)
    cont = tf.cast(wm.continue_logit(feat) > 0.0, tf.float32)
    cont = tf.concat([start_cont[None], cont[1:]], 0)
    returns = math_ops.lambda_returns(
        wm.reward(feat), cont, critic.value(feat), hp.gamma, hp.gae_lambda
    )
    weights = math_ops.trajectory_weights(cont, hp.gamma)
    logits = critic(feat[:-1])
    loss = tf.reduce_mean(
        weights
        * (
            -math_ops.two_hot_log_prob(logits, tf.stop_gradient(returns), critic.bins)
            - hp.critic_ema_regularizer
            * math_ops.two_hot_log_prob(logits, model.critic_ema.value(feat[:-1]), critic.bins)
        )
    )
    return loss, returns
