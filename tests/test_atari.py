"""The Atari env factory: the paper's setup (DreamerV3 and DreamerV2's Atari protocol), checked
on real ALE games."""

import os
import re

import cv2
import gymnasium as gym
import numpy as np
import pytest
import yaml
from ray.tune.registry import ENV_CREATOR, _global_registry, register_env

from rllib_dreamerv3 import DreamerV3Config
from rllib_dreamerv3.env_runner import make_env
from rllib_dreamerv3.envs.atari import ENV_CONFIG, is_atari_id, make_atari_env

TUNED = os.path.join(os.path.dirname(__file__), "..", "tuned_examples")
ATARI_100K_GAMES = {
    "Alien",
    "Amidar",
    "Assault",
    "Asterix",
    "BankHeist",
    "BattleZone",
    "Boxing",
    "Breakout",
    "ChopperCommand",
    "CrazyClimber",
    "DemonAttack",
    "Freeway",
    "Frostbite",
    "Gopher",
    "Hero",
    "Jamesbond",
    "Kangaroo",
    "Krull",
    "KungFuMaster",
    "MsPacman",
    "Pong",
    "PrivateEye",
    "Qbert",
    "RoadRunner",
    "Seaquest",
    "UpNDown",
}


def resize(frame):
    return cv2.resize(frame, (64, 64), interpolation=cv2.INTER_AREA)


def test_rgb_frames_full_action_set_sticky_actions_and_frame_cap():
    env = make_atari_env("ALE/Pong-v5")
    env.action_space.seed(0)
    assert env.observation_space == gym.spaces.Box(0, 255, (64, 64, 3), np.uint8)
    assert env.action_space == gym.spaces.Discrete(18)
    ale = env.unwrapped.ale
    assert ale.getFloat("repeat_action_probability") == 0.25
    assert ale.getInt("max_num_frames_per_episode") == 108_000
    obs, _ = env.reset(seed=0)
    for _ in range(10):
        obs, *_ = env.step(env.action_space.sample())
    assert obs.shape == (64, 64, 3) and obs.dtype == np.uint8
    assert obs.min() < obs.max()
    assert ale.getEpisodeFrameNumber() == 10 * 4  # one step is four emulator frames
    env.close()


def test_atari100k_protocol_has_no_sticky_actions_and_grayscale_has_one_channel():
    env = make_atari_env("ALE/Pong-v5", {"protocol": "atari100k", "grayscale": True})
    assert env.unwrapped.ale.getFloat("repeat_action_probability") == 0.0
    assert env.observation_space == gym.spaces.Box(0, 255, (64, 64, 1), np.uint8)
    obs, _ = env.reset(seed=0)
    assert obs.shape == (64, 64, 1) and obs.dtype == np.uint8
    env.close()


def test_atari100k_protocol_has_the_minimal_action_set_and_1_to_30_noop_starts():
    env = make_atari_env("ALE/Pong-v5", {"protocol": "atari100k"})
    ale = env.unwrapped.ale
    assert env.action_space == gym.spaces.Discrete(6)  # Pong's minimal action set
    assert len(ale.getMinimalActionSet()) == 6
    # Each reset plays a number of no-op emulator frames drawn from 1..30 (the env's RNG).
    env.reset(seed=0)
    noops = [ale.getEpisodeFrameNumber()]
    for _ in range(39):
        env.reset()
        noops.append(ale.getEpisodeFrameNumber())
    assert 1 <= min(noops) and max(noops) <= 30 and len(set(noops)) > 10
    env.reset(seed=0)
    again = [ale.getEpisodeFrameNumber()]
    for _ in range(39):
        env.reset()
        again.append(ale.getEpisodeFrameNumber())
    assert again == noops  # seeded
    # The default protocol: 18 actions, no no-ops.
    full = make_atari_env("ALE/Pong-v5")
    assert full.action_space == gym.spaces.Discrete(18)
    full.reset(seed=0)
    assert full.unwrapped.ale.getEpisodeFrameNumber() == 0
    full.close()
    env.close()


def test_observation_is_the_max_of_the_last_two_of_four_frames():
    # No sticky actions, so replaying an action on the raw ALE from a cloned state gives the
    # same frames the wrapper saw.
    env = make_atari_env("ALE/Pong-v5", {"protocol": "atari100k"})
    env.reset(seed=0)
    ale = env.unwrapped.ale
    ale_actions = ale.getMinimalActionSet()  # the atari100k protocol's action set
    rng = np.random.default_rng(0)
    for _ in range(20):  # until the ball is in play
        env.step(int(rng.integers(len(ale_actions))))
    pooling_mattered = 0
    for _ in range(20):
        action = int(rng.integers(len(ale_actions)))
        state = ale.cloneState()
        frames = []
        for _ in range(4):
            ale.act(ale_actions[action])
            frames.append(ale.getScreenRGB())
        ale.restoreState(state)
        obs, *_ = env.step(action)
        np.testing.assert_array_equal(obs, resize(np.maximum(frames[-2], frames[-1])))
        pooling_mattered += not np.array_equal(obs, resize(frames[-1]))
    assert pooling_mattered > 0
    env.close()


def test_render_mode_renders_full_frames_and_leaves_observations_alone():
    env = make_atari_env("ALE/Pong-v5", {"render_mode": "rgb_array"})
    obs, _ = env.reset(seed=0)
    assert obs.shape == (64, 64, 3)
    frame = env.render()
    assert frame.shape == (210, 160, 3) and frame.dtype == np.uint8
    env.close()


