"""Actor and critic, both on the model state `s = [h, z]` (Hafner et al. 2023, actor-critic
learning)."""

import tensorflow as tf

from rllib_dreamerv3 import math_ops, random_ops
from rllib_dreamerv3.networks import MLP, two_hot_head


class Actor(tf.Module):
    """Policy head. Discrete: one-hot categorical with unimix. Continuous: Normal with tanh mean.

    Discrete actions are one-hot `[N, num_actions]`; continuous actions are in `[-1, 1]`,
    `[N, action_dim]`. The continuous std is `(max_std - min_std) * sigmoid(x + 2) + min_std`.
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
        """Distribution parameters: `probs` (discrete) or `(mean, std)` (continuous)."""
        return self.dist_from_output(self.mlp(feat))

    def dist_from_output(self, out):
        """:meth:`dist` from the MLP's output `self.mlp(feat)`, computed by the caller."""
        if self.discrete:
            return math_ops.unimix_probs(out, self.unimix)
        mean, std = tf.split(out, 2, -1)
        std = (self.max_std - self.min_std) * tf.sigmoid(std + 2.0) + self.min_std
        return tf.tanh(mean), std

    def sample(self, dist, seed):
        """A differentiable sample: straight-through one-hot, or reparameterised and clipped."""
        if self.discrete:
            idx = random_ops.categorical(dist, seed)
            return math_ops.straight_through(tf.one_hot(idx, self.action_dim), dist)
        mean, std = dist
        action = mean + std * random_ops.normal(random_ops.shape_of(mean), seed)
        return action + tf.stop_gradient(tf.clip_by_value(action, -1.0, 1.0) - action)

    def mode(self, dist):
        if self.discrete:
            return tf.one_hot(tf.argmax(dist, -1), self.action_dim)
        return dist[0]

    def log_prob(self, dist, action):
        if self.discrete:
            return tf.reduce_sum(action * tf.math.log(dist), -1)
        return math_ops.normal_log_prob(action, *dist)

    def entropy(self, dist):
        if self.discrete:
            return math_ops.categorical_entropy(dist)
        return math_ops.normal_entropy(dist[1])


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
