"""`rllib export`, `export_policy`: a SavedModel that acts as the checkpoint, without Ray."""

import json
import os
import subprocess
import sys
import textwrap
import warnings

import gymnasium as gym
import numpy as np
import pytest
import tensorflow as tf
from helpers import tiny_config
from ray.rllib.core.columns import Columns

from rllib_dreamerv3 import cli
from rllib_dreamerv3.export import (
    MODULE_PATH,
    export_policy,
    export_tflite,
    read_metadata,
    run_saved_model,
)
from rllib_dreamerv3.rl_module import IS_FIRST, DreamerV3RLModule

pytestmark = pytest.mark.usefixtures("ray_session")


@pytest.fixture(scope="module", params=["CartPole-v1", "Pendulum-v1"])
def checkpoint(request, tmp_path_factory):
    """A checkpoint after two training iterations (weights away from their initial values)."""
    algo = tiny_config(request.param, jit_compile=True, dream_every_n_updates=0).build_algo()
    try:
        algo.train()
        algo.train()
        path = algo.save_to_path(str(tmp_path_factory.mktemp("checkpoint")))
    finally:
        algo.stop()
    return request.param, path


def test_greedy_steps_equal_the_checkpoints_policy(checkpoint, tmp_path):
    env_id, path = checkpoint
    export_dir = export_policy(path, tmp_path / "policy")
    policy = tf.saved_model.load(export_dir)
    module = DreamerV3RLModule.from_checkpoint(os.path.join(path, MODULE_PATH))
    env = gym.make(env_id)
    obs, _ = env.reset(seed=0)
    state = {k: v[None] for k, v in module.get_initial_state().items()}
    served = policy.initial_state(tf.constant(1))
    is_first, episodes = True, 0
    for _ in range(1000):
        ours = module.forward_inference(
            {Columns.OBS: obs[None], Columns.STATE_IN: state, IS_FIRST: np.array([is_first])}
        )
        out = policy.step(obs=tf.constant(obs[None]), is_first=tf.constant([is_first]), **served)
        action = ours[Columns.ACTIONS].numpy()[0]
        # The same XLA-compiled step on the same inputs: the same numbers.
        np.testing.assert_array_equal(out.pop("action").numpy()[0], action)
        state, served = ours[Columns.STATE_OUT], out
        np.testing.assert_array_equal(served["h"], state["h"])
        obs, _, terminated, truncated, _ = env.step(action)
        is_first = terminated or truncated
        if is_first:
            obs, _ = env.reset()
            episodes += 1
    assert episodes >= 4  # resets inside the run (Pendulum: 200-step episodes)
    # Only what acting reads is stored: no decoder, reward or continue head, no critic.
    wm = module.model.world_model
    acting = [wm.encoder, wm.gru_input, wm.gru, wm.prior_net, wm.posterior_net, module.model.actor]
    expected = sum(int(np.prod(v.shape)) for m in acting for v in m.variables) + wm.h0_raw.shape[0]
    stored = tf.train.list_variables(os.path.join(export_dir, "variables", "variables"))
    assert sum(int(np.prod(shape)) for name, shape in stored if "OBJECT_GRAPH" not in name) == (
        expected
    )


def test_cli_export_and_evaluate_the_saved_model_as_the_checkpoint(checkpoint, tmp_path, capsys):
    env_id, path = checkpoint
    out = str(tmp_path / "exported")
    assert cli.main(["export", path, out]) == 0
    assert "SavedModel of the" in capsys.readouterr().out
    assert read_metadata(out)["env"] == env_id
    argv = ["--episodes", "2", "--seed", "3", "--json"]
    assert cli.main(["evaluate", path, *argv]) == 0
    from_checkpoint = json.loads(capsys.readouterr().out)
    assert cli.main(["evaluate", "--saved-model", out, *argv]) == 0
    from_saved_model = json.loads(capsys.readouterr().out)
    assert from_saved_model == from_checkpoint  # same resets, same greedy actions


def test_sampled_steps_are_reproducible_from_the_seed(checkpoint, tmp_path):
    env_id, path = checkpoint
    policy = tf.saved_model.load(export_policy(path, tmp_path / "policy"))
    env = gym.make(env_id)
    obs = np.stack([env.reset(seed=i)[0] for i in range(16)])  # a batch of 16 envs
    state = policy.initial_state(tf.constant(16))
    first = tf.ones([16], tf.bool)

    def sample(seed):
        return policy.step_sample(obs=obs, is_first=first, seed=tf.constant(seed), **state)

    a, b, c = sample([1, 2]), sample([1, 2]), sample([1, 3])
    np.testing.assert_array_equal(a["action"], b["action"])
    assert not np.array_equal(a["z"], c["z"])  # another seed, other latents
    returns, lengths = run_saved_model(
        os.path.join(tmp_path, "policy"), env, episodes=2, greedy=False, seed=0
    )
    assert len(returns) == 2 and min(lengths) >= 1


