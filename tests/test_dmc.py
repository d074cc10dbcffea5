"""DeepMind Control tasks as in the paper (rllib_dreamerv3.envs.dmc): ids, action repeat 2, 500-step
truncated episodes, proprio and vision observations, and clear errors."""

import os
import subprocess
import sys

import gymnasium as gym
import numpy as np
import pytest
import yaml

from rllib_dreamerv3 import DreamerV3Config
from rllib_dreamerv3.envs.dmc import is_dmc_id, make_dmc_env

shimmy = pytest.importorskip("shimmy", reason="DMC needs the [dmc] extra")

TUNED = os.path.join(os.path.dirname(__file__), "..", "tuned_examples")


def _random_actions(env, n, seed=0):
    rng = np.random.default_rng(seed)
    return rng.uniform(-1, 1, (n, *env.action_space.shape))


def test_ids():
    assert is_dmc_id("DMC/walker-walk") and is_dmc_id("DMC/ball_in_cup-catch")
    assert not is_dmc_id("dm_control/walker-walk-v0") and not is_dmc_id("DMC/walker")


def test_proprio_env_repeats_each_action_twice_and_sums_the_rewards():
    env = make_dmc_env("DMC/cup-catch")  # the paper's name of ball_in_cup-catch
    assert env.observation_space == gym.spaces.Dict(
        {
            "position": gym.spaces.Box(-np.inf, np.inf, (4,), np.float64),
            "velocity": gym.spaces.Box(-np.inf, np.inf, (4,), np.float64),
        }
    )
    gym.register_envs(shimmy)
    raw = gym.make("dm_control/ball_in_cup-catch-v0")
    obs, _ = env.reset(seed=3)
    raw_obs, _ = raw.reset(seed=3)
    np.testing.assert_array_equal(obs["position"], raw_obs["position"])
    for action in _random_actions(env, 20):
        obs, reward, terminated, truncated, _ = env.step(action)
        raw_rewards = [raw.step(action)[1] for _ in range(2)]
        raw_obs = raw.unwrapped._env.physics.data.qpos.copy()
        assert reward == pytest.approx(sum(raw_rewards))
        np.testing.assert_array_equal(obs["position"], raw_obs)
        assert not (terminated or truncated)
    env.close()
    raw.close()


def test_an_episode_is_500_agent_steps_and_ends_truncated():
    env = make_dmc_env("DMC/cartpole-balance")
    env.reset(seed=0)
    actions = _random_actions(env, 500)
    total = 0.0
    for t, action in enumerate(actions):
        _, reward, terminated, truncated, _ = env.step(action)
        total += reward
        assert 0.0 <= reward <= 2.0  # two frames, each rewarded in [0, 1]
        assert not terminated
        assert truncated == (t == 499)
    assert 0 < total <= 1000
    env.close()


def test_vision_env_renders_64x64_frames_in_its_own_process():
    env = make_dmc_env("DMC/cartpole-swingup", {"vision": True})
    assert env.observation_space == gym.spaces.Dict(
        {"image": gym.spaces.Box(0, 255, (64, 64, 3), np.uint8)}
    )
    obs, _ = env.reset(seed=0)
    assert obs["image"].dtype == np.uint8 and obs["image"].shape == (64, 64, 3)
    assert obs["image"].std() > 10  # a picture, not a blank frame
    frames = [env.step(a)[0]["image"] for a in _random_actions(env, 5)]
    assert any(not np.array_equal(frames[0], f) for f in frames[1:])
    process = env._process
    env.close()
    assert process.poll() is not None  # the render process is gone


def test_vision_with_proprio_adds_the_vector_observations():
    env = make_dmc_env("DMC/reacher-easy", {"vision": True, "proprio": True})
    assert sorted(env.observation_space.spaces) == ["image", "position", "to_target", "velocity"]
    obs, _ = env.reset(seed=0)
    assert obs["to_target"].shape == (2,)
    env.close()


