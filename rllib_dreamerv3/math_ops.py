"""Pure math of DreamerV3 (Hafner et al. 2023): every function is stateless and framework-light.

All functions take and return `tf.Tensor`s (numpy arrays are accepted too) and are safe to use
inside `tf.function` / XLA. Shapes are given as `[...]` for arbitrary leading dimensions.
"""

import tensorflow as tf
import tensorflow_probability as tfp


def symlog(x):
    """`sign(x) * log(|x| + 1)`: squashes large magnitudes, identity-like near zero."""
    return tf.sign(x) * tf.math.log1p(tf.abs(x))


def symexp(y):
    """Inverse of :func:`symlog`: `sign(y) * (exp(|y|) - 1)`."""
    return tf.sign(y) * tf.math.expm1(tf.abs(y))


def two_hot_bins(num_bins=255, low=-20.0, high=20.0):
    """Bin centres, evenly spaced on `[low, high]` in symlog space: `[num_bins]` float32."""
    return tf.linspace(tf.constant(low, tf.float32), tf.constant(high, tf.float32), num_bins)


def two_hot_parts(y, bins):
    """The two-hot encoding of `y` ([...], already in bin space) as `(below, weight_above)`:
    the index `[...]` int32 of the lower of its two bins and the weight `[...]` of the upper one
    (the lower one has `1 - weight_above`). See :func:`two_hot`."""
    y = tf.convert_to_tensor(y, tf.float32)
    num_bins = bins.shape[0]
    low, high = bins[0], bins[-1]
    step = (high - low) / (num_bins - 1)
    y = tf.clip_by_value(y, low, high)
    below = tf.clip_by_value(tf.floor((y - low) / step), 0.0, num_bins - 2.0)
    # Distance to the lower bin's centre, not `position - below`: keeps the weight's rounding
    # error at the bins' own (~1e-5 of a bin) rather than that of a position up to 254.
    weight_above = tf.clip_by_value((y - (low + below * step)) / step, 0.0, 1.0)
    # A NaN `y` gives a NaN `below`, whose integer cast is undefined: clipping the index keeps
    # gathers in range (TF's CPU gather raises outside it), and the NaN still reaches the
    # loss through `weight_above`.
    return tf.clip_by_value(tf.cast(below, tf.int32), 0, num_bins - 2), weight_above


def two_hot(y, bins):
    """Encode `y` ([...], already in bin space) as weights on its two nearest bins: [..., num_bins].

    `bins` must be evenly spaced and increasing (as from :func:`two_hot_bins`): the lower
    neighbour's index is computed arithmetically, `floor((y - bins[0]) / step)`, which under XLA
    is far cheaper than a search over the bins. Weights are proportional to closeness; a value on
    a bin is one-hot (up to float rounding); values outside the bins' range clip to the end bins.
    """
    return two_hot_from_parts(*two_hot_parts(y, bins), bins.shape[0])


def two_hot_from_parts(below, weight_above, num_bins):
    """The dense `[..., num_bins]` two-hot weights of :func:`two_hot_parts`' output."""
    return (
        tf.one_hot(below, num_bins) * (1.0 - weight_above)[..., None]
        + tf.one_hot(below + 1, num_bins) * weight_above[..., None]
    )


def two_hot_log_prob(logits, target, bins):
    """`ln p(target)` of a two-hot head: `sum(two_hot(symlog(target)) * log_softmax(logits))`,
    `[...]`. `target` is in real space; the discrete distribution over the bins (in symlog space)
    gives a value between two bins the probability of its two-hot encoding."""
    labels = two_hot(symlog(tf.convert_to_tensor(target, tf.float32)), bins)
    return tf.reduce_sum(labels * tf.nn.log_softmax(logits), -1)


def two_hot_mean(logits, bins):
    """Real-space prediction of a two-hot head: `symexp(sum(softmax(logits) * bins))`, `[...]`."""
    return symexp(tf.reduce_sum(tf.nn.softmax(logits) * bins, -1))


def unimix_probs(logits, unimix=0.01):
    """`(1 - unimix) * softmax(logits) + unimix / num_classes` over the last axis."""
    num_classes = logits.shape[-1]
    return (1.0 - unimix) * tf.nn.softmax(logits) + unimix / num_classes


def straight_through(sample, probs):
    """One-hot `sample` in the forward pass, gradients of `probs` in the backward pass."""
    return sample + probs - tf.stop_gradient(probs)


def categorical_entropy(probs, axis=-1):
    """Entropy of categoricals given by `probs`, summed over `axis` classes."""
    return -tf.reduce_sum(probs * tf.math.log(probs), axis=axis)


def categorical_kl(p, q):
    """KL[p || q] of independent categoricals `[..., K, C]`, summed over the K categoricals,
    `[...]`."""
    return tf.reduce_sum(p * (tf.math.log(p) - tf.math.log(q)), axis=[-2, -1])


def free_bits(kl, free_nats=1.0):
    """`max(free_nats, kl)`: no gradient pressure once the KL is below `free_nats`."""
    return tf.maximum(kl, free_nats)


def lambda_returns(reward, cont, value, gamma, lam):
    """λ-returns of an imagined trajectory, in real space, time-major.

    Args:
        reward, cont, value: `[H + 1, N]`; index t is imagined step t. `reward[t]` and `cont[t]`
            are predicted on arrival at state t (index 0 is unused for the reward).
        gamma, lam: discount γ and λ.

    Returns:
        `[H, N]` with `R_t = r_{t+1} + γ c_{t+1} ((1 - λ) v_{t+1} + λ R_{t+1})` and `R_H = v_H`.
    """
    horizon = reward.shape[0] - 1
    ret = value[horizon]
    returns = []
    for t in reversed(range(horizon)):
        ret = reward[t + 1] + gamma * cont[t + 1] * ((1.0 - lam) * value[t + 1] + lam * ret)
        returns.append(ret)
    return tf.stack(returns[::-1], axis=0)


def trajectory_weights(cont, gamma):
    """Per-step loss weights `[H, N]` from continues `[H + 1, N]` (index 0 from real data).

    `w_0 = c_0`, `w_t = w_{t-1} * γ * c_t`: 1 for the first step of a non-terminal start state,
    and zero after a predicted episode end.
    """
    horizon = cont.shape[0] - 1
    discounts = tf.concat([cont[:1], gamma * cont[1:horizon]], axis=0)
    return tf.stop_gradient(tf.math.cumprod(discounts, axis=0))


def percentiles(x, qs):
    """The `qs`-th percentiles (0–100) of all entries of `x`, `[len(qs)]`, with linear
    interpolation between order statistics like numpy's default."""
    flat = tf.reshape(tf.convert_to_tensor(x), [-1])
    return tfp.stats.percentile(flat, list(qs), interpolation="linear")


def percentile(x, q):
    """The `q`-th percentile (0–100) of all entries of `x` (see :func:`percentiles`)."""
    return percentiles(x, [q])[0]


def return_scale_update(scale, returns, decay, low=5.0, high=95.0, percentiles=percentiles):
    """New EMA of the return range: `decay * S + (1 - decay) * (P_high(R) - P_low(R))`.

    `percentiles`: a function like :func:`percentiles` (the fused kernels pass theirs)."""
    p_low, p_high = tf.unstack(percentiles(returns, [low, high]))
    return decay * scale + (1.0 - decay) * (p_high - p_low)


def normalized_advantage(returns, value, scale):
    """`(R - v) / max(1, S)`: only returns spread wider than 1 are scaled down."""
    return (returns - value) / tf.maximum(1.0, scale)
