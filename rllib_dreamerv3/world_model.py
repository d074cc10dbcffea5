"""The world model: encoder, RSSM (GRU sequence model, posterior and prior) and heads (SPEC §2).

Shapes: `h` is `[N, gru_units]`, `z` is `[N, K * C]` (K categoricals of C classes, one-hot,
flattened), features `[h, z]` feed every head. Sequences are processed time-major, `[T, B, ...]`.
"""

import tensorflow as tf

from rllib_dreamerv3 import math_ops, networks, random_ops
from rllib_dreamerv3.encoders import make_encoder_decoder
from rllib_dreamerv3.networks import MLP, DenseBlock, GRUCell


# From this many latent features (K * C) on, the observe loop feeds the latent to the dynamics'
# input layer by its classes (kernel-row sums, with the one-hot matmul's gradients, see
# `Dense.onehot_partial`): the one-hot matmul was a third of a loop step's forward time at XS.
# A/B in one process: XS vector discrete 0.483 -> 0.474 s, S 1.499 -> 1.482 s; but nano
# (16 features) 0.035 -> 0.037 s, where the extra per-step operations cost more than the
# [16, 18] matmul they replace.
OBSERVE_BY_INDEX_MIN_FEATURES = 256


class WorldModel(tf.Module):
    """Encoder, RSSM and the decoder, reward and continue heads.

    Args:
        obs_shape: shape of one observation: `(obs_dim,)` for vectors, `(64, 64, C)` for images.
        action_dim: number of discrete actions (actions are one-hot) or continuous action dims.
        size: a :class:`~rllib_dreamerv3.model_sizes.ModelSize`.
        unimix: uniform mixture weight of the latent categoricals.
        num_bins: bins of the two-hot reward head.
        cnn_kernel: kernel size of the image encoder's and decoder's convolutions.
    """

    def __init__(self, obs_shape, action_dim, size, unimix=0.01, num_bins=255, cnn_kernel=4,
                 name=None):
        super().__init__(name=name)
        self.size = size
        self.unimix = unimix
        self.stoch_shape = (size.num_categoricals, size.num_classes)
        self.stoch_dim = size.num_categoricals * size.num_classes
        self.feat_dim = size.gru_units + self.stoch_dim
        self.encoder, self.decoder = make_encoder_decoder(obs_shape, self.feat_dim, size,
                                                          cnn_kernel)
        self.gru_input = DenseBlock(self.stoch_dim + action_dim, size.dense_units)
        self.gru = GRUCell(size.dense_units, size.gru_units)
        self.h0_raw = tf.Variable(tf.zeros([size.gru_units]), name="h0_raw")
        self.prior_net = MLP(size.gru_units, size.dense_units, 1, out_units=self.stoch_dim)
        self.posterior_net = MLP(size.gru_units + self.encoder.out_units, size.dense_units, 1,
                                 out_units=self.stoch_dim)
        self.reward_head = networks.two_hot_head(self.feat_dim, size, num_bins)
        self.continue_head = MLP(self.feat_dim, size.dense_units, size.mlp_layers, out_units=1)
        self.bins = math_ops.two_hot_bins(num_bins)

    # --- latent distributions -------------------------------------------------------------
    def _logits(self, flat_logits):
        return tf.reshape(flat_logits, [-1, *self.stoch_shape])  # [N, K, C]

    def probs(self, logits):
        """Unimix probabilities `[N, K, C]` from logits `[N, K, C]`."""
        return math_ops.unimix_probs(logits, self.unimix)

    def sample_z(self, logits, seed, with_index=False):
        """Straight-through one-hot sample `[N, K * C]` of the categoricals given by `logits`;
        with `with_index`, also the sampled classes `[N, K]`."""
        probs = self.probs(logits)
        idx = random_ops.categorical(tf.reshape(probs, [-1, self.size.num_classes]), seed)
        sample = tf.reshape(tf.one_hot(idx, self.size.num_classes), tf.shape(probs))
        z = tf.reshape(math_ops.straight_through(sample, probs), [-1, self.stoch_dim])
        return (z, tf.reshape(idx, [-1, self.size.num_categoricals])) if with_index else z

    def z_index(self, z):
        """Classes `[..., K]` of a (straight-through) one-hot `z` `[..., K * C]`."""
        return tf.argmax(tf.reshape(z, [*z.shape[:-1], *self.stoch_shape]), -1,
                         output_type=tf.int32)

    def head(self, mlp, h, z_index, z=None, with_mean=False):
        """`mlp([h, z])` with `z` given by its classes: the latent's share of the first layer is
        a sum of kernel rows (:meth:`MLP.first_layer_onehot_part`). The variables' gradients are
        those of `mlp([h, z])`; so are `z`'s if `z` is given, else no gradient reaches `z`.
        `with_mean`: return `(output, mean of its units)` (:meth:`MLP.with_mean_output`)."""
        rest = mlp.first_layer_onehot_part(z_index, self.size.gru_units, self.size.num_classes, z)
        return mlp.with_mean_output(h, rest) if with_mean else mlp(h, rest=rest)

    def mode_z(self, logits):
        """Most likely class of every categorical, one-hot `[N, K * C]`."""
        onehot = tf.one_hot(tf.argmax(logits, -1), self.size.num_classes)
        return tf.reshape(onehot, [-1, self.stoch_dim])

    def prior_logits(self, h):
        return self._logits(self.prior_net(h))

    def posterior_logits(self, h, embed=None, embed_part=None):
        """Posterior logits from `h` and `embed`, or from `h` and `embed_part`, the posterior
        net's first-layer contribution of the embedding (:meth:`posterior_embed_part`)."""
        if embed_part is None:
            return self._logits(self.posterior_net(tf.concat([h, embed], -1)))
        return self._logits(self.posterior_net(h, rest=embed_part))

    def posterior_embed_part(self, embed):
        """The embedding's contribution to the posterior net's first layer, `[..., units]`;
        `observe` computes it for all steps at once, outside the recurrence."""
        return self.posterior_net.first_layer_part(embed, self.size.gru_units)

    # --- state transitions ----------------------------------------------------------------
    def _initial(self):
        h0 = tf.tanh(self.h0_raw)[None]
        return h0, self.mode_z(self.prior_logits(h0))  # [1, D], [1, K*C]

    def initial_state(self, batch_size, initial=None):
        """`h_0 = tanh(learned)`, `z_0` = mode of the prior on `h_0`; both `[batch_size, ...]`.

        `initial`: `(h0, z0)` already computed by the caller (else computed here).
        """
        h0, z0 = self._initial() if initial is None else initial
        ones = tf.ones([batch_size, 1])
        return ones * h0, ones * z0

    def reset(self, h, z, prev_action, is_first, initial=None):
        """Replace the state and previous action by the initial ones where `is_first` ([N] bool).

        `initial`: `(h0, z0)` from a caller that resets many times (else computed here).
        """
        h0, z0 = self._initial() if initial is None else initial
        mask = tf.cast(is_first, h.dtype)[:, None]
        return (mask * h0 + (1.0 - mask) * h, mask * z0 + (1.0 - mask) * z,
                (1.0 - mask) * prev_action)

    def sequence_step(self, h, z, action, z_index=None):
        """`h_t = GRU(h_{t-1}, DenseBlock([z_{t-1}, a_{t-1}]))`.

        `z_index`: the classes of the one-hot `z` `[N, K]`; if given, `z`'s share of the input
        layer is a sum of kernel rows (:meth:`Dense.onehot_partial`; same gradients).
        """
        if z_index is None:
            return self.gru(self.gru_input(tf.concat([z, action], -1)), h)
        dense = self.gru_input.dense
        pre = (dense.onehot_partial(z_index, 0, self.size.num_classes, z)
               + dense.partial(action, self.stoch_dim, dense.w.shape[0]))
        return self.gru(self.gru_input.activate(pre), h)

    def _posterior_step(self, h, z, prev_action, embed, is_first, seed, sample=True,
                        initial=None, embed_part=None):
        h, z, prev_action = self.reset(h, z, prev_action, is_first, initial)
        h = self.sequence_step(h, z, prev_action)
        post = self.posterior_logits(h, embed, embed_part)
        z = self.sample_z(post, seed) if sample else self.mode_z(post)
        return h, z, post

    def observe_step(self, h, z, prev_action, embed, is_first, seed, sample=True):
        """One posterior step: reset on `is_first`, advance `h`, infer `z` from `h` and `embed`.

        Returns `(h, z, posterior_logits, prior_logits)`.
        """
        h, z, post = self._posterior_step(h, z, prev_action, embed, is_first, seed, sample)
        return h, z, post, self.prior_logits(h)

    def imagine_step(self, h, z, action, seed, with_index=False, z_index=None):
        """One prior step: advance `h` with the chosen action, sample `z` from the prior (and
        with `with_index`, also return its classes `[N, K]`). `z_index`: the classes of the
        given one-hot `z` (faster, see :meth:`sequence_step`)."""
        h = self.sequence_step(h, z, action, z_index)
        sample = self.sample_z(self.prior_logits(h), seed, with_index)
        return (h, *sample) if with_index else (h, sample)

    def observe(self, embed, prev_action, is_first, seeds):
        """Posterior states along whole sequences (time-major).

        Args:
            embed: `[T, B, E]` encoder outputs; prev_action: `[T, B, A]` the action before each
            step; is_first: `[T, B]` bool; seeds: `[T, 2]` int32 stateless seeds.

        Returns:
            `h [T, B, D]`, `z [T, B, K*C]`, posterior and prior logits `[T, B, K, C]`. Each sequence
            starts from the initial state.
        """
        batch = embed.shape[1]
        initial = self._initial()
        state = (*self.initial_state(batch, initial), tf.zeros([batch, *self.stoch_shape]))
        by_index = self.stoch_dim >= OBSERVE_BY_INDEX_MIN_FEATURES
        if by_index:
            index0 = self.z_index(initial[1])  # [1, K]
            state += (tf.tile(index0, [batch, 1]),)

        def step(carry, inputs):  # `_posterior_step`, optionally carrying the latent's classes
            part_t, action_t, first_t, seed_t = inputs
            h, z, action_t = self.reset(carry[0], carry[1], action_t, first_t, initial)
            index = tf.where(first_t[:, None], index0, carry[3]) if by_index else None
            h = self.sequence_step(h, z, action_t, z_index=index)
            post = self.posterior_logits(h, embed_part=part_t)
            if not by_index:
                return h, self.sample_z(post, seed_t), post
            z, index = self.sample_z(post, seed_t, with_index=True)
            return h, z, post, index

        # Only the recurrence is in the loop: the embedding's share of the posterior's first
        # layer is computed for all T * B steps before it, and the prior, which needs only h, on
        # all states after it (one large matmul instead of T small ones, forward and back).
        # The loop's weights are read once, before it (else their gradient stacks a copy of every
        # weight per step), with the kernel rows the loop multiplies separately.
        embed_part = self.posterior_embed_part(embed)
        first, gru_in = self.posterior_net.blocks[0].dense, self.gru_input.dense
        rows = [(first, 0, self.size.gru_units)]
        if by_index:
            rows += [(gru_in, 0, self.stoch_dim), (gru_in, self.stoch_dim, gru_in.w.shape[0])]
        with networks.variables_read_once(self.gru_input, self.gru, self.posterior_net,
                                          row_blocks=rows):
            h, z, post = networks.scan(step, (embed_part, prev_action, is_first, seeds),
                                       state)[:3]
        prior = tf.reshape(self.prior_logits(tf.reshape(h, [-1, h.shape[-1]])),
                           [-1, batch, *self.stoch_shape])
        return h, z, post, prior

    # --- heads ----------------------------------------------------------------------------
    def reward(self, feat):
        """Predicted reward in real space, `[...]`."""
        return math_ops.two_hot_mean(self.reward_head(feat), self.bins)

    def continue_logit(self, feat):
        """Bernoulli logit of `c = 1 - terminated`, `[...]`."""
        return self.continue_head(feat)[..., 0]
