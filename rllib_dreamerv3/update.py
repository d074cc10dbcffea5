"""One DreamerV3 update: world model step, imagination, critic and actor steps, critic EMA (Hafner
et al. 2023) — built as a single compiled TF function with fixed shapes."""

import tensorflow as tf

from rllib_dreamerv3 import kernels, losses, random_ops
from rllib_dreamerv3.tf_rllib import collectives

WORLD_MODEL, ACTOR, CRITIC = "world_model", "actor", "critic"


def _step(optimizer, tape, loss, variables, clip, collective=None):
    """One optimizer step on `loss`, clipped to global norm `clip`; skipped unless finite.

    A NaN or inf in the loss or in any gradient (the global norm is then non-finite) leaves
    the variables and the optimizer's state (moments, step count) as they were, so one bad
    batch cannot turn the weights into NaN. Returns `(global norm, 1.0 if skipped else 0.0)`.

    With a `collective` (data-parallel Learners, each with an equal share of the batch), the
    gradients and the loss are first averaged over the Learners: every Learner then clips,
    checks and applies the same gradient, that of the whole batch's mean loss.
    """
    grads = tape.gradient(loss, variables)
    if collective is not None:
        grads = [tf.zeros_like(v) if g is None else g for g, v in zip(grads, variables)]
        *grads, loss = collective.all_reduce_mean([*grads, loss])
    norm = tf.linalg.global_norm(grads)
    finite = tf.math.is_finite(norm) & tf.math.is_finite(loss)
    grads, _ = tf.clip_by_global_norm(grads, clip, use_norm=norm)

    def apply():
        optimizer.apply_gradients(zip(grads, variables))
        return tf.constant(0.0)

    skipped = tf.cond(finite, apply, lambda: tf.constant(1.0))
    return norm, skipped


def _by_sequence(x, num):
    """`[T, B, ...]` -> `[B * T, ...]`, row `b * T + t`."""
    return tf.reshape(tf.transpose(x, [1, 0, *range(2, x.shape.rank)]), [num, -1])


def batch_signature(obs_shape, obs_dtype, action_dim, batch_size, batch_length):
    """`tf.TensorSpec`s of a training batch `[B, T, ...]` (see :func:`losses.world_model_loss`).

    For Dict observations `obs_shape` and `obs_dtype` are dicts `{key: ...}` alike, and so is
    the batch's `obs`.
    """
    bt = [batch_size, batch_length]
    if isinstance(obs_shape, dict):
        obs = {k: tf.TensorSpec(bt + list(obs_shape[k]), obs_dtype[k]) for k in obs_shape}
    else:
        obs = tf.TensorSpec(bt + list(obs_shape), obs_dtype)
    return {
        "obs": obs,
        "actions": tf.TensorSpec(bt + [action_dim], tf.float32),
        "rewards": tf.TensorSpec(bt, tf.float32),
        "is_first": tf.TensorSpec(bt, tf.bool),
        "is_terminal": tf.TensorSpec(bt, tf.bool),
    }


def make_update_fn(model, optimizers, hp, signature, jit_compile=True, collective=None):
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
        collective: with data-parallel Learners, their
            :class:`~rllib_dreamerv3.tf_rllib.collectives.Collective`; `signature` is then this
            Learner's share of the batch (the first rows of the whole batch come to rank 0).
            Gradients and metrics are averaged over the Learners, the return scale's
            percentiles are those of all their returns, and the random draws are this
            Learner's rows of the whole batch's draws: every Learner makes the update that one
            Learner would make on the whole batch. XLA does not compile collectives on CPUs,
            so pass `jit_compile=False` there.

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

    rank, num_learners = (0, 1) if collective is None else (collective.rank, collective.group_size)

    def update(batch, seed):
        with collectives.in_group(collective), random_ops.sharded(rank, num_learners):
            metrics = one_update(batch, seed)
        if collective is not None:  # the whole batch's metrics: means of equal shares
            metrics = dict(zip(metrics, collective.all_reduce_mean(list(metrics.values()))))
        return metrics

    def one_update(batch, seed):
        seeds = random_ops.split(seed, batch_length + 2 * horizon)
        with tf.GradientTape() as tape:
            wm_loss, metrics, (h, z) = impl.world_model_loss(model, batch, seeds[:batch_length], hp)
        metrics["grad_norm_world_model"], metrics["skipped_world_model"] = _step(
            optimizers[WORLD_MODEL], tape, wm_loss, wm_vars, hp.world_model_grad_clip, collective
        )

        # Every replayed state `[T, B]` starts a trajectory. They are laid out sequence by
        # sequence (`[B * T]`), so that a Learner's share of the batch (a block of sequences)
        # is a block of the trajectories and of their random draws (`random_ops.sharded`).
        start_h = tf.stop_gradient(_by_sequence(h, batch_size * batch_length))
        start_z = tf.stop_gradient(_by_sequence(z, batch_size * batch_length))
        start_cont = 1.0 - tf.reshape(tf.cast(batch["is_terminal"], tf.float32), [-1])
        with tf.GradientTape() as actor_tape, tf.GradientTape() as critic_tape:
            imagined = impl.imagine(model, start_h, start_z, horizon, seeds[batch_length:])
            actor_loss, critic_loss, scale, ac_metrics = impl.actor_critic_losses(
                model, imagined, start_cont, hp
            )
        metrics.update(ac_metrics)
        metrics["grad_norm_critic"], metrics["skipped_critic"] = _step(
            optimizers[CRITIC],
            critic_tape,
            critic_loss,
            critic_vars,
            hp.critic_grad_clip,
            collective,
        )
        metrics["grad_norm_actor"], metrics["skipped_actor"] = _step(
            optimizers[ACTOR], actor_tape, actor_loss, actor_vars, hp.actor_grad_clip, collective
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
