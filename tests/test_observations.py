"""Dict and Discrete observations: the model format (`spaces.ObsFormat`), the Dict encoder and
decoder, the replay buffer's per-entry storage, and the EnvRunner's conversion."""

import gymnasium as gym
import numpy as np
import pytest
import tensorflow as tf
from helpers import tiny_config
from ray.rllib.core import DEFAULT_MODULE_ID

from rllib_dreamerv3 import math_ops
from rllib_dreamerv3.algorithm import learner_batches
from rllib_dreamerv3.encoders import (
    DictDecoder,
    DictEncoder,
    ImageDecoder,
    ImageEncoder,
    VectorDecoder,
    VectorEncoder,
)
from rllib_dreamerv3.env_runner import DreamerV3EnvRunner
from rllib_dreamerv3.model_sizes import MODEL_SIZES
from rllib_dreamerv3.replay_buffer import ReplayBuffer, bytes_per_step
from rllib_dreamerv3.spaces import ObsFormat

SIZE = MODEL_SIZES["nano"]
SPACE = gym.spaces.Dict(
    {
        "pos": gym.spaces.Box(-1, 1, (3,), np.float64),
        "height": gym.spaces.Box(-1, 1, (), np.float64),
        "cell": gym.spaces.Discrete(4, start=1),
        "arm": gym.spaces.Dict({"cam": gym.spaces.Box(0, 255, (64, 64, 3), np.uint8)}),
        "count": gym.spaces.Box(0, 10, (2,), np.int64),
    }
)


def num_params(module):
    return sum(int(np.prod(v.shape)) for v in module.trainable_variables)


# --- the model format ---------------------------------------------------------------------------
def test_dict_leaves_are_flattened_sorted_and_converted():
    fmt = ObsFormat(SPACE)
    assert fmt.is_dict
    assert fmt.shape() == {
        "arm/cam": (64, 64, 3),
        "cell": (4,),
        "count": (2,),
        "height": (1,),
        "pos": (3,),
    }
    assert {k: d.name for k, d in fmt.dtype().items()} == {
        "arm/cam": "uint8",
        "cell": "float32",
        "count": "float32",
        "height": "float32",
        "pos": "float32",
    }
    image = np.arange(64 * 64 * 3).reshape(64, 64, 3).astype(np.uint8)
    obs = {
        "pos": np.array([0.5, -0.25, 1.0]),
        "height": np.float64(0.75),
        "cell": 3,  # Discrete(4, start=1): index 2
        "arm": {"cam": image},
        "count": np.array([7, 2]),
    }
    converted = fmt.convert(obs)
    np.testing.assert_array_equal(converted["cell"], [0, 0, 1, 0])
    np.testing.assert_array_equal(converted["height"], [0.75])
    np.testing.assert_array_equal(converted["pos"], np.float32([0.5, -0.25, 1.0]))
    np.testing.assert_array_equal(converted["count"], np.float32([7, 2]))
    np.testing.assert_array_equal(converted["arm/cam"], image)
    assert converted["arm/cam"].dtype == np.uint8 and converted["pos"].dtype == np.float32
    stacked = fmt.stack([converted, converted])
    assert stacked["arm/cam"].shape == (2, 64, 64, 3) and stacked["cell"].shape == (2, 4)
    assert fmt.bytes_per_step() == 64 * 64 * 3 + 4 * (4 + 2 + 1 + 3)


def test_discrete_observations_become_one_hot_vectors():
    fmt = ObsFormat(gym.spaces.Discrete(5, start=-2))
    assert not fmt.is_dict and fmt.shape() == (5,) and fmt.dtype() == np.float32
    np.testing.assert_array_equal(fmt.convert(np.int64(-2)), [1, 0, 0, 0, 0])
    np.testing.assert_array_equal(fmt.convert(2), [0, 0, 0, 0, 1])
    with pytest.raises(ValueError, match=r"an observation 3, outside Discrete\(5, start=-2\)"):
        fmt.convert(3)
    with pytest.raises(ValueError, match="0.5, which is not an integer"):
        fmt.convert(0.5)


