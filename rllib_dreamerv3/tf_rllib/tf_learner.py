"""`TfLearner`: every framework-specific method of RLlib's `Learner`, for TensorFlow 2.

The default update is one compiled function: forward pass, losses, gradients, per-optimizer
global-norm clipping and optimizer steps. Subclasses with a custom update override `_update`.
Metrics cannot be logged from inside a traced function, so traced code returns them and they
are logged afterwards.
"""

import tensorflow as tf
import tf_keras
from ray.rllib.core.learner.learner import Learner
from ray.rllib.policy.sample_batch import MultiAgentBatch, SampleBatch

from rllib_dreamerv3.tf_rllib import collectives
from rllib_dreamerv3.tf_rllib.compat import ensure_tf2_behavior, limit_tf_threads
from rllib_dreamerv3.tf_rllib.tensors import to_tensor


def make_adam(learning_rate, epsilon, params):
    """A built `tf_keras` Adam for `params` (its slots exist before any tracing).

    `epsilon` is added to the bias-corrected root second moment, `m̂ / (√v̂ + ε)`, as in Kingma &
    Ba's Algorithm 1 (and optax/PyTorch). Keras' default adds it to the uncorrected `√v`, which
    is an ε larger by `1/√(1 − β₂ᵗ)` (31.6× at the first step with β₂ = 0.999).
    """
    optimizer = tf_keras.optimizers.Adam(
        learning_rate=learning_rate, epsilon=epsilon, adaptive_epsilon=True
    )
    optimizer.build(params)
    return optimizer


