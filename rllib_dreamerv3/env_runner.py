"""`DreamerV3EnvRunner`: steps `num_envs_per_env_runner` gymnasium envs with the stateful policy.

Each sub-env is one replay stream. Steps are recorded as `(obs, action, reward, is_first,
is_terminal)`: the action is the one taken after seeing `obs` (zeros on an episode's last step),
the reward is the one received on arriving at `obs`. A terminated episode's last step has
`is_terminal=True`; a truncated one's has `is_terminal=False` (the episode did not end in the
environment, so the continue head must not learn a terminal there).

With `overlap_policy_and_envs` (on by default for image observations and >= 2 envs), the envs
form two groups: while the compiled policy computes one group's actions on a worker thread (TF
releases the GIL), the main thread steps the other group's envs. Every env still acts on its
latest observation; only the grouping of policy calls (and so the random draws) differs.

Every observation and reward is checked against the observation space (shape, dtype) and for
NaN/inf (`nonfinite_env_data`). A sub-env that raises is replaced when
`restart_failed_sub_environments` is set; otherwise the error propagates, and since that call's
steps are lost, the next `sample()` starts every env's episode anew, so that no replay stream
continues across the gap.
"""

import collections
import logging
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import ray
from ray.rllib.algorithms.algorithm import Algorithm
from ray.rllib.core import COMPONENT_RL_MODULE, DEFAULT_MODULE_ID
from ray.rllib.env import INPUT_ENV_SINGLE_SPACES, INPUT_ENV_SPACES
from ray.rllib.env.env_context import EnvContext
from ray.rllib.env.env_runner import EnvRunner
from ray.rllib.utils.checkpoints import Checkpointable
from ray.rllib.utils.metrics import (
    EPISODE_LEN_MAX,
    EPISODE_LEN_MEAN,
    EPISODE_LEN_MIN,
    EPISODE_RETURN_MAX,
    EPISODE_RETURN_MEAN,
    EPISODE_RETURN_MIN,
    NUM_ENV_STEPS_SAMPLED,
    NUM_ENV_STEPS_SAMPLED_LIFETIME,
    NUM_EPISODES,
    NUM_EPISODES_LIFETIME,
)
from ray.tune.registry import ENV_CREATOR, _global_registry

from rllib_dreamerv3.envs.atari import is_atari_id, make_atari_env
from rllib_dreamerv3.envs.dmc import is_dmc_id, make_dmc_env
from rllib_dreamerv3.replay_buffer import FIELDS
from rllib_dreamerv3.spaces import (
    action_dim,
    is_discrete,
    is_image,
    rescale_action,
)
from rllib_dreamerv3.tf_rllib import ensure_tf2_behavior, limit_tf_threads

WEIGHTS_SEQ_NO = "weights_seq_no"
NUM_NONFINITE_ENV_STEPS_SKIPPED = "num_nonfinite_env_steps_skipped"
NUM_SUB_ENV_RESTARTS = "num_sub_env_restarts"
logger = logging.getLogger(__name__)


def make_env(config, worker_index=0, vector_index=0):
    """Create one env from `config.env` the way RLlib does (Tune registry, class, gym id).

    An ALE id not registered with Tune goes to `make_atari_env`, with `config.env_config` as its
    settings: `"ALE/<Game>-v5"` is built as in the paper, other ALE versions are rejected. A
    `"DMC/<domain>-<task>"` id goes to `make_dmc_env` alike.
    """
    context = EnvContext(config.env_config, worker_index=worker_index, vector_index=vector_index)
    special = is_atari_id(config.env) or is_dmc_id(config.env)
    if special and not _global_registry.contains(ENV_CREATOR, config.env):
        return (make_atari_env if is_atari_id(config.env) else make_dmc_env)(config.env, context)
    _, creator = Algorithm._get_env_id_and_creator(config.env, config)
    try:
        return creator(context)
    except Exception as err:  # gymnasium raises several error types for unknown ids
        raise ValueError(
            f"Could not create env {config.env!r} with env_config={dict(config.env_config)}: "
            f"{err}. Give a gymnasium id (e.g. 'CartPole-v1'), an env class, or a name "
            "registered with ray.tune.register_env."
        ) from err