def test_box_observations_keep_their_format():
    assert ObsFormat(gym.spaces.Box(-1, 1, (3,))).shape() == (3,)
    image = ObsFormat(gym.spaces.Box(0, 255, (64, 64, 1), np.uint8))
    assert image.shape() == (64, 64, 1) and image.dtype() == np.uint8


@pytest.mark.parametrize(
    "keys,expected",
    [
        (".*", ["arm/cam", "cell", "count", "height", "pos"]),
        ("arm/.*|pos", ["arm/cam", "pos"]),
        ("po", None),  # a regular expression matches whole keys: "po" matches none
        (["height", "pos"], ["height", "pos"]),
    ],
)
def test_encoder_and_decoder_keys_select_entries(keys, expected):
    if expected is None:
        with pytest.raises(ValueError, match=r"encoder_keys='po' selects none of the obs"):
            ObsFormat(SPACE, encoder_keys=keys)
        return
    fmt = ObsFormat(SPACE, encoder_keys=keys, decoder_keys=["pos"])
    assert fmt.encoder_keys == expected and fmt.decoder_keys == ["pos"]


def test_bad_keys_and_bad_observations_are_named():
    with pytest.raises(ValueError, match=r"decoder_keys=\['pso'\] names \['pso'\].*\['arm/cam'"):
        ObsFormat(SPACE, decoder_keys=["pso"])
    with pytest.raises(ValueError, match="encoder_keys='\\(' is not a regular expression"):
        ObsFormat(SPACE, encoder_keys="(")
    fmt = ObsFormat(SPACE)
    obs = SPACE.sample()
    del obs["pos"]
    with pytest.raises(ValueError, match=r"without the keys \['pos'\]"):
        fmt.convert(obs)
    obs = SPACE.sample()
    obs["arm"]["cam"] = np.zeros((32, 32, 3), np.uint8)
    with pytest.raises(ValueError, match=r"entry 'arm/cam' is of shape \(32, 32, 3\)"):
        fmt.convert(obs)


def test_a_key_that_appears_twice_is_an_error():
    space = gym.spaces.Dict(
        {"a/b": gym.spaces.Box(0, 1, (2,)), "a": gym.spaces.Dict({"b": gym.spaces.Discrete(2)})}
    )
    with pytest.raises(ValueError, match="has the key 'a/b' twice"):
        ObsFormat(space)


def test_learner_batches_split_dict_observations_into_row_blocks():
    rows = np.arange(4)
    batch = {
        "obs": {"pos": np.stack([rows, rows], 1)[:, None], "cam": rows[:, None, None] * np.ones(3)},
        "rewards": rows[:, None].astype(np.float32),
    }
    shards = [b.policy_batches[DEFAULT_MODULE_ID] for b in learner_batches(batch, 2)["batches"]]
    for shard, block in zip(shards, ([0, 1], [2, 3])):
        np.testing.assert_array_equal(shard["obs"]["pos"][:, 0, 0], block)
        np.testing.assert_array_equal(shard["obs"]["cam"][:, 0, 0], block)
        np.testing.assert_array_equal(shard["rewards"][:, 0], block)


def test_nonfinite_entries_are_found_by_key():
    fmt = ObsFormat(SPACE)
    obs = fmt.convert(SPACE.sample())
    assert fmt.nonfinite(obs) is None
    obs["pos"][1] = np.nan
    assert fmt.nonfinite(obs) == ("pos", 1, [1])


# --- the Dict encoder and decoder ---------------------------------------------------------------
SHAPES = {"cam": (64, 64, 3), "depth": (64, 64, 1), "pos": (3,), "vel": (2,)}


