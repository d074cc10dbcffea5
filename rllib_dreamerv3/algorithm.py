"""`DreamerV3Config` (every hyperparameter, the paper's defaults, validated) and `DreamerV3`.

`DreamerV3` is the RLlib Algorithm: it samples, stores the steps, replays them at the training
ratio and syncs weights. Config and algorithm share this module, as in RLlib's own algorithms,
so each names the other (`DreamerV3Config().algo_class`, `DreamerV3.get_default_config()`)
without an import cycle; `rllib_dreamerv3.config` re-exports the config's names.
"""

import collections
import difflib
import functools
import importlib.util
import inspect
import logging
import numbers
import os
import shutil
import tempfile
import textwrap
import time

import numpy as np
from ray.exceptions import ActorDiedError
from ray.rllib.algorithms.algorithm import Algorithm
from ray.rllib.algorithms.algorithm_config import AlgorithmConfig
from ray.rllib.core import COMPONENT_LEARNER, COMPONENT_RL_MODULE, DEFAULT_MODULE_ID
from ray.rllib.core.rl_module.rl_module import RLModuleSpec
from ray.rllib.env import INPUT_ENV_SINGLE_SPACES
from ray.rllib.env.env_runner_group import EnvRunnerGroup
from ray.rllib.policy.sample_batch import MultiAgentBatch, SampleBatch
from ray.rllib.utils.from_config import NotProvided
from ray.rllib.utils.metrics import (
    ENV_RUNNER_RESULTS,
    EPISODE_LEN_MAX,
    EPISODE_LEN_MEAN,
    EPISODE_LEN_MIN,
    EPISODE_RETURN_MAX,
    EPISODE_RETURN_MEAN,
    EPISODE_RETURN_MIN,
    LEARNER_RESULTS,
    NUM_ENV_STEPS_SAMPLED_LIFETIME,
    NUM_ENV_STEPS_TRAINED_LIFETIME,
    REPLAY_BUFFER_RESULTS,
)
from ray.tune.result import SHOULD_CHECKPOINT
from tqdm import tqdm

from rllib_dreamerv3 import checkpoints
from rllib_dreamerv3.env_runner import DreamerV3EnvRunner, make_env
from rllib_dreamerv3.learner import DreamerV3Learner
from rllib_dreamerv3.model_sizes import MODEL_SIZES
from rllib_dreamerv3.progress import PROGRESS_LOSSES, log_progress, summary
from rllib_dreamerv3.progress import logger as progress_logger
from rllib_dreamerv3.replay_buffer import ReplayBuffer, bytes_per_step
from rllib_dreamerv3.rl_module import DreamerV3RLModule
from rllib_dreamerv3.spaces import ObsFormat, action_dim, check_spaces, is_image
from rllib_dreamerv3.tf_rllib.tune_storage import save_in_place
from rllib_dreamerv3.validation import numeric_errors

NUM_UPDATES_LIFETIME = "num_updates_lifetime"
# In every result: None, or the counters at the end of the process's first iteration with
# updates; progress lines estimate their ETA from the iterations after it.
ETA_REFERENCE = "eta_reference"
TRAINING_RATIO_ACHIEVED = "training_ratio_achieved"
NEXT_CHECKPOINT_S = "next_checkpoint_s"
REPLAY_STORAGES = ("memory", "disk")
REPLAY_DIR = checkpoints.REPLAY_DIR  # the replay buffer's files inside a checkpoint
DREAMS = "dreams"
logger = logging.getLogger(__name__)

# name -> (default, description). The single source of DreamerV3's hyperparameters: the
# defaults are the paper's (Hafner et al. 2023, arXiv 2301.04104) where it sets them.
# `DreamerV3Config.training` takes each as a keyword; its signature and docs are built from here.
HYPERPARAMETERS = {
    "model_size": ("XS", f"network sizes, one of {list(MODEL_SIZES)}"),
    "training_ratio": (1024, "replayed steps per sampled env step"),
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
    "vector_mlp_units": (
        None,
        "width of the vector-observation encoder and decoder MLPs (None: the model size's)",
    ),
    "vector_mlp_layers": (
        None,
        "hidden layers of the vector-observation encoder and decoder (None: the model size's)",
    ),
    "encoder_keys": (
        ".*",
        "Dict observations: the entries the encoder reads, a regular expression matching whole "
        "keys or a list of keys (vectors go through the MLP, images through the CNN)",
    ),
    "decoder_keys": (
        ".*",
        "Dict observations: the entries the decoder reconstructs (as encoder_keys)",
    ),
    "actor_min_std": (0.1, "minimum std of the continuous actor"),
    "actor_max_std": (1.0, "maximum std of the continuous actor"),
    "replay_capacity": (1_000_000, "replay capacity in env steps (FIFO)"),
    "replay_storage": (
        "memory",
        "where the replay buffer keeps its steps: 'memory' (RAM), or 'disk' (memory-mapped "
        "files in replay_directory; only bookkeeping stays in RAM, for buffers larger than RAM)",
    ),
    "replay_directory": (
        None,
        "replay_storage='disk': the directory for the buffer's files (None: the trial's "
        "directory under Ray Tune, else the system's temporary directory); deleted on stop()",
    ),
    "num_steps_sampled_before_learning_starts": (
        1024,
        "warm-up env steps (random actions) before the first update",
    ),
    "store_replay_buffer_in_checkpoint": (True, "save the replay buffer with checkpoints"),
    "checkpoint_interval_s": (
        900.0,
        "under Ray Tune (and `rllib train`), ask Tune for a checkpoint once this many seconds "
        "passed since the last one, so a killed run loses at most this much (0: only Tune's "
        "own checkpoint_config)",
    ),
    "sync_weights_every_n_updates": (
        1,
        "send the Learner's weights to the EnvRunners every N updates (1: act with the "
        "latest weights, as the paper). A local EnvRunner beside a local Learner acts with "
        "the Learner's own variables and never needs a sync",
    ),
    "dream_every_n_updates": (
        1000,
        "report dream summaries (reconstructions, open-loop dreams) every N updates; 0: off",
    ),
    "dream_burn_in": (5, "real steps the open-loop dream observes before imagining"),
    "dream_num_sequences": (4, "replayed sequences shown in the dream summaries (at most B)"),
    "precision": (
        "float32",
        "matmul/conv precision: 'float32', or 'bfloat16' (mixed precision "
        "for GPUs: float32 variables, norms and losses; slower on most CPUs)",
    ),
    "jit_compile": (True, "compile the update and the policy with XLA"),
    "fast_kernels": (
        True,
        "compute the update with the fused kernels of rllib_dreamerv3.kernels "
        "(same results as the plain TensorFlow path, faster on CPU); False: the "
        "plain path",
    ),
    "learner_peer_timeout_s": (
        30.0,
        "with num_learners >= 2: a Learner whose peer's TF server does not answer a health "
        "check (every third of this) within this many seconds aborts its all-reduces, and "
        "training stops with an error instead of waiting for a dead Learner",
    ),
    "tf_num_threads": (
        None,
        "cap TF's thread pools per process (None: TF's default in the "
        "driver and Learner; num_cpus_per_env_runner in remote EnvRunners)",
    ),
    "nonfinite_env_data": (
        "raise",
        "what EnvRunners do with a NaN/inf observation or reward: 'raise' an error "
        "naming the env, step and key, or 'skip' the step (its episode ends there, the env is "
        "reset; counted in num_nonfinite_env_steps_skipped)",
    ),
    "max_skipped_updates_in_a_row": (
        10,
        "updates in a row whose steps were skipped for non-finite losses or gradients "
        "before training stops with an error (0: never)",
    ),
    "overlap_policy_and_envs": (
        "auto",
        "EnvRunners step half their envs while the policy acts for the other half "
        "(True/False; 'auto': on for image observations with >= 2 envs per runner)",
    ),
    "log_progress": (
        True,
        "log one progress line per train() iteration outside Ray Tune (logger "
        "rllib_dreamerv3.progress, to stdout)",
    ),
}

