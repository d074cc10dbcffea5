"""`DreamerV3RLModule`: world model, actor, critic and EMA critic as one TF2 RLModule."""

import numpy as np
import tensorflow as tf
from ray.rllib.core.columns import Columns

from rllib_dreamerv3 import interrupts
from rllib_dreamerv3.model import DreamerV3Model
from rllib_dreamerv3.model_sizes import get_model_size
from rllib_dreamerv3.networks import set_matmul_dtype
from rllib_dreamerv3.spaces import ObsFormat, action_dim, check_spaces, env_action, is_discrete
from rllib_dreamerv3.tf_rllib import TfRLModule
from rllib_dreamerv3.tf_rllib.custom_gradients import release_custom_gradients

IS_FIRST = "is_first"


def _unstack(obs):
    """The N single observations of a stacked batch `obs` (an array, or a dict of arrays)."""
    if isinstance(obs, dict):
        n = len(next(iter(tf.nest.flatten(obs))))
        return [tf.nest.map_structure(lambda x, i=i: x[i], obs) for i in range(n)]
    return list(np.asarray(obs))


def _missing_inputs_error(batch):
    """The `KeyError` for a policy batch without all of `obs`, `is_first` and `state_in`."""
    missing = [k for k in (Columns.OBS, IS_FIRST, Columns.STATE_IN) if k not in batch]
    return KeyError(
        f"DreamerV3RLModule's forward_inference/forward_exploration need the batch keys "
        f"'obs', 'is_first' and 'state_in' (missing: {', '.join(map(repr, missing))}): "
        "it is recurrent. For N envs: 'is_first' a bool array [N] (True where an env "
        "starts anew), 'state_in' the previous call's 'state_out' (at the start: "
        "get_initial_state() with each value stacked N times). Or call "
        "module.act(obs, state), which keeps both for you."
    )


