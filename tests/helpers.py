"""Helpers shared by the tests: inputs, references, and the smallest training config."""

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


def layer_norm_case(norm_class, shape):
    """`(norm, x, expected)`: a LayerNorm of `norm_class` with seeded scale and offset, seeded
    inputs `x` `[*shape]` and the normalised `x` computed in float64 (eps 1e-3)."""
    rng = np.random.default_rng(0)
    x = (rng.normal(size=shape) * 3.0 + 2.0).astype(np.float32)
    norm = norm_class(shape[-1])
    norm.scale.assign(rng.uniform(0.5, 1.5, shape[-1]).astype(np.float32))
    norm.offset.assign(rng.normal(size=shape[-1]).astype(np.float32))
    x64 = x.astype(np.float64)
    mean, var = x64.mean(-1, keepdims=True), x64.var(-1, keepdims=True)
    expected = (x64 - mean) / np.sqrt(var + 1e-3) * norm.scale.numpy() + norm.offset.numpy()
    return norm, tf.constant(x), expected


def two_hot_hand_case():
    """`(bins, logits, target, cross-entropy)` worked by hand: 3 bins, symlog(target) = 0.5
    puts half the label on bins 1 and 2."""
    bins = tf.constant([-1.0, 0.0, 1.0])
    logits = tf.constant([0.0, 1.0, 2.0])
    target = math_ops.symexp(tf.constant(0.5))
    log_softmax = np.log(np.exp([0.0, 1.0, 2.0]) / np.exp([0.0, 1.0, 2.0]).sum())
    return bins, logits, target, -(0.5 * log_softmax[1] + 0.5 * log_softmax[2])


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


def tiny_config(env="CartPole-v1", **training):
    """A DreamerV3Config that trains in seconds: nano model, B=2, T=8, H=3, ratio 32, 32 warm-up
    steps, 16 env steps per iteration, seed 0; `training` overrides `.training(...)`.

    The update runs as a plain TF graph (`jit_compile=False`): XLA's compile of the first
    update costs more than the rest of most tests. Tests of the default, compiled path pass
    `jit_compile=True`."""
    from rllib_dreamerv3 import DreamerV3Config

    settings = dict(
        model_size="nano",
        batch_size_B=2,
        batch_length_T=8,
        horizon_H=3,
        training_ratio=32,
        num_steps_sampled_before_learning_starts=32,
        jit_compile=False,
    )
    settings.update(training)
    return (
        DreamerV3Config()
        .environment(env)
        .training(**settings)
        .reporting(min_sample_timesteps_per_iteration=16)
        .debugging(seed=0)
    )


# Percentile inputs shared by the reference (tfp) and the fast path's bitwise search: ties,
# signed zeros, extreme magnitudes, a single entry, and returns of the scale DreamerV3 sees.
_rng = np.random.default_rng(1)
PERCENTILE_CASES = {
    "normal": _rng.normal(size=(15, 37)),
    "ties": _rng.integers(-3, 4, size=1000),
    "signed_zeros_tiny_huge": np.array([3.0, -0.0, 0.0, -1e-30, 1e-37, 1e30, -3e38, 2, 2, 2, -5]),
    "constant": np.full(10, 7.5),
    "single": np.array([-1.25]),
    "imagined_returns": _rng.normal(size=(16, 1024)) * 1e-3,
}