# The numeric hyperparameters' types and ranges: `RULES` in rllib_dreamerv3/validation.py.
PRECISIONS = ("float32", "bfloat16")
NONFINITE_ENV_DATA = ("raise", "skip")
_BOOLS = ("fast_kernels", "log_progress")


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
                "rllib_dreamerv3/algorithm.py; help(DreamerV3Config.training) lists them) and "
                "the arguments of AlgorithmConfig.training (e.g. gamma, grad_clip)."
            )
    return None


def _signature_with_table_defaults(training):
    """`training`'s signature with each DreamerV3 parameter's default taken from the table.

    The function's own defaults are `NotProvided` (leave the value as it is); `help()` and IDEs
    show what an unchanged `DreamerV3Config()` holds instead.
    """
    signature = inspect.signature(training)
    return signature.replace(
        parameters=[
            param.replace(default=HYPERPARAMETERS[param.name][0])
            if param.name in HYPERPARAMETERS
            else param
            for param in signature.parameters.values()
        ]
    )


def _training_doc():
    """`DreamerV3Config.training`'s docstring: an Args section with one entry per table row."""
    lines = [
        "Set training hyperparameters: DreamerV3's (below) and RLlib's own (`**kwargs`).",
        "",
        "Only the arguments given are set; the others keep their current values. The defaults",
        "shown are those of a new `DreamerV3Config()`, i.e. of `HYPERPARAMETERS` in",
        "rllib_dreamerv3/algorithm.py. An unknown keyword raises a TypeError naming the closest",
        "valid one, before anything is set. Values are checked by `validate()`.",
        "",
        "Args:",
    ]
    for name, (default, meaning) in HYPERPARAMETERS.items():
        lines += textwrap.wrap(
            f"{name}: {meaning}. Default: {default!r}.",
            width=92,
            initial_indent="    ",
            subsequent_indent="        ",
        )
    lines += textwrap.wrap(
        "**kwargs: any argument of `AlgorithmConfig.training`, e.g. `gamma` "
        "(default: 1-1/333) or `grad_clip`.",
        width=92,
        initial_indent="    ",
        subsequent_indent="        ",
    )
    lines += ["", "Returns:", "    This config, for chaining."]
    return "\n".join(lines)


