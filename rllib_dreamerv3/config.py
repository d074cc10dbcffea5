"""`DreamerV3Config`: every hyperparameter of SPEC §4–6, with the paper's defaults, validated."""

import difflib
import inspect
import numbers
import os

from ray.rllib.algorithms.algorithm_config import AlgorithmConfig
from ray.rllib.core.rl_module.rl_module import RLModuleSpec

from rllib_dreamerv3.model_sizes import MODEL_SIZES
from rllib_dreamerv3.replay_buffer import bytes_per_step
from rllib_dreamerv3.spaces import action_dim, check_spaces, obs_storage_dtype

# name -> (default, description). The single source of DreamerV3's hyperparameters.
HYPERPARAMETERS = {
    "model_size": ("XS", f"network sizes, one of {list(MODEL_SIZES)} (SPEC §6)"),
    "training_ratio": (1024, "replayed steps per sampled env step (SPEC §5)"),
    "batch_size_B": (16, "sequences per training batch"),
    "batch_length_T": (64, "steps per training sequence"),
    "horizon_H": (15, "imagination horizon"),
    "gae_lambda": (0.95, "λ of the λ-returns"),
    "entropy_scale": (3e-4, "actor entropy regulariser η"),
    "return_normalization_decay": (0.99, "EMA decay of the return range S"),
    "world_model_lr": (1e-4, "world model Adam learning rate"),
    "actor_lr": (3e-5, "actor Adam learning rate"),
    "critic_lr": (3e-5, "critic Adam learning rate"),
    "world_model_adam_eps": (1e-8, "world model Adam epsilon"),
    "actor_adam_eps": (1e-5, "actor Adam epsilon"),
    "critic_adam_eps": (1e-5, "critic Adam epsilon"),
    "world_model_grad_clip": (1000.0, "world model global-norm gradient clip"),
    "actor_grad_clip": (100.0, "actor global-norm gradient clip"),
    "critic_grad_clip": (100.0, "critic global-norm gradient clip"),
    "free_bits": (1.0, "free nats of L_dyn and L_rep"),
    "pred_loss_scale": (1.0, "weight of L_pred"),
    "dyn_loss_scale": (0.5, "weight of L_dyn"),
    "rep_loss_scale": (0.1, "weight of L_rep"),
    "critic_ema_rate": (0.02, "EMA rate of the slow critic per update"),
    "critic_ema_regularizer": (1.0, "weight of the critic's pull towards the slow critic"),
    "unimix": (0.01, "uniform mixture of latent and discrete-action categoricals"),
    "num_bins": (255, "two-hot bins of the reward and critic heads"),
    "cnn_kernel": (4, "kernel size of the image encoder's and decoder's convolutions"),
    "actor_min_std": (0.1, "minimum std of the continuous actor"),
    "actor_max_std": (1.0, "maximum std of the continuous actor"),
    "replay_capacity": (1_000_000, "replay capacity in env steps (FIFO)"),
    "num_steps_sampled_before_learning_starts": (
        1024, "warm-up env steps (random actions) before the first update"),
    "store_replay_buffer_in_checkpoint": (True, "save the replay buffer with checkpoints"),
    "dream_every_n_updates": (
        1000, "report dream summaries (reconstructions, open-loop dreams) every N updates; 0: off"),
    "dream_burn_in": (5, "real steps the open-loop dream observes before imagining"),
    "dream_num_sequences": (4, "replayed sequences shown in the dream summaries (at most B)"),
    "precision": ("float32", "matmul/conv precision: 'float32', or 'bfloat16' (mixed precision "
                  "for GPUs: float32 variables, norms and losses; slower on most CPUs)"),
    "jit_compile": (True, "compile the update and the policy with XLA"),
    "tf_num_threads": (None, "cap TF's thread pools per process (None: TF's default in the "
                       "driver and Learner; num_cpus_per_env_runner in remote EnvRunners)"),
    "nonfinite_env_data": (
        "raise", "what EnvRunners do with a NaN/inf observation or reward: 'raise' an error "
        "naming the env, step and key, or 'skip' the step (its episode ends there, the env is "
        "reset; counted in num_nonfinite_env_steps_skipped)"),
    "max_skipped_updates_in_a_row": (
        10, "updates in a row whose steps were skipped for non-finite losses or gradients "
        "before training stops with an error (0: never)"),
    "overlap_policy_and_envs": (
        "auto", "EnvRunners step half their envs while the policy acts for the other half "
        "(True/False; 'auto': on for image observations with >= 2 envs per runner)"),
}

