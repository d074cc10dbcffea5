"""Actor and critic, both on the model state `s = [h, z]` (Hafner et al. 2023, actor-critic
learning)."""

import tensorflow as tf
import tensorflow_probability as tfp

from rllib_dreamerv3 import math_ops, random_ops
from rllib_dreamerv3.networks import MLP, two_hot_head

tfd = tfp.distributions


class Actor(tf.Module):
    """The policy `π(a | s)` as a tensorflow-probability distribution over actions `[N, A]`.

    Discrete: `OneHotCategorical` with unimix, actions one-hot. Continuous: independent Normals
    with mean `tanh(x)` and std `(max_std - min_std) * sigmoid(x + 2) + min_std`, actions
    clipped to `[-1, 1]`. The distribution gives `log_prob`, `entropy` and `mode`; samples come
    from :meth:`sample`, whose draws are :mod:`~rllib_dreamerv3.random_ops`' (the same for any
    number of data-parallel Learners).
    """

    def __init__(
        self, feat_dim, action_dim, discrete, size, unimix=0.01, min_std=0.1, max_std=1.0, name=None
    ):
        super().__init__(name=name)
        self.discrete = discrete
        self.action_dim = action_dim
        self.unimix, self.min_std, self.max_std = unimix, min_std, max_std
        out_units = action_dim if discrete else 2 * action_dim
        self.mlp = MLP(feat_dim, size.dense_units, size.mlp_layers, out_units=out_units)

    def dist(self, feat):
        """The distribution `π(a | s)` on the model states `feat` `[..., D + K * C]`."""
        return self.dist_from_output(self.mlp(feat))

    def dist_from_output(self, out):
        """:meth:`dist` from the MLP's output `self.mlp(feat)`, computed by the caller."""
        if self.discrete:
            probs = math_ops.unimix_probs(out, self.unimix)
            return tfd.OneHotCategorical(probs=probs, dtype=tf.float32)
        mean, std = tf.split(out, 2, -1)
        std = (self.max_std - self.min_std) * tf.sigmoid(std + 2.0) + self.min_std
        return tfd.Independent(tfd.Normal(tf.tanh(mean), std), reinterpreted_batch_ndims=1)

    def sample(self, dist, seed):
        """A differentiable sample: straight-through one-hot, or reparameterised and clipped
        (the clip passes the gradient through)."""
        if self.discrete:
            probs = dist.probs_parameter()
            idx = random_ops.categorical(probs, seed)
            return math_ops.straight_through(tf.one_hot(idx, self.action_dim), probs)
        mean, std = dist.mean(), dist.stddev()
        action = mean + std * random_ops.normal(random_ops.shape_of(mean), seed)
        return action + tf.stop_gradient(tf.clip_by_value(action, -1.0, 1.0) - action)


class Critic(tf.Module):
    """Two-hot value head with a zero-initialised output layer; values in real space."""

    def __init__(self, feat_dim, size, num_bins=255, name=None):
        super().__init__(name=name)
        self.mlp = two_hot_head(feat_dim, size, num_bins)
        self.bins = math_ops.two_hot_bins(num_bins)

    def __call__(self, feat):
        """Logits `[..., num_bins]` of the value's bins (in symlog space)."""
        return self.mlp(feat)

    def value(self, feat):
        """The value in real space, `[...]`."""
        return math_ops.two_hot_mean(self.mlp(feat), self.bins)
