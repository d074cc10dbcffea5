"""DreamerV3's losses, written as the paper states them (Hafner et al. 2023, arXiv 2301.04104v1).

`hp` is any object with the hyperparameter attributes of
:class:`~rllib_dreamerv3.DreamerV3Config` (`free_bits`, `pred_loss_scale`, ...). Batches are
batch-major `[B, T, ...]`; everything inside is time-major `[T, B, ...]`.

This module is the reference. :mod:`rllib_dreamerv3.kernels` provides the same three functions,
:func:`world_model_loss`, :func:`imagine` and :func:`actor_critic_losses`, computed with fused
kernels (`fast_kernels=True`); both share the helpers below that combine the terms.
"""

from typing import NamedTuple

import tensorflow as tf

from rllib_dreamerv3 import math_ops
from rllib_dreamerv3.tf_rllib.collectives import gather_in_group

sg = tf.stop_gradient


def time_major(x):
    """Swap the first two axes: `[B, T, ...]` <-> `[T, B, ...]`."""
    x = tf.convert_to_tensor(x)
    return tf.transpose(x, [1, 0] + list(range(2, x.shape.rank)))


def sequences(batch):
    """The batch's `(obs, prev_actions, rewards, is_first, cont)`, time-major (`obs`: a dict of
    such for Dict observations); `prev_actions` holds the action before each step (zeros before
    the first), `cont = 1 - is_terminal`."""
    actions = time_major(batch["actions"])
    prev_actions = tf.concat([tf.zeros_like(actions[:1]), actions[:-1]], 0)
    cont = 1.0 - time_major(tf.cast(batch["is_terminal"], tf.float32))
    return (
        tf.nest.map_structure(time_major, batch["obs"]),
        prev_actions,
        time_major(batch["rewards"]),
        time_major(batch["is_first"]),
        cont,
    )


# --- world model --------------------------------------------------------------------------------
def world_model_loss(model, batch, seeds, hp):
    """`L(φ) = E[β_pred L_pred + β_dyn L_dyn + β_rep L_rep]`, averaged over B and T (paper,
    world model learning).

    Args:
        batch: dict with `obs [B, T, ...]`, `actions [B, T, A]` (the action taken at each step;
            one-hot if discrete), `rewards [B, T]` (received on arrival at each step),
            `is_first [B, T]`, `is_terminal [B, T]`.
        seeds: `[T, 2]` int32 stateless seeds for the posterior samples.

    Returns:
        `(loss, metrics, (h, z))` with the posterior states `[T, B, ...]`.
    """
    wm = model.world_model
    obs, prev_actions, rewards, is_first, cont = sequences(batch)
    h, z, post, prior = wm.observe(wm.encoder(obs), prev_actions, is_first, seeds)
    feat = tf.concat([h, z], -1)
    # L_pred = -ln p(x|z,h) - ln p(r|z,h) - ln p(c|z,h): the decoder's loss, the reward head's
    # two-hot log-likelihood of the symlog reward, the continue head's Bernoulli one.
    decoder_loss = wm.decoder.loss(feat, obs)
    reward_loss = -math_ops.two_hot_log_prob(wm.reward_head(feat), rewards, wm.bins)
    continue_loss = tf.nn.sigmoid_cross_entropy_with_logits(cont, wm.continue_logit(feat))
    loss, metrics = combine_world_model_loss(
        wm, decoder_loss, reward_loss, continue_loss, post, prior, hp
    )
    return loss, metrics, (h, z)


def kl_balancing(wm, post_logits, prior_logits, free_bits):
    """`L_dyn = max(free, KL[sg(q(z|h,x)) || p(z|h)])` trains the prior towards the posterior,
    `L_rep = max(free, KL[q(z|h,x) || sg(p(z|h))])` the posterior towards the prior; both on the
    unimix distributions, with free bits (`free` nats). Returns `(L_dyn, L_rep, KL)`, `[T, B]`
    each (the KL before free bits)."""
    post, prior = wm.probs(post_logits), wm.probs(prior_logits)
    kl_dyn = math_ops.categorical_kl(sg(post), prior)
    kl_rep = math_ops.categorical_kl(post, sg(prior))
    return math_ops.free_bits(kl_dyn, free_bits), math_ops.free_bits(kl_rep, free_bits), kl_dyn