def test_tflite_step_equals_the_saved_models(tmp_path):
    algo = tiny_config("CartPole-v1", dream_every_n_updates=0).build_algo()
    try:
        out = export_policy(algo, tmp_path / "policy", jit_compile=False)
    finally:
        algo.stop()
    path, reason = export_tflite(out, tmp_path / "policy.tflite")
    assert reason is None and os.path.getsize(path) > 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tf.lite.Interpreter's deprecation notice
        step = tf.lite.Interpreter(str(path)).get_signature_runner("step")
    policy = tf.saved_model.load(out)
    state = {k: v.numpy() for k, v in policy.initial_state(tf.constant(1)).items()}
    obs = np.array([[0.01, -0.2, 0.03, 0.4]], np.float32)
    lite = step(obs=obs, is_first=np.array([True]), **state)
    served = policy.step(obs=obs, is_first=tf.constant([True]), **state)
    assert lite["action"] == served["action"].numpy()
    np.testing.assert_allclose(lite["h"], served["h"], rtol=1e-5, atol=1e-6)


def test_loading_needs_neither_ray_nor_this_package(tmp_path):
    algo = tiny_config("CartPole-v1", dream_every_n_updates=0).build_algo()
    try:
        out = export_policy(algo, tmp_path / "policy")
    finally:
        algo.stop()
    script = textwrap.dedent(
        f"""
        import sys

        class Blocked:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("ray", "rllib_dreamerv3"):
                    raise ImportError(f"{{name}} is blocked in this test")

        sys.meta_path.insert(0, Blocked())
        import numpy as np
        import tensorflow as tf

        policy = tf.saved_model.load({str(out)!r})
        state = policy.initial_state(tf.constant(2))
        obs = np.zeros([2, 4], np.float32)
        out = policy.step(obs=obs, is_first=tf.constant([True, True]), **state)
        assert out["action"].shape == (2,) and out["action"].dtype == tf.int64
        assert not any(m.split(".")[0] in ("ray", "rllib_dreamerv3") for m in sys.modules)
        print("ok", out["action"].numpy().tolist())
        """
    )
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("ok")


def test_export_errors_name_the_problem(tmp_path, capsys):
    assert cli.main(["export", str(tmp_path / "missing"), str(tmp_path / "out")]) == 2
    assert "no such checkpoint directory" in capsys.readouterr().err
    assert cli.main(["evaluate", "--saved-model", str(tmp_path)]) == 2
    assert "no saved_model.pb" in capsys.readouterr().err
    assert cli.main(["evaluate"]) == 2
    assert "needs a checkpoint directory (or --saved-model DIR)" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError, match="not a DreamerV3 Algorithm checkpoint"):
        export_policy(str(tmp_path), tmp_path / "out")


class DictCartPole(gym.ObservationWrapper):
    """CartPole with Dict observations: the cart's and the pole's entries."""

    def __init__(self, config=None):
        super().__init__(gym.make("CartPole-v1"))
        box = self.env.observation_space
        self.observation_space = gym.spaces.Dict(
            {
                "cart": gym.spaces.Box(box.low[:2], box.high[:2], dtype=np.float32),
                "pole": gym.spaces.Box(box.low[2:], box.high[2:], dtype=np.float32),
            }
        )

    def observation(self, obs):
        return {"cart": obs[:2], "pole": obs[2:]}


def test_dict_observation_policies_export_and_act_as_the_checkpoint(tmp_path):
    from ray.tune.registry import register_env

    register_env("DictCartPole", DictCartPole)
    algo = tiny_config("DictCartPole", jit_compile=True, dream_every_n_updates=0).build_algo()
    try:
        algo.train()
        export_dir = export_policy(algo, tmp_path / "policy")
        module = algo.get_module()
        policy = tf.saved_model.load(export_dir)
        env = DictCartPole()
        obs, _ = env.reset(seed=0)
        state, served, is_first = None, policy.initial_state(tf.constant(1)), True
        for _ in range(50):
            action, state = module.act({k: v[None] for k, v in obs.items()}, state)
            batch = {k: tf.constant(v[None]) for k, v in obs.items()}
            out = policy.step(obs=batch, is_first=tf.constant([is_first]), **served)
            np.testing.assert_array_equal(out.pop("action").numpy(), action)
            served, is_first = out, False
            np.testing.assert_array_equal(served["h"], state["h"])
            obs, _, terminated, truncated, _ = env.step(action[0])
            if terminated or truncated:
                obs, _ = env.reset()
                state, is_first = None, True
    finally:
        algo.stop()
    returns, lengths = run_saved_model(export_dir, DictCartPole(), episodes=1, seed=0)
    assert lengths[0] >= 1
    assert export_tflite(export_dir, tmp_path / "policy.tflite") == (
        None,
        "the policy takes Dict observations; TFLite models take flat tensors",
    )
