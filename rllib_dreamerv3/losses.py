"""DreamerV3's losses (SPEC §2–3), as functions of a :class:`DreamerV3Model` and a batch.

`hp` is any object with the hyperparameter attributes of
:class:`~rllib_dreamerv3.config.DreamerV3Config` (`free_bits`, `pred_loss_scale`, ...).
Batches are batch-major `[B, T, ...]`; everything inside is time-major `[T, B, ...]`.
"""

from typing import NamedTuple

import tensorflow as tf

from rllib_dreamerv3 import math_ops, networks

sg = tf.stop_gradient


def time_major(x):
    """Swap the first two axes: `[B, T, ...]` <-> `[T, B, ...]`."""
    x = tf.convert_to_tensor(x)
    return tf.transpose(x, [1, 0] + list(range(2, x.shape.rank)))


def world_model_loss(model, batch, seeds, hp):
    """`L = pred_scale * L_pred + dyn_scale * L_dyn + rep_scale * L_rep`, averaged over B and T.

    Args:
        batch: dict with `obs [B, T, ...]`, `actions [B, T, A]` (the action taken at each step;
            one-hot if discrete), `rewards [B, T]` (received on arrival at each step),
            `is_first [B, T]`, `is_terminal [B, T]`.
        seeds: `[T, 2]` int32 stateless seeds for the posterior samples.

    Returns:
        `(loss, metrics, (h, z))` with the posterior states `[T, B, ...]`.
    """
    wm = model.world_model
    obs = time_major(batch["obs"])  # uint8 images stay uint8 until the encoder
    actions = time_major(batch["actions"])
    rewards = time_major(batch["rewards"])
    is_first = time_major(batch["is_first"])
    cont = 1.0 - time_major(tf.cast(batch["is_terminal"], tf.float32))
    embed = wm.encoder(obs)  # [T, B, E]
    prev_actions = tf.concat([tf.zeros_like(actions[:1]), actions[:-1]], 0)
    h, z, post, prior = wm.observe(embed, prev_actions, is_first, seeds)
    feat = tf.concat([h, z], -1)

    decoder_loss = wm.decoder.loss(feat, obs)
    reward_logits, reward_mean = wm.reward_head.with_mean_output(feat)
    reward_loss = math_ops.two_hot_loss(reward_logits, rewards, wm.bins, reward_mean)
    continue_loss = tf.nn.sigmoid_cross_entropy_with_logits(cont, wm.continue_logit(feat))
    pred_loss = decoder_loss + reward_loss + continue_loss

    post_probs, prior_probs = wm.probs(post), wm.probs(prior)
    kl_dyn = math_ops.categorical_kl(sg(post_probs), prior_probs)
    kl_rep = math_ops.categorical_kl(post_probs, sg(prior_probs))
    dyn_loss = math_ops.free_bits(kl_dyn, hp.free_bits)
    rep_loss = math_ops.free_bits(kl_rep, hp.free_bits)
    loss = tf.reduce_mean(hp.pred_loss_scale * pred_loss + hp.dyn_loss_scale * dyn_loss
                          + hp.rep_loss_scale * rep_loss)
    metrics = {
        "L_world_model": loss,
        "L_pred": tf.reduce_mean(pred_loss),
        "L_decoder": tf.reduce_mean(decoder_loss),
        "L_reward": tf.reduce_mean(reward_loss),
        "L_continue": tf.reduce_mean(continue_loss),
        "L_dyn": tf.reduce_mean(dyn_loss),
        "L_rep": tf.reduce_mean(rep_loss),
        "kl_dyn_before_free_bits": tf.reduce_mean(kl_dyn),
        "kl_rep_before_free_bits": tf.reduce_mean(kl_rep),
        "prior_entropy": tf.reduce_mean(math_ops.categorical_entropy(prior_probs, [-2, -1])),
        "posterior_entropy": tf.reduce_mean(math_ops.categorical_entropy(post_probs, [-2, -1])),
    }
    return loss, metrics, (h, z)


class Imagination(NamedTuple):
    """An imagined trajectory from :func:`imagine` (time-major; index 0: the start states).

    `h` `[H + 1, N, D]` and `z` `[H + 1, N, K * C]` (one-hot) are the model states, `z_index`
    `[H + 1, N, K]` the latents' classes (the networks take the latent as classes, see
    :meth:`WorldModel.head`), `actions` `[H, N, A]` the actions taken from the first `H`
    states and `dist` the actor's distribution parameters there (`[H, N, A]` each; reused by the
    actor loss instead of a second actor pass).
    """

    h: tf.Tensor
    z: tf.Tensor
    z_index: tf.Tensor
    actions: tf.Tensor
    dist: tuple

    @property
    def feat(self):
        """The model features `concat([h, z])`, `[H + 1, N, D + K * C]`."""
        return tf.concat([self.h, self.z], -1)


