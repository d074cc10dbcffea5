"""The world model's recurrence with the latent `z` carried by its classes.

`z` is K one-hot groups of C classes. A layer whose input holds `z` multiplies a matrix that is
almost all zeros; here `z`'s share of such a layer is the sum of the K kernel rows its classes
select (:func:`~.layers.onehot_partial`, same values and gradients). The reference is
:class:`~rllib_dreamerv3.world_model.WorldModel`.
"""

import tensorflow as tf

from rllib_dreamerv3 import math_ops
from rllib_dreamerv3.kernels import layers, sampling
from rllib_dreamerv3.kernels.loops import scan

OBSERVE_BY_INDEX_MIN_FEATURES = 256
"""From this many latent features (K * C) on, the observe loop feeds `z` to the dynamics by its
classes; below it the loop's extra gather and select per step cost more than the small one-hot
matmul they replace."""


def z_index(wm, z):
    """Classes `[..., K]` of a (straight-through) one-hot `z` `[..., K * C]`."""
    return tf.argmax(tf.reshape(z, [*z.shape[:-1], *wm.stoch_shape]), -1, output_type=tf.int32)


def sample_z(wm, logits, seed):
    """`(wm.sample_z(logits, seed), its classes [N, K])`."""
    probs = wm.probs(logits)
    idx = sampling.categorical(tf.reshape(probs, [-1, wm.size.num_classes]), seed)
    sample = tf.reshape(tf.one_hot(idx, wm.size.num_classes), tf.shape(probs))
    z = tf.reshape(math_ops.straight_through(sample, probs), [-1, wm.stoch_dim])
    return z, tf.reshape(idx, [-1, wm.size.num_categoricals])


def head(wm, net, h, index, z=None, masked_out=0, with_mean=False):
    """`net(concat([h, z]))` for an MLP on the model state, with `z` given by its classes
    `index`. The variables' gradients are those of `net(concat([h, z]))`; so are `z`'s if `z`
    is given, else no gradient reaches `z`. `masked_out`, `with_mean`: see
    :func:`~.layers.mlp` and :func:`~.layers.mlp_with_mean`."""
    rest = layers.onehot_partial(
        net.blocks[0].dense, index, wm.size.gru_units, wm.size.num_classes, z
    )
    if with_mean:
        return layers.mlp_with_mean(net, h, rest, masked_out)
    return layers.mlp(net, h, rest, masked_out=masked_out)


def prior_logits(wm, h):
    """`wm.prior_logits(h)`."""
    return wm._logits(layers.mlp(wm.prior_net, h))


def sequence_step(wm, h, z, action, index=None, weights=None):
    """`wm.sequence_step(h, z, action)`; with `index` (`z`'s classes), `z`'s share of the input
    layer is a sum of kernel rows. `weights`: a :class:`~.layers.LoopWeights`, inside a loop."""
    block = wm.gru_input
    if index is None:
        x = layers.dense_block(block, tf.concat([z, action], -1), weights=weights)
    else:
        dense = block.dense
        pre = layers.onehot_partial(
            dense, index, 0, wm.size.num_classes, z, weights
        ) + layers.dense_partial(dense, action, wm.stoch_dim, dense.w.shape[0], weights)
        x = layers.activate(block, pre, weights)
    return layers.gru(wm.gru, x, h, weights)


def imagine_step(wm, h, z, index, action, seed):
    """`wm.imagine_step(h, z, action, seed)` from `z` and its classes; returns `(h, z, index)`."""
    h = sequence_step(wm, h, z, action, index)
    return (h, *sample_z(wm, prior_logits(wm, h), seed))


def observe(wm, embed, prev_action, is_first, seeds):
    """`wm.observe(embed, prev_action, is_first, seeds)`.

    Only the recurrence is in the loop: the embedding's share of the posterior's first layer is
    computed for all T * B steps before it, and the prior, which needs only `h`, on all states
    after it (one large matmul instead of T small ones, forward and back). The loop's weights
    are read once, before it (:class:`~.layers.LoopWeights`), with the kernel rows the loop
    multiplies on their own.
    """
    batch, units = embed.shape[1], wm.size.gru_units
    initial = wm._initial()
    state = (*wm.initial_state(batch, initial), tf.zeros([batch, *wm.stoch_shape]))
    by_index = wm.stoch_dim >= OBSERVE_BY_INDEX_MIN_FEATURES
    index0 = z_index(wm, initial[1])  # [1, K]
    if by_index:
        state += (tf.tile(index0, [batch, 1]),)

    first, gru_in = wm.posterior_net.blocks[0].dense, wm.gru_input.dense
    rows = [(first, 0, units)]
    if by_index:
        rows += [(gru_in, 0, wm.stoch_dim), (gru_in, wm.stoch_dim, gru_in.w.shape[0])]
    weights = layers.LoopWeights([wm.gru_input, wm.gru, wm.posterior_net], row_blocks=rows)

    def step(carry, inputs):
        embed_part, action, first_t, seed = inputs
        h, z, action = wm.reset(carry[0], carry[1], action, first_t, initial)
        index = tf.where(first_t[:, None], index0, carry[3]) if by_index else None
        h = sequence_step(wm, h, z, action, index, weights)
        post = wm._logits(layers.mlp(wm.posterior_net, h, embed_part, weights))
        if not by_index:
            return h, sample_z(wm, post, seed)[0], post
        z, index = sample_z(wm, post, seed)
        return h, z, post, index

    embed_part = layers.first_layer_part(wm.posterior_net, embed, units)
    h, z, post = scan(step, (embed_part, prev_action, is_first, seeds), state)[:3]
    prior = tf.reshape(prior_logits(wm, tf.reshape(h, [-1, units])), [-1, batch, *wm.stoch_shape])
    return h, z, post, prior
