"""Data-parallel Learners (`num_learners >= 2`): TF collectives set up by Ray Train's backend.

One of `conftest.ISOLATED_MODULES`: the whole suite runs this module in an interpreter of its
own. Every XLA compilation stays mapped in its process for good, and the whole suite in one
process comes close to Linux's default `vm.max_map_count` (65,530 memory maps; past it, TF dies
with SIGSEGV): with these tests in it, the suite crashed.
"""

import time

import gymnasium as gym
import numpy as np
import pytest
import ray
from helpers import tiny_config
from ray.rllib.core import DEFAULT_MODULE_ID

from rllib_dreamerv3 import DreamerV3Config
from rllib_dreamerv3.algorithm import learner_batches


@pytest.fixture(scope="module", autouse=True)
def ray_four_cpus():
    """Two Learners and two EnvRunners take a CPU each (logical CPUs: the machine has 2). A Ray
    left running by an earlier test module may have fewer: the Learners would wait forever."""
    if ray.is_initialized():
        ray.shutdown()
    ray.init(
        num_cpus=4,
        include_dashboard=False,
        runtime_env={"env_vars": {"TF_CPP_MIN_LOG_LEVEL": "3"}},
    )
    yield
    ray.shutdown()


def _spaces(env_id):
    env = gym.make(env_id)
    return {DEFAULT_MODULE_ID: (env.observation_space, env.action_space)}


def _fixed_batch(batch_size, length, obs_dim, num_actions, seed=0):
    rng = np.random.default_rng(seed)
    batch = {
        "obs": rng.normal(size=(batch_size, length, obs_dim)).astype(np.float32),
        "actions": np.eye(num_actions, dtype=np.float32)[
            rng.integers(0, num_actions, (batch_size, length))
        ],
        "rewards": rng.normal(size=(batch_size, length)).astype(np.float32),
        "is_first": np.zeros((batch_size, length), bool),
        "is_terminal": np.zeros((batch_size, length), bool),
    }
    batch["is_first"][:, 0] = True
    batch["is_terminal"][1, -3] = True  # one ended episode: its start state has cont 0
    return batch


def _weights(group):
    """All module variables (weights, EMA critic, return scale) as one float64 vector."""
    state = group.get_state(components="learner/rl_module")["learner"]["rl_module"]
    module = state[DEFAULT_MODULE_ID]
    return np.concatenate([np.ravel(module[key]).astype(np.float64) for key in sorted(module)])


def _relative_difference(weights, reference, start):
    return np.linalg.norm(weights - reference) / np.linalg.norm(reference - start)


def test_two_learners_make_the_update_of_one_learner_on_the_whole_batch():
    # B = 4 rows: each of the two Learners gets 2, all-reduces its gradients (mean), gathers
    # the returns for the return scale's percentiles and draws its rows' share of the random
    # numbers: the update is that of one Learner on all 4 rows, up to float32 rounding.
    spaces = _spaces("CartPole-v1")
    config = tiny_config("CartPole-v1", batch_size_B=4)
    two = config.copy().learners(num_learners=2).build_learner_group(spaces=spaces)
    # The same graph without collectives (XLA cannot compile them on CPUs), and the XLA one.
    plain = config.copy().training(jit_compile=False).build_learner_group(spaces=spaces)
    xla = config.copy().training(jit_compile=True).build_learner_group(spaces=spaces)
    try:
        state = xla.get_state()
        two.set_state(state)
        plain.set_state(state)
        start = _weights(xla)
        batch = _fixed_batch(4, 8, 4, 2)
        for update in range(1, 11):
            results = two.update(**learner_batches(batch, 2))
            plain.update(**learner_batches(batch, 1))
            xla.update(**learner_batches(batch, 1))
            if update in (1, 10):
                weights, reference = _weights(two), _weights(plain)
                assert _relative_difference(weights, reference, start) <= (
                    1e-5 if update == 1 else 1e-4
                )
                # XLA rounds differently (one ulp on untouched weights already counts here).
                assert _relative_difference(weights, _weights(xla), start) <= 1e-4
        assert weights.shape == reference.shape and not np.array_equal(weights, start)
        # Both Learners report the whole batch's metrics.
        first, second = (result[DEFAULT_MODULE_ID] for result in results)
        assert first["L_world_model"].peek() == second["L_world_model"].peek()
        assert first["return_scale"].peek() == second["return_scale"].peek()
    finally:
        for group in (two, plain, xla):
            group.shutdown()


