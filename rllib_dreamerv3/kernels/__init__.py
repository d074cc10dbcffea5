"""Fast kernels: the update of :mod:`rllib_dreamerv3.losses`, computed faster.

The algorithm is written once, in plain TensorFlow, in :mod:`rllib_dreamerv3.losses`,
:mod:`~rllib_dreamerv3.world_model`, :mod:`~rllib_dreamerv3.actor_critic` and
:mod:`~rllib_dreamerv3.networks`. This sub-package computes the same three functions,

- :func:`world_model_loss(model, batch, seeds, hp) <world_model_loss>`,
- :func:`imagine(model, h, z, horizon, seeds) <imagine>`,
- :func:`actor_critic_losses(model, imagined, start_cont, hp) <actor_critic_losses>`,

with the same signatures, from the same variables, with the same results up to float rounding
(`tests/test_kernels.py` checks losses, gradients and whole updates). The config switch
`fast_kernels` (default True) selects this sub-package in the update
(:func:`rllib_dreamerv3.update.make_update_fn`); False runs the reference.

The techniques, each in one module:

- :mod:`.layers`: a Dense layer's bias as one more kernel row; LayerNorm with its gradient
  written out as matrix-vector products; stride-2 convolutions as space-to-depth plus matmuls;
  a layer's input split into parts computed separately (outside a loop, or from one-hot classes
  as sums of kernel rows, :func:`~.layers.onehot_partial`); :class:`~.layers.LoopWeights`, the
  variables a loop body reads, read once before the loop and passed in explicitly.
- :mod:`.rssm`: the world model's recurrence with the latent carried by its classes.
- :mod:`.two_hot`: the two-hot heads' normaliser, expected value and cross-entropies in one
  pass over the logits, padded by masked columns to an aligned width.
- :mod:`.sampling`: categorical samples with their cumulative sums as one matmul.
- :mod:`.percentiles`: the return scale's percentiles by a bitwise search instead of a sort.
- :mod:`.loops`: a scan whose gradient does not copy its outputs, and identities that make XLA
  compute a value (or a gradient) into a buffer of its own.

None of them adds a variable, so checkpoints do not depend on the switch.
"""

from rllib_dreamerv3.kernels.losses import actor_critic_losses, imagine, world_model_loss

__all__ = ["actor_critic_losses", "imagine", "world_model_loss"]
