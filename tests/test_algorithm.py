"""DreamerV3 inside RLlib: build and train, remote runners/learners, checkpoints, env runner."""

import os
import time
import weakref

import gymnasium as gym
import numpy as np
import pytest
from helpers import tiny_config
from ray.rllib.core import DEFAULT_MODULE_ID

from rllib_dreamerv3 import DreamerV3, DreamerV3Config
from rllib_dreamerv3.env_runner import DreamerV3EnvRunner

LOSSES = (
    "L_world_model",
    "L_pred",
    "L_dyn",
    "L_rep",
    "L_decoder",
    "L_reward",
    "L_continue",
    "L_actor",
    "L_critic",
)
DIAGNOSTICS = (
    "kl_dyn_before_free_bits",
    "kl_rep_before_free_bits",
    "prior_entropy",
    "posterior_entropy",
    "return_scale",
    "critic_value_mean",
    "actor_entropy",
    "grad_norm_world_model",
    "grad_norm_actor",
    "grad_norm_critic",
)


pytestmark = pytest.mark.usefixtures("ray_session")


@pytest.mark.parametrize(
    "env,num_env_runners,num_learners",
    [
        ("CartPole-v1", 0, 0),
        # Opt-in: a remote EnvRunner and a remote Learner are each covered by a Pendulum case.
        pytest.param("CartPole-v1", 1, 1, marks=pytest.mark.slow),
        ("Pendulum-v1", 0, 1),
        ("Pendulum-v1", 1, 0),
    ],
)
def test_build_and_train_two_iterations(env, num_env_runners, num_learners):
    config = (
        tiny_config(env, jit_compile=True)  # the default, XLA-compiled update
        .env_runners(num_env_runners=num_env_runners)
        .learners(num_learners=num_learners)
    )
    algo = config.build_algo()
    try:
        for _ in range(2):
            result = algo.train()
        if num_learners == 0:  # fixed shapes: the update was traced once for all updates
            assert algo.learner_group._learner.num_traces == 1
        assert result["learners"][DEFAULT_MODULE_ID]["num_update_traces"] == 1
    finally:
        algo.stop()
    sampled = result["env_runners"]["num_env_steps_sampled_lifetime"]
    assert sampled >= 32 + 16
    updates = result["num_updates_lifetime"]
    # training_ratio 32 with B*T = 16: two updates per env step sampled after the warm-up.
    assert result["training_ratio_achieved"] == pytest.approx(32, rel=0.1)
    assert updates >= 2 * 16
    assert result["num_env_steps_trained_lifetime"] == updates * 2 * 8
    learner = result["learners"][DEFAULT_MODULE_ID]
    for key in LOSSES + DIAGNOSTICS:
        assert np.isfinite(learner[key]), key
    assert result["replay_buffer"]["num_steps_stored"] >= sampled
    assert result["replay_buffer"]["num_bytes"] > 0
    assert "dreams" not in result  # dream summaries come every 1000 updates by default
    # The result begins with the summary that Tune's status table shows as columns.
    summary = dict(list(result.items())[:4])
    # NaN where no episode has ended yet (Pendulum's last 200 steps)
    episode_return = result["env_runners"].get("episode_return_mean", np.nan)
    np.testing.assert_equal(
        summary,
        {
            "episode_return_mean": episode_return,
            **{key: learner[key] for key in ("L_world_model", "L_actor", "L_critic")},
        },
    )


def test_stop_releases_the_learner_and_env_runner_groups():
    # Released at `stop()`, not whenever the algorithm object goes: a trial actor is terminated
    # right after `stop()`, and a `__del__` interrupted then prints a traceback. (No `train()`:
    # each XLA compilation stays mapped in this process for good, see test_multi_learner.py.)
    algo = tiny_config("CartPole-v1").build_algo()
    groups = [weakref.ref(algo.learner_group), weakref.ref(algo.env_runner_group)]
    algo.stop()
    assert [group() for group in groups] == [None, None]