class DreamerV3Config(AlgorithmConfig):
    """Configuration of :class:`DreamerV3`.

    Example:
        >>> from rllib_dreamerv3 import DreamerV3Config
        >>> config = DreamerV3Config().environment("CartPole-v1").training(model_size="nano")
        >>> algo = config.build_algo()  # doctest: +SKIP

    Every DreamerV3 hyperparameter is set through :meth:`training`; the defaults are the paper's
    (see `HYPERPARAMETERS` in this module, or `help(DreamerV3Config.training)`). `gamma`
    defaults to `1 - 1/333`. Runs on TF2 only (`framework="tf2"`), with at most one Learner.
    """

    def __init__(self, algo_class=None):
        super().__init__(algo_class=algo_class or DreamerV3)
        for name, (default, _) in HYPERPARAMETERS.items():
            setattr(self, name, default)
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

    # One keyword-only parameter per key of HYPERPARAMETERS (tests/test_config_signature.py
    # checks that names agree). The real defaults are `NotProvided`, so only the given values
    # are set; `__signature__` and `__doc__` below show the table's defaults and meanings.
    def training(
        self,
        *,
        model_size: str = NotProvided,
        training_ratio: int = NotProvided,
        batch_size_B: int = NotProvided,
        batch_length_T: int = NotProvided,
        horizon_H: int = NotProvided,
        gae_lambda: float = NotProvided,
        entropy_scale: float = NotProvided,
        return_normalization_decay: float = NotProvided,
        world_model_lr: float = NotProvided,
        actor_lr: float = NotProvided,
        critic_lr: float = NotProvided,
        world_model_adam_eps: float = NotProvided,
        actor_adam_eps: float = NotProvided,
        critic_adam_eps: float = NotProvided,
        world_model_grad_clip: float = NotProvided,
        actor_grad_clip: float = NotProvided,
        critic_grad_clip: float = NotProvided,
        free_bits: float = NotProvided,
        pred_loss_scale: float = NotProvided,
        dyn_loss_scale: float = NotProvided,
        rep_loss_scale: float = NotProvided,
        critic_ema_rate: float = NotProvided,
        critic_ema_regularizer: float = NotProvided,
        unimix: float = NotProvided,
        num_bins: int = NotProvided,
        cnn_kernel: int = NotProvided,
        vector_mlp_units: int | None = NotProvided,
        vector_mlp_layers: int | None = NotProvided,
        encoder_keys: str | list = NotProvided,
        decoder_keys: str | list = NotProvided,
        actor_min_std: float = NotProvided,
        actor_max_std: float = NotProvided,
        replay_capacity: int = NotProvided,
        replay_storage: str = NotProvided,
        replay_directory: str | None = NotProvided,
        num_steps_sampled_before_learning_starts: int = NotProvided,
        store_replay_buffer_in_checkpoint: bool = NotProvided,
        checkpoint_interval_s: float = NotProvided,
        sync_weights_every_n_updates: int = NotProvided,
        dream_every_n_updates: int = NotProvided,
        dream_burn_in: int = NotProvided,
        dream_num_sequences: int = NotProvided,
        precision: str = NotProvided,
        jit_compile: bool = NotProvided,
        fast_kernels: bool = NotProvided,
        learner_peer_timeout_s: float = NotProvided,
        tf_num_threads: int | None = NotProvided,
        nonfinite_env_data: str = NotProvided,
        max_skipped_updates_in_a_row: int = NotProvided,
        overlap_policy_and_envs: bool | str = NotProvided,
        log_progress: bool = NotProvided,
        **kwargs,
    ):
        arguments = dict(locals())  # the parameters by name: no other local exists yet
        given = {
            name: value
            for name, value in arguments.items()
            if name in HYPERPARAMETERS and value is not NotProvided
        }
        error = _unknown_training_key(kwargs, super().training)
        if error is not None:
            raise error
        for name, value in given.items():
            setattr(self, name, value)
        super().training(**kwargs)
        return self

    training.__signature__ = _signature_with_table_defaults(training)
    training.__doc__ = _training_doc()

    def build(self, *args, **kwargs):
        """:meth:`build_algo` (RLlib 2.60 deprecates `build`; here it stays an alias)."""
        return self.build_algo(*args, **kwargs)

    def get_default_learner_class(self):
        return DreamerV3Learner

    def get_default_rl_module_spec(self):
        return RLModuleSpec(module_class=DreamerV3RLModule)

    @property
    def _model_config_auto_includes(self):
        keys = (
            "model_size",
            "unimix",
            "num_bins",
            "actor_min_std",
            "actor_max_std",
            "cnn_kernel",
            "vector_mlp_units",
            "vector_mlp_layers",
            "encoder_keys",
            "decoder_keys",
            "precision",
            "jit_compile",
        )
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
                "config.framework('tf2') (the default) or RLlib's built-in torch DreamerV3."
            )
        super().validate()
        self._validate_dreamer_values()
        self._validate_env_spaces()

    def _validate_dreamer_values(self):
        if self.model_size not in MODEL_SIZES:
            self._value_error(
                f"Unknown model_size={self.model_size!r}; use one of {list(MODEL_SIZES)}."
            )
        defaults = {name: default for name, (default, _) in HYPERPARAMETERS.items()}
        for error in numeric_errors(self.hyperparameters, defaults):
            self._value_error(error)  # type, finiteness and range: validation.RULES
        for name in ("encoder_keys", "decoder_keys"):
            value = getattr(self, name)
            keys = isinstance(value, (list, tuple)) and all(isinstance(k, str) for k in value)
            if not (isinstance(value, str) or (keys and value)):
                self._value_error(
                    f"{name}={value!r} must be a regular expression (a str, matching whole keys) "
                    "or a non-empty list of observation keys."
                )
        overlap = self.overlap_policy_and_envs
        if not (isinstance(overlap, bool) or (isinstance(overlap, str) and overlap == "auto")):
            self._value_error(f"overlap_policy_and_envs={overlap!r} must be 'auto', True or False.")
        if overlap is True and self.num_envs_per_env_runner < 2:
            self._value_error(
                "overlap_policy_and_envs=True needs num_envs_per_env_runner >= 2 "
                f"(got {self.num_envs_per_env_runner}): it splits each runner's "
                "envs into two groups."
            )
        if self.nonfinite_env_data not in NONFINITE_ENV_DATA:
            self._value_error(
                f"nonfinite_env_data={self.nonfinite_env_data!r} must be one of "
                f"{NONFINITE_ENV_DATA}."
            )
        for name in _BOOLS:
            value = getattr(self, name)
            if not isinstance(value, bool):
                self._value_error(f"{name}={value!r} must be True or False.")
        if self.precision not in PRECISIONS:
            self._value_error(f"precision={self.precision!r} must be one of {PRECISIONS}.")
        self._validate_between_keys()
        fragment = self.rollout_fragment_length
        if fragment != "auto" and (not isinstance(fragment, numbers.Integral) or fragment <= 0):
            self._value_error(
                f"rollout_fragment_length={fragment!r} must be 'auto' or a "
                "positive integer (env steps per env per sample call)."
            )
        self._validate_gpus()
        if self.is_multi_agent:
            self._value_error("DreamerV3 is single-agent; multi-agent configs are not supported.")

    def _validate_between_keys(self):
        """The checks that relate two values (each one's own range: `validation.RULES`)."""
        if self.dream_every_n_updates:
            self._validate_dream_values()
        if self.actor_min_std >= self.actor_max_std:
            self._value_error(
                f"actor_min_std={self.actor_min_std} must be smaller than "
                f"actor_max_std={self.actor_max_std}."
            )
        if self.replay_capacity < self.batch_length_T:
            self._value_error(
                f"replay_capacity={self.replay_capacity} must hold at least one "
                f"sequence of batch_length_T={self.batch_length_T} steps."
            )
        if self.num_learners > 1 and self.batch_size_B % self.num_learners:
            self._value_error(
                f"batch_size_B={self.batch_size_B} must be a multiple of num_learners="
                f"{self.num_learners}: each Learner updates on batch_size_B / num_learners of "
                "its rows (batch_size_B is the total over all Learners)."
            )

    def _validate_gpus(self):
        """`num_gpus_per_learner > 0` needs GPUs: those of the Ray cluster if Ray runs, else
        this machine's (where `build()` starts Ray)."""
        wanted = self.num_gpus_per_learner
        if not wanted:
            return
        import ray

        if ray.is_initialized():
            available, where = ray.cluster_resources().get("GPU", 0), "the Ray cluster has"
        else:
            import tensorflow as tf

            available, where = len(tf.config.list_physical_devices("GPU")), "this machine has"
        needed = wanted * max(1, self.num_learners)
        if available < needed:
            self._value_error(
                f"num_gpus_per_learner={wanted} with num_learners={self.num_learners} needs "
                f"{needed:g} GPU(s), but {where} {available:g} (TensorFlow finds a GPU only "
                "with a CUDA build, `pip install tensorflow[and-cuda]`). Set "
                "num_gpus_per_learner=0 to learn on CPUs."
            )

    def _validate_dream_values(self):
        burn_in = self.dream_burn_in  # its type and >= 1: validation.RULES
        if not (isinstance(burn_in, numbers.Integral) and 1 <= burn_in < self.batch_length_T):
            self._value_error(
                f"dream_burn_in={burn_in!r} must be an integer in "
                f"[1, batch_length_T={self.batch_length_T}): the dream observes "
                "that many steps, then imagines the rest (or set "
                "dream_every_n_updates=0 to turn dreams off)."
            )

    def _validate_env_spaces(self):
        """Check the env's spaces: those set by `environment(observation_space=...,
        action_space=...)`, else those of one env built from `env` (and closed again)."""
        if self.env is None:
            return
        obs_space, act_space = self.observation_space, self.action_space
        if obs_space is None or act_space is None:
            # gymnasium's registry (`gymnasium.spec(id)`) holds no spaces: only an env has them.
            env = make_env(self)
            try:
                obs_space = env.observation_space if obs_space is None else obs_space
                act_space = env.action_space if act_space is None else act_space
            finally:
                env.close()
        check_spaces(obs_space, act_space)
        try:
            obs_format = ObsFormat(obs_space, self.encoder_keys, self.decoder_keys)
        except ValueError as err:
            self._value_error(str(err))
        else:
            for name in ("encoder_keys", "decoder_keys"):
                if getattr(self, name) != ".*" and not obs_format.is_dict:
                    self._value_error(
                        f"{name}={getattr(self, name)!r} chooses entries of Dict observations, "
                        f"but this env's observation space is {obs_space}; leave {name} at '.*'."
                    )
        self._validate_replay_memory(obs_space, act_space)

    def _validate_replay_memory(self, observation_space, action_space):
        """A full replay buffer must fit into this machine's memory (images: ~12 kB a step),
        or with `replay_storage="disk"`, onto the free disk of its directory."""
        if self.replay_storage not in REPLAY_STORAGES:
            self._value_error(
                f"replay_storage={self.replay_storage!r}; use one of {list(REPLAY_STORAGES)}."
            )
        obs_format = ObsFormat(observation_space)
        per_step = bytes_per_step(obs_format.shape(), obs_format.dtype(), action_dim(action_space))
        need = self.replay_capacity * per_step
        if self.replay_storage == "disk":
            where = self.replay_directory or tempfile.gettempdir()
            while not os.path.isdir(where) and os.path.dirname(where) != where:
                where = os.path.dirname(where)
            free = shutil.disk_usage(where).free
            if need > free:
                self._value_error(
                    f"replay_capacity={self.replay_capacity} steps of {per_step} bytes need "
                    f"{need / 2**30:.1f} GiB on disk, more than the {free / 2**30:.1f} GiB free "
                    f"at {where}; set replay_directory to a larger disk, or lower "
                    f"replay_capacity to {int(0.5 * free / per_step)} steps."
                )
            return
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if need > memory:
            self._value_error(
                f"replay_capacity={self.replay_capacity} steps of {per_step} bytes need "
                f"{need / 2**30:.1f} GiB, more than this machine's "
                f"{memory / 2**30:.1f} GiB of memory; set replay_storage='disk' (memory-mapped "
                f"files), or lower replay_capacity, e.g. to {int(0.5 * memory / per_step)} "
                "steps (half the memory)."
            )

    @property
    def steps_per_sample(self):
        """Env steps per env in one `training_step` sample ('auto': one update's worth)."""
        if self.rollout_fragment_length != "auto":
            return int(self.rollout_fragment_length)
        replay_per_update = self.batch_size_B * self.batch_length_T
        envs = max(1, self.num_env_runners) * self.num_envs_per_env_runner
        return max(1, round(replay_per_update / self.training_ratio / envs))


