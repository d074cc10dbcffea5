"""The losses of :mod:`rllib_dreamerv3.losses`, computed with the fused kernels.

Same signatures and results as the reference functions of the same names; the terms are
combined by the reference's own helpers (:func:`~rllib_dreamerv3.losses.combine_world_model_loss`,
:func:`~rllib_dreamerv3.losses.actor_loss_and_metrics`), so only how each prediction is computed
differs.
"""

import tensorflow as tf

from rllib_dreamerv3 import losses, math_ops
from rllib_dreamerv3.kernels import layers, percentiles, rssm
from rllib_dreamerv3.kernels.loops import materialized_gradient
from rllib_dreamerv3.kernels.two_hot import (
    masked_columns,
    two_hot_cross_entropy,
    two_hot_loss,
    two_hot_stats,
)
from rllib_dreamerv3.losses import Imagination

sg = tf.stop_gradient


def world_model_loss(model, batch, seeds, hp):
    """:func:`rllib_dreamerv3.losses.world_model_loss`."""
    wm = model.world_model
    obs, prev_actions, rewards, is_first, cont = losses.sequences(batch)
    embed = layers.encoder(wm.encoder, obs)
    h, z, post, prior = rssm.observe(wm, embed, prev_actions, is_first, seeds)
    feat = tf.concat([h, z], -1)
    decoder_loss = layers.decoder_loss(wm.decoder, feat, obs)
    # The two-hot head's softmax is shifted by its mean logit (see two_hot_stats), which the
    # head returns for the price of a matrix-vector product.
    reward_logits, reward_mean = layers.mlp_with_mean(
        wm.reward_head, feat, masked_out=masked_columns(wm.bins.shape[0])
    )
    reward_loss = two_hot_loss(reward_logits, rewards, wm.bins, reward_mean)
    continue_logit = layers.mlp(wm.continue_head, feat)[..., 0]
    continue_loss = tf.nn.sigmoid_cross_entropy_with_logits(cont, continue_logit)
    loss, metrics = losses.combine_world_model_loss(
        wm, decoder_loss, reward_loss, continue_loss, post, prior, hp
    )
    return loss, metrics, (h, z)


def imagine(model, h, z, horizon, seeds):
    """:func:`rllib_dreamerv3.losses.imagine`, keeping the latents' classes (`z_index`)."""
    wm, actor = model.world_model, model.actor
    hs, zs, indices, actions, outs = [h], [z], [rssm.z_index(wm, z)], [], []
    for t in range(horizon):
        # No `z` given: the latent enters as classes, without gradient, as `sg(s)` would.
        out = rssm.head(wm, actor.mlp, sg(h), indices[-1])
        action = actor.sample(actor.dist_from_output(out), seeds[2 * t])
        if actor.discrete:
            action = sg(action)
        h, z, index = rssm.imagine_step(wm, h, z, indices[-1], action, seeds[2 * t + 1])
        if not actor.discrete:  # returns backpropagate through h
            h = materialized_gradient(h)
        hs.append(h)
        zs.append(z)
        indices.append(index)
        actions.append(action)
        outs.append(out)
    dist = actor.dist_from_output(tf.stack(outs, 0))
    return Imagination(
        tf.stack(hs, 0), tf.stack(zs, 0), tf.stack(actions, 0), dist, tf.stack(indices, 0)
    )


def actor_critic_losses(model, imagined, start_cont, hp):
    """:func:`rllib_dreamerv3.losses.actor_critic_losses` (`imagined` from :func:`imagine`)."""
    wm, actor, critic = model.world_model, model.actor, model.critic
    h_grad, z_grad = imagined.h, imagined.z
    z_index = imagined.z_index
    if z_index is None:
        z_index = rssm.z_index(wm, z_grad)
    masked = masked_columns(critic.bins.shape[0])
    h = sg(h_grad)
    # With continuous actions the returns backpropagate into the actor through the rewards.
    reward_logits, reward_mean = rssm.head(
        wm, wm.reward_head, h_grad[1:], z_index[1:], z_grad[1:], masked, with_mean=True
    )
    reward = two_hot_stats(reward_logits, wm.bins, reward_mean)[0]
    reward = tf.concat([tf.zeros_like(start_cont)[None], reward], 0)
    cont_logit = rssm.head(wm, wm.continue_head, h[1:], z_index[1:])[..., 0]
    cont = tf.cast(cont_logit > 0.0, tf.float32)
    cont = tf.concat([start_cont[None], cont], 0)
    # One critic pass serves the values (returns, advantages) and the critic's loss. With
    # continuous actions the returns backpropagate into the actor through the values, so the
    # critic runs on the states with their gradient; the critic loss is differentiated w.r.t.
    # the critic's variables only, so this path to the states does not affect it.
    critic_logits, critic_mean = (
        rssm.head(wm, critic.mlp, h, z_index, None, masked, with_mean=True)
        if actor.discrete
        else rssm.head(wm, critic.mlp, h_grad, z_index, z_grad, masked, with_mean=True)
    )
    value, log_normalizer = two_hot_stats(critic_logits, critic.bins, critic_mean, keep_exp=True)
    returns = math_ops.lambda_returns(reward, cont, value, hp.gamma, hp.gae_lambda)  # [H, N]
    weights = math_ops.trajectory_weights(cont, hp.gamma)

    ema_logits, ema_mean = rssm.head(
        wm, model.critic_ema.mlp, h[:-1], z_index[:-1], None, masked, with_mean=True
    )
    ema_value = two_hot_stats(ema_logits, critic.bins, ema_mean)[0]
    # The cross-entropies towards the returns and towards the slow critic's values share the
    # logits: one pass. It runs on all H + 1 states with weight 0 on the last (which has no
    # return), so that the logits' gradient needs no slice and pad.
    no_return = tf.zeros_like(start_cont)[None]
    cross_entropy = two_hot_cross_entropy(
        critic_logits,
        log_normalizer,
        [tf.concat([returns, no_return], 0), tf.concat([ema_value, no_return], 0)],
        [1.0, hp.critic_ema_regularizer],
        critic.bins,
    )  # [H + 1, N]
    critic_loss = tf.reduce_sum(tf.concat([sg(weights), no_return], 0) * cross_entropy) / tf.cast(
        tf.size(weights), tf.float32
    )  # the mean over the H steps
    return losses.actor_loss_and_metrics(
        model,
        imagined,
        reward,
        cont,
        value,
        returns,
        weights,
        critic_loss,
        hp,
        percentiles=percentiles.percentiles,
    )
