"""One DreamerV3 update: world model step, imagination, critic and actor steps, critic EMA (Hafner
et al. 2023) — built as a single compiled TF function with fixed shapes."""

import tensorflow as tf

from rllib_dreamerv3 import kernels, losses, random_ops

WORLD_MODEL, ACTOR, CRITIC = "world_model", "actor", "critic"


def _step(optimizer, tape, loss, variables, clip):
    """One optimizer step on `loss`, clipped to global norm `clip`; skipped unless finite.

    A NaN or inf in the loss or in any gradient (the global norm is then non-finite) leaves
    the variables and the optimizer's state (moments, step count) as they were, so one bad
    batch cannot turn the weights into NaN. Returns `(global norm, 1.0 if skipped else 0.0)`.
    """
    grads = tape.gradient(loss, variables)
    norm = tf.linalg.global_norm(grads)
    finite = tf.math.is_finite(norm) & tf.math.is_finite(loss)
    grads, _ = tf.clip_by_global_norm(grads, clip, use_norm=norm)

    def apply():
        optimizer.apply_gradients(zip(grads, variables))
        return tf.constant(0.0)

    skipped = tf.cond(finite, apply, lambda: tf.constant(1.0))
    return norm, skipped


def batch_signature(obs_shape, obs_dtype, action_dim, batch_size, batch_length):
    """`tf.TensorSpec`s of a training batch `[B, T, ...]` (see :func:`losses.world_model_loss`)."""
    bt = [batch_size, batch_length]
    return {
        "obs": tf.TensorSpec(bt + list(obs_shape), obs_dtype),
        "actions": tf.TensorSpec(bt + [action_dim], tf.float32),
        "rewards": tf.TensorSpec(bt, tf.float32),
        "is_first": tf.TensorSpec(bt, tf.bool),
        "is_terminal": tf.TensorSpec(bt, tf.bool),
    }


def make_update_fn(model, optimizers, hp, signature, jit_compile=True):
    """A compiled `update(batch, seed) -> metrics` for `model`.

    Args:
        model: a :class:`~rllib_dreamerv3.model.DreamerV3Model`.
        optimizers: dict with keys `"world_model"`, `"actor"`, `"critic"` (built optimizers).
        hp: the config (loss scales, γ, λ, clips, ...; see :mod:`rllib_dreamerv3.losses`).
            `hp.fast_kernels` picks the implementation of the losses: the fused kernels of
            :mod:`rllib_dreamerv3.kernels` (True) or the reference :mod:`rllib_dreamerv3.losses`
            (False); both give the same results.
        signature: the batch's :func:`batch_signature`; the function is traced once for it.
        jit_compile: compile with XLA (else a plain graph function).

    Returns:
        A `tf.function`; its input signature fixes all shapes, so it never re-traces. Its
        metrics include `skipped_world_model`, `skipped_critic` and `skipped_actor`: 1.0 where
        that step was skipped because its loss or gradients were not finite (see `_step`).
    """
    wm_vars = model.world_model.trainable_variables
    actor_vars = model.actor.trainable_variables
    critic_vars = model.critic.trainable_variables
    horizon = hp.horizon_H
    impl = kernels if hp.fast_kernels else losses
    batch_size, batch_length = signature["rewards"].shape

    def update(batch, seed):
        seeds = random_ops.split(seed, batch_length + 2 * horizon)
        with tf.GradientTape() as tape:
            wm_loss, metrics, (h, z) = impl.world_model_loss(model, batch, seeds[:batch_length], hp)
        metrics["grad_norm_world_model"], metrics["skipped_world_model"] = _step(
            optimizers[WORLD_MODEL], tape, wm_loss, wm_vars, hp.world_model_grad_clip
        )

        start_h = tf.stop_gradient(tf.reshape(h, [batch_size * batch_length, -1]))
        start_z = tf.stop_gradient(tf.reshape(z, [batch_size * batch_length, -1]))
        start_cont = 1.0 - tf.reshape(tf.transpose(tf.cast(batch["is_terminal"], tf.float32)), [-1])
        with tf.GradientTape() as actor_tape, tf.GradientTape() as critic_tape:
            imagined = impl.imagine(model, start_h, start_z, horizon, seeds[batch_length:])
            actor_loss, critic_loss, scale, ac_metrics = impl.actor_critic_losses(
                model, imagined, start_cont, hp
            )
        metrics.update(ac_metrics)
        metrics["grad_norm_critic"], metrics["skipped_critic"] = _step(
            optimizers[CRITIC], critic_tape, critic_loss, critic_vars, hp.critic_grad_clip
        )
        metrics["grad_norm_actor"], metrics["skipped_actor"] = _step(
            optimizers[ACTOR], actor_tape, actor_loss, actor_vars, hp.actor_grad_clip
        )
        # The return scale is an EMA: a non-finite one would stay non-finite.
        model.return_scale.assign(tf.where(tf.math.is_finite(scale), scale, model.return_scale))
        # The slow critic follows the critic only when the critic stepped.
        tf.cond(
            metrics["skipped_critic"] > 0.0,
            lambda: None,
            lambda: model.update_critic_ema(hp.critic_ema_rate),
        )
        return metrics

    return tf.function(
        update,
        jit_compile=jit_compile,
        autograph=False,
        input_signature=[signature, tf.TensorSpec([2], tf.int32)],
    )