def imagine(model, h, z, horizon, seeds):
    """Roll the actor through the world model for `horizon` steps from start states `[N, ...]`.

    Returns an :class:`Imagination`. The actor acts on the states without their gradient, as
    in DreamerV3's `policy(sg(state))`. Discrete actions are fed to the dynamics without
    gradient (REINFORCE needs none); continuous actions keep their reparameterised gradient so
    returns can be backpropagated into the actor through the dynamics.
    """
    wm, actor = model.world_model, model.actor
    hs, zs, indices, actions, dists = [h], [z], [wm.z_index(z)], [], []
    for t in range(horizon):
        # No `z` given: the latent enters as classes, with no gradient (WorldModel.head).
        dist = actor.dist_from_output(wm.head(actor.mlp, sg(h), indices[-1]))
        action = actor.sample(dist, seeds[2 * t])
        if actor.discrete:
            action = sg(action)
        h, z, index = wm.imagine_step(h, z, action, seeds[2 * t + 1], with_index=True,
                                      z_index=indices[-1])
        if not actor.discrete:  # returns backpropagate through h: see materialized_gradient
            h = networks.materialized_gradient(h)
        hs.append(h)
        zs.append(z)
        indices.append(index)
        actions.append(action)
        dists.append(dist)
    dists = tf.nest.map_structure(lambda *xs: tf.stack(xs, 0), *dists)
    return Imagination(tf.stack(hs, 0), tf.stack(zs, 0), tf.stack(indices, 0),
                       tf.stack(actions, 0), dists)


def actor_critic_losses(model, imagined, start_cont, hp):
    """Critic and actor losses on an imagined trajectory, and the new return scale.

    Args:
        imagined: an :class:`Imagination` of `H` steps from `N` start states.
        start_cont: `[N]` real `1 - is_terminal` of the start states.

    Returns:
        `(actor_loss, critic_loss, new_return_scale, metrics)`. The critic loss depends only on the
        critic's variables; the actor loss is meant to update only the actor's variables.
    """
    wm, actor, critic = model.world_model, model.actor, model.critic
    h_grad, z_grad, z_index = imagined.h, imagined.z, imagined.z_index
    actions, dist = imagined.actions, imagined.dist
    # The heads take the latents as class indices (WorldModel.head: kernel-row sums instead of
    # matmuls with one-hot inputs, and segment sums for their kernels' gradients).
    # The reward and continue heads run on the imagined states only: the start states' reward
    # is unused and their continue flag is the real one.
    h = sg(h_grad)
    # The two-hot heads' softmaxes are shifted by their mean logit, which the heads return for
    # the price of a matrix-vector product (math_ops.two_hot_stats: no pass for the row maximum).
    # With continuous actions the returns backpropagate into the actor through the rewards.
    reward_logits, reward_mean = wm.head(wm.reward_head, h_grad[1:], z_index[1:], z_grad[1:],
                                         with_mean=True)
    reward = math_ops.two_hot_stats(reward_logits, wm.bins, reward_mean)[0]
    reward = tf.concat([tf.zeros_like(start_cont)[None], reward], 0)
    cont_logit = wm.head(wm.continue_head, h[1:], z_index[1:])[..., 0]
    cont = tf.cast(cont_logit > 0.0, tf.float32)  # mode of the continue head
    cont = tf.concat([start_cont[None], cont], 0)
    # One critic pass serves the values (returns, advantages) and the critic's loss. With
    # continuous actions the returns backpropagate into the actor through the values, so the
    # critic runs on the states with their gradient; the critic loss is differentiated w.r.t.
    # the critic's variables only, so this path to the states does not affect it.
    critic_logits, critic_mean = (
        wm.head(critic.mlp, h, z_index, with_mean=True) if actor.discrete
        else wm.head(critic.mlp, h_grad, z_index, z_grad, with_mean=True))  # [H + 1, N, bins]
    value, log_normalizer = math_ops.two_hot_stats(critic_logits, critic.bins, critic_mean,
                                                   keep_exp=True)
    returns = math_ops.lambda_returns(reward, cont, value, hp.gamma, hp.gae_lambda)  # [H, N]
    weights = math_ops.trajectory_weights(cont, hp.gamma)

    ema_logits, ema_mean = wm.head(model.critic_ema.mlp, h[:-1], z_index[:-1], with_mean=True)
    ema_value = math_ops.two_hot_stats(ema_logits, critic.bins, ema_mean)[0]
    # Cross-entropy towards the returns plus the regulariser's towards the EMA critic's values:
    # both of the same logits, in one pass. The loss runs on all H + 1 states with weight 0 on
    # the last (which has no return): slicing the logits to the first H and padding their
    # gradient back cost more than the extra row (-6 % of a nano update, A/B).
    no_return = tf.zeros_like(start_cont)[None]
    cross_entropy = math_ops.two_hot_cross_entropy(
        critic_logits, log_normalizer,
        [tf.concat([returns, no_return], 0), tf.concat([ema_value, no_return], 0)],
        [1.0, hp.critic_ema_regularizer], critic.bins)  # [H + 1, N]
    critic_loss = (tf.reduce_sum(tf.concat([weights, no_return], 0) * cross_entropy)
                   / tf.cast(tf.size(weights), tf.float32))  # the mean over the H steps

    scale = math_ops.return_scale_update(model.return_scale, sg(returns),
                                         hp.return_normalization_decay)
    adv = math_ops.normalized_advantage(returns, sg(value[:-1]), scale)
    # `dist` is what the actor gave on `sg(h[:-1]), sg(z[:-1])` (imagine).
    entropy = actor.entropy(dist)
    if actor.discrete:
        objective = sg(adv) * actor.log_prob(dist, actions)
    else:
        objective = adv
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
