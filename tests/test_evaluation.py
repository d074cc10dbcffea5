"""RLlib's `.evaluation(...)` for DreamerV3: eval EnvRunners, greedy actions, training untouched."""

import math
import pickle

import gymnasium as gym
import helpers
import numpy as np
import pytest
from ray.rllib.utils.metrics import (
    ENV_RUNNER_RESULTS,
    EVALUATION_RESULTS,
    NUM_ENV_STEPS_SAMPLED_LIFETIME,
)

from rllib_dreamerv3.env_runner import DreamerV3EnvRunner, ReplayChunk

pytestmark = pytest.mark.usefixtures("ray_session")


def tiny_config(env="CartPole-v1"):
    return helpers.tiny_config(
        env, batch_size_B=4, num_steps_sampled_before_learning_starts=16, jit_compile=False
    )


class _FixedLengthEnv(gym.Env):
    """Episodes of 3 steps with reward 1 per step; the action is recorded."""

    observation_space = gym.spaces.Box(-1, 1, (2,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, config=None):
        self.t = 0

    def reset(self, *, seed=None, options=None):
        self.t = 0
        return np.zeros(2, np.float32), {}

    def step(self, action):
        self.t += 1
        return np.full(2, self.t / 3, np.float32), 1.0, self.t == 3, False, {}


class _GrowingEpisodesEnv(gym.Env):
    """Episode k (from 0) lasts k + 1 steps with reward 1 per step: its return is k + 1."""

    observation_space = gym.spaces.Box(-1, 1, (2,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, config=None):
        self.episode, self.t = -1, 0

    def reset(self, *, seed=None, options=None):
        self.episode, self.t = self.episode + 1, 0
        return np.zeros(2, np.float32), {}

    def step(self, action):
        self.t += 1
        done = self.t == self.episode + 1
        return np.full(2, self.t / 20, np.float32), 1.0, done, False, {}


def test_episode_metrics_are_smoothed_over_the_last_episodes_across_iterations():
    # 16 steps per iteration and episodes of 7, 8, 9, ... steps: one or two episodes end in an
    # iteration, so the window of 4 spans iterations. Ray 2.60's own reduction would report
    # the mean of the iteration's episodes only.
    window = 4
    config = tiny_config(_GrowingEpisodesEnv).reporting(metrics_num_episodes_for_smoothing=window)
    algo = config.build_algo()
    try:
        for _ in range(4):
            result = algo.train()
        steps = result[ENV_RUNNER_RESULTS][NUM_ENV_STEPS_SAMPLED_LIFETIME]
        finished = 0  # episodes of 1, 2, ... steps end at 1, 3, 6, 10, ... steps
        while (finished + 1) * (finished + 2) // 2 <= steps:
            finished += 1
        last = np.arange(finished - window + 1, finished + 1)  # their returns = lengths
        runners = result[ENV_RUNNER_RESULTS]
        assert runners["episode_return_mean"] == pytest.approx(last.mean())
        assert runners["episode_len_mean"] == pytest.approx(last.mean())
        assert (runners["episode_return_min"], runners["episode_return_max"]) == (
            last[0],
            last[-1],
        )
        assert result["episode_return_mean"] == pytest.approx(last.mean())  # Tune's column
        # The window is part of the checkpoint state.
        state = algo.get_state()
        assert [length for _, length in state["dreamer_recent_episodes"]] == list(last)
    finally:
        algo.stop()


def _finite(value):
    return value is not None and math.isfinite(float(value))


def test_sample_num_episodes_runs_whole_episodes_from_a_reset():
    config = tiny_config(_FixedLengthEnv).env_runners(num_envs_per_env_runner=2)
    runner = DreamerV3EnvRunner(config=config, worker_index=0)
    runner.sample(num_timesteps=4)  # mid-episode in both envs
    chunks = runner.sample(num_episodes=2)
    # Envs restart, so both end after exactly 3 steps: 2 episodes, 3 env steps per chunk.
    assert [chunk.env_steps() for chunk in chunks] == [3, 3]
    assert sum(chunk.agent_steps() for chunk in chunks) == 6
    steps = chunks[0][1]
    assert steps["is_first"][0] and len(steps["obs"]) == 4  # 3 acting steps + final obs
    metrics = runner.get_metrics()
    # The 2 episodes cut short by the reset are not counted; the 2 complete ones are.
    assert float(metrics["num_episodes"]) == 2
    assert float(metrics["episode_return_mean"]) == pytest.approx(3.0)
    # `progress` sees the episodes ended so far before every step, and the last count.
    reported = []
    runner.sample(num_episodes=4, progress=reported.append)
    assert reported == [0, 0, 0, 2, 2, 2, 4]  # two envs of 3-step episodes, in lockstep
    reported.clear()
    runner.sample(num_timesteps=4, progress=reported.append)  # steps per env without episodes
    assert reported == [0, 1, 2]
    runner.stop()


def test_replay_chunk_is_a_pair_that_survives_pickling():
    chunk = ReplayChunk((1, 0), {"obs": np.zeros((3, 2))}, 2)
    stream_key, steps = chunk
    assert stream_key == (1, 0) and steps["obs"].shape == (3, 2)
    copy = pickle.loads(pickle.dumps(chunk))
    assert copy[0] == (1, 0) and copy.env_steps() == 2 and copy.agent_steps() == 2


def test_evaluation_is_greedy_by_default_and_can_explore():
    assert tiny_config().get_evaluation_config_object().explore is False
    config = tiny_config().evaluation(evaluation_config={"explore": True})
    assert config.get_evaluation_config_object().explore is True
    # Other overrides keep the greedy default.
    config = tiny_config().evaluation(evaluation_config={"env_config": {}})
    assert config.get_evaluation_config_object().explore is False


def test_evaluate_without_evaluation_settings_leaves_training_untouched():
    algo = tiny_config().evaluation(evaluation_duration=3).build_algo()
    try:
        algo.train()
        training_runner = algo.env_runner
        pending, lifetime = training_runner._pending, training_runner.num_env_steps_sampled_lifetime
        stored = len(algo.replay_buffer)
        sampled = algo.metrics.peek((ENV_RUNNER_RESULTS, NUM_ENV_STEPS_SAMPLED_LIFETIME))

        results = algo.evaluate()

        evaluation = results[ENV_RUNNER_RESULTS]
        assert evaluation["num_episodes"] >= 3
        for key in ("episode_return_mean", "episode_return_min", "episode_return_max"):
            assert _finite(evaluation[key]), key
        # A separate evaluation EnvRunner ran the episodes; training's is where it was.
        assert algo.eval_env_runner_group is not None
        assert training_runner._pending is pending
        assert training_runner.num_env_steps_sampled_lifetime == lifetime
        assert len(algo.replay_buffer) == stored
        assert algo.metrics.peek((ENV_RUNNER_RESULTS, NUM_ENV_STEPS_SAMPLED_LIFETIME)) == sampled
        # The next iteration counts its own ~16 steps, not the >= 24 evaluation steps.
        result = algo.train()
        assert sampled < result[ENV_RUNNER_RESULTS]["num_env_steps_sampled_lifetime"] < sampled + 24
    finally:
        algo.stop()


def test_evaluation_interval_on_a_remote_evaluation_env_runner():
    config = tiny_config().evaluation(
        evaluation_interval=1,
        evaluation_num_env_runners=1,
        evaluation_duration=40,
        evaluation_duration_unit="timesteps",
    )
    algo = config.build_algo()
    try:
        result = algo.train()
        stored = len(algo.replay_buffer)
    finally:
        algo.stop()
    evaluation = result[EVALUATION_RESULTS][ENV_RUNNER_RESULTS]
    assert evaluation["num_env_steps_sampled"] >= 40
    assert evaluation["num_episodes"] >= 1 and _finite(evaluation["episode_return_mean"])
    # Only the training samples (warm-up: 16 steps, plus a final record per episode end)
    # reached the buffer and the counters; the 40 evaluation steps did not.
    assert result[ENV_RUNNER_RESULTS]["num_env_steps_sampled_lifetime"] == 16
    assert 16 <= stored < 16 + 40
