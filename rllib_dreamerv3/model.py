"""All DreamerV3 networks in one `tf.Module`: world model, actor, critic, its EMA copy, and the
return-normalisation statistic. Independent of RLlib; the RLModule wraps it."""

import tensorflow as tf

from rllib_dreamerv3 import random_ops
from rllib_dreamerv3.actor_critic import Actor, Critic
from rllib_dreamerv3.world_model import WorldModel


class DreamerV3Model(tf.Module):
    """The networks and statistics that make up one DreamerV3 agent.

    Args:
        obs_shape: shape of one observation, `(obs_dim,)` or `(64, 64, C)` images (an int is
            read as `(obs_dim,)`), or `{key: shape}` for Dict observations.
        action_dim: number of discrete actions, or continuous action dimensions.
        discrete: whether actions are discrete (one-hot) or continuous in `[-1, 1]`.
        size: a :class:`~rllib_dreamerv3.model_sizes.ModelSize`.
        unimix: uniform mixture of latent and discrete-action categoricals.
        num_bins: bins of the two-hot reward and value heads.
        actor_min_std, actor_max_std: bounds of the continuous actor's std.
        cnn_kernel: kernel size of the image encoder and decoder.
        encoder_keys, decoder_keys: Dict observations: the keys the encoder reads and the
            decoder reconstructs (None: all).
    """

    def __init__(
        self,
        obs_shape,
        action_dim,
        discrete,
        size,
        unimix=0.01,
        num_bins=255,
        actor_min_std=0.1,
        actor_max_std=1.0,
        cnn_kernel=4,
        encoder_keys=None,
        decoder_keys=None,
        name="dreamer",
    ):
        super().__init__(name=name)
        if isinstance(obs_shape, dict):
            obs_shape = {key: tuple(shape) for key, shape in obs_shape.items()}
        else:
            obs_shape = (obs_shape,) if isinstance(obs_shape, int) else tuple(obs_shape)
        self.obs_shape = obs_shape
        self.world_model = WorldModel(
            obs_shape,
            action_dim,
            size,
            unimix,
            num_bins,
            cnn_kernel,
            encoder_keys,
            decoder_keys,
        )
        feat_dim = self.world_model.feat_dim
        self.actor = Actor(
            feat_dim, action_dim, discrete, size, unimix, actor_min_std, actor_max_std
        )
        self.critic = Critic(feat_dim, size, num_bins)
        self.critic_ema = Critic(feat_dim, size, num_bins)
        for slow, fast in zip(self.critic_ema.variables, self.critic.variables):
            slow.assign(fast)
        # EMA of the 5th-95th percentile range of imagined returns (S, Hafner et al. 2023, Eq. 12).
        self.return_scale = tf.Variable(0.0, trainable=False, name="return_scale")
        self.action_dim = action_dim
        self.discrete = discrete

    def initial_carry(self, batch_size):
        """Policy carry `(h, z, previous action)` for `batch_size` envs."""
        h, z = self.world_model.initial_state(batch_size)
        return h, z, tf.zeros([batch_size, self.action_dim])

    def policy_step(self, carry, obs, is_first, seed, explore):
        """One env step of the stateful policy, batched over envs.

        Args:
            carry: `(h [N, D], z [N, K*C], previous action [N, A])`.
            obs: `[N, *obs_shape]` (a dict of such for Dict observations).
            is_first: `[N]` bool, resets the carry of those envs.
            seed: `[2]` int32 stateless seed. explore: sample (True) or act greedily (False).

        Returns:
            `(action [N, A], new carry)`; discrete actions are one-hot.
        """
        h, z, prev_action = carry
        wm = self.world_model
        h, z, _ = wm.observe_step(
            h, z, prev_action, wm.encoder(obs), is_first, seed, sample=explore
        )
        dist = self.actor.dist(tf.concat([h, z], -1))
        seed = random_ops.fold_in(seed, 1)
        action = self.actor.sample(dist, seed) if explore else dist.mode()
        if self.discrete:  # exact one-hot: the straight-through sum is off by float rounding
            action = tf.one_hot(tf.argmax(action, -1), self.action_dim)
        action = tf.stop_gradient(action)
        return action, (h, z, action)

    def update_critic_ema(self, rate):
        """`slow <- (1 - rate) * slow + rate * fast` for every critic variable."""
        for slow, fast in zip(self.critic_ema.variables, self.critic.variables):
            slow.assign((1.0 - rate) * slow + rate * fast)