def test_pong_trains_two_iterations_with_uint8_frames_and_dreams():
    config = tiny_config(
        "ALE/Pong-v5",
        jit_compile=True,  # the default, XLA-compiled update, with the image encoder's kernels
        dream_every_n_updates=32,
        dream_num_sequences=1,
        dream_burn_in=3,
        replay_capacity=10_000,
    )
    algo = config.build_algo()
    try:
        results = [algo.train() for _ in range(2)]
        assert algo.replay_buffer.sample(1)["obs"].dtype == np.uint8
    finally:
        algo.stop()
    result = results[-1]
    assert result["num_updates_lifetime"] >= 32
    assert np.isfinite(result["learners"][DEFAULT_MODULE_ID]["L_decoder"])
    stored = result["replay_buffer"]["num_steps_stored"]
    per_step = 64 * 64 * 3 + 18 * 4 + 4 + 2 + 24  # frame, one-hot action, reward, flags, index
    assert result["replay_buffer"]["num_bytes"] == stored * per_step
    assert result["replay_buffer"]["capacity_bytes"] == 10_000 * per_step
    dreams = next(r["dreams"] for r in results if "dreams" in r)
    assert dreams["video"].shape == (1, 8, 3, 64, 3 * 64)
    assert dreams["reconstruction"].shape == (3, 2 * 64, 8 * 64)
    assert np.isfinite(dreams["obs_mse_open_loop"])


def test_warm_up_in_rounds_samples_what_one_call_would():
    # 37 warm-up steps on 2 envs: one call would step each env 19 times; ten rounds of 4 steps
    # (a multiple of the env count) and a remainder of 1 end at the same 38.
    config = tiny_config(num_steps_sampled_before_learning_starts=37)
    algo = config.env_runners(num_envs_per_env_runner=2).build_algo()
    try:
        calls = []
        sample = algo._sample
        algo._sample = lambda **kw: calls.append(kw["num_timesteps"]) or sample(**kw)
        algo._warm_up(37)
        assert calls == [4] * 9 + [1]
        assert algo.replay_buffer.num_steps_added == 38
    finally:
        algo.stop()


def test_training_step_warm_up_then_ratio():
    algo = tiny_config(training_ratio=64).build_algo()
    try:
        algo.training_step()
        assert algo.replay_buffer.num_steps_added >= 32  # warm-up, random actions
        assert algo._counters["num_updates"] == 1
        for _ in range(5):
            algo.training_step()
        # 5 samples of one step each at 4 updates per step (the first update included).
        assert algo._counters["num_updates"] == 5 * 4
    finally:
        algo.stop()


def test_remote_sampling_sends_a_function_pickled_by_reference(monkeypatch):
    # A function that Ray must pickle by value (a closure) costs a remote EnvRunner ~1 KB per
    # task that it never frees; the standard pickle refuses those and pickles a module-level
    # function (and a partial of one) by its name.
    import pickle

    algo = tiny_config().build_algo()
    sent = []

    def foreach_env_runner(func, local_env_runner=True):
        sent.append(func)
        return [func(algo.env_runner)]

    try:
        group = algo.env_runner_group
        monkeypatch.setattr(group, "num_remote_env_runners", lambda: 1)
        monkeypatch.setattr(group, "foreach_env_runner", foreach_env_runner)
        monkeypatch.setattr(algo, "_check_env_runners_sampled", lambda *args: None)
        algo._sample(num_timesteps=4)
    finally:
        algo.stop()
    (func,) = sent
    assert len(pickle.dumps(func)) < 300


def test_results_carry_the_eta_reference_after_the_first_iteration_with_updates():
    algo = tiny_config().build_algo()
    try:
        first = algo.train()  # warm-up and the first updates
        second = algo.train()
    finally:
        algo.stop()
    assert first["num_updates_lifetime"] > 0
    assert first["eta_reference"] is None
    assert second["eta_reference"] == {
        "training_iteration": 1,
        "time_total_s": first["time_total_s"],
        "num_env_steps_sampled_lifetime": first["env_runners"]["num_env_steps_sampled_lifetime"],
        "num_updates_lifetime": first["num_updates_lifetime"],
    }


def test_the_first_dream_compile_does_not_count_in_the_eta(monkeypatch):
    algo = tiny_config(dream_every_n_updates=0).build_algo()
    try:
        first = algo.train()
        algo.config._is_frozen = False  # the first dreams come in the second iteration
        algo.config.dream_every_n_updates = first["num_updates_lifetime"] + 1
        algo.config.freeze()
        compute = algo._compute_dreams

        def slow_first_compile():  # stands in for a compile of 1 s
            if not algo._dreams_compiled:
                time.sleep(1.0)
            return compute()

        monkeypatch.setattr(algo, "_compute_dreams", slow_first_compile)
        second, third = algo.train(), algo.train()
    finally:
        algo.stop()
    assert second.get("dreams") is not None
    assert third["eta_reference"]["training_iteration"] == 1
    assert third["eta_reference"]["time_total_s"] - first["time_total_s"] >= 1.0


def _module_state(algo):
    return algo.learner_group._learner.module[DEFAULT_MODULE_ID].get_state()