# Opt-in: the longest test here; the update's equality with one Learner is the default check.
@pytest.mark.slow
def test_two_learners_with_two_env_runners_stay_identical():
    config = (
        tiny_config("CartPole-v1", batch_size_B=4, training_ratio=64)
        .learners(num_learners=2)
        .env_runners(num_env_runners=2)
    )
    algo = config.build_algo()
    try:
        while (result := algo.train())["num_updates_lifetime"] < 20:
            pass
        states = algo.learner_group.foreach_learner(
            lambda learner: [v.numpy() for v in learner._all_variables()]
        )
        states = [state.get() for state in states]
        assert len(states) == 2
        # weights, EMA critic, return scale; the three Adams' step counts and moments
        assert len(states[0]) > 2 * len(algo.get_module().tf_variables()) + 3
        for first, second in zip(*states):
            np.testing.assert_allclose(first, second, rtol=0, atol=1e-6)
        learner = result["learners"][DEFAULT_MODULE_ID]
        assert learner["num_update_traces"] == 1
        assert np.isfinite(learner["L_world_model"]) and learner["return_scale"] > 0
        assert result["num_env_steps_trained_lifetime"] == result["num_updates_lifetime"] * 4 * 8
        # EnvRunners act with the Learners' weights.
        runner = algo.env_runner_group.foreach_env_runner(
            lambda r: r.module.get_state(), local_env_runner=False
        )[0]
        learner_module = algo.get_module().get_state(inference_only=True)
        for key, value in learner_module.items():
            np.testing.assert_array_equal(runner[key], value, err_msg=key)
    finally:
        algo.stop()


def test_checkpoint_of_two_learners_restores_with_two_one_and_zero(tmp_path):
    config = tiny_config("CartPole-v1", batch_size_B=4).learners(num_learners=2)
    algo = config.build_algo()
    try:
        algo.train()
        path = algo.save_to_path(str(tmp_path / "ckpt"))
        saved = algo.get_module().get_state()
        updates = algo.train()["num_updates_lifetime"]
    finally:
        algo.stop()
    for num_learners in (2, 1, 0):
        restored = config.copy().learners(num_learners=num_learners).build_algo()
        try:
            restored.restore_from_path(path)
            state = restored.get_module().get_state()
            for key, value in saved.items():
                np.testing.assert_array_equal(state[key], value, err_msg=key)
            result = restored.train()  # and continues
            assert result["num_updates_lifetime"] == updates
        finally:
            restored.stop()


def test_a_dead_learner_stops_training_with_a_clear_error():
    config = (
        tiny_config("CartPole-v1", batch_size_B=4, learner_peer_timeout_s=5.0)
        .learners(num_learners=2)
        .fault_tolerance(restart_failed_env_runners=False)
    )
    algo = config.build_algo()
    try:
        algo.train()
        ray.kill(algo.learner_group._workers[1])
        start = time.monotonic()
        with pytest.raises(RuntimeError) as info:
            algo.train()
        assert time.monotonic() - start < 60  # the timeout, not a hang
        message = str(info.value)
        assert "num_learners=2" in message and "cannot go on" in message
        assert "from_checkpoint" in message
    finally:
        algo.stop()


def test_batch_size_must_split_evenly_over_the_learners():
    config = DreamerV3Config().environment("CartPole-v1").training(batch_size_B=5)
    config.learners(num_learners=2)
    with pytest.raises(ValueError, match=r"batch_size_B=5 must be a multiple of num_learners=2"):
        config.validate()


def test_gpus_per_learner_without_gpus_is_a_clear_error():
    assert not ray.cluster_resources().get("GPU")
    config = DreamerV3Config().environment("CartPole-v1").learners(num_learners=2)
    config.learners(num_gpus_per_learner=1)
    with pytest.raises(ValueError) as info:
        config.validate()
    message = str(info.value)
    assert "num_gpus_per_learner=1" in message and "needs 2 GPU(s)" in message
    assert "num_gpus_per_learner=0" in message