def combine_world_model_loss(
    wm, decoder_loss, reward_loss, continue_loss, post_logits, prior_logits, hp
):
    """`(L(φ), metrics)` from the per-step prediction losses `[T, B]` and the posterior and
    prior logits `[T, B, K, C]`."""
    pred_loss = decoder_loss + reward_loss + continue_loss
    dyn_loss, rep_loss, kl = kl_balancing(wm, post_logits, prior_logits, hp.free_bits)
    loss = tf.reduce_mean(
        hp.pred_loss_scale * pred_loss + hp.dyn_loss_scale * dyn_loss + hp.rep_loss_scale * rep_loss
    )
    prior_entropy = math_ops.categorical_entropy(wm.probs(prior_logits), [-2, -1])
    post_entropy = math_ops.categorical_entropy(wm.probs(post_logits), [-2, -1])
    metrics = {
        "L_world_model": loss,
        "L_pred": tf.reduce_mean(pred_loss),
        "L_decoder": tf.reduce_mean(decoder_loss),
        "L_reward": tf.reduce_mean(reward_loss),
        "L_continue": tf.reduce_mean(continue_loss),
        "L_dyn": tf.reduce_mean(dyn_loss),
        "L_rep": tf.reduce_mean(rep_loss),
        # KL[sg(post) || prior] and KL[post || sg(prior)] have the same value
        "kl_dyn_before_free_bits": tf.reduce_mean(kl),
        "kl_rep_before_free_bits": tf.reduce_mean(kl),
        "prior_entropy": tf.reduce_mean(prior_entropy),
        "posterior_entropy": tf.reduce_mean(post_entropy),
    }
    return loss, metrics


# --- imagination --------------------------------------------------------------------------------
class Imagination(NamedTuple):
    """An imagined trajectory from :func:`imagine` (time-major; index 0: the start states).

    `h` `[H + 1, N, D]` and `z` `[H + 1, N, K * C]` (one-hot) are the model states, `actions`
    `[H, N, A]` the actions taken from the first `H` states and `dist` the actor's distribution
    there (batch shape `[H, N]`). `z_index` `[H + 1, N, K]`: the latents' classes, where
    the imagination kept them (the fused kernels do), else None.
    """

    h: tf.Tensor
    z: tf.Tensor
    actions: tf.Tensor
    dist: object
    z_index: tf.Tensor = None

    @property
    def feat(self):
        """The model states `s = concat([h, z])`, `[H + 1, N, D + K * C]`."""
        return tf.concat([self.h, self.z], -1)


def imagine(model, h, z, horizon, seeds):
    """Roll the actor through the world model for `horizon` steps from start states `[N, ...]`.

    Returns an :class:`Imagination`. The actor acts on the states without their gradient,
    `a ~ π(a | sg(s))`. Discrete actions enter the dynamics without gradient (REINFORCE needs
    none); continuous actions keep their reparameterised gradient, so that returns
    backpropagate into the actor through the dynamics.
    """
    wm, actor = model.world_model, model.actor
    hs, zs, actions, outs = [h], [z], [], []
    for t in range(horizon):
        out = actor.mlp(sg(tf.concat([h, z], -1)))
        action = actor.sample(actor.dist_from_output(out), seeds[2 * t])
        if actor.discrete:
            action = sg(action)
        h, z = wm.imagine_step(h, z, action, seeds[2 * t + 1])
        hs.append(h)
        zs.append(z)
        actions.append(action)
        outs.append(out)
    dist = actor.dist_from_output(tf.stack(outs, 0))  # all steps' distributions at once
    return Imagination(tf.stack(hs, 0), tf.stack(zs, 0), tf.stack(actions, 0), dist)