@pytest.mark.parametrize("store_buffer", [True, False])
def test_checkpoint_round_trip(tmp_path, store_buffer, monkeypatch):
    from ray.tune.trainable import trainable

    # Where Ray's Trainable would make its (empty) timestamped folder outside Tune.
    ray_results = tmp_path / "ray_results"
    monkeypatch.setattr(trainable, "DEFAULT_STORAGE_PATH", str(ray_results))
    algo = tiny_config(store_replay_buffer_in_checkpoint=store_buffer).build_algo()
    try:
        algo.train()
        algo.train()
        path = algo.save_to_path(str(tmp_path / "ckpt"))
        restored = DreamerV3.from_checkpoint(path)
        before = _module_state(algo)
        opt_before = algo.learner_group._learner._get_optimizer_state()
    finally:
        algo.stop()
    try:
        after = _module_state(restored)
        assert before.keys() == after.keys()
        assert any("critic_ema" in k for k in after) and "model/return_scale" in after
        for key in before:
            np.testing.assert_array_equal(before[key], after[key], err_msg=key)
        opt_after = restored.learner_group._learner._get_optimizer_state()
        assert sorted(opt_before) == sorted(opt_after) and len(opt_after) == 3
        for name in opt_before:
            for a, b in zip(opt_before[name]["variables"], opt_after[name]["variables"]):
                np.testing.assert_array_equal(a, b)
        assert restored._counters == algo._counters
        assert restored.training_iteration == 2
        assert restored._time_total == algo._time_total > 0  # time_total_s continues
        if store_buffer:
            assert len(restored.replay_buffer) == len(algo.replay_buffer)
            np.testing.assert_array_equal(restored.replay_buffer.sample(4)["obs"].shape, (4, 8, 4))
        else:
            assert len(restored.replay_buffer) == 0
        result = restored.train()  # continues where it stopped
        assert result["num_updates_lifetime"] > algo._counters["num_updates"]
    finally:
        restored.stop()
    # Building and restoring outside Tune left no folders behind.
    assert not ray_results.exists() or not any(ray_results.iterdir())
    assert not os.path.exists(algo.logdir) and not os.path.exists(restored.logdir)


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(Exception, match="does-not-exist|not found|No such|exist"):
        DreamerV3.from_checkpoint(str(tmp_path / "does-not-exist"))