class TfLearner(Learner):
    """Base class for TF2 Learners on RLlib's new API stack.

    Subclasses implement `configure_optimizers_for_module` (creating optimizers with
    :func:`make_adam` or any built `tf_keras` optimizer and calling `register_optimizer`) and
    `compute_loss_for_module`. Set `jit_compile = True` on a subclass to compile with XLA.
    """

    framework = "tf2"
    jit_compile = False

    def __init__(self, **kwargs):
        ensure_tf2_behavior()
        super().__init__(**kwargs)
        self._compiled_update = None
        self.collective = None

    def build(self):
        """Build the module and optimizers. With `num_learners >= 2`, first join the other
        Learners' TF cluster (`TF_CONFIG`, written by Ray Train's TF backend) and afterwards
        give every Learner rank 0's weights and optimizer state: :attr:`collective` is then
        the group's :class:`~rllib_dreamerv3.tf_rllib.collectives.Collective` (else None)."""
        limit_tf_threads(getattr(self.config, "tf_num_threads", None))
        cluster = collectives.cluster_from_env() if self.config.num_learners > 1 else None
        if cluster is not None:  # before any variable exists (see `collectives.connect`)
            self.collective = collectives.connect(*cluster)
        super().build()
        if self.collective is not None:
            self.collective.broadcast_variables(self._all_variables())  # all peers are up
            self.collective.watch_peers(getattr(self.config, "learner_peer_timeout_s", 30.0))

    def _all_variables(self):
        """The module's variables and the optimizers' (in a fixed order)."""
        variables = []
        for module_id in sorted(self.module.keys()):
            variables.extend(self.module[module_id].tf_variables().values())
        for optimizer in self._named_optimizers.values():
            variables.extend(optimizer.variables)
        return variables

    # --- parameters and batches -------------------------------------------------------------
    def get_param_ref(self, param):
        return param.ref()  # tf.Variables are not hashable

    def get_parameters(self, module):
        return list(module.trainable_variables)

    def _convert_batch_type(self, batch, to_device=False, pin_memory=False, use_stream=False):
        return MultiAgentBatch(
            {mid: SampleBatch(to_tensor(dict(b))) for mid, b in batch.policy_batches.items()},
            env_steps=batch.env_steps(),
        )

    def _get_tensor_variable(self, value, dtype=None, trainable=False):
        return tf.Variable(value, trainable=trainable, dtype=dtype)

    # --- optimizers ---------------------------------------------------------------------------
    @staticmethod
    def _get_optimizer_lr(optimizer):
        return float(optimizer.learning_rate)

    @staticmethod
    def _set_optimizer_lr(optimizer, lr):
        optimizer.learning_rate = float(lr)

    @staticmethod
    def _get_clip_function():
        from ray.rllib.utils.tf_utils import clip_gradients

        return clip_gradients

    @staticmethod
    def _get_global_norm_function():
        return tf.linalg.global_norm

    def _check_registered_optimizer(self, optimizer, params):
        super()._check_registered_optimizer(optimizer, params)
        if not isinstance(optimizer, tf_keras.optimizers.Optimizer):
            raise TypeError(
                f"TfLearner optimizers must be tf_keras optimizers, got {type(optimizer)}; "
                "create them with rllib_dreamerv3.tf_rllib.make_adam()."
            )
        for param in params:
            if not isinstance(param, tf.Variable):
                raise TypeError(f"Optimizer parameters must be tf.Variables, got {type(param)}.")

    def _get_optimizer_state(self):
        return {
            name: {
                "module_id": self._optimizer_name_to_module[name],
                "variables": [v.numpy() for v in optimizer.variables],
            }
            for name, optimizer in self._named_optimizers.items()
        }

    def _set_optimizer_state(self, state):
        # Check everything before writing anything: a bad state must not half-load.
        for name, entry in state.items():
            if name not in self._named_optimizers:
                raise ValueError(
                    f"Optimizer {name!r} in the state does not exist in this Learner "
                    f"(it has {sorted(self._named_optimizers)})."
                )
            variables = self._named_optimizers[name].variables
            if len(variables) != len(entry["variables"]) or any(
                tuple(v.shape) != tuple(value.shape)
                for v, value in zip(variables, entry["variables"])
            ):
                raise ValueError(
                    f"Optimizer {name!r}'s variables do not match the state's (counts or "
                    "shapes differ): the state comes from a different model."
                )
        for name, entry in state.items():
            for var, value in zip(self._named_optimizers[name].variables, entry["variables"]):
                var.assign(value)

    # --- gradients and the default update -------------------------------------------------------
    def compute_gradients(self, loss_per_module, gradient_tape=None, **kwargs):
        if gradient_tape is None:
            raise ValueError(
                "TfLearner.compute_gradients needs the `gradient_tape` that recorded the losses."
            )
        refs = list(self._params)
        total = tf.add_n(list(loss_per_module.values()))
        grads = gradient_tape.gradient(total, [self._params[r] for r in refs])
        return {ref: g for ref, g in zip(refs, grads) if g is not None}

    def postprocess_gradients_for_module(self, *, module_id, config=None, module_gradients_dict):
        """Clip each optimizer's gradients as `config.grad_clip[_by]` says; trace-safe logging.

        The global norm per optimizer is reported (as RLlib's torch Learner does) when clipping
        by global norm or when `config.log_gradients` is set.
        """
        if not config.grad_clip and not config.log_gradients:
            return dict(module_gradients_dict)
        out = dict(module_gradients_dict)
        clip, clip_by = config.grad_clip, config.grad_clip_by
        for optimizer_name, optimizer in self.get_optimizers_for_module(module_id):
            grads = self.filter_param_dict_for_optimizer(module_gradients_dict, optimizer)
            values = list(grads.values())
            norm = tf.linalg.global_norm(values)
            if clip:
                if clip_by == "global_norm":
                    values, _ = tf.clip_by_global_norm(values, clip, use_norm=norm)
                elif clip_by == "norm":
                    values = [tf.clip_by_norm(g, clip) for g in values]
                else:
                    values = [tf.clip_by_value(g, -clip, clip) for g in values]
                out.update(zip(grads.keys(), values))
            if (clip and clip_by == "global_norm") or config.log_gradients:
                self._traced_metrics[(module_id, f"gradients_{optimizer_name}_global_norm")] = norm
        return out

    def apply_gradients(self, gradients_dict):
        for optimizer in self._named_optimizers.values():
            pairs = [
                (gradients_dict[ref], self._params[ref])
                for ref in self._optimizer_parameters[optimizer]
                if ref in gradients_dict
            ]
            if pairs:
                optimizer.apply_gradients(pairs)

    def _traced_update(self, batch):
        self._traced_metrics = {}
        with tf.GradientTape() as tape:
            fwd_out = self.module.forward_train(batch)
            losses = self.compute_losses(fwd_out=fwd_out, batch=batch)
        grads = self.compute_gradients(losses, gradient_tape=tape)
        self.apply_gradients(self.postprocess_gradients(grads))
        return fwd_out, losses, dict(self._traced_metrics)

    def _update(self, batch, **kwargs):
        if self._compiled_update is None:
            # A closure, not a bound method: Ray adds `_ray_trace_ctx` to actor methods.
            def update(batch):
                return self._traced_update(batch)

            self._compiled_update = tf.function(
                update, autograph=False, jit_compile=self.jit_compile
            )
        fwd_out, losses, metrics = self._compiled_update({mid: dict(b) for mid, b in batch.items()})
        for key, value in metrics.items():
            self.metrics.log_value(key, value, window=1)
        return fwd_out, losses, {}