def test_dict_encoder_concatenates_vectors_into_the_mlp_and_images_into_the_cnn():
    tf.random.set_seed(0)
    encoder = DictEncoder(SHAPES, SIZE)
    assert encoder.vector_keys == ["pos", "vel"] and encoder.image_keys == ["cam", "depth"]
    # The same networks as a 5-dim vector encoder and a 4-channel image encoder.
    assert num_params(encoder.vector) == num_params(VectorEncoder(5, SIZE))
    assert num_params(encoder.image) == num_params(ImageEncoder((64, 64, 4), SIZE))
    assert encoder.out_units == encoder.vector.out_units + encoder.image.out_units
    rng = np.random.default_rng(0)
    obs = {
        "cam": rng.integers(0, 256, (2, 64, 64, 3), dtype=np.uint8),
        "depth": rng.integers(0, 256, (2, 64, 64, 1), dtype=np.uint8),
        "pos": rng.normal(size=(2, 3)).astype(np.float32),
        "vel": rng.normal(size=(2, 2)).astype(np.float32),
    }
    obs = {key: tf.constant(value) for key, value in obs.items()}
    embed = encoder(obs).numpy()
    vector = encoder.vector(tf.concat([obs["pos"], obs["vel"]], -1)).numpy()
    image = encoder.image(tf.concat([obs["cam"], obs["depth"]], -1)).numpy()
    np.testing.assert_array_equal(embed, np.concatenate([vector, image], -1))


def test_dict_decoder_splits_its_outputs_and_sums_the_entries_losses():
    tf.random.set_seed(0)
    decoder = DictDecoder(7, SHAPES, SIZE)
    assert num_params(decoder.vector) == num_params(VectorDecoder(7, 5, SIZE))
    assert num_params(decoder.image) == num_params(ImageDecoder(7, (64, 64, 4), SIZE))
    rng = np.random.default_rng(1)
    feat = tf.constant(rng.normal(size=(2, 7)).astype(np.float32))
    obs = {
        "cam": rng.integers(0, 256, (2, 64, 64, 3), dtype=np.uint8),
        "depth": rng.integers(0, 256, (2, 64, 64, 1), dtype=np.uint8),
        "pos": rng.normal(size=(2, 3)).astype(np.float32) * 5,
        "vel": rng.normal(size=(2, 2)).astype(np.float32),
    }
    out = {key: value.numpy() for key, value in decoder(feat).items()}
    assert {k: v.shape for k, v in out.items()} == {k: (2, *s) for k, s in SHAPES.items()}
    vector, image = decoder.vector(feat).numpy(), decoder.image(feat).numpy()
    np.testing.assert_array_equal(out["pos"], vector[:, :3])
    np.testing.assert_array_equal(out["depth"], image[..., 3:])
    # By hand: symlog squared error of the vectors, centred-pixel squared error of the images.
    symlog = lambda x: np.sign(x) * np.log1p(np.abs(x))  # noqa: E731
    expected = sum(np.sum((out[k] - symlog(obs[k])) ** 2, -1) for k in ("pos", "vel")) + sum(
        np.sum((out[k] - (obs[k] / 255.0 - 0.5)) ** 2, (1, 2, 3)) for k in ("cam", "depth")
    )
    # Sums of 12,288 float32 squares (each ≲ 1): ~1e-7 relative error per term, summed.
    np.testing.assert_allclose(decoder.loss(feat, obs).numpy(), expected, rtol=1e-5)
    prediction = decoder.predict(feat)
    assert prediction["cam"].dtype == tf.uint8
    np.testing.assert_allclose(prediction["vel"], math_ops.symexp(out["vel"]), rtol=1e-6)


# --- the replay buffer --------------------------------------------------------------------------
def _dict_steps(start, n):
    counter = np.arange(start, start + n)
    return {
        "obs": {
            "cam": np.broadcast_to(counter[:, None, None, None] % 256, (n, 64, 64, 1)).astype(
                np.uint8
            ),
            "pos": np.stack([counter, -counter], 1).astype(np.float32),
        },
        "actions": np.zeros((n, 2), np.float32),
        "rewards": counter.astype(np.float32),
        "is_first": counter == 0,
        "is_terminal": np.zeros(n, bool),
    }


