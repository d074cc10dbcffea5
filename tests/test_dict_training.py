"""DreamerV3 trains on Dict observations (vectors, images, both), Discrete observations and the
DeepMind Control tasks, proprio and vision; dreams show every Dict entry."""

import gymnasium as gym
import numpy as np
import pytest
from helpers import tiny_config
from ray.rllib.core import DEFAULT_MODULE_ID

pytestmark = pytest.mark.usefixtures("ray_session")

VECTORS = {
    "pos": gym.spaces.Box(-5, 5, (3,), np.float64),
    "height": gym.spaces.Box(0, 2, (), np.float32),
}
IMAGES = {"frame": gym.spaces.Box(0, 255, (64, 64, 1), np.uint8)}
SPACES = {
    "vectors": gym.spaces.Dict(VECTORS),
    "images": gym.spaces.Dict(IMAGES),
    "both": gym.spaces.Dict({**VECTORS, **IMAGES, "mode": gym.spaces.Discrete(3)}),
}


def dict_env(space):
    class Env(gym.Env):
        """Random observations of `space`, reward = action, 10-step episodes."""

        observation_space = space
        action_space = gym.spaces.Discrete(2)

        def __init__(self, config=None):
            self.t = 0

        def reset(self, *, seed=None, options=None):
            super().reset(seed=seed)
            self.observation_space.seed(seed)
            self.t = 0
            return self.observation_space.sample(), {}

        def step(self, action):
            self.t += 1
            return self.observation_space.sample(), float(action), False, self.t == 10, {}

    return Env


def train_two_iterations(config):
    algo = config.build_algo()
    try:
        results = [algo.train() for _ in range(2)]
        batch = algo.replay_buffer.sample(2)
        decoder = algo.learner_group._learner.module[DEFAULT_MODULE_ID].model.world_model.decoder
    finally:
        algo.stop()
    learner = results[-1]["learners"][DEFAULT_MODULE_ID]
    for key in ("L_world_model", "L_decoder", "L_actor", "L_critic"):
        assert np.isfinite(learner[key]), key
    assert learner["num_update_traces"] == 1
    assert results[-1]["num_updates_lifetime"] >= 32
    return results, batch, decoder


@pytest.mark.parametrize("kind", list(SPACES))
def test_dict_observations_train_and_are_stored_per_entry(kind):
    results, batch, _ = train_two_iterations(
        tiny_config(dict_env(SPACES[kind]), dream_every_n_updates=32, dream_num_sequences=1)
    )
    obs = batch["obs"]
    expected = {"vectors": {"height", "pos"}, "images": {"frame"}}.get(kind)
    assert set(obs) == (expected or {"height", "pos", "frame", "mode"})
    for key, value in obs.items():
        assert value.dtype == (np.uint8 if key == "frame" else np.float32), key
    if kind == "both":
        np.testing.assert_array_equal(obs["mode"].sum(-1), 1.0)  # one-hot
    dreams = next(r["dreams"] for r in results if "dreams" in r)
    if "frame" in obs:  # every image entry as a video and a frame grid
        assert dreams["video/frame"].shape == (1, 8, 1, 64, 3 * 64)
        assert dreams["reconstruction/frame"].shape == (1, 2 * 64, 8 * 64)
    if "pos" in obs:  # the vector entries as line plots: 3 + 1 (+ 3 one-hot) panels
        panels = 4 if kind == "vectors" else 7
        assert dreams["observations"].shape == (3, panels * 90, 320)
    assert all(np.isfinite(dreams[f"obs_mse_open_loop/{key}"]) for key in obs)


def test_encoder_and_decoder_keys_choose_the_entries():
    config = tiny_config(
        dict_env(SPACES["both"]), encoder_keys="frame|pos", decoder_keys=["height", "mode"]
    )
    config.validate()
    space = SPACES["both"]
    spaces = {DEFAULT_MODULE_ID: (space, gym.spaces.Discrete(2))}
    module = config.get_rl_module_spec(spaces=spaces).build()
    wm = module.model.world_model
    assert wm.encoder.vector_keys == ["pos"] and wm.encoder.image_keys == ["frame"]
    assert wm.decoder.image is None and wm.decoder.vector_keys == ["height", "mode"]
    with pytest.raises(ValueError, match="decoder_keys='nothing' selects none"):
        tiny_config(dict_env(space), decoder_keys="nothing").validate()
    with pytest.raises(ValueError, match="encoder_keys=3 must be a regular expression"):
        tiny_config(dict_env(space), encoder_keys=3).validate()
    with pytest.raises(ValueError, match="decoder_keys=\\['pos'\\] chooses entries of Dict"):
        tiny_config("CartPole-v1", decoder_keys=["pos"]).validate()


@pytest.mark.slow  # ~40 s: Ray actors and a restore; opt-in to keep the default suite short
def test_dict_replay_and_weights_survive_a_checkpoint_with_a_remote_env_runner(tmp_path):
    config = tiny_config(dict_env(SPACES["both"])).env_runners(num_env_runners=1)
    algo = config.build_algo()
    try:
        algo.train()
        path = algo.save_to_path(str(tmp_path / "ckpt"))
        stored = algo.replay_buffer.get_state()
        weights = algo.get_module().get_state()
    finally:
        algo.stop()
    from rllib_dreamerv3 import DreamerV3

    restored = DreamerV3.from_checkpoint(path)
    try:
        state = restored.replay_buffer.get_state()
        assert state["size"] == stored["size"] > 0
        for key in ("obs/frame", "obs/mode", "obs/pos", "obs/height"):
            np.testing.assert_array_equal(state["data"][key], stored["data"][key])
        again = restored.get_module().get_state()
        for name in ("model/world_model/encoder/image", "model/world_model/decoder/vector"):
            keys = [k for k in weights if k.startswith(name)]
            assert keys, name
            for k in keys:
                np.testing.assert_array_equal(again[k], weights[k])
        restored.train()  # and it trains on
    finally:
        restored.stop()


def test_discrete_observations_train_as_one_hot_vectors():
    _, batch, _ = train_two_iterations(tiny_config("FrozenLake-v1"))
    assert batch["obs"].shape == (2, 8, 16) and batch["obs"].dtype == np.float32
    np.testing.assert_array_equal(batch["obs"].sum(-1), 1.0)


@pytest.mark.parametrize("vision", [False, True], ids=["proprio", "vision"])
def test_dmc_tasks_train_two_iterations(vision):
    env = "DMC/cartpole-swingup" if vision else "DMC/cup-catch"
    config = tiny_config(env).environment(env_config={"vision": vision})
    _, batch, _ = train_two_iterations(config)
    if vision:
        assert batch["obs"]["image"].shape == (2, 8, 64, 64, 3)
        assert batch["obs"]["image"].dtype == np.uint8
    else:
        assert {k: v.shape for k, v in batch["obs"].items()} == {
            "position": (2, 8, 4),
            "velocity": (2, 8, 4),
        }