class ReplayChunk(tuple):
    """`(stream_key, steps)` of one sub-env from one `sample()` call.

    `env_steps()` / `agent_steps()` count the env steps it took (the final observation of an
    episode is one more record but no step): RLlib's evaluation loop sums them over what
    `sample()` returns, as it would over episodes.
    """

    def __new__(cls, stream_key, steps, num_env_steps):
        chunk = super().__new__(cls, (stream_key, steps))
        chunk.num_env_steps = num_env_steps
        return chunk

    def __getnewargs__(self):  # chunks are pickled on their way back from remote EnvRunners
        return (*self, self.num_env_steps)

    def env_steps(self):
        return self.num_env_steps

    def agent_steps(self):
        return self.num_env_steps


class DreamerV3EnvRunner(EnvRunner, Checkpointable):
    """EnvRunner for DreamerV3: a vector of envs, the compiled stateful policy, replay chunks.

    `sample()` returns a list of `(stream_key, steps)` with `steps` a dict of numpy arrays (the
    replay buffer's `FIELDS`), one entry per sub-env; `stream_key` is `(worker_index, env_index)`.
    """

    def __init__(self, *, config, **kwargs):
        ensure_tf2_behavior()
        super().__init__(config=config, **kwargs)
        limit_tf_threads(self._tf_threads())
        self._given_spaces = kwargs.get("spaces")
        self.num_envs = self.config.num_envs_per_env_runner
        has_env = (
            self.worker_index > 0
            or self.config.num_env_runners == 0
            or self.config.create_env_on_local_worker
        )
        self.envs = (
            [make_env(self.config, self.worker_index, i) for i in range(self.num_envs)]
            if has_env
            else []
        )
        self.module = self.config.get_rl_module_spec(
            spaces=self.get_spaces(), inference_only=True
        ).build()
        self._weights_seq_no = 0
        self._rng = np.random.default_rng(
            None if self.config.seed is None else self.config.seed + self.worker_index
        )
        if self.config.seed is not None:
            self.module.set_policy_seed(self.config.seed + self.worker_index)
        self.shares_learner_module = False  # see `share_module`
        self._pending = None  # per env: the current observation's record, waiting for an action
        self._pool = None  # the policy's worker thread when envs and policy overlap
        # (return, length) until `pop_finished_episodes`; only the smoothing window's worth.
        self._finished_episodes = collections.deque(
            maxlen=self.config.metrics_num_episodes_for_smoothing
        )

    def share_module(self, module):
        """Act with `module`, the Learner's RLModule in this process, instead of a copy.

        The policy then reads the Learner's variables themselves: every update is visible to
        the next action without copying weights, and `set_state` leaves the module's weights
        alone (they are the Learner's). Only for a local EnvRunner beside a local Learner; the
        policy's seed carries over, so the actions equal those of a copy synced after every
        update.
        """
        if self.worker_index != 0:
            raise ValueError(
                f"share_module is for the local EnvRunner (worker_index 0), not {self.worker_index}"
            )
        module.set_policy_seed_state(self.module.get_policy_seed_state())
        self.module = module
        self.shares_learner_module = True

    def _tf_threads(self):
        """TF threads of this process: `tf_num_threads`, else for a remote runner the CPUs Ray
        gives it (like Ray's OMP_NUM_THREADS; idle TF threads spinning next to the envs slow
        sampling down), else TF's default (the local runner shares the Learner's process)."""
        threads = getattr(self.config, "tf_num_threads", None)
        if threads is None and self.worker_index > 0:
            threads = max(1, round(self.config.num_cpus_per_env_runner or 1))
        return threads

    @property
    def overlaps_policy_and_envs(self):
        """Whether `sample()` steps one group of envs while the policy acts for the other."""
        overlap = self.config.overlap_policy_and_envs
        if overlap == "auto":
            return self.num_envs >= 2 and is_image(self.module.observation_space)
        return bool(overlap) and self.num_envs >= 2

    # --- RLlib plumbing -------------------------------------------------------------------------
    def get_spaces(self):
        if not self.envs:
            return self._given_spaces
        spaces = (self.envs[0].observation_space, self.envs[0].action_space)
        return {
            INPUT_ENV_SPACES: spaces,
            INPUT_ENV_SINGLE_SPACES: spaces,
            DEFAULT_MODULE_ID: spaces,
        }

    def assert_healthy(self):
        assert self.module is not None, "DreamerV3EnvRunner has no module."

    def get_metrics(self):
        return self.metrics.reduce()

    def pop_finished_episodes(self):
        """`(return, length)` of the episodes finished since the last call, oldest first (at
        most `metrics_num_episodes_for_smoothing`, the latest).

        The algorithm smooths its episode metrics over these (see
        `DreamerV3.step`): Ray's metrics reduce each iteration's episodes on their own."""
        episodes = list(self._finished_episodes)
        self._finished_episodes.clear()
        return episodes

    def get_state(self, components=None, *, not_components=None, **kwargs):
        state = {
            NUM_ENV_STEPS_SAMPLED_LIFETIME: self.num_env_steps_sampled_lifetime,
            WEIGHTS_SEQ_NO: self._weights_seq_no,
        }
        if self._check_component(COMPONENT_RL_MODULE, components, not_components):
            state[COMPONENT_RL_MODULE] = self.module.get_state(inference_only=True)
        return state

    def set_state(self, state):
        if COMPONENT_RL_MODULE in state:
            module_state = state[COMPONENT_RL_MODULE]
            if isinstance(module_state, ray.ObjectRef):
                module_state = ray.get(module_state)
            module_state = module_state.get(DEFAULT_MODULE_ID, module_state)
            seq_no = state.get(WEIGHTS_SEQ_NO, 0)
            if self.shares_learner_module:  # these are the module's own weights already
                self._weights_seq_no = max(seq_no, self._weights_seq_no)
            elif seq_no == 0 or seq_no > self._weights_seq_no:
                self.module.set_state(module_state)
                self._weights_seq_no = seq_no
        if NUM_ENV_STEPS_SAMPLED_LIFETIME in state:
            self.num_env_steps_sampled_lifetime = state[NUM_ENV_STEPS_SAMPLED_LIFETIME]

    def get_ctor_args_and_kwargs(self):
        return (), {"config": self.config, "spaces": self.get_spaces()}

    def stop(self):
        if self._pool is not None:
            self._pool.shutdown()
        for env in self.envs:
            env.close()

    # --- sampling -------------------------------------------------------------------------------
    def _reset_env(self, i):
        obs, _ = self.envs[i].reset(
            seed=None if self.config.seed is None else int(self._rng.integers(2**31))
        )
        self._returns[i], self._lengths[i] = 0.0, 0
        obs, _ = self._checked(i, obs, 0.0, "reset()", allow_skip=False)
        return {"obs": obs, "rewards": 0.0, "is_first": True, "is_terminal": False}

    def _env_name(self, i):
        env = self.config.env
        return f"env {getattr(env, '__name__', env)!r} (EnvRunner {self.worker_index}, sub-env {i})"

    def _checked(self, i, obs, reward, source, allow_skip=True):
        """`(obs, reward)`, the observation in the model format (see `spaces.ObsFormat`), if they
        fit the observation space and are finite.

        A wrong shape, dtype or Dict key raises. A NaN/inf raises, or with
        `nonfinite_env_data='skip'` (and `allow_skip`) returns None: the caller drops the step.
        """
        try:
            obs = self.module.obs_format.convert(obs)
        except ValueError as err:
            raise ValueError(
                f"{self._env_name(i)} returned {err} at {source}. Make the env return "
                "observations of its declared space (or wrap it, e.g. with gymnasium.wrappers."
                "FlattenObservation or DtypeObservation)."
            ) from None
        try:
            reward = float(reward)
        except (TypeError, ValueError):
            raise ValueError(
                f"{self._env_name(i)} returned the reward {reward!r} at {source}; "
                "rewards must be scalar numbers."
            ) from None
        nonfinite = None if not np.isfinite(reward) else self.module.obs_format.nonfinite(obs)
        if np.isfinite(reward) and nonfinite is None:
            return obs, reward
        if nonfinite is None:
            bad, detail = "reward", f"reward={reward}"
        else:
            key, count, index = nonfinite
            bad = "obs" if key is None else f"obs[{key!r}]"
            detail = f"{bad} has {count} NaN/inf entries, the first at index {index}"
        if allow_skip and self.config.nonfinite_env_data == "skip":
            return None
        raise ValueError(
            f"{self._env_name(i)} returned a non-finite {bad!r} at {source} ({detail}). "
            "DreamerV3 would learn NaN weights "
            "from it. Fix the env, clean its output with a gymnasium wrapper (e.g. "
            "TransformObservation with np.nan_to_num), or set nonfinite_env_data='skip' to "
            "drop such steps (the episode then ends there)."
        )

    def _restart_env(self, i, err):
        """`restart_failed_sub_environments`: replace sub-env `i` after it raised `err`; its
        episode is abandoned and the next step starts a new one (`is_first`)."""
        logger.warning(
            "%s raised %r; restarting it (restart_failed_sub_environments=True).",
            self._env_name(i),
            err,
        )
        try:
            self.envs[i].close()
        except Exception:  # a broken env may fail to close; it is replaced either way
            logger.debug("Closing the failed %s raised.", self._env_name(i), exc_info=True)
        self.envs[i] = make_env(self.config, self.worker_index, i)
        self.metrics.log_value(NUM_SUB_ENV_RESTARTS, 1, reduce="lifetime_sum")
        return self._reset_env(i)

    def _start(self):
        space = self.module.action_space
        self._discrete = is_discrete(space)
        self._action_dim = action_dim(space)
        self._returns = np.zeros(self.num_envs)
        self._lengths = np.zeros(self.num_envs, np.int64)
        self._pending = [self._reset_env(i) for i in range(self.num_envs)]
        self._state = {
            k: np.repeat(v[None], self.num_envs, 0)
            for k, v in self.module.get_initial_state().items()
        }
        # Envs whose policy state is stale (random-action steps): their next policy call
        # treats them as first steps.
        self._restart_policy = np.zeros(self.num_envs, bool)

    def _random_actions(self):
        """Uniform random actions from the runner's seeded RNG: (env actions, model actions)."""
        space = self.module.action_space
        if self._discrete:
            index = self._rng.integers(self._action_dim, size=self.num_envs)
            model_actions = np.eye(self._action_dim, dtype=np.float32)[index]
            return index + space.start, model_actions
        model_actions = self._rng.uniform(-1.0, 1.0, (self.num_envs, self._action_dim))
        env_actions = rescale_action(model_actions, space.low, space.high)
        return env_actions.astype(space.dtype), model_actions.astype(np.float32)

    def _policy(self, explore, envs):
        """Actions of the envs `envs` (index array) from their pending observations.

        Returns `(env actions, model actions, new policy state)`; changes nothing (so that it can
        run on the worker thread): :meth:`_commit` stores the state once the actions are used.
        """
        obs = self.module.obs_format.stack([self._pending[i]["obs"] for i in envs])
        is_first = (
            np.array([self._pending[i]["is_first"] for i in envs]) | self._restart_policy[envs]
        )
        out = self.module.forward_exploration if explore else self.module.forward_inference
        result = out(
            {
                "obs": obs,
                "is_first": is_first,
                "state_in": {k: v[envs] for k, v in self._state.items()},
            }
        )
        state = {k: v.numpy() for k, v in result["state_out"].items()}
        return result["actions"].numpy(), result["actions_model"].numpy(), state

    def _commit(self, envs, state):
        for key, value in state.items():
            self._state[key][envs] = value
        self._restart_policy[envs] = False

    def _step_envs(self, envs, env_actions, model_actions, records):
        """Step the envs `envs` with their actions; returns how many episodes ended."""
        ended = 0
        for i, env_action, model_action in zip(envs, env_actions, model_actions):
            records[i].append({**self._pending[i], "actions": model_action})
            try:
                obs, reward, terminated, truncated, _ = self.envs[i].step(env_action)
            except Exception as err:
                if not self.config.restart_failed_sub_environments:
                    raise
                self._pending[i] = self._restart_env(i, err)
                continue
            checked = self._checked(
                i,
                obs,
                reward,
                f"step {self._lengths[i] + 1} of its episode (action {env_action!r})",
            )
            if checked is None:  # nonfinite_env_data='skip': the episode ends before this step
                self.metrics.log_value(NUM_NONFINITE_ENV_STEPS_SKIPPED, 1, reduce="lifetime_sum")
                self._pending[i] = self._reset_env(i)
                continue
            obs, reward = checked
            self._returns[i] += reward
            self._lengths[i] += 1
            if terminated or truncated:
                records[i].append(
                    {
                        "obs": obs,
                        "actions": np.zeros(self._action_dim),
                        "rewards": reward,
                        "is_first": False,
                        "is_terminal": bool(terminated),
                    }
                )
                self._log_episode(self._returns[i], self._lengths[i])
                ended += 1
                self._pending[i] = self._reset_env(i)
            else:
                self._pending[i] = {
                    "obs": obs,
                    "rewards": reward,
                    "is_first": False,
                    "is_terminal": False,
                }
        return ended

    def sample(
        self,
        *,
        num_timesteps=None,
        num_episodes=None,
        explore=None,
        random_actions=False,
        force_reset=False,
        progress=None,
        **kwargs,
    ):
        """Step every sub-env `num_timesteps / num_envs` times (default: the config's amount).

        With `num_episodes` (RLlib's evaluation asks for it), the envs are reset first and
        stepped until at least that many episodes have ended; episodes still running then are
        left out of the metrics. `force_reset` also resets the envs first: the episodes in
        progress are abandoned, and the next chunk of each stream starts with `is_first`.
        `explore` defaults to `config.explore` (False in evaluation, see `DreamerV3Config`).
        `progress`, if given, is called before every step with the episodes ended so far (with
        `num_episodes`) or the steps per env done so far (e.g. to drive a progress bar).

        Returns `[ReplayChunk(stream_key, steps), ...]`, one chunk per sub-env (see the class
        docstring).
        """
        if not self.envs:
            raise RuntimeError(
                "This EnvRunner has no envs (the local runner when "
                "num_env_runners > 0); sample from the remote runners."
            )
        if num_timesteps is not None and num_episodes is not None:
            raise ValueError("Give num_timesteps or num_episodes, not both.")
        explore = self.config.explore if explore is None else explore
        if self._pending is None or force_reset or num_episodes is not None:
            self._start()
        steps_per_env = (
            -(-num_timesteps // self.num_envs) if num_timesteps else self.config.steps_per_sample
        )
        records = [[] for _ in range(self.num_envs)]

        def more(steps_done, episodes_done):
            if progress is not None:
                progress(episodes_done if num_episodes is not None else steps_done)
            return (
                episodes_done < num_episodes
                if num_episodes is not None
                else steps_done < steps_per_env
            )

        try:
            if random_actions or not self.overlaps_policy_and_envs:
                steps_done = self._sample_in_lockstep(explore, random_actions, records, more)
            else:
                steps_done = self._sample_overlapped(explore, records, more)
        except BaseException:
            # This call's steps are lost with the exception: the next call restarts every env
            # (`is_first`), so no replay stream joins its stored steps to steps after the gap.
            self._pending = None
            raise
        num_steps = steps_done * self.num_envs
        self.num_env_steps_sampled_lifetime += num_steps
        self.metrics.log_value(NUM_ENV_STEPS_SAMPLED, num_steps, reduce="sum")
        self.metrics.log_value(
            NUM_ENV_STEPS_SAMPLED_LIFETIME, num_steps, reduce="lifetime_sum", with_throughput=True
        )
        return [
            ReplayChunk((self.worker_index, i), self._stack(recs), steps_done)
            for i, recs in enumerate(records)
        ]

    def _sample_in_lockstep(self, explore, random_actions, records, more):
        """One policy call for all envs, then every env steps; returns steps per env."""
        everyone = np.arange(self.num_envs)
        steps_done = episodes_done = 0
        while more(steps_done, episodes_done):
            steps_done += 1
            if random_actions:
                env_actions, model_actions = self._random_actions()
                # The policy's recurrent state did not follow these steps: restart it.
                self._restart_policy[:] = True
            else:
                env_actions, model_actions, state = self._policy(explore, everyone)
                self._commit(everyone, state)
            episodes_done += self._step_envs(everyone, env_actions, model_actions, records)
        return steps_done

    def _sample_overlapped(self, explore, records, more):
        """Two env groups A and B: B's policy call runs while A's envs step, and A's next one
        while B's envs step. In `num_episodes` mode A's next actions are computed before it is
        known whether the loop goes on; unused, they are dropped (their state is not stored)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="dreamer_policy")
        group_a, group_b = np.array_split(np.arange(self.num_envs), 2)
        steps_done = episodes_done = 0
        if not more(steps_done, episodes_done):
            return 0
        actions_a = self._policy(explore, group_a)
        while True:
            self._commit(group_a, actions_a[2])
            steps_done += 1
            pending_b = self._pool.submit(self._policy, explore, group_b)
            try:
                episodes_done += self._step_envs(group_a, *actions_a[:2], records)
            finally:
                actions_b = pending_b.result()
            self._commit(group_b, actions_b[2])
            # Steps and episodes only grow: if the loop ends now, A needs no next actions.
            last = not more(steps_done, episodes_done)
            pending_a = None if last else self._pool.submit(self._policy, explore, group_a)
            try:
                episodes_done += self._step_envs(group_b, *actions_b[:2], records)
            finally:
                if pending_a is not None:
                    actions_a = pending_a.result()
            if last or not more(steps_done, episodes_done):
                return steps_done

    def _stack(self, records):
        out = {key: np.asarray([r[key] for r in records]) for key in FIELDS if key != "obs"}
        out["obs"] = self.module.obs_format.stack([r["obs"] for r in records])
        out["actions"] = out["actions"].astype(np.float32)
        out["rewards"] = out["rewards"].astype(np.float32)
        return out

    def _log_episode(self, episode_return, length):
        self._finished_episodes.append((float(episode_return), int(length)))
        window = self.config.metrics_num_episodes_for_smoothing
        self.metrics.log_value(EPISODE_RETURN_MEAN, episode_return, window=window)
        self.metrics.log_value(EPISODE_LEN_MEAN, length, window=window)
        self.metrics.log_value(EPISODE_RETURN_MIN, episode_return, reduce="min", window=window)
        self.metrics.log_value(EPISODE_RETURN_MAX, episode_return, reduce="max", window=window)
        self.metrics.log_value(EPISODE_LEN_MIN, length, reduce="min", window=window)
        self.metrics.log_value(EPISODE_LEN_MAX, length, reduce="max", window=window)
        self.metrics.log_value(NUM_EPISODES, 1, reduce="sum")
        self.metrics.log_value(NUM_EPISODES_LIFETIME, 1, reduce="lifetime_sum")