def test_losing_a_life_does_not_end_the_episode():
    env = make_atari_env("ALE/Breakout-v5")
    env.action_space.seed(0)
    _, info = env.reset(seed=0)
    lives = info["lives"]
    for _ in range(2000):
        _, _, terminated, truncated, info = env.step(env.action_space.sample())
        if info["lives"] < lives:
            assert not terminated and not truncated
            break
    else:
        pytest.fail("No life was lost in 2000 random steps of Breakout.")
    env.close()


def test_unknown_key_lists_the_valid_keys():
    with pytest.raises(ValueError, match="'grayscal'.*'grayscale'") as info:
        make_atari_env("ALE/Pong-v5", {"grayscal": True})
    for key in ENV_CONFIG:
        assert repr(key) in str(info.value)


@pytest.mark.parametrize(
    "env_config, match",
    [
        ({"protocol": "atari100"}, "protocol='atari100'.*'atari100k'"),
        ({"grayscale": 1}, "grayscale=1 must be True or False"),
        ({"render_mode": "rgb"}, "render_mode='rgb' is unknown.*'rgb_array'"),
    ],
)
def test_bad_values_are_named(env_config, match):
    with pytest.raises(ValueError, match=match):
        make_atari_env("ALE/Pong-v5", env_config)


def test_other_ale_versions_and_unknown_games_are_rejected():
    assert is_atari_id("ALE/Pong-v5") and is_atari_id("ale_py:ALE/Pong-v5")
    assert is_atari_id("ALE/Pong-v4") and not is_atari_id("PongNoFrameskip-v4")
    env = make_atari_env("ale_py:ALE/Pong-v5")
    assert env.spec.id == "ALE/Pong-v5"
    env.close()
    with pytest.raises(ValueError, match="only the ALE's v5 ids.*'ALE/Pong-v5'"):
        make_atari_env("ALE/Pong-v4")
    with pytest.raises(ValueError, match="Did you mean 'ALE/Pong-v5'"):
        make_atari_env("ALE/Pongg-v5")


def test_atari100k_grid_example_runs_the_26_games_with_the_atari100k_settings():
    with open(os.path.join(TUNED, "atari_100k_26_games.yaml")) as f:
        (spec,) = yaml.safe_load(f).values()
    with open(os.path.join(TUNED, "atari_100k.yaml")) as f:
        (single,) = yaml.safe_load(f).values()
    assert spec["config"] == single["config"] and spec["stop"] == single["stop"]
    ids = spec["env"]["grid_search"]
    grid = {re.fullmatch(r"ALE/(\w+)-v5", env_id).group(1) for env_id in ids}
    assert len(ids) == len(ATARI_100K_GAMES) == 26 and grid == ATARI_100K_GAMES
    import ale_py

    gym.register_envs(ale_py)
    assert sorted(g for g in grid if f"ALE/{g}-v5" not in gym.registry) == []


@pytest.mark.parametrize(
    "name, protocol, steps",
    [("pong.yaml", "atari", 20_000), ("atari_100k.yaml", "atari100k", 100_000)],
)
def test_atari_tuned_examples_are_valid_configs(name, protocol, steps):
    with open(os.path.join(TUNED, name)) as f:
        (spec,) = yaml.safe_load(f).values()
    config = DreamerV3Config().update_from_dict(spec["config"]).environment(spec["env"])
    config.validate()
    assert config.env_config["protocol"] == protocol
    assert spec["stop"]["num_env_steps_sampled_lifetime"] == steps


def test_atari100k_example_evaluates_100_sampled_episodes_at_its_last_iteration():
    with open(os.path.join(TUNED, "atari_100k.yaml")) as f:
        (spec,) = yaml.safe_load(f).values()
    config = DreamerV3Config().update_from_dict(spec["config"]).environment(spec["env"])
    per_iteration = config.min_sample_timesteps_per_iteration
    # Every iteration samples exactly `per_iteration` env steps: the warm-up fills the first,
    # and each training step's sample divides it.
    assert config.num_steps_sampled_before_learning_starts == per_iteration
    assert per_iteration % (config.steps_per_sample * config.num_envs_per_env_runner) == 0
    last_iteration = spec["stop"]["num_env_steps_sampled_lifetime"] // per_iteration
    assert config.evaluation_interval == last_iteration == 100
    assert config.evaluation_duration == 100 and config.evaluation_duration_unit == "episodes"
    assert config.evaluation_config == {"explore": True}


def test_make_env_routes_ale_ids_to_the_factory():
    config = DreamerV3Config().environment("ALE/Pong-v5", env_config={"grayscale": True})
    env = make_env(config)
    assert isinstance(env, gym.wrappers.AtariPreprocessing)
    assert env.observation_space.shape == (64, 64, 1)
    env.close()
    with pytest.raises(ValueError, match="Unknown Atari env_config key 'size'"):
        make_env(DreamerV3Config().environment("ALE/Pong-v5", env_config={"size": 84}))


def test_make_env_prefers_an_env_registered_with_tune_under_the_same_name():
    register_env("ALE/Pong-v5", lambda env_config: gym.make("CartPole-v1"))
    try:
        env = make_env(DreamerV3Config().environment("ALE/Pong-v5"))
        assert env.spec.id == "CartPole-v1"
        env.close()
    finally:
        _global_registry.unregister(ENV_CREATOR, "ALE/Pong-v5")
