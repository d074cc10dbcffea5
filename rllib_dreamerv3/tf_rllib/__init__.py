"""A small TensorFlow 2 layer for RLlib's new API stack (Ray 2.60), not specific to DreamerV3.

- :class:`TfRLModule`: RLModule base with numpy-dict state of its `tf.Module`s.
- :class:`TfLearner`: every framework-specific `Learner` method (optimizers, gradients,
  clipping, learning rates, optimizer state) and a compiled default update.
- :func:`to_tensor` / :func:`to_numpy`: batch conversion instead of RLlib's torch connectors.
- :func:`ensure_tf2_behavior`, :func:`apply_ray_patches`: the guard and the version-pinned
  run-time patch that keep TF working inside Ray.
- :mod:`~rllib_dreamerv3.tf_rllib.collectives`: TF's collectives among data-parallel Learners
  (`TfLearner.collective` when `num_learners >= 2`): all-reduce, all-gather, broadcast, and a
  watchdog for dead peers.
"""

from rllib_dreamerv3.tf_rllib.compat import (
    PINNED_RAY_VERSION,
    apply_ray_patches,
    ensure_tf2_behavior,
    limit_tf_threads,
)
from rllib_dreamerv3.tf_rllib.tensors import to_numpy, to_tensor
from rllib_dreamerv3.tf_rllib.tf_learner import TfLearner, make_adam
from rllib_dreamerv3.tf_rllib.tf_rl_module import TfRLModule

__all__ = [
    "PINNED_RAY_VERSION",
    "TfLearner",
    "TfRLModule",
    "apply_ray_patches",
    "ensure_tf2_behavior",
    "limit_tf_threads",
    "make_adam",
    "to_numpy",
    "to_tensor",
]