def test_bad_ids_and_settings_are_named():
    with pytest.raises(ValueError, match="Unknown DMC task 'DMC/walker-wakl'.*'DMC/walker-walk'"):
        make_dmc_env("DMC/walker-wakl")
    with pytest.raises(ValueError, match="Unknown DMC env_config key 'visoin'.*'vision'"):
        make_dmc_env("DMC/walker-walk", {"visoin": True})
    with pytest.raises(ValueError, match="leaves no observation"):
        make_dmc_env("DMC/walker-walk", {"proprio": False})
    with pytest.raises(ValueError, match="action_repeat=0 must be an integer >= 1"):
        make_dmc_env("DMC/walker-walk", {"action_repeat": 0})
    # walker has two cameras, 'side' and 'back': an unknown one is named before rendering.
    for camera in (2, -1, "front", 1.0):
        with pytest.raises(
            ValueError, match=rf"camera={camera!r} is not a camera.*has 2: ids 0 to 1"
        ):
            make_dmc_env("DMC/walker-walk", {"vision": True, "camera": camera})
    assert make_dmc_env("DMC/walker-walk", {"camera": "side"}).observation_space is not None


def test_a_rendering_backend_that_fails_is_a_clear_error(monkeypatch):
    # The user's MUJOCO_GL: render processes use it.
    monkeypatch.setenv("MUJOCO_GL", "no-such-backend")
    with pytest.raises(RuntimeError, match="cannot render.*='no-such-backend'.*EGL") as info:
        make_dmc_env("DMC/cartpole-swingup", {"vision": True})
    assert "MUJOCO_GL must be one of" in str(info.value)  # dm_control's own words


def run_with_egl(code):
    """`python -c code` with the user's `MUJOCO_GL=egl`; its completed process."""
    env = {**os.environ, "MUJOCO_GL": "egl"}
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )


def test_importing_the_package_keeps_opengl_out_of_the_process_only():
    code = (
        "import os, rllib_dreamerv3; from dm_control import _render; "
        "print(_render.BACKEND, os.environ['MUJOCO_GL'])"
    )
    out = run_with_egl(code)
    assert out.returncode == 0, out.stderr[-2000:]  # no abort at exit either
    # No backend in this process (dm_control's name for 'disable'); the user's setting is back.
    assert out.stdout.split() == ["off", "egl"]


def test_a_users_own_mujoco_env_gets_the_users_backend_after_the_import():
    # Rendering itself cannot be shown here: Mesa's EGL/OSMesa crash any process that has loaded
    # TensorFlow, imported by the user or by us (see docs/dmc.md). What the import must not do
    # is change the backend a user's gymnasium MuJoCo env opens; earlier it made gymnasium
    # raise "MUJOCO_GL must be one of ...: got 'disable'".
    code = """
import rllib_dreamerv3, gymnasium as gym
from gymnasium.envs.mujoco import mujoco_rendering

class Opened(Exception):
    pass

def opener(name):
    def open_context(width, height):
        raise Opened(name)
    return open_context

for name in list(mujoco_rendering._ALL_RENDERERS):
    mujoco_rendering._ALL_RENDERERS[name] = opener(name)
env = gym.make("InvertedPendulum-v5", render_mode="rgb_array")
env.reset(seed=0)
try:
    env.render()
except Opened as opened:
    print("opened", opened)
"""
    out = run_with_egl(code)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["opened", "egl"]


@pytest.mark.parametrize(
    "name, vision, agent_steps",
    [("dmc_proprio.yaml", False, 250_000), ("dmc_vision.yaml", True, 500_000)],
)
def test_tuned_examples_have_the_papers_settings(name, vision, agent_steps):
    with open(os.path.join(TUNED, name)) as f:
        (spec,) = yaml.safe_load(f).values()
    config = DreamerV3Config().update_from_dict(spec["config"]).environment(spec["env"])
    config.validate()
    assert (config.model_size, config.training_ratio) == ("S", 512)
    assert (config.world_model_lr, config.actor_lr, config.critic_lr) == (1e-4, 3e-5, 3e-5)
    assert config.env_config.get("vision", False) == vision
    # The paper's budgets, 500k env frames (proprio) and 1M (vision), at action repeat 2.
    assert spec["stop"]["num_env_steps_sampled_lifetime"] == agent_steps
    if not vision:  # the author's vector MLPs
        assert (config.vector_mlp_units, config.vector_mlp_layers) == (1024, 5)
