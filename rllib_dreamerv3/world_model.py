"""The world model: encoder, RSSM (GRU sequence model, posterior and prior) and heads (Hafner
et al. 2023, world model learning; the RSSM of DreamerV2, arXiv 2010.02193).

Shapes: `h` is `[N, gru_units]`, `z` is `[N, K * C]` (K categoricals of C classes, one-hot,
flattened), features `[h, z]` feed every head. Sequences are processed time-major, `[T, B, ...]`.
"""

import tensorflow as tf

from rllib_dreamerv3 import math_ops, random_ops
from rllib_dreamerv3.encoders import make_encoder_decoder
from rllib_dreamerv3.networks import MLP, DenseBlock, GRUCell, two_hot_head


class WorldModel(tf.Module):
    """Encoder, RSSM and the decoder, reward and continue heads.

    Args:
        obs_shape: shape of one observation: `(obs_dim,)` for vectors, `(64, 64, C)` for images,
            `{key: shape}` for Dict observations (see :class:`~rllib_dreamerv3.spaces.ObsFormat`).
        action_dim: number of discrete actions (actions are one-hot) or continuous action dims.
        size: a :class:`~rllib_dreamerv3.model_sizes.ModelSize`.
        unimix: uniform mixture weight of the latent categoricals.
        num_bins: bins of the two-hot reward head.
        cnn_kernel: kernel size of the image encoder's and decoder's convolutions.
        encoder_keys, decoder_keys: Dict observations: the keys the encoder reads and the
            decoder reconstructs (None: all).
    """

    def __init__(
        self,
        obs_shape,
        action_dim,
        size,
        unimix=0.01,
        num_bins=255,
        cnn_kernel=4,
        encoder_keys=None,
        decoder_keys=None,
        name=None,
    ):
        super().__init__(name=name)
        self.size = size
        self.unimix = unimix
        self.stoch_shape = (size.num_categoricals, size.num_classes)
        self.stoch_dim = size.num_categoricals * size.num_classes
        self.feat_dim = size.gru_units + self.stoch_dim
        self.encoder, self.decoder = make_encoder_decoder(
            obs_shape, self.feat_dim, size, cnn_kernel, encoder_keys, decoder_keys
        )
        self.gru_input = DenseBlock(self.stoch_dim + action_dim, size.dense_units)
        self.gru = GRUCell(size.dense_units, size.gru_units)
        self.h0_raw = tf.Variable(tf.zeros([size.gru_units]), name="h0_raw")
        self.prior_net = MLP(size.gru_units, size.dense_units, 1, out_units=self.stoch_dim)
        self.posterior_net = MLP(
            size.gru_units + self.encoder.out_units, size.dense_units, 1, out_units=self.stoch_dim
        )
        self.reward_head = two_hot_head(self.feat_dim, size, num_bins)
        self.continue_head = MLP(self.feat_dim, size.dense_units, size.mlp_layers, out_units=1)
        self.bins = math_ops.two_hot_bins(num_bins)

    # --- latent distributions -------------------------------------------------------------
    def _logits(self, flat_logits):
        return tf.reshape(flat_logits, [-1, *self.stoch_shape])  # [N, K, C]

    def probs(self, logits):
        """Unimix probabilities `[N, K, C]` from logits `[N, K, C]`."""
        return math_ops.unimix_probs(logits, self.unimix)

    def sample_z(self, logits, seed):
        """Straight-through one-hot sample `[N, K * C]` of the categoricals given by `logits`:
        the sample in the forward pass, the probabilities' gradient in the backward pass."""
        probs = self.probs(logits)
        idx = random_ops.categorical(tf.reshape(probs, [-1, self.size.num_classes]), seed)
        sample = tf.reshape(tf.one_hot(idx, self.size.num_classes), tf.shape(probs))
        return tf.reshape(math_ops.straight_through(sample, probs), [-1, self.stoch_dim])

    def mode_z(self, logits):
        """Most likely class of every categorical, one-hot `[N, K * C]`."""
        onehot = tf.one_hot(tf.argmax(logits, -1), self.size.num_classes)
        return tf.reshape(onehot, [-1, self.stoch_dim])

    def prior_logits(self, h):
        return self._logits(self.prior_net(h))

    def posterior_logits(self, h, embed):
        return self._logits(self.posterior_net(tf.concat([h, embed], -1)))

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
        return (
            mask * h0 + (1.0 - mask) * h,
            mask * z0 + (1.0 - mask) * z,
            (1.0 - mask) * prev_action,
        )

    def sequence_step(self, h, z, action):
        """`h_t = GRU(h_{t-1}, DenseBlock([z_{t-1}, a_{t-1}]))`."""
        return self.gru(self.gru_input(tf.concat([z, action], -1)), h)

    def observe_step(self, h, z, prev_action, embed, is_first, seed, sample=True, initial=None):
        """One posterior step: reset on `is_first`, advance `h`, infer `z` from `h` and `embed`
        (a sample, or with `sample=False` the mode). `initial`: as in :meth:`reset`.

        Returns `(h, z, posterior_logits)`.
        """
        h, z, prev_action = self.reset(h, z, prev_action, is_first, initial)
        h = self.sequence_step(h, z, prev_action)
        post = self.posterior_logits(h, embed)
        z = self.sample_z(post, seed) if sample else self.mode_z(post)
        return h, z, post

    def imagine_step(self, h, z, action, seed):
        """One prior step: advance `h` with the chosen action, sample `z` from the prior."""
        h = self.sequence_step(h, z, action)
        return h, self.sample_z(self.prior_logits(h), seed)

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

        def step(carry, inputs):
            h, z, _ = carry
            return self.observe_step(h, z, *inputs, initial=initial)

        h, z, post = tf.scan(step, (prev_action, embed, is_first, seeds), state)
        # The prior needs only h: computed for all steps at once, after the recurrence.
        prior = tf.reshape(
            self.prior_logits(tf.reshape(h, [-1, h.shape[-1]])), [-1, batch, *self.stoch_shape]
        )
        return h, z, post, prior

    # --- heads ----------------------------------------------------------------------------
    def reward(self, feat):
        """Predicted reward in real space, `[...]`."""
        return math_ops.two_hot_mean(self.reward_head(feat), self.bins)

    def continue_logit(self, feat):
        """Bernoulli logit of `c = 1 - terminated`, `[...]`."""
        return self.continue_head(feat)[..., 0]