_POSITIVE_INTS = ("training_ratio", "batch_size_B", "horizon_H", "replay_capacity",
                  "num_bins", "cnn_kernel")
_POSITIVE_FLOATS = ("world_model_lr", "actor_lr", "critic_lr", "world_model_adam_eps",
                    "actor_adam_eps", "critic_adam_eps", "world_model_grad_clip",
                    "actor_grad_clip", "critic_grad_clip", "actor_max_std")
PRECISIONS = ("float32", "bfloat16")
_NON_NEGATIVE_INTS = ("dream_every_n_updates", "max_skipped_updates_in_a_row")
NONFINITE_ENV_DATA = ("raise", "skip")
_NON_NEGATIVE = ("entropy_scale", "free_bits", "pred_loss_scale", "dyn_loss_scale",
                 "rep_loss_scale", "critic_ema_regularizer", "actor_min_std",
                 "num_steps_sampled_before_learning_starts")
_UNIT_INTERVAL = {  # name -> (low, high, low inclusive, high inclusive)
    "gamma": (0.0, 1.0, False, True),
    "gae_lambda": (0.0, 1.0, True, True),
    "return_normalization_decay": (0.0, 1.0, True, False),
    "critic_ema_rate": (0.0, 1.0, False, True),
    "unimix": (0.0, 1.0, True, False),
}


def _unknown_training_key(kwargs, rllib_training):
    """None, or the TypeError for the first keyword in `kwargs` that `training()` would reject.

    Known keywords are DreamerV3's (`HYPERPARAMETERS`) and the parameters of `rllib_training`
    (the bound `AlgorithmConfig.training`); the error names the closest of them.
    """
    params = inspect.signature(rllib_training).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return None  # this RLlib takes any keyword
    known = [*HYPERPARAMETERS, *params]
    for name in kwargs:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            return TypeError(
                f"DreamerV3Config.training() got an unexpected keyword argument {name!r}.{hint} "
                "Valid keys are DreamerV3's hyperparameters (HYPERPARAMETERS in "
                "rllib_dreamerv3/config.py) and the arguments of AlgorithmConfig.training "
                "(e.g. gamma, grad_clip).")
    return None