class DreamerV3RLModule(TfRLModule):
    """DreamerV3's networks (:class:`~rllib_dreamerv3.model.DreamerV3Model`) for RLlib.

    Inference is stateful. `forward_inference` (greedy) and `forward_exploration` (sampled)
    take a batch of N envs: `obs [N, ...]` (in the model format of :attr:`obs_format`: a dict
    for Dict observations), `is_first [N]` and `state_in` (`h`, `z`, `action`:
    the recurrent state and previous action of each env; see :meth:`get_initial_state`); envs
    with `is_first` start from the initial state. They return `actions` (env actions: ints for
    Discrete, bounded floats for Box), `actions_model` (one-hot / [-1, 1]) and `state_out`.

    Training runs through :class:`~rllib_dreamerv3.learner.DreamerV3Learner`'s compiled update,
    not through `forward_train`.
    """

    # Inference needs the encoder, the RSSM and the actor; not the heads or the critics.
    inference_only_excluded = (
        "model/critic",
        "model/critic_ema",
        "model/world_model/decoder",
        "model/world_model/reward_head",
        "model/world_model/continue_head",
    )

    def setup(self):
        check_spaces(self.observation_space, self.action_space)
        cfg = self.model_config
        # How observations are checked, converted and stored: see `spaces.ObsFormat`.
        self.obs_format = ObsFormat(
            self.observation_space, cfg.get("encoder_keys", ".*"), cfg.get("decoder_keys", ".*")
        )
        dict_obs = self.obs_format.is_dict
        self.model = DreamerV3Model(
            obs_shape=self.obs_format.shape(),
            action_dim=action_dim(self.action_space),
            discrete=is_discrete(self.action_space),
            size=get_model_size(
                cfg.get("model_size", "XS"),
                cfg.get("vector_mlp_units"),
                cfg.get("vector_mlp_layers"),
            ),
            unimix=cfg.get("unimix", 0.01),
            num_bins=cfg.get("num_bins", 255),
            actor_min_std=cfg.get("actor_min_std", 0.1),
            actor_max_std=cfg.get("actor_max_std", 1.0),
            cnn_kernel=cfg.get("cnn_kernel", 4),
            encoder_keys=self.obs_format.encoder_keys if dict_obs else None,
            decoder_keys=self.obs_format.decoder_keys if dict_obs else None,
        )
        if cfg.get("precision", "float32") != "float32":
            set_matmul_dtype(self.model, cfg["precision"])
        self._policy_fns = {}
        self._concrete_fns = {}
        self.set_policy_seed(None)  # sets the seed key and call count

    def set_policy_seed(self, seed):
        """Make the sampled latents and actions of `forward_exploration` reproducible.

        Each call of the policy gets the stateless seed `(key, count)`: `key` derives from
        `seed` (from OS entropy when `seed` is None), `count` numbers the calls. Kept in numpy,
        so drawing a seed costs no TF op per env step.
        """
        state = np.random.SeedSequence(seed).generate_state(1, np.uint32)
        self._seed_key = int(state.view(np.int32)[0])
        self._seed_count = 0

    def get_policy_seed_state(self):
        """`(key, count)`: where the policy's seed sequence stands."""
        return self._seed_key, self._seed_count

    def set_policy_seed_state(self, state):
        """Continue the seed sequence of :meth:`get_policy_seed_state` (e.g. another module's)."""
        self._seed_key, self._seed_count = (int(x) for x in state)

    def _next_seed(self):
        self._seed_count = (self._seed_count + 1) % (2**31 - 1)
        return np.array([self._seed_key, self._seed_count], np.int32)

    def get_initial_state(self):
        """Per-env recurrent state `{h, z, action}` (numpy, no batch dimension)."""
        h, z, action = self.model.initial_carry(1)
        return {"h": h.numpy()[0], "z": z.numpy()[0], "action": action.numpy()[0]}

    def policy_fn(self, explore):
        """The compiled policy,
        `(obs, is_first, h, z, action, seed) -> (env_action, model_action, h, z)`."""
        if explore not in self._policy_fns:
            model, space = self.model, self.action_space

            def policy(obs, is_first, h, z, action, seed):
                action, (h, z, _) = model.policy_step((h, z, action), obs, is_first, seed, explore)
                return env_action(action, space), action, h, z

            jit = bool(self.model_config.get("jit_compile", True))
            self._policy_fns[explore] = tf.function(policy, autograph=False, jit_compile=jit)
        return self._policy_fns[explore]

    def act(self, obs, state=None, explore=False):
        """Actions for N envs, one step: `obs` (N env observations, stacked; a dict of stacked
        arrays for Dict observations) and the `state` this method returned for the previous
        step (None at the first step, where every env starts anew). Returns `(actions, state)`:
        env actions `[N, ...]` (numpy) and the state for the next call. Greedy unless `explore`.

        >>> obs, _ = env.reset(seed=0)  # doctest: +SKIP
        >>> action, state = module.act(obs[None])  # doctest: +SKIP
        >>> obs, reward, terminated, truncated, _ = env.step(action[0])  # doctest: +SKIP
        >>> action, state = module.act(obs[None], state)  # doctest: +SKIP
        """
        obs = self.obs_format.stack([self.obs_format.convert(o) for o in _unstack(obs)])
        n = len(tf.nest.flatten(obs)[0])
        if state is None:
            initial = self.get_initial_state()
            state = {key: np.repeat(value[None], n, axis=0) for key, value in initial.items()}
            is_first = np.ones(n, bool)
        else:
            is_first = np.zeros(n, bool)
        batch = {Columns.OBS: obs, IS_FIRST: is_first, Columns.STATE_IN: state}
        out = self._act(batch, explore)
        state = {key: value.numpy() for key, value in out[Columns.STATE_OUT].items()}
        return out[Columns.ACTIONS].numpy(), state

    def _act(self, batch, explore):
        try:
            obs, is_first, state = batch[Columns.OBS], batch[IS_FIRST], batch[Columns.STATE_IN]
        except KeyError:
            raise _missing_inputs_error(batch) from None
        args = (
            tf.nest.map_structure(tf.convert_to_tensor, obs),
            tf.convert_to_tensor(is_first, tf.bool),
            tf.convert_to_tensor(state["h"]),
            tf.convert_to_tensor(state["z"]),
            tf.convert_to_tensor(state["action"]),
            tf.convert_to_tensor(self._next_seed()),
        )
        # A concrete function per (mode, shapes and dtypes): calling it skips tf.function's
        # per-call argument matching, which costs about as much as a small policy step.
        key = (explore,) + tuple((tuple(a.shape), a.dtype) for a in tf.nest.flatten(args))
        fn = self._concrete_fns.get(key)
        call = interrupts.call_directly
        if fn is None:
            fn = self.policy_fn(explore).get_concrete_function(*args)
            release_custom_gradients(fn.graph)  # freed with this module: see that module
            self._concrete_fns[key] = fn
            call = interrupts.call  # the first call compiles: see rllib_dreamerv3.interrupts
        env_action, action, h, z = call(fn, *args)
        return {
            Columns.ACTIONS: env_action,
            "actions_model": action,
            Columns.STATE_OUT: {"h": h, "z": z, "action": action},
        }

    def _forward_inference(self, batch, **kwargs):
        return self._act(batch, explore=False)

    def _forward_exploration(self, batch, **kwargs):
        return self._act(batch, explore=True)

    def _forward_train(self, batch, **kwargs):
        raise NotImplementedError(
            "DreamerV3 trains through DreamerV3Learner's compiled update, not forward_train."
        )