def _split_rows(value, num):
    """`num` row blocks of an array, or of every entry of a dict of arrays (one dict each)."""
    if isinstance(value, dict):
        blocks = {key: np.split(entry, num) for key, entry in value.items()}
        return [{key: entry[i] for key, entry in blocks.items()} for i in range(num)]
    return np.split(value, num)


def learner_batches(batch, num_learners):
    """`LearnerGroup.update` arguments for a replay batch `{key: [B, T, ...]}`: with several
    Learners, one contiguous block of `B / num_learners` rows each, in Learner order (the
    update's random draws are laid out for that order, see `update.make_update_fn`)."""
    num = max(1, num_learners)
    rows, length = batch["rewards"].shape[:2]
    parts = {key: _split_rows(value, num) for key, value in batch.items()}
    shards = [{key: value[i] for key, value in parts.items()} for i in range(num)]
    batches = [
        MultiAgentBatch({DEFAULT_MODULE_ID: SampleBatch(shard)}, rows // num * length)
        for shard in shards
    ]
    return {"batch": batches[0]} if num == 1 else {"batches": batches}


def _sample_with_metrics(runner, num_timesteps, random_actions):
    """An EnvRunner's samples, metrics and finished episodes (see `DreamerV3._sample`)."""
    return (
        runner.sample(num_timesteps=num_timesteps, random_actions=random_actions),
        runner.get_metrics(),
        runner.pop_finished_episodes(),
    )


class DreamerV3(Algorithm):
    """DreamerV3 (Hafner et al. 2023) on RLlib's new API stack, in TensorFlow 2.

    Each `training_step` samples from the EnvRunners (random actions until
    `num_steps_sampled_before_learning_starts` steps are stored), adds the steps to the replay
    buffer, runs as many updates as `training_ratio` asks (replayed steps `B*T` per update over
    env steps sampled since learning started), and syncs the new weights to the EnvRunners.

    Every `dream_every_n_updates` updates the iteration's results also carry `dreams`
    (reconstructions and open-loop dreams as TensorBoard images/videos; see
    :mod:`rllib_dreamerv3.dreams`).

    Checkpoints (`save_to_path` / `DreamerV3.from_checkpoint`) hold the module weights with the
    EMA critic and the return scale, the three optimisers' states, counters, metrics and, unless
    `store_replay_buffer_in_checkpoint=False`, the replay buffer. Local checkpoints are written
    crash-safely and verified on restore (see :mod:`rllib_dreamerv3.checkpoints`).

    `get_module()` returns a module with the Learner's current weights, ready for
    `forward_inference`.
    """

    # What Ray Tune prints of a finished trial's last result (it reads this class attribute of
    # a trainable; without it, every one of the result's hundreds of entries).
    _progress_metrics = (
        "episode_return_mean",
        *PROGRESS_LOSSES,
        "num_env_steps_sampled_lifetime",
        "num_updates_lifetime",
        "evaluation/env_runners/episode_return_mean",
    )

    @classmethod
    def get_default_config(cls):
        return DreamerV3Config()

    @property
    def _under_tune(self):
        """Whether Ray Tune runs this algorithm (it gives Tune's trainables a storage context).
        `Trainable.__init__` sets the trial info only after the log directory, so read softly."""
        return (
            getattr(self, "_storage", None) is not None
            or getattr(self, "_trial_info", None) is not None
        )

    def _setup_logdir(self):
        """Outside Ray Tune, Ray's `Trainable` makes a timestamped directory in ~/ray_results
        that nothing writes to (results reach files only through Tune); DreamerV3 takes a
        temporary directory instead and removes it on `stop()` if it is still empty. Under Tune
        (a storage context), the trial directory as usual."""
        if self._under_tune:
            super()._setup_logdir()
            return
        self._logdir = tempfile.mkdtemp(prefix="rllib_dreamerv3_")
        self._temporary_logdir = True

    def cleanup(self):
        super().cleanup()
        if getattr(self, "replay_buffer", None) is not None:
            self.replay_buffer.close()  # a disk buffer's files are scratch, not a checkpoint
        # Release the stopped groups now (their last references). Kept, they would be freed
        # whenever this object is, which for a Tune trial actor can be while Ray terminates the
        # process right after `stop()` (SIGTERM, raised as `SystemExit`): an interrupted
        # `__del__` then prints an "Exception ignored" traceback.
        for name in ("learner_group", "env_runner_group", "eval_env_runner_group"):
            if getattr(self, name, None) is not None:
                setattr(self, name, None)
        if getattr(self, "_temporary_logdir", False):
            try:
                os.rmdir(self._logdir)
            except OSError:  # something wrote there (kept), or it is gone already
                pass

    def setup(self, config):
        super().setup(config)
        cfg = self.config
        obs_space, _ = self.spaces[INPUT_ENV_SINGLE_SPACES]
        self.replay_buffer = self._new_replay_buffer()
        # `{name: (path, manifest entry)}` of the replay files of the last checkpoint saved or
        # restored: the next save links the unchanged ones.
        self._replay_files = {}
        self._last_checkpoint_time = time.monotonic()
        # Ray's own counters (a defaultdict) live in the same dict: add to it, don't replace it.
        self._counters.update(num_updates=0, env_steps_at_learning_start=None)
        self._dreams = None  # the latest dream summaries, until `step` reports them
        # (return, length) of the latest finished training episodes, for the smoothed metrics.
        self._recent_episodes = collections.deque(maxlen=cfg.metrics_num_episodes_for_smoothing)
        self._no_samples_since = None  # when remote EnvRunners started returning nothing
        # Updates done when this process ran its first iteration, and the counters at the end of
        # its first iteration with updates (warm-up and compile behind it): see `ETA_REFERENCE`.
        self._updates_at_first_step = None
        self._eta_reference = None
        self._dreams_compiled = False
        self._share_learner_module()
        # Only image dreams have videos (vector dreams are plots).
        videos = cfg.dream_every_n_updates and is_image(obs_space)
        if videos and importlib.util.find_spec("moviepy") is None:
            logger.warning(
                "Dreams are on (dream_every_n_updates=%d) but moviepy is not installed: "
                "TensorBoard gets their images, not their videos. pip install moviepy (in a "
                "clone: pip install -e '.[video]') for videos, or set dream_every_n_updates=0 "
                "to turn dreams off.",
                cfg.dream_every_n_updates,
            )

    def _new_replay_buffer(self):
        cfg = self.config
        obs_space, act_space = self.spaces[INPUT_ENV_SINGLE_SPACES]
        obs_format = ObsFormat(obs_space)
        directory = None
        if cfg.replay_storage == "disk":
            parent = cfg.replay_directory or (self.logdir if self._under_tune else None)
            if parent is not None:
                os.makedirs(parent, exist_ok=True)
            directory = tempfile.mkdtemp(prefix="replay_storage-", dir=parent)
        return ReplayBuffer(
            cfg.replay_capacity,
            cfg.batch_length_T,
            obs_format.shape(),
            obs_format.dtype(),
            action_dim(act_space),
            seed=cfg.seed,
            directory=directory,
        )

    def _share_learner_module(self):
        """With a local Learner, the local EnvRunner (in this process too) acts with the
        Learner's module itself: no weights are copied to it (`DreamerV3EnvRunner.share_module`).
        Remote EnvRunners still get theirs by `sync_weights`."""
        if self.env_runner is None or not self.learner_group.is_local:
            return
        self.env_runner.share_module(
            self._first_learner(lambda learner: learner.module[DEFAULT_MODULE_ID])
        )

    # --- one training step --------------------------------------------------------------------
    def _env_steps_sampled(self):
        return self.metrics.peek((ENV_RUNNER_RESULTS, NUM_ENV_STEPS_SAMPLED_LIFETIME), default=0)

    def _sample(self, num_timesteps=None, random_actions=False):
        """Sample from all EnvRunners into the replay buffer; `num_timesteps` is the total."""
        remote = self.env_runner_group.num_remote_env_runners()
        per_runner = None if num_timesteps is None else -(-num_timesteps // max(1, remote))
        # A module-level function, which Ray pickles by reference: a function defined here would
        # travel by value, and a remote EnvRunner keeps ~1 KB of every such function it unpickles.
        sample = functools.partial(
            _sample_with_metrics, num_timesteps=per_runner, random_actions=random_actions
        )
        if remote == 0:
            results = [sample(self.env_runner)]
        else:
            results = self.env_runner_group.foreach_env_runner(sample, local_env_runner=False)
            self._check_env_runners_sampled(results, remote)
        for chunks, _, episodes in results:
            for stream_key, steps in chunks:
                self.replay_buffer.add(stream_key, steps)
            self._recent_episodes.extend(episodes)
        self.metrics.aggregate([metrics for _, metrics, _ in results], key=ENV_RUNNER_RESULTS)

    def _warm_up(self, num_timesteps):
        """Sample `num_timesteps` random-action steps in about ten rounds, with a progress bar
        on a terminal (none under Ray Tune or when stderr is no terminal). Each round is a
        multiple of the number of envs, so the total equals one `_sample` of them all."""
        envs = max(1, self.env_runner_group.num_remote_env_runners())
        envs *= self.config.num_envs_per_env_runner
        self._notice(
            f"warm-up: {num_timesteps} env steps of random actions before the first update"
        )
        per_round = envs * -(-num_timesteps // (10 * envs))
        bar = tqdm(
            total=num_timesteps,
            desc="warm-up (random actions)",
            unit="step",
            leave=False,
            disable=True if self._under_tune else None,  # None: only on a terminal
        )
        with bar:
            while num_timesteps > 0:
                self._sample(num_timesteps=min(per_round, num_timesteps), random_actions=True)
                bar.update(min(per_round, num_timesteps))
                num_timesteps -= per_round

    def _notice(self, message):
        """Log `message` as a progress line outside Ray Tune (unless `log_progress=False`);
        under Tune, `progress.ProgressLines` says it when the trial starts."""
        if self.config.log_progress and not self._under_tune:
            progress_logger.info("DreamerV3 %s", message)

    def _env_runner_restart_limit_s(self):
        """How long training waits without samples while failed EnvRunners are restarting:
        `delay_between_env_runner_restarts_s` (a failed runner sleeps that long before its
        process exits) + `env_runner_restore_timeout_s` (RLlib's time for bringing a recovered
        runner back; here also its new process and env construction). Both are
        `config.fault_tolerance(...)` settings (RLlib's defaults: 60 s + 1800 s)."""
        cfg = self.config
        return cfg.delay_between_env_runner_restarts_s + cfg.env_runner_restore_timeout_s

    def _restarting_env_runners(self):
        """IDs of the out-of-service remote EnvRunners that may still come back.

        With `restart_failed_env_runners`, Ray restarts a failed EnvRunner actor (at most
        `max_num_env_runner_restarts` times) and RLlib's actor manager, which marked it
        unhealthy, pings it before every training step (`restore_env_runners`) and puts it
        back into service once it answers. While Ray restarts it, a ping answers
        `ActorUnavailableError` (or nothing in time, while the env is being constructed); an
        actor that is dead for good (restarts used up, or its constructor raised on a restart:
        Ray does not retry that) answers `ActorDiedError`. The manager keeps these pings'
        errors to itself, so this pings the unhealthy runners once more, without marking any
        healthy (that stays `restore_env_runners`' job, which also syncs their state).
        """
        if not self.config.restart_failed_env_runners:
            return []
        manager = self.env_runner_group._worker_manager
        down = [i for i in manager.actor_ids() if not manager.is_actor_healthy(i)]
        if not down:
            return []
        pings = manager.foreach_actor(
            lambda runner: runner.ping(),
            remote_actor_ids=down,
            healthy_only=False,
            timeout_seconds=self.config.env_runner_health_probe_timeout_s,
        )
        dead = {
            ping.actor_id
            for ping in pings
            if not ping.ok and isinstance(ping.get(), ActorDiedError)
        }
        return [i for i in down if i not in dead]

    def _check_env_runners_sampled(self, results, remote):
        """Raise instead of looping forever when no remote EnvRunner returns samples.

        Failed runners return nothing. While some of them are restarting (see
        `_restarting_env_runners`), training waits for them, at most
        `_env_runner_restart_limit_s()` from the first sample call that got nothing; with none
        that can come back (no restarts, or all dead for good) this raises at once.
        """
        if results:
            self._no_samples_since = None
            return
        now = time.monotonic()
        first = self._no_samples_since is None
        if first:
            self._no_samples_since = now
        cfg = self.config
        healthy = self.env_runner_group.num_healthy_remote_workers()
        restarting = self._restarting_env_runners()
        waited = now - self._no_samples_since
        limit = self._env_runner_restart_limit_s()
        settings = (
            f"delay_between_env_runner_restarts_s={cfg.delay_between_env_runner_restarts_s} + "
            f"env_runner_restore_timeout_s={cfg.env_runner_restore_timeout_s}"
        )
        if restarting and waited <= limit:
            if first:
                logger.warning(
                    "No remote EnvRunner returned samples: waiting for Ray to restart EnvRunner(s) "
                    "%s, at most %.0f s (%s, config.fault_tolerance settings).",
                    restarting,
                    limit,
                    settings,
                )
            return
        since = f" for {waited:.0f} s" if waited >= 1 else ""
        if restarting:
            why = (
                f"EnvRunner(s) {restarting} did not come back from their restart within "
                f"{limit:.0f} s ({settings}; config.fault_tolerance(...) sets both)."
            )
        else:
            why = (
                f"none can come back (restart_failed_env_runners="
                f"{cfg.restart_failed_env_runners}, max_num_env_runner_restarts="
                f"{cfg.max_num_env_runner_restarts}; a runner whose construction fails on a "
                "restart is not restarted again)."
            )
        raise RuntimeError(
            f"No EnvRunner returned samples{since}: {healthy} of {remote} remote EnvRunners "
            f"are healthy, and {why} Training cannot go on without samples. The EnvRunners' "
            "errors (often the env raising, or running out of memory) are in the log above; "
            "fix the cause and continue from the last checkpoint. "
            "config.fault_tolerance(restart_failed_env_runners=True) (the default) restarts "
            "failed EnvRunners, restart_failed_sub_environments=True restarts just the failed "
            "env."
        )

    def training_step(self):
        cfg = self.config
        warmup_left = cfg.num_steps_sampled_before_learning_starts - self._env_steps_sampled()
        if warmup_left > 0 or not self.replay_buffer.can_sample():
            self._warm_up(max(warmup_left, cfg.batch_length_T))
        else:
            self._sample()

        sampled = self._env_steps_sampled()
        warmed_up = sampled >= cfg.num_steps_sampled_before_learning_starts
        if self.replay_buffer.can_sample() and warmed_up:
            if self._counters["env_steps_at_learning_start"] is None:
                self._counters["env_steps_at_learning_start"] = sampled
            self._train(sampled)
        self._log_replay_and_ratio(sampled)

    def _train(self, sampled):
        cfg = self.config
        replay_per_update = cfg.batch_size_B * cfg.batch_length_T
        since_start = sampled - self._counters["env_steps_at_learning_start"]
        target_updates = max(1, int(since_start * cfg.training_ratio / replay_per_update))
        if self._counters["num_updates"] >= target_updates:
            return
        updates_before = self._counters["num_updates"]
        if self._updates_at_first_step == updates_before and self._eta_reference is None:
            how = "with XLA" if cfg.jit_compile else "as a TF graph"
            self._notice(
                f"compiling the update {how} (once per algorithm built; a minute or more on a CPU)"
            )
        while self._counters["num_updates"] < target_updates:
            batch = self.replay_buffer.sample(cfg.batch_size_B)
            results = self._update_learners(batch, sampled)
            self.metrics.aggregate(results, key=LEARNER_RESULTS)
            self._counters["num_updates"] += 1
        updates = self._counters["num_updates"]
        every = cfg.dream_every_n_updates
        if every and updates // every > updates_before // every:
            start = time.perf_counter()
            self._dreams = self._compute_dreams()
            if not self._dreams_compiled:  # this first call compiled the dream function
                self._dreams_compiled = True
                reference = self._eta_reference
                if reference is not None:  # a one-off cost: no part of the ETA's rate
                    shifted = reference["time_total_s"] + time.perf_counter() - start
                    self._eta_reference = {**reference, "time_total_s": shifted}
        every = cfg.sync_weights_every_n_updates
        if self._needs_weight_sync() and updates // every > updates_before // every:
            self.env_runner_group.sync_weights(
                from_worker_or_learner_group=self.learner_group, inference_only=True
            )

    def _update_learners(self, batch, sampled):
        try:
            return self.learner_group.update(
                **learner_batches(batch, self.config.num_learners),
                timesteps={NUM_ENV_STEPS_SAMPLED_LIFETIME: sampled},
            )
        except Exception as error:
            if self.config.num_learners < 2:
                raise
            raise RuntimeError(
                f"A Learner of the group of num_learners={self.config.num_learners} failed "
                f"during update {self._counters['num_updates'] + 1} ({type(error).__name__}: "
                f"{str(error).strip().splitlines()[-1][:300]}). Data-parallel Learners "
                "all-reduce every update, so the group cannot go on without it: training "
                "stops. Restore the last checkpoint (DreamerV3.from_checkpoint; under Ray "
                "Tune, FailureConfig(max_failures=...) restores it automatically)."
            ) from error

    @property
    def _local_runner_shares_module(self):
        return self.env_runner is not None and self.env_runner.shares_learner_module

    def _needs_weight_sync(self):
        """Whether any EnvRunner acts with a copy of the weights (remote ones always do)."""
        remote = self.env_runner_group.num_remote_env_runners() > 0
        return remote or not self._local_runner_shares_module

    def _log_replay_and_ratio(self, sampled):
        cfg = self.config
        start = self._counters["env_steps_at_learning_start"]
        updates = self._counters["num_updates"]
        replayed = updates * cfg.batch_size_B * cfg.batch_length_T
        since_start = 0 if start is None else sampled - start
        self.metrics.log_value(NUM_UPDATES_LIFETIME, updates, window=1)
        # Replayed env steps (B*T per update); RLlib's per-learner count sees only B rows when
        # the Learner is remote.
        self.metrics.log_value(NUM_ENV_STEPS_TRAINED_LIFETIME, replayed, window=1)
        self.metrics.log_value(
            TRAINING_RATIO_ACHIEVED, replayed / since_start if since_start > 0 else 0.0, window=1
        )
        self.metrics.log_dict(
            {
                "num_steps_stored": len(self.replay_buffer),
                "num_bytes": self.replay_buffer.nbytes,
                "capacity_bytes": self.replay_buffer.capacity_nbytes,
                "num_steps_added_lifetime": self.replay_buffer.num_steps_added,
            },
            key=REPLAY_BUFFER_RESULTS,
            window=1,
        )

    def _compute_dreams(self):
        """Dream summaries of a fresh replay batch, computed by the Learner (it holds the
        decoder and heads that the EnvRunners' inference-only modules lack)."""
        rows = self.config.batch_size_B // max(1, self.config.num_learners)
        batch = self.replay_buffer.sample(rows)  # one Learner's share: its update's shapes
        return self._first_learner(lambda learner: learner.dreams(batch))

    def _first_learner(self, func):
        """`func(learner)` of the (first) Learner: all Learners hold the same weights."""
        ids = None if self.learner_group.is_local else [0]
        results = self.learner_group.foreach_learner(func, remote_actor_ids=ids)
        return next(iter(results)).get()

    def train(self):
        """One training iteration (RLlib's `train()`). Outside Ray Tune it also logs a progress
        line (:mod:`rllib_dreamerv3.progress`) unless `log_progress=False`."""
        result = super().train()
        if self.config.log_progress and not self._under_tune:
            log_progress(result)
        return result

    def step(self):
        """One `train()` iteration. The results begin with :func:`progress.summary` (episode
        return and losses as top-level numbers, the columns of Tune's status table) and carry
        `dreams` (see :mod:`rllib_dreamerv3.dreams`) in iterations that computed them."""
        self._track_eta_reference()
        results = super().step()
        results[ETA_REFERENCE] = self._eta_reference
        self._smooth_episode_metrics(results.get(ENV_RUNNER_RESULTS))
        if self._dreams is not None:
            results[DREAMS] = self._dreams
            self._dreams = None
        self._checkpoint_on_the_clock(results)
        return {**summary(results), **results}

    def _track_eta_reference(self):
        """Before an iteration: once the previous one was this process's first with updates,
        keep the counters it ended with, so that an ETA counts only the iterations after the
        warm-up and the first compile (which last much longer than later ones)."""
        updates = self._counters["num_updates"]
        if self._updates_at_first_step is None:
            self._updates_at_first_step = updates
        elif self._eta_reference is None and updates > self._updates_at_first_step:
            self._eta_reference = {
                "training_iteration": self.iteration,
                "time_total_s": self._time_total,
                NUM_ENV_STEPS_SAMPLED_LIFETIME: self._env_steps_sampled(),
                NUM_UPDATES_LIFETIME: updates,
            }

    def _checkpoint_on_the_clock(self, results):
        """Under Ray Tune, ask for a checkpoint (`should_checkpoint`) once
        `checkpoint_interval_s` passed since the last save; report the seconds to the next one
        (`next_checkpoint_s`, shown in the progress line)."""
        interval = self.config.checkpoint_interval_s
        if not interval or not self._under_tune:
            return
        due = self._last_checkpoint_time + interval - time.monotonic()
        if due <= 0:
            results[SHOULD_CHECKPOINT] = True
            self._last_checkpoint_time = time.monotonic()  # the save resets it again
            due = 0.0
        results[NEXT_CHECKPOINT_S] = due

    def _smooth_episode_metrics(self, env_runner_results):
        """Set the episode return and length metrics (mean, min, max) to those of the latest
        `metrics_num_episodes_for_smoothing` training episodes, across iterations.

        Ray 2.60's metrics reduce each iteration on its own: its `episode_return_mean` is that
        of the episodes finished in this iteration (one long episode can be all of it), and a
        stop criterion on it would fire on a single good episode. Iterations without a finished
        episode keep reporting the window's values."""
        if env_runner_results is None or not self._recent_episodes:
            return
        returns, lengths = np.asarray(self._recent_episodes, dtype=np.float64).T
        env_runner_results.update(
            {
                EPISODE_RETURN_MEAN: float(returns.mean()),
                EPISODE_RETURN_MIN: float(returns.min()),
                EPISODE_RETURN_MAX: float(returns.max()),
                EPISODE_LEN_MEAN: float(lengths.mean()),
                EPISODE_LEN_MIN: float(lengths.min()),
                EPISODE_LEN_MAX: float(lengths.max()),
            }
        )

    # --- evaluation -----------------------------------------------------------------------------
    def evaluate(self, parallel_train_future=None):
        """RLlib's evaluation (`config.evaluation(...)`), always on evaluation EnvRunners.

        Without `evaluation_interval` or `evaluation_num_env_runners`, RLlib would evaluate on
        the training EnvRunner, cutting its episodes and replay streams short; a local
        evaluation EnvRunner is created instead on the first call. Evaluation steps never reach
        the replay buffer or the training counters. Actions are greedy unless
        `evaluation_config={"explore": True}`.
        """
        if self.eval_env_runner_group is None:
            _, env_creator = self._get_env_id_and_creator(
                self.evaluation_config.env, self.evaluation_config
            )
            self.eval_env_runner_group = EnvRunnerGroup(
                env_creator=env_creator,
                validate_env=None,
                config=self.evaluation_config,
                default_policy_class=self.get_default_policy_class(self.config),
                local_env_runner=True,
                logdir=self.logdir,
                tune_trial_id=self.trial_id,
                pg_offset=self.config.num_env_runners,
            )
        return super().evaluate(parallel_train_future)

    # --- the trained module -----------------------------------------------------------------
    def get_module(self, module_id=DEFAULT_MODULE_ID):
        """The RLModule `module_id`, holding the Learner's current weights (all of them).

        RLlib returns the local EnvRunner's module, to which training only syncs what inference
        needs; this first copies the Learner's full module state into it (critic, decoder and
        heads included), so `forward_inference` on it acts with the trained policy and every
        network equals the Learner's at the time of the call. Each call copies the weights:
        keep the returned module for a loop of actions rather than calling this per step.
        """
        module = super().get_module(module_id)
        if module is not None and self._local_runner_shares_module:
            # The local EnvRunner acts with the Learner's module itself: hand out a copy, so
            # that it does not change under the caller as training goes on.
            module = self.config.get_rl_module_spec(spaces=self.env_runner.get_spaces()).build()
        if module is not None:
            state = self.learner_group.get_state(
                components=f"{COMPONENT_LEARNER}/{COMPONENT_RL_MODULE}/{module_id}"
            )
            module.set_state(state[COMPONENT_LEARNER][COMPONENT_RL_MODULE][module_id])
        return module

    # --- checkpoints ----------------------------------------------------------------------------
    def _checkpoint_info(self):
        """What a restore must match, stored in the checkpoint's manifest."""
        if not self.config.store_replay_buffer_in_checkpoint:
            return {"replay_buffer": None}
        return {"replay_buffer": self.replay_buffer.spec}

    def _check_checkpoint_info(self, path, info):
        stored = info.get("replay_buffer")
        if stored is not None and stored != self.replay_buffer.spec:
            diffs = ", ".join(
                f"{key}={stored[key]!r} (here {value!r})"
                for key, value in self.replay_buffer.spec.items()
                if stored.get(key) != value
            )
            raise checkpoints.CheckpointError(
                f"Checkpoint {path} holds a replay buffer with {diffs}; this algorithm's buffer "
                "cannot take it. Restore with the checkpoint's settings (DreamerV3."
                "from_checkpoint(path) uses them), or set replay_capacity to the checkpoint's. "
                "Nothing was restored."
            )

    def save_to_path(self, path=None, *, state=None, filesystem=None, use_msgpack=False):
        """RLlib's `save_to_path`; a local `path` is written crash-safely (a temporary sibling
        directory, a manifest of checksums, then a rename), so overwriting an existing
        checkpoint never leaves a mix of two saves.

        The replay buffer goes into `replay_buffer/` as chunk files (see
        :meth:`ReplayBuffer.save_files`): a chunk that an earlier save of this algorithm wrote
        and that has not changed since is hard-linked from there, not written again, so a save
        costs the steps added since the last one. Each checkpoint directory stays complete on
        its own (links are files; a copy of the directory restores anywhere).
        """
        local = path is not None and checkpoints.is_local(path, filesystem)
        if not local:
            return super().save_to_path(
                path, state=state, filesystem=filesystem, use_msgpack=use_msgpack
            )
        written = {}

        def write(tmp):
            super(DreamerV3, self).save_to_path(tmp, state=state, use_msgpack=use_msgpack)
            if self.config.store_replay_buffer_in_checkpoint:
                written.update(self._save_replay_files(tmp))
            return {name: entry for name, (_, entry) in written.items()}

        path = checkpoints.save_atomically(path, write, info=self._checkpoint_info())
        self._replay_files = {
            name: (os.path.join(path, name), entry) for name, (_, entry) in written.items()
        }
        self._last_checkpoint_time = time.monotonic()
        return path

    def _save_replay_files(self, directory):
        """`{relative name: (path, manifest entry)}` of the replay files written or linked."""
        reuse = {
            name[len(REPLAY_DIR) + 1 :]: file for name, (file, _) in self._replay_files.items()
        }
        out = {}
        for file, (target, data) in self.replay_buffer.save_files(
            os.path.join(directory, REPLAY_DIR), reuse=reuse
        ).items():
            name = f"{REPLAY_DIR}/{file}"
            entry = checkpoints.entry(data) if data is not None else self._replay_files[name][1]
            out[name] = (target, entry)
        return out

    def save(self, checkpoint_dir=None):
        """Ray Tune's save of a trial; see :func:`tf_rllib.tune_storage.save_in_place`."""
        saved = save_in_place(self, checkpoint_dir)
        return saved if saved is not None else super().save(checkpoint_dir)

    def restore_from_path(self, path, *, component=None, filesystem=None, **kwargs):
        """RLlib's `restore_from_path`, after checking a local checkpoint: every file against
        the manifest's checksums, and the replay buffer's shape against this algorithm's.
        A failed check raises before anything is restored. The replay chunks are checked as
        they are read into a new buffer, which replaces the old one once all else is restored.
        """
        replay = None
        if checkpoints.is_local(path, filesystem):
            path = os.fspath(path)
            checkpoints.recover_interrupted_save(path)
            manifest = checkpoints.verify_for_restore(path)
            if component is None:
                if manifest is not None:
                    self._check_checkpoint_info(path, manifest["info"])
                if os.path.isdir(os.path.join(path, REPLAY_DIR)):
                    replay = self._load_replay_files(path, manifest)
        try:
            super().restore_from_path(path, component=component, filesystem=filesystem, **kwargs)
        except BaseException:
            if replay is not None:
                replay[0].close()
            raise
        if replay is not None:
            self.replay_buffer.close()
            self.replay_buffer, self._replay_files = replay

    def _load_replay_files(self, path, manifest):
        buffer = self._new_replay_buffer()

        def read(file):
            return checkpoints.read_verified(path, f"{REPLAY_DIR}/{file}", manifest)

        try:
            buffer.load_files(read)
        except BaseException as err:
            buffer.close()
            if not isinstance(err, ValueError) or isinstance(err, checkpoints.CheckpointError):
                raise
            raise checkpoints.CheckpointError(
                f"Checkpoint {path}: its replay buffer cannot be restored ({err}). Nothing was "
                "restored."
            ) from None
        files = {}
        if manifest is not None:
            files = {
                name: (os.path.join(path, name), entry)
                for name, entry in manifest["files"].items()
                if name.startswith(REPLAY_DIR + "/")
            }
        return buffer, files

    @classmethod
    def from_checkpoint(cls, path, filesystem=None, **kwargs):
        """RLlib's `from_checkpoint`; a local checkpoint is checked before the algorithm is
        built (see :func:`checkpoints.check_before_restore`), and all its files as it is
        restored (a damaged file is named in a `CheckpointError`)."""
        if checkpoints.is_local(path, filesystem):
            checkpoints.check_before_restore(path)
        return super().from_checkpoint(path, filesystem=filesystem, **kwargs)

    def get_state(self, components=None, *, not_components=None, **kwargs):
        """RLlib's state plus DreamerV3's counters and episode window. The replay buffer is not
        part of it: `save_to_path` writes it as files and `restore_from_path` reads them."""
        state = super().get_state(components, not_components=not_components, **kwargs)
        state["dreamer_counters"] = dict(self._counters)
        state["dreamer_recent_episodes"] = list(self._recent_episodes)
        # RLlib keeps the iteration; the training time too, so that `time_total_s` (a stop
        # criterion, and the progress line's time) continues after `from_checkpoint`.
        state["time_total_s"] = self._time_total
        return state

    def set_state(self, state):
        """RLlib's `set_state`; also takes the `replay_buffer` state of older checkpoints, which
        held the buffer in the state file."""
        if "replay_buffer" in state:  # checked before anything is written
            self.replay_buffer.check_state(state["replay_buffer"])
        super().set_state(state)
        if "dreamer_counters" in state:
            self._counters.update(state["dreamer_counters"])
        if "time_total_s" in state:
            self._time_total = state["time_total_s"]
        if "dreamer_recent_episodes" in state:
            self._recent_episodes.clear()
            self._recent_episodes.extend(map(tuple, state["dreamer_recent_episodes"]))
        if "replay_buffer" in state:
            self.replay_buffer.set_state(state["replay_buffer"])