class DreamerV3Config(AlgorithmConfig):
    """Configuration of :class:`~rllib_dreamerv3.DreamerV3`.

    Example:
        >>> from rllib_dreamerv3 import DreamerV3Config
        >>> config = DreamerV3Config().environment("CartPole-v1").training(model_size="nano")
        >>> algo = config.build_algo()  # doctest: +SKIP

    Every DreamerV3 hyperparameter is set through :meth:`training`; the defaults are the paper's
    (see `HYPERPARAMETERS` in this module). `gamma` defaults to `1 - 1/333`. Runs on TF2 only
    (`framework="tf2"`), with at most one Learner.
    """

    def __init__(self, algo_class=None):
        if algo_class is None:
            from rllib_dreamerv3.algorithm import DreamerV3

            algo_class = DreamerV3
        super().__init__(algo_class=algo_class)
        for name, (default, _) in HYPERPARAMETERS.items():
            setattr(self, name, default)
        from rllib_dreamerv3.env_runner import DreamerV3EnvRunner

        self.framework_str = "tf2"
        self.env_runner_cls = DreamerV3EnvRunner
        self.gamma = 1.0 - 1.0 / 333.0
        self.lr = None  # three learning rates instead, see `training()`
        self.rollout_fragment_length = "auto"
        self.min_sample_timesteps_per_iteration = 100
        # Our EnvRunner has no connectors whose states would need merging.
        self.merge_env_runner_states = False
        self.broadcast_env_runner_states = False
        self.evaluation_config = {"explore": False}  # greedy evaluation unless asked otherwise

    def training(self, **kwargs):
        """Set training hyperparameters: DreamerV3's (`HYPERPARAMETERS`) and RLlib's own.

        DreamerV3 keys are those of `HYPERPARAMETERS` in this module (name -> default and
        meaning), e.g. `model_size`, `training_ratio`, `batch_size_B`, `batch_length_T`,
        `world_model_lr`, `actor_lr`, `critic_lr`, `replay_capacity`,
        `dream_every_n_updates`. Any other key goes to `AlgorithmConfig.training` (e.g. `gamma`).
        An unknown key raises a TypeError naming the closest valid one, before anything is set.
        """
        error = _unknown_training_key(kwargs, super().training)
        if error is not None:
            raise error
        for name in list(kwargs):
            if name in HYPERPARAMETERS:
                setattr(self, name, kwargs.pop(name))
        super().training(**kwargs)
        return self

    def get_default_learner_class(self):
        from rllib_dreamerv3.learner import DreamerV3Learner

        return DreamerV3Learner

    def get_default_rl_module_spec(self):
        from rllib_dreamerv3.rl_module import DreamerV3RLModule

        return RLModuleSpec(module_class=DreamerV3RLModule)

    @property
    def _model_config_auto_includes(self):
        keys = ("model_size", "unimix", "num_bins", "actor_min_std", "actor_max_std",
                "cnn_kernel", "precision", "jit_compile")
        return super()._model_config_auto_includes | {k: getattr(self, k) for k in keys}

    @property
    def hyperparameters(self):
        """`{name: value}` of every DreamerV3 hyperparameter (plus `gamma`)."""
        return {name: getattr(self, name) for name in HYPERPARAMETERS} | {"gamma": self.gamma}

    def validate(self):
        """RLlib's checks, then DreamerV3's: every bad value is named with what is allowed."""
        if self.framework_str != "tf2":  # before RLlib's checks, which import the framework
            self._value_error(
                f"framework={self.framework_str!r}: rllib_dreamerv3 is TensorFlow 2 only; use "
                "config.framework('tf2') (the default) or RLlib's built-in torch DreamerV3.")
        super().validate()
        self._validate_dreamer_values()
        self._validate_env_spaces()

    def _validate_dreamer_values(self):
        if self.model_size not in MODEL_SIZES:
            self._value_error(f"Unknown model_size={self.model_size!r}; use one of "
                              f"{list(MODEL_SIZES)}.")
        for name in _POSITIVE_INTS:
            value = getattr(self, name)
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value <= 0:
                self._value_error(f"{name}={value!r} must be a positive integer.")
        for name in _NON_NEGATIVE_INTS:
            value = getattr(self, name)
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 0:
                self._value_error(f"{name}={value!r} must be an integer >= 0.")
        overlap = self.overlap_policy_and_envs
        if not (isinstance(overlap, bool) or (isinstance(overlap, str) and overlap == "auto")):
            self._value_error(f"overlap_policy_and_envs={overlap!r} must be 'auto', True or "
                              "False.")
        if overlap is True and self.num_envs_per_env_runner < 2:
            self._value_error("overlap_policy_and_envs=True needs num_envs_per_env_runner >= 2 "
                              f"(got {self.num_envs_per_env_runner}): it splits each runner's "
                              "envs into two groups.")
        if self.nonfinite_env_data not in NONFINITE_ENV_DATA:
            self._value_error(f"nonfinite_env_data={self.nonfinite_env_data!r} must be one of "
                              f"{NONFINITE_ENV_DATA}.")
        if self.precision not in PRECISIONS:
            self._value_error(f"precision={self.precision!r} must be one of {PRECISIONS}.")
        if (not isinstance(self.batch_length_T, numbers.Integral)
                or isinstance(self.batch_length_T, bool) or self.batch_length_T < 2):
            self._value_error(f"batch_length_T={self.batch_length_T!r} must be an integer >= 2 "
                              "(the world model learns from transitions within sequences).")
        if self.dream_every_n_updates:
            self._validate_dream_values()
        for name in _POSITIVE_FLOATS:
            value = getattr(self, name)
            if not isinstance(value, numbers.Real) or not value > 0:
                self._value_error(f"{name}={value!r} must be a positive number.")
        for name in _NON_NEGATIVE:
            value = getattr(self, name)
            if not isinstance(value, numbers.Real) or not value >= 0:
                self._value_error(f"{name}={value!r} must be a number >= 0.")
        for name, (low, high, low_in, high_in) in _UNIT_INTERVAL.items():
            value = getattr(self, name)
            ok = isinstance(value, numbers.Real) and (
                (low <= value if low_in else low < value)
                and (value <= high if high_in else value < high))
            if not ok:
                interval = f"{'[' if low_in else '('}{low}, {high}{']' if high_in else ')'}"
                self._value_error(f"{name}={value!r} must lie in {interval}.")
        if self.actor_min_std >= self.actor_max_std:
            self._value_error(f"actor_min_std={self.actor_min_std} must be smaller than "
                              f"actor_max_std={self.actor_max_std}.")
        if self.replay_capacity < self.batch_length_T:
            self._value_error(f"replay_capacity={self.replay_capacity} must hold at least one "
                              f"sequence of batch_length_T={self.batch_length_T} steps.")
        fragment = self.rollout_fragment_length
        if fragment != "auto" and (not isinstance(fragment, numbers.Integral) or fragment <= 0):
            self._value_error(f"rollout_fragment_length={fragment!r} must be 'auto' or a "
                              "positive integer (env steps per env per sample call).")
        if self.num_learners > 1:
            self._value_error(
                f"num_learners={self.num_learners}: TF learners do not synchronise gradients "
                "across processes; use num_learners=0 (local) or 1 (one remote Learner).")
        if self.is_multi_agent:
            self._value_error("DreamerV3 is single-agent; multi-agent configs are not supported.")

    def _validate_dream_values(self):
        sequences, burn_in = self.dream_num_sequences, self.dream_burn_in
        if not (isinstance(sequences, numbers.Integral) and sequences >= 1):
            self._value_error(f"dream_num_sequences={sequences!r} must be a positive integer.")
        if not (isinstance(burn_in, numbers.Integral) and 1 <= burn_in < self.batch_length_T):
            self._value_error(f"dream_burn_in={burn_in!r} must be an integer in "
                              f"[1, batch_length_T={self.batch_length_T}): the dream observes "
                              "that many steps, then imagines the rest (or set "
                              "dream_every_n_updates=0 to turn dreams off).")

    def _validate_env_spaces(self):
        if self.env is None:
            return
        spaces = (self.observation_space, self.action_space)
        if None in spaces:
            from rllib_dreamerv3.env_runner import make_env

            env = make_env(self)
            spaces = (env.observation_space, env.action_space)
            env.close()
        check_spaces(*spaces)
        self._validate_replay_memory(*spaces)

    def _validate_replay_memory(self, observation_space, action_space):
        """A full replay buffer must fit into this machine's memory (images: ~12 kB a step)."""
        per_step = bytes_per_step(observation_space.shape, obs_storage_dtype(observation_space),
                                  action_dim(action_space))
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if self.replay_capacity * per_step > memory:
            self._value_error(
                f"replay_capacity={self.replay_capacity} steps of {per_step} bytes need "
                f"{self.replay_capacity * per_step / 2**30:.1f} GiB, more than this machine's "
                f"{memory / 2**30:.1f} GiB of memory; lower replay_capacity, e.g. to "
                f"{int(0.5 * memory / per_step)} steps (half the memory).")

    @property
    def steps_per_sample(self):
        """Env steps per env in one `training_step` sample ('auto': one update's worth)."""
        if self.rollout_fragment_length != "auto":
            return int(self.rollout_fragment_length)
        replay_per_update = self.batch_size_B * self.batch_length_T
        envs = max(1, self.num_env_runners) * self.num_envs_per_env_runner
        return max(1, round(replay_per_update / self.training_ratio / envs))
