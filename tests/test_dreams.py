"""Dream summaries: the open-loop dream, and media in the shapes/dtypes TensorBoard needs."""

import json
import pickle

import cv2
import numpy as np
import pytest
import tensorflow as tf
from ray.air._internal.json import SafeFallbackEncoder
from tensorboardX import SummaryWriter

from rllib_dreamerv3.dreams import MediaArray, dream_summaries, make_dream_fn, save_dreams
from rllib_dreamerv3.model import DreamerV3Model
from rllib_dreamerv3.model_sizes import get_model_size
from rllib_dreamerv3.update import batch_signature

B, T, BURN_IN, N = 3, 6, 2, 2


def image_batch(seed=0):
    rng = np.random.default_rng(seed)
    is_first = np.zeros((B, T), bool)
    is_first[:, 0] = True
    return {
        "obs": rng.integers(0, 256, (B, T, 64, 64, 3), dtype=np.uint8),
        "actions": np.eye(4, dtype=np.float32)[rng.integers(0, 4, (B, T))],
        "rewards": rng.normal(size=(B, T)).astype(np.float32),
        "is_first": is_first,
        "is_terminal": np.zeros((B, T), bool),
    }


@pytest.fixture(scope="module")
def image_dream():
    tf.random.set_seed(0)
    model = DreamerV3Model((64, 64, 3), 4, True, get_model_size("nano"))
    signature = batch_signature((64, 64, 3), tf.uint8, 4, B, T)
    return make_dream_fn(model, signature, BURN_IN, N)


def run(dream_fn, batch, seed=(1, 2)):
    return {k: v.numpy() for k, v in dream_fn(batch, tf.constant(seed, tf.int32)).items()}


def test_open_loop_dream_sees_only_the_burn_in(image_dream):
    batch = image_batch()
    out = run(image_dream, batch)
    assert out["obs"].shape == out["recon"].shape == out["dream"].shape == (N, T, 64, 64, 3)
    assert out["dream"].dtype == np.uint8
    np.testing.assert_array_equal(out["obs"], batch["obs"][:N])
    # Burn-in: the dream is the posterior reconstruction.
    np.testing.assert_array_equal(out["dream"][:, :BURN_IN], out["recon"][:, :BURN_IN])
    # Changing the frames after the burn-in changes the reconstructions, not the dream.
    changed = dict(batch, obs=batch["obs"].copy())
    changed["obs"][:, BURN_IN:] = 255 - changed["obs"][:, BURN_IN:]
    out2 = run(image_dream, changed)
    np.testing.assert_array_equal(out2["dream"], out["dream"])
    assert not np.array_equal(out2["recon"][:, BURN_IN:], out["recon"][:, BURN_IN:])
    assert image_dream.experimental_get_tracing_count() == 1


def test_image_summaries_have_tensorboard_shapes_and_dtypes(image_dream, tmp_path):
    summaries = dream_summaries(run(image_dream, image_batch()), BURN_IN)
    # Images [C, H, W] and a video [1, T, C, H, W], all uint8 (what Tune's TBX logger writes).
    recon = summaries["reconstruction"]
    assert recon.shape == (3, N * 2 * 64, T * 64) and recon.dtype == np.uint8
    video = summaries["video"]
    assert video.shape == (1, T, 3, N * 64, 3 * 64) and video.dtype == np.uint8
    plot = summaries["rewards_and_continues"]
    assert plot.ndim == 3 and plot.shape[0] == 3 and plot.dtype == np.uint8
    for key in (
        "obs_mse_posterior",
        "obs_mse_open_loop",
        "reward_mae_open_loop",
        "continue_mae_open_loop",
    ):
        assert isinstance(summaries[key], float) and np.isfinite(summaries[key])
    writer = SummaryWriter(str(tmp_path / "tb"))
    writer.add_image("reconstruction", recon, 0)
    writer.close()
    assert any(p.name.startswith("events") for p in (tmp_path / "tb").iterdir())
    paths = save_dreams(summaries, str(tmp_path / "png"))
    png = cv2.imread(next(p for p in paths if p.endswith("reconstruction.png")))
    assert png.shape == (N * 2 * 64, T * 64, 3)


def test_vector_summaries_plot_observations():
    tf.random.set_seed(0)
    model = DreamerV3Model((3,), 2, True, get_model_size("nano"))
    dream = make_dream_fn(model, batch_signature((3,), tf.float32, 2, B, T), BURN_IN, N)
    rng = np.random.default_rng(0)
    batch = {
        "obs": rng.normal(size=(B, T, 3)).astype(np.float32),
        "actions": np.eye(2, dtype=np.float32)[rng.integers(0, 2, (B, T))],
        "rewards": np.zeros((B, T), np.float32),
        "is_first": np.zeros((B, T), bool),
        "is_terminal": np.zeros((B, T), bool),
    }
    summaries = dream_summaries(run(dream, batch), BURN_IN)
    assert "video" not in summaries
    image = summaries["observations"]
    assert image.ndim == 3 and image.shape[0] == 3 and image.dtype == np.uint8
    assert image.min() < 100 < 250 <= image.max()  # lines drawn on a white canvas


def test_media_arrays_stay_out_of_json_logs_and_survive_pickling():
    media = np.zeros((1, 4, 3, 8, 8), np.uint8).view(MediaArray)
    text = json.dumps({"video": media}, cls=SafeFallbackEncoder)
    assert text == '{"video": "<uint8 media (1, 4, 3, 8, 8)>"}'
    restored = pickle.loads(pickle.dumps(media))
    assert isinstance(restored, MediaArray) and restored.shape == (1, 4, 3, 8, 8)