# --- actor and critic ---------------------------------------------------------------------------
def actor_critic_losses(model, imagined, start_cont, hp):
    """Critic and actor losses on an imagined trajectory, and the new return scale.

    Args:
        imagined: an :class:`Imagination` of `H` steps from `N` start states.
        start_cont: `[N]` real `1 - is_terminal` of the start states.

    Returns:
        `(actor_loss, critic_loss, new_return_scale, metrics)`. The critic loss depends only on
        the critic's variables; the actor loss is meant to update only the actor's variables.
    """
    wm, critic = model.world_model, model.critic
    feat = imagined.feat  # with continuous actions, returns backpropagate through it
    # The reward and continue heads predict on arrival at the imagined states; the start
    # states' reward is unused and their continue flag is the real one.
    reward = tf.concat([tf.zeros_like(start_cont)[None], wm.reward(feat[1:])], 0)
    cont = tf.cast(wm.continue_logit(sg(feat[1:])) > 0.0, tf.float32)  # the head's mode
    cont = tf.concat([start_cont[None], cont], 0)
    value = critic.value(feat)  # [H + 1, N]
    returns = math_ops.lambda_returns(reward, cont, value, hp.gamma, hp.gae_lambda)  # [H, N]
    weights = math_ops.trajectory_weights(cont, hp.gamma)
    ema_value = model.critic_ema.value(sg(feat[:-1]))
    critic_loss = critic_nll(
        critic(sg(feat[:-1])), returns, ema_value, weights, hp.critic_ema_regularizer, critic.bins
    )
    return actor_loss_and_metrics(
        model, imagined, reward, cont, value, returns, weights, critic_loss, hp
    )


def critic_nll(logits, returns, ema_value, weights, regularizer, bins):
    """The critic loss `L(ψ) = -Σ_t w_t [ln p_ψ(R^λ_t | s_t) + r ln p_ψ(v_ema(s_t) | s_t)]`
    averaged over the `H` steps and `N` trajectories: the two-hot log-likelihood of the
    λ-returns (paper, critic learning), plus (weight `r`, `critic_ema_regularizer`) that of the
    slow critic's values (the regulariser of the author's implementation).

    Args:
        logits: `[H, N, bins]` of the critic on `sg(s_t)`.
        returns, ema_value, weights: `[H, N]` (no gradient reaches them).
    """
    nll = -math_ops.two_hot_log_prob(logits, sg(returns), bins)
    regularizer_nll = -math_ops.two_hot_log_prob(logits, sg(ema_value), bins)
    return tf.reduce_mean(sg(weights) * (nll + regularizer * regularizer_nll))


def actor_loss_and_metrics(
    model,
    imagined,
    reward,
    cont,
    value,
    returns,
    weights,
    critic_loss,
    hp,
    percentiles=math_ops.percentiles,
):
    """The actor loss, the new return scale and the metrics, from the imagined trajectory's
    predictions (`reward`, `cont`, `value` `[H + 1, N]`) and `returns`, `weights` `[H, N]`.

    Returns `(actor_loss, critic_loss, new_return_scale, metrics)` (paper, actor learning).
    The returns are normalised by `max(1, S)`, `S` an EMA of their 5th-to-95th percentile
    range; the actor maximises the normalised advantage (REINFORCE for discrete actions,
    backpropagated through the dynamics for continuous ones) plus `entropy_scale` times its
    entropy. `percentiles`: a function like :func:`~rllib_dreamerv3.math_ops.percentiles`
    (the fused kernels pass theirs).
    """
    actor = model.actor
    # With data-parallel Learners, the percentiles are those of all Learners' returns.
    scale = math_ops.return_scale_update(
        model.return_scale,
        gather_in_group(sg(returns)),
        hp.return_normalization_decay,
        percentiles=percentiles,
    )
    # With continuous actions the advantage is differentiated through the returns and through
    # the baseline v(s_t), whose state depends on the actor's earlier actions (as in the
    # author's `-(R - v(s)) / S`); the actor loss updates only the actor's variables.
    adv = math_ops.normalized_advantage(returns, value[:-1], scale)
    dist, actions = imagined.dist, imagined.actions  # the actor's on sg(s_t)
    entropy = dist.entropy()
    objective = sg(adv) * dist.log_prob(actions) if actor.discrete else adv
    actor_loss = tf.reduce_mean(weights * (-objective - hp.entropy_scale * entropy))
    metrics = {
        "L_actor": actor_loss,
        "L_critic": critic_loss,
        "actor_entropy": tf.reduce_mean(entropy),
        "return_scale": scale,
        "critic_value_mean": tf.reduce_mean(value),
        "imagined_return_mean": tf.reduce_mean(returns),
        "imagined_reward_mean": tf.reduce_mean(reward[1:]),
        "imagined_continue_mean": tf.reduce_mean(cont[1:]),
        "advantage_mean": tf.reduce_mean(adv),
    }
    return actor_loss, critic_loss, scale, metrics