def test_replay_stores_each_entry_in_its_own_dtype_and_round_trips():
    shapes, dtypes = {"cam": (64, 64, 1), "pos": (2,)}, {"cam": np.uint8, "pos": np.float32}
    buffer = ReplayBuffer(100, 4, shapes, dtypes, 2, seed=0)
    buffer.add("env", _dict_steps(0, 30))
    batch = buffer.sample(5)
    assert batch["obs"]["cam"].dtype == np.uint8 and batch["obs"]["cam"].shape == (5, 4, 64, 64, 1)
    # Sequences are contiguous: every entry agrees with the step counter (the reward).
    np.testing.assert_array_equal(batch["obs"]["pos"][..., 0], batch["rewards"])
    np.testing.assert_array_equal(batch["obs"]["cam"][..., 0, 0, 0], batch["rewards"] % 256)
    assert buffer.nbytes == 30 * bytes_per_step(shapes, dtypes, 2)
    assert bytes_per_step(shapes, dtypes, 2) == 64 * 64 + 8 + 8 + 4 + 2 + 24
    assert buffer.spec["obs_shape"] == {"cam": [64, 64, 1], "pos": [2]}
    assert buffer.spec["obs_dtype"] == {"cam": "uint8", "pos": "float32"}
    restored = ReplayBuffer(100, 4, shapes, dtypes, 2, seed=1)
    restored.set_state(buffer.get_state())
    again, ref = restored.sample(3), buffer.sample(3)
    for key in ("cam", "pos"):
        np.testing.assert_array_equal(again["obs"][key], ref["obs"][key])
    other = ReplayBuffer(100, 4, {"pos": (2,)}, {"pos": np.float32}, 2)
    with pytest.raises(ValueError, match="holds .*'obs/cam'.* another observation space"):
        other.set_state(buffer.get_state())
    with pytest.raises(ValueError, match="steps lack 'obs/cam'"):
        restored.add("env", {**_dict_steps(0, 3), "obs": {"pos": np.zeros((3, 2))}})


# --- the EnvRunner ------------------------------------------------------------------------------
class DictEnv(gym.Env):
    """Observations: a counter in `pos`, its parity in a Discrete `parity`, a frame whose pixels
    hold the counter; reward 1 per step; 5-step episodes."""

    observation_space = gym.spaces.Dict(
        {
            "pos": gym.spaces.Box(-100, 100, (2,), np.float64),
            "parity": gym.spaces.Discrete(2),
            "frame": gym.spaces.Box(0, 255, (64, 64, 1), np.uint8),
        }
    )
    action_space = gym.spaces.Discrete(2)

    def __init__(self, config=None):
        self.t = 0

    def _obs(self):
        frame = np.full((64, 64, 1), self.t, np.uint8)
        return {
            "pos": np.array([self.t, -self.t], np.float64),
            "parity": self.t % 2,
            "frame": frame,
        }

    def reset(self, *, seed=None, options=None):
        self.t = 0
        return self._obs(), {}

    def step(self, action):
        self.t += 1
        return self._obs(), 1.0, self.t == 5, False, {}


def test_env_runner_records_dict_observations_in_the_model_format():
    runner = DreamerV3EnvRunner(config=tiny_config(DictEnv), worker_index=0)
    (_, steps), *_ = runner.sample(num_timesteps=7, random_actions=True)
    obs = steps["obs"]
    assert set(obs) == {"frame", "parity", "pos"}
    counter = np.array([0, 1, 2, 3, 4, 5, 0, 1])  # an episode's 6 records, then 2
    np.testing.assert_array_equal(obs["pos"], np.stack([counter, -counter], 1))
    assert obs["pos"].dtype == np.float32 and obs["frame"].dtype == np.uint8
    np.testing.assert_array_equal(obs["parity"], np.eye(2)[counter % 2])
    np.testing.assert_array_equal(obs["frame"][:, 0, 0, 0], counter)
    # The policy acts on them too.
    (_, steps), *_ = runner.sample(num_timesteps=3)
    np.testing.assert_array_equal(steps["obs"]["pos"][:, 0], [2, 3, 4, 5])  # and the last obs
    runner.stop()