class _ScriptedEnv(gym.Env):
    """Episodes of 3 steps: even episodes terminate, odd episodes are truncated."""

    observation_space = gym.spaces.Box(-10, 10, (2,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, config=None):
        self.episode = -1

    def reset(self, *, seed=None, options=None):
        self.episode += 1
        self.t = 0
        return np.array([self.episode, 0], np.float32), {}

    def step(self, action):
        self.t += 1
        done = self.t == 3
        obs = np.array([self.episode, self.t], np.float32)
        return (
            obs,
            float(self.t),
            done and self.episode % 2 == 0,
            done and self.episode % 2 == 1,
            {},
        )


def test_env_runner_records_terminated_vs_truncated():
    config = tiny_config(_ScriptedEnv).env_runners(num_envs_per_env_runner=2)
    runner = DreamerV3EnvRunner(config=config, worker_index=0)
    chunks = runner.sample(num_timesteps=12)  # 6 steps per env = 2 episodes each
    assert [key for key, _ in chunks] == [(0, 0), (0, 1)]
    steps = chunks[0][1]
    # Each episode: 3 acting steps (first has is_first) + the final observation.
    np.testing.assert_array_equal(steps["obs"][:, 1], [0, 1, 2, 3, 0, 1, 2, 3])
    np.testing.assert_array_equal(steps["is_first"], [1, 0, 0, 0, 1, 0, 0, 0])
    # Episode 0 terminated, episode 1 was truncated: no terminal for the continue head.
    np.testing.assert_array_equal(steps["is_terminal"], [0, 0, 0, 1, 0, 0, 0, 0])
    np.testing.assert_array_equal(steps["rewards"], [0, 1, 2, 3, 0, 1, 2, 3])
    # Acting steps carry one-hot actions; the final observation has none.
    np.testing.assert_array_equal(steps["actions"].sum(-1), [1, 1, 1, 0, 1, 1, 1, 0])
    metrics = runner.get_metrics()
    assert float(metrics["episode_return_mean"]) == pytest.approx(6.0)
    runner.stop()


def test_policy_state_resets_on_is_first():
    config = tiny_config()
    runner = DreamerV3EnvRunner(config=config, worker_index=0)
    module = runner.module
    obs = np.zeros((2, 4), np.float32)
    state = {k: np.repeat(v[None], 2, 0) for k, v in module.get_initial_state().items()}
    state["h"] = state["h"] + 5.0
    out = module.forward_inference(
        {"obs": obs, "is_first": np.array([True, False]), "state_in": state}
    )
    assert out["actions"].shape == (2,)
    h = out["state_out"]["h"].numpy()
    # Same observation, but env 0 restarted from the initial state and env 1 from h + 5.
    assert not np.allclose(h[0], h[1])
    fresh = {k: np.repeat(v[None], 2, 0) for k, v in module.get_initial_state().items()}
    out_fresh = module.forward_inference(
        {"obs": obs, "is_first": np.array([False, False]), "state_in": fresh}
    )
    np.testing.assert_allclose(h[0], out_fresh["state_out"]["h"].numpy()[0], rtol=1e-5)
    runner.stop()


def test_act_keeps_the_recurrent_state_as_forward_inference_does():
    config = tiny_config()
    runner = DreamerV3EnvRunner(config=config, worker_index=0)
    module = runner.module
    obs = np.random.default_rng(0).normal(size=(3, 2, 4)).astype(np.float64)  # [T, N, ...]
    actions, state = module.act(obs[0])  # float64 from the env: converted
    is_first, expected = (
        np.ones(2, bool),
        {k: np.repeat(v[None], 2, 0) for k, v in module.get_initial_state().items()},
    )
    for t in range(3):
        if t:
            actions, state = module.act(obs[t], state)
        out = module.forward_inference(
            {"obs": obs[t].astype(np.float32), "is_first": is_first, "state_in": expected}
        )
        expected = {k: v.numpy() for k, v in out["state_out"].items()}
        is_first = np.zeros(2, bool)
        np.testing.assert_array_equal(actions, out["actions"].numpy())
        np.testing.assert_allclose(state["h"], expected["h"], rtol=1e-6, atol=1e-6)
    with pytest.raises(KeyError, match="'is_first', 'state_in'.*get_initial_state.*act"):
        module.forward_inference({"obs": obs[0].astype(np.float32)})
    runner.stop()


def test_importing_the_package_registers_the_tune_trainable():
    from ray.tune.registry import TRAINABLE_CLASS, _global_registry

    assert _global_registry.contains(TRAINABLE_CLASS, "DreamerV3")
    assert _global_registry.get(TRAINABLE_CLASS, "DreamerV3") is DreamerV3


def test_env_runner_sampling_is_reproducible_with_a_seed():
    runs = []
    for _ in range(2):
        runner = DreamerV3EnvRunner(config=tiny_config(), worker_index=1)
        runner.sample(num_timesteps=20, random_actions=True)
        runs.append(runner.sample(num_timesteps=30))  # policy actions, sampled
        runner.stop()
    (_, a), (_, b) = runs[0][0], runs[1][0]
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def _greedy_chunks(overlap, calls):
    config = tiny_config(overlap_policy_and_envs=overlap).env_runners(num_envs_per_env_runner=4)
    runner = DreamerV3EnvRunner(config=config, worker_index=0)
    assert runner.overlaps_policy_and_envs is overlap
    try:
        chunks = [runner.sample(explore=False, **kwargs) for kwargs in calls]
        return chunks, {key: value.copy() for key, value in runner._state.items()}
    finally:
        runner.stop()


def test_overlapped_sampling_records_what_lockstep_sampling_records():
    """Greedy actions are deterministic, so grouping the policy calls in two halves (while the
    other half's envs step) must give the same records, across calls and with resets."""
    calls = [
        {"num_timesteps": 40},
        {"num_timesteps": 20},
        {"num_episodes": 3},
        {"num_timesteps": 8, "random_actions": True},
        {"num_timesteps": 12},
    ]
    (lockstep, state_ref), (overlapped, state) = (
        _greedy_chunks(False, calls),
        _greedy_chunks(True, calls),
    )
    assert len(lockstep[2][0][1]["obs"]) > 0
    for key in state_ref:  # every env's recurrent state followed its own observations
        np.testing.assert_allclose(state[key], state_ref[key], rtol=1e-5, atol=1e-6)
    for call, (ours, ref) in enumerate(zip(overlapped, lockstep)):
        assert [key for key, _ in ours] == [key for key, _ in ref]
        for (_, a), (_, b) in zip(ours, ref):
            for key in b:
                np.testing.assert_array_equal(a[key], b[key], err_msg=f"call {call}: {key}")


def test_overlap_is_on_by_default_for_image_envs_with_several_envs():
    def runner(env, num_envs):
        config = tiny_config(env).env_runners(num_envs_per_env_runner=num_envs)
        return DreamerV3EnvRunner(config=config, worker_index=0)

    for env, num_envs, expected in [
        ("ALE/Pong-v5", 2, True),
        ("ALE/Pong-v5", 1, False),
        ("CartPole-v1", 4, False),
    ]:
        r = runner(env, num_envs)
        assert r.overlaps_policy_and_envs is expected, (env, num_envs)
        r.stop()


def test_remote_env_runners_use_their_cpus_as_tf_threads():
    from types import SimpleNamespace

    def threads(worker_index, **settings):
        config = DreamerV3Config().training(**settings.pop("training", {})).env_runners(**settings)
        fake = SimpleNamespace(config=config, worker_index=worker_index)
        return DreamerV3EnvRunner._tf_threads(fake)

    assert threads(1) == 1  # num_cpus_per_env_runner defaults to 1
    assert threads(2, num_cpus_per_env_runner=3) == 3
    assert threads(1, training={"tf_num_threads": 4}) == 4
    assert threads(0) is None  # the local runner shares the Learner's process


def _train_and_count_syncs(config, iterations):
    """`(algo, sync_weights calls)` after `iterations` of training; the caller stops algo."""
    algo = config.build_algo()
    calls = []
    sync = algo.env_runner_group.sync_weights
    algo.env_runner_group.sync_weights = lambda *a, **kw: calls.append(1) or sync(*a, **kw)
    for _ in range(iterations):
        algo.train()
    return algo, len(calls)


def test_local_env_runner_acts_with_the_learners_variables(monkeypatch):
    # Local EnvRunner and local Learner: the policy reads the Learner's module, nothing is
    # synced, and every action equals that of the copy synced after every update.
    shared, shared_syncs = _train_and_count_syncs(tiny_config(), 3)
    monkeypatch.setattr(DreamerV3, "_share_learner_module", lambda self: None)
    copied, copied_syncs = _train_and_count_syncs(tiny_config(), 3)
    try:
        learner_module = shared.learner_group._learner.module[DEFAULT_MODULE_ID]
        assert shared.env_runner.module is learner_module
        assert (
            copied.env_runner.module is not copied.learner_group._learner.module[DEFAULT_MODULE_ID]
        )
        assert shared_syncs == 0
        updates = copied._counters["num_updates"]
        assert updates == shared._counters["num_updates"] >= 2 * 16
        assert copied_syncs >= 16 + 1  # one per training step that updated
        # Same actions taken (replay contents), same weights.
        ours, theirs = shared.replay_buffer.get_state(), copied.replay_buffer.get_state()
        assert ours["size"] == theirs["size"] > 32
        for key in ours["data"]:
            np.testing.assert_array_equal(ours["data"][key], theirs["data"][key], err_msg=key)
        theirs_weights = _module_state(copied)
        for name, value in _module_state(shared).items():
            np.testing.assert_array_equal(value, theirs_weights[name], err_msg=name)
        # get_module hands out a copy that training does not change.
        module = shared.get_module()
        assert module is not learner_module
        before = module.get_state()
        shared.train()
        after = module.get_state()
        changed = _module_state(shared)
        for name, value in before.items():
            np.testing.assert_array_equal(value, after[name], err_msg=name)
        assert any(not np.array_equal(before[name], changed[name]) for name in before)
    finally:
        shared.stop()
        copied.stop()


@pytest.mark.parametrize("every", [1, 3])
def test_remote_env_runners_get_weights_every_n_updates(every):
    # One update per training step (ratio 16 = B*T, one env step per sample): syncs follow
    # the updates, every `every`-th of them.
    config = tiny_config(training_ratio=16, sync_weights_every_n_updates=every).env_runners(
        num_env_runners=1
    )
    algo, syncs = _train_and_count_syncs(config, 2)
    try:
        updates = algo._counters["num_updates"]
        assert updates >= 16
        assert syncs == updates // every
        # The local EnvRunner (idle beside remote ones) shares the Learner's module; the
        # remote one holds a copy, which after every update's sync equals the Learner's.
        assert algo.env_runner.shares_learner_module
        remote = algo.env_runner_group.foreach_env_runner(
            lambda runner: runner.module.get_state(inference_only=True), local_env_runner=False
        )[0]
        learner = algo.learner_group._learner.module[DEFAULT_MODULE_ID]
        inference = learner.get_state(inference_only=True)
        assert sorted(remote) == sorted(inference)
        stale = [k for k in inference if not np.array_equal(remote[k], inference[k])]
        assert (stale == []) == (updates % every == 0)
    finally:
        algo.stop()
