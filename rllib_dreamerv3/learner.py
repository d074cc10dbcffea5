"""`DreamerV3Learner`: three Adam optimisers (the paper's Table W.1) and one compiled update per
call."""

import numpy as np
import tensorflow as tf
from ray.rllib.core import DEFAULT_MODULE_ID

from rllib_dreamerv3 import interrupts
from rllib_dreamerv3.dreams import dream_summaries, make_dream_fn
from rllib_dreamerv3.spaces import action_dim
from rllib_dreamerv3.tf_rllib import TfLearner, make_adam
from rllib_dreamerv3.tf_rllib.custom_gradients import release_custom_gradients
from rllib_dreamerv3.update import ACTOR, CRITIC, WORLD_MODEL, batch_signature, make_update_fn

# What a collective raises when a peer is gone: its timeout, or a connection error.
_COLLECTIVE_ERRORS = (
    tf.errors.DeadlineExceededError,
    tf.errors.UnavailableError,
    tf.errors.AbortedError,
    tf.errors.CancelledError,
)
SKIPPED_METRICS = ("skipped_world_model", "skipped_critic", "skipped_actor")
NUM_SKIPPED_UPDATES_LIFETIME = "num_skipped_updates_lifetime"


class DreamerV3Learner(TfLearner):
    """Learner running DreamerV3's update (:func:`~rllib_dreamerv3.update.make_update_fn`).

    A batch is `[B, T, ...]` numpy: `obs`, `actions` (one-hot for discrete), `rewards`,
    `is_first`, `is_terminal`. Each `update` call performs exactly one DreamerV3 update
    (world model, critic and actor steps, critic EMA) in one XLA-compiled function whose input
    shapes are fixed, so it traces once. Its metrics are logged under the module id.

    A step whose loss or gradients are not finite is skipped (the weights stay as they were):
    each update reports `skipped_world_model`, `skipped_critic`, `skipped_actor` and the
    lifetime count `num_skipped_updates_lifetime`; `max_skipped_updates_in_a_row` such
    updates in a row raise a `FloatingPointError`.
    """

    def configure_optimizers_for_module(self, module_id, config=None):
        model = self.module[module_id].model
        parts = {
            WORLD_MODEL: (model.world_model, config.world_model_lr, config.world_model_adam_eps),
            ACTOR: (model.actor, config.actor_lr, config.actor_adam_eps),
            CRITIC: (model.critic, config.critic_lr, config.critic_adam_eps),
        }
        for name, (net, lr, eps) in parts.items():
            params = list(net.trainable_variables)
            self.register_optimizer(
                module_id=module_id,
                optimizer_name=name,
                optimizer=make_adam(lr, eps, params),
                params=params,
                lr_or_lr_schedule=lr,
            )

    def build(self):
        super().build()
        cfg = self.config
        module = self.module[DEFAULT_MODULE_ID]
        optimizers = {name: opt for name, opt in self.get_optimizers_for_module(DEFAULT_MODULE_ID)}
        obs_format = module.obs_format
        group = self.collective
        self._signature = batch_signature(
            obs_format.shape(),
            obs_format.dtype(),
            action_dim(module.action_space),
            cfg.batch_size_B // (1 if group is None else group.group_size),  # this one's rows
            cfg.batch_length_T,
        )
        self._update_fn = make_update_fn(
            module.model,
            optimizers,
            cfg,
            self._signature,
            # XLA does not compile the Learners' collectives (see `tf_rllib.collectives`).
            jit_compile=cfg.jit_compile and group is None,
            collective=group,
        )
        self._update_call = None  # its concrete function, traced on the first update
        seed = cfg.seed
        if group is not None:  # every Learner must draw the same update seeds
            entropy = np.random.SeedSequence(seed).generate_state(1, np.uint64)[0] >> 12
            seed = int(group.broadcast([tf.constant(entropy, tf.int64)])[0])
        self._seed_rng = np.random.default_rng(seed)
        self._dream_fn = None  # built on the first `dreams` call: no cost when dreams are off
        self._skipped_in_a_row = 0  # consecutive updates with a skipped step
        self._skipped_total = 0

    @property
    def num_traces(self):
        """How often the update function has been traced (1 after the first update)."""
        return self._update_fn.experimental_get_tracing_count()

    def _check_batch(self, batch, signature=None, where=""):
        signature = self._signature if signature is None else signature
        for key, spec in signature.items():
            if not isinstance(batch, dict) or key not in batch:
                raise ValueError(
                    f"DreamerV3 batch{where} lacks {key!r}; it needs {sorted(signature)}."
                )
            if isinstance(spec, dict):  # Dict observations
                self._check_batch(batch[key], spec, f"{where}[{key!r}]")
            elif tuple(batch[key].shape) != tuple(spec.shape):
                raise ValueError(
                    f"DreamerV3 batch{where}[{key!r}] has shape {tuple(batch[key].shape)}, "
                    f"expected {tuple(spec.shape)} (B={self.config.batch_size_B} rows over "
                    f"{max(1, self.config.num_learners)} Learner(s), "
                    f"T={self.config.batch_length_T})."
                )

    def _inputs(self, batch):
        self._check_batch(batch)
        inputs = tf.nest.map_structure(
            lambda spec, value: tf.cast(value, spec.dtype),
            self._signature,
            {key: batch[key] for key in self._signature},
        )
        return inputs, tf.constant(self._seed_rng.integers(0, 2**31 - 1, 2), tf.int32)

    def dreams(self, batch):
        """Dream summaries (:func:`~rllib_dreamerv3.dreams.dream_summaries`) of a `[B, T]`
        replay batch: reconstructions, an open-loop dream, and their errors."""
        cfg = self.config
        if self._dream_fn is None:
            self._dream_fn = make_dream_fn(
                self.module[DEFAULT_MODULE_ID].model,
                self._signature,
                cfg.dream_burn_in,
                min(cfg.dream_num_sequences, cfg.batch_size_B),
                jit_compile=cfg.jit_compile,
            ).get_concrete_function()
            release_custom_gradients(self._dream_fn.graph)  # see `_update`
        # Its calls are rare and the first one compiles: Ctrl-C must not wait for that.
        out = interrupts.call(self._dream_fn, *self._inputs(batch))
        return dream_summaries(tf.nest.map_structure(np.asarray, out), cfg.dream_burn_in)

    def _update(self, batch, **kwargs):
        inputs, seed = self._inputs(batch[DEFAULT_MODULE_ID])
        # The first call compiles the update with XLA: made so that Ctrl-C need not wait for it
        # (see rllib_dreamerv3.interrupts); later calls wait for an interrupted first one.
        call = interrupts.call if self._update_call is None else interrupts.call_directly
        if self._update_call is None:
            self._update_call = self._update_fn.get_concrete_function()
            # The trace's custom gradients are built; unregistered, its graph is freed with
            # this Learner (see `tf_rllib.custom_gradients`).
            release_custom_gradients(self._update_call.graph)
        # The concrete function skips `tf.function`'s per-call work: binding the Python arguments
        # to the signature and looking the trace up in its cache. That work does not grow with the
        # model, so it matters most for small models, where the compiled update itself is short.
        # The input signature is fixed, so this concrete function is the one and only trace.
        try:
            metrics = call(self._update_call, inputs, seed)
        except _COLLECTIVE_ERRORS as error:
            if self.collective is None:
                raise
            group = self.collective
            peer = group.failed_peer or "another Learner"
            raise RuntimeError(
                f"Learner {group.rank} of {group.group_size}: the update's all-reduce with the "
                f"other Learners failed ({type(error).__name__}): {peer} did not answer within "
                f"learner_peer_timeout_s={self.config.learner_peer_timeout_s} s. The group "
                "cannot go on without it; restore the last checkpoint (Ray Tune's "
                "FailureConfig(max_failures=...) does so automatically)."
            ) from error
        self._count_skipped_steps(metrics)
        self.metrics.log_dict(metrics, key=DEFAULT_MODULE_ID, window=1)
        # 1 from the first update on; more would mean re-tracing (and re-compiling).
        self.metrics.log_value((DEFAULT_MODULE_ID, "num_update_traces"), self.num_traces, window=1)
        loss = metrics["L_world_model"] + metrics["L_actor"] + metrics["L_critic"]
        return {}, {DEFAULT_MODULE_ID: loss}, {}

    def _count_skipped_steps(self, metrics):
        """Count updates whose steps were skipped for non-finite losses or gradients (the
        weights stay as they were); raise once `max_skipped_updates_in_a_row` came in a row."""
        skipped = [name for name in SKIPPED_METRICS if float(metrics[name]) > 0.0]
        self._skipped_in_a_row = self._skipped_in_a_row + 1 if skipped else 0
        self._skipped_total += bool(skipped)
        self.metrics.log_value(
            (DEFAULT_MODULE_ID, NUM_SKIPPED_UPDATES_LIFETIME), self._skipped_total, window=1
        )
        limit = self.config.max_skipped_updates_in_a_row
        if limit and self._skipped_in_a_row >= limit:
            losses = {
                name: float(metrics[name]) for name in ("L_world_model", "L_actor", "L_critic")
            }
            raise FloatingPointError(
                f"{self._skipped_in_a_row} DreamerV3 updates in a row had non-finite losses or "
                f"gradients (last one: {losses}; skipped steps: {skipped}). Their steps were "
                "skipped, so the weights are still those of the last finite update. Usual "
                "causes: NaN/inf observations or rewards from the env (EnvRunners reject them "
                "unless nonfinite_env_data='skip'), or learning rates too high for this env. "
                "Restore the last checkpoint and fix the cause, or raise "
                "max_skipped_updates_in_a_row (0: never stop)."
            )

    def compute_loss_for_module(self, *, module_id, config, batch, fwd_out):
        raise NotImplementedError("DreamerV3Learner computes its losses inside `_update`.")

    def get_state(self, *args, **kwargs):
        interrupts.wait_for_abandoned()  # an interrupted update still writing the weights
        state = super().get_state(*args, **kwargs)
        state["seed_rng"] = self._seed_rng.bit_generator.state
        state["skipped_updates"] = (self._skipped_in_a_row, self._skipped_total)
        return state

    def set_state(self, state):
        interrupts.wait_for_abandoned()
        super().set_state(state)
        if "seed_rng" in state:
            self._seed_rng.bit_generator.state = state["seed_rng"]
        if "skipped_updates" in state:
            self._skipped_in_a_row, self._skipped_total = state["skipped_updates"]
