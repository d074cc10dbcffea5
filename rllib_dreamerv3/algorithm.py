"""`DreamerV3`: the RLlib Algorithm — sample, store, replay at the training ratio, sync weights."""

import importlib.util
import logging
import pathlib
import time

from ray.rllib.algorithms.algorithm import Algorithm
from ray.rllib.core import COMPONENT_LEARNER, COMPONENT_RL_MODULE, DEFAULT_MODULE_ID
from ray.rllib.env import INPUT_ENV_SINGLE_SPACES
from ray.rllib.env.env_runner_group import EnvRunnerGroup
from ray.rllib.policy.sample_batch import MultiAgentBatch, SampleBatch
from ray.rllib.utils.metrics import (ENV_RUNNER_RESULTS, LEARNER_RESULTS,
                                     NUM_ENV_STEPS_SAMPLED_LIFETIME,
                                     NUM_ENV_STEPS_TRAINED_LIFETIME, REPLAY_BUFFER_RESULTS)

from rllib_dreamerv3 import checkpoints
from rllib_dreamerv3.config import DreamerV3Config
from rllib_dreamerv3.replay_buffer import ReplayBuffer
from rllib_dreamerv3.spaces import action_dim, obs_storage_dtype

NUM_UPDATES_LIFETIME = "num_updates_lifetime"
TRAINING_RATIO_ACHIEVED = "training_ratio_achieved"
DREAMS = "dreams"
logger = logging.getLogger(__name__)


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

    @classmethod
    def get_default_config(cls):
        return DreamerV3Config()

    def setup(self, config):
        super().setup(config)
        cfg = self.config
        obs_space, act_space = self.spaces[INPUT_ENV_SINGLE_SPACES]
        self.replay_buffer = ReplayBuffer(cfg.replay_capacity, cfg.batch_length_T,
                                          obs_space.shape, obs_storage_dtype(obs_space),
                                          action_dim(act_space), seed=cfg.seed)
        # Ray's own counters (a defaultdict) live in the same dict: add to it, don't replace it.
        self._counters.update(num_updates=0, env_steps_at_learning_start=None)
        self._dreams = None  # the latest dream summaries, until `step` reports them
        self._no_samples_since = None  # when remote EnvRunners started returning nothing
        if cfg.dream_every_n_updates and importlib.util.find_spec("moviepy") is None:
            logger.warning(
                "Dreams are on (dream_every_n_updates=%d) but moviepy is not installed: "
                "TensorBoard gets their images, not their videos. pip install "
                "'rllib-dreamerv3[video]' for videos, or set dream_every_n_updates=0 to turn "
                "dreams off.", cfg.dream_every_n_updates)

    # --- one training step --------------------------------------------------------------------
    def _env_steps_sampled(self):
        return self.metrics.peek((ENV_RUNNER_RESULTS, NUM_ENV_STEPS_SAMPLED_LIFETIME), default=0)

    def _sample(self, num_timesteps=None, random_actions=False):
        """Sample from all EnvRunners into the replay buffer; `num_timesteps` is the total."""
        remote = self.env_runner_group.num_remote_env_runners()
        per_runner = None if num_timesteps is None else -(-num_timesteps // max(1, remote))

        def sample(runner):
            return (runner.sample(num_timesteps=per_runner, random_actions=random_actions),
                    runner.get_metrics())

        if remote == 0:
            results = [sample(self.env_runner)]
        else:
            results = self.env_runner_group.foreach_env_runner(sample, local_env_runner=False)
            self._check_env_runners_sampled(results, remote)
        for chunks, _ in results:
            for stream_key, steps in chunks:
                self.replay_buffer.add(stream_key, steps)
        self.metrics.aggregate([metrics for _, metrics in results], key=ENV_RUNNER_RESULTS)

    def _check_env_runners_sampled(self, results, remote):
        """Raise instead of looping forever when no remote EnvRunner returns samples.

        Failed runners return nothing. Without restarts none comes back, so this raises at
        once; with `restart_failed_env_runners`, RLlib restarts them before each training step,
        and this raises once no sample arrived for `sample_timeout_s` (at least 60 s).
        """
        if results:
            self._no_samples_since = None
            return
        now = time.monotonic()
        if self._no_samples_since is None:
            self._no_samples_since = now
        cfg = self.config
        healthy = self.env_runner_group.num_healthy_remote_workers()
        waited = now - self._no_samples_since
        limit = max(60.0, cfg.sample_timeout_s or 0.0)
        if (healthy == 0 and not cfg.restart_failed_env_runners) or waited > limit:
            since = f" for {waited:.0f} s" if waited >= 1 else ""
            raise RuntimeError(
                f"No EnvRunner returned samples{since}: {healthy} of {remote} "
                f"remote EnvRunners are healthy, restart_failed_env_runners="
                f"{cfg.restart_failed_env_runners}. Training cannot go on without samples. The "
                "EnvRunners' errors (often the env raising, or running out of memory) are in "
                "the log above; fix the cause and continue from the last checkpoint. "
                "config.fault_tolerance(restart_failed_env_runners=True) (the default) "
                "restarts failed EnvRunners, restart_failed_sub_environments=True restarts "
                "just the failed env.")

    def training_step(self):
        cfg = self.config
        warmup_left = cfg.num_steps_sampled_before_learning_starts - self._env_steps_sampled()
        if warmup_left > 0 or not self.replay_buffer.can_sample():
            self._sample(num_timesteps=max(warmup_left, cfg.batch_length_T),
                         random_actions=True)
        else:
            self._sample()

        sampled = self._env_steps_sampled()
        if self.replay_buffer.can_sample() and sampled >= cfg.num_steps_sampled_before_learning_starts:
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
        while self._counters["num_updates"] < target_updates:
            batch = self.replay_buffer.sample(cfg.batch_size_B)
            results = self.learner_group.update(
                batch=MultiAgentBatch({DEFAULT_MODULE_ID: SampleBatch(batch)},
                                      env_steps=replay_per_update),
                timesteps={NUM_ENV_STEPS_SAMPLED_LIFETIME: sampled})
            self.metrics.aggregate(results, key=LEARNER_RESULTS)
            self._counters["num_updates"] += 1
        every = cfg.dream_every_n_updates
        if every and self._counters["num_updates"] // every > updates_before // every:
            self._dreams = self._compute_dreams()
        self.env_runner_group.sync_weights(from_worker_or_learner_group=self.learner_group,
                                           inference_only=True)

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
        self.metrics.log_value(TRAINING_RATIO_ACHIEVED,
                               replayed / since_start if since_start > 0 else 0.0, window=1)
        self.metrics.log_dict({"num_steps_stored": len(self.replay_buffer),
                               "num_bytes": self.replay_buffer.nbytes,
                               "capacity_bytes": self.replay_buffer.capacity_nbytes,
                               "num_steps_added_lifetime": self.replay_buffer.num_steps_added},
                              key=REPLAY_BUFFER_RESULTS, window=1)

    def _compute_dreams(self):
        """Dream summaries of a fresh replay batch, computed by the Learner (it holds the
        decoder and heads that the EnvRunners' inference-only modules lack)."""
        batch = self.replay_buffer.sample(self.config.batch_size_B)
        results = self.learner_group.foreach_learner(lambda learner: learner.dreams(batch))
        return next(iter(results)).get()

    def step(self):
        """One `train()` iteration; adds `dreams` (see :mod:`rllib_dreamerv3.dreams`) to the
        results of the iterations in which dream summaries were computed."""
        results = super().step()
        if self._dreams is not None:
            results[DREAMS] = self._dreams
            self._dreams = None
        return results

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
            _, env_creator = self._get_env_id_and_creator(self.evaluation_config.env,
                                                          self.evaluation_config)
            self.eval_env_runner_group = EnvRunnerGroup(
                env_creator=env_creator, validate_env=None, config=self.evaluation_config,
                default_policy_class=self.get_default_policy_class(self.config),
                local_env_runner=True, logdir=self.logdir, tune_trial_id=self.trial_id,
                pg_offset=self.config.num_env_runners)
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
        if module is not None:
            state = self.learner_group.get_state(
                components=f"{COMPONENT_LEARNER}/{COMPONENT_RL_MODULE}/{module_id}")
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
            diffs = ", ".join(f"{key}={stored[key]!r} (here {value!r})"
                              for key, value in self.replay_buffer.spec.items()
                              if stored.get(key) != value)
            raise checkpoints.CheckpointError(
                f"Checkpoint {path} holds a replay buffer with {diffs}; this algorithm's buffer "
                "cannot take it. Restore with the checkpoint's settings (DreamerV3."
                "from_checkpoint(path) uses them), or set replay_capacity to the checkpoint's. "
                "Nothing was restored.")

    def save_to_path(self, path=None, *, state=None, filesystem=None, use_msgpack=False):
        """RLlib's `save_to_path`; a local `path` is written crash-safely (a temporary sibling
        directory, a manifest of checksums, then a rename), so overwriting an existing
        checkpoint never leaves a mix of two saves."""
        if path is None or filesystem is not None or not checkpoints.is_local(path):
            return super().save_to_path(path, state=state, filesystem=filesystem,
                                        use_msgpack=use_msgpack)
        return checkpoints.save_atomically(
            path, lambda tmp: super(DreamerV3, self).save_to_path(
                tmp, state=state, use_msgpack=use_msgpack),
            info=self._checkpoint_info())

    def restore_from_path(self, path, *, component=None, filesystem=None, **kwargs):
        """RLlib's `restore_from_path`, after checking a local checkpoint: every file against
        the manifest's checksums, and the replay buffer's shape against this algorithm's.
        A failed check raises before anything is restored."""
        if filesystem is None and checkpoints.is_local(path):
            checkpoints.recover_interrupted_save(path)
            if component is None:
                manifest = checkpoints.verify(path)
                if manifest is not None:
                    self._check_checkpoint_info(path, manifest["info"])
            elif checkpoints.read_manifest(path) is not None:
                checkpoints.verify(path)
        super().restore_from_path(path, component=component, filesystem=filesystem, **kwargs)

    @classmethod
    def from_checkpoint(cls, path, filesystem=None, **kwargs):
        """RLlib's `from_checkpoint`; a local checkpoint's files are verified before the
        algorithm is built (a damaged file is named in a `CheckpointError`)."""
        if filesystem is None and checkpoints.is_local(path):
            checkpoints.recover_interrupted_save(path)
            if pathlib.Path(path).is_dir():
                checkpoints.verify(path)
        return super().from_checkpoint(path, filesystem=filesystem, **kwargs)

    def get_state(self, components=None, *, not_components=None, **kwargs):
        state = super().get_state(components, not_components=not_components, **kwargs)
        state["dreamer_counters"] = dict(self._counters)
        if self.config.store_replay_buffer_in_checkpoint:
            state["replay_buffer"] = self.replay_buffer.get_state()
        return state

    def set_state(self, state):
        if "replay_buffer" in state:  # checked before anything is written
            self.replay_buffer.check_state(state["replay_buffer"])
        super().set_state(state)
        if "dreamer_counters" in state:
            self._counters.update(state["dreamer_counters"])
        if "replay_buffer" in state:
            self.replay_buffer.set_state(state["replay_buffer"])
