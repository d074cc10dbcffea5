"""Which observation and action spaces DreamerV3 supports, with errors that say what to do."""

import gymnasium as gym
import numpy as np
import tensorflow as tf

IMAGE_SIZE = 64  # the CNN encoder takes 64×64 images, as in the DreamerV3 paper

SUPPORTED = (
    "observations: a 1-D Box (vectors) or a Box(0, 255, (64, 64, C), uint8) image with C in "
    "{1, 3}; actions: Discrete(n) or a 1-D Box with finite bounds"
)


def check_spaces(observation_space, action_space):
    """Raise a `ValueError` naming the space and listing what is supported, if unsupported."""
    obs = observation_space
    if isinstance(obs, gym.spaces.Dict):
        raise ValueError(
            f"Unsupported observation space {obs!r}. DreamerV3 supports {SUPPORTED}. Dict "
            "observations (e.g. an image plus a vector) are not supported: keep the image, or "
            "flatten the vector parts into one 1-D Box with gymnasium.wrappers.FlattenObservation."
        )
    if not isinstance(obs, gym.spaces.Box):
        raise ValueError(
            f"Unsupported observation space {obs!r}. DreamerV3 supports {SUPPORTED}. "
            "Flatten Tuple/MultiBinary observations into a 1-D Box, e.g. with "
            "gymnasium.wrappers.FlattenObservation."
        )
    if len(obs.shape) == 3:
        _check_image_space(obs)
    elif len(obs.shape) != 1:
        raise ValueError(
            f"Unsupported observation shape {obs.shape} of {obs!r}. DreamerV3 supports "
            f"{SUPPORTED}. Flatten other arrays into a 1-D Box with "
            "gymnasium.wrappers.FlattenObservation."
        )
    act = action_space
    if isinstance(act, gym.spaces.Discrete):
        return
    if isinstance(act, gym.spaces.Box) and len(act.shape) == 1:
        if not (np.all(np.isfinite(act.low)) and np.all(np.isfinite(act.high))):
            raise ValueError(
                f"Action space {act!r} has infinite bounds. DreamerV3 supports {SUPPORTED}: "
                "its continuous actor acts in [-1, 1] and rescales to the bounds. Give the Box "
                "finite low/high, e.g. with gymnasium.wrappers.ClipAction and RescaleAction."
            )
        return
    raise ValueError(
        f"Unsupported action space {act!r}. DreamerV3 supports {SUPPORTED}. MultiDiscrete, "
        "MultiBinary, Dict and Tuple action spaces are not supported."
    )


def _check_image_space(obs):
    height, width, channels = obs.shape
    if channels not in (1, 3) and height in (1, 3):
        raise ValueError(
            f"Image observations {obs!r} look channels-first {obs.shape}; DreamerV3 needs "
            f"channels-last (64, 64, C). Transpose them, e.g. with "
            "gymnasium.wrappers.TransformObservation(env, lambda o: o.transpose(1, 2, 0), ...). "
            f"DreamerV3 supports {SUPPORTED}."
        )
    if obs.dtype != np.uint8:
        raise ValueError(
            f"Image observations {obs!r} have dtype {obs.dtype}; DreamerV3 needs uint8 pixels "
            "in [0, 255] (they stay uint8 in the replay buffer). Convert them, e.g. "
            "(obs * 255).astype(np.uint8) in an ObservationWrapper. "
            f"DreamerV3 supports {SUPPORTED}."
        )
    if (height, width) != (IMAGE_SIZE, IMAGE_SIZE) or channels not in (1, 3):
        raise ValueError(
            f"Unsupported image shape {obs.shape} of {obs!r}. DreamerV3's CNN takes "
            f"({IMAGE_SIZE}, {IMAGE_SIZE}, C) images with C = 3 (RGB) or 1 (grayscale). Resize "
            f"with gymnasium.wrappers.ResizeObservation(env, ({IMAGE_SIZE}, {IMAGE_SIZE})) "
            "(and GrayscaleObservation(env, keep_dim=True) for one channel); Atari ids "
            f"'ALE/<Game>-v5' are wrapped to 64×64 automatically. DreamerV3 supports {SUPPORTED}."
        )


def is_image(observation_space):
    """Whether observations are images (3-D), encoded by the CNN."""
    return len(observation_space.shape) == 3


def action_dim(action_space):
    """Width of the action vector the model uses: one-hot size or continuous dims."""
    if isinstance(action_space, gym.spaces.Discrete):
        return int(action_space.n)
    return int(action_space.shape[0])


def rescale_action(action, low, high):
    """Map a model action in [-1, 1] to the env's `[low, high]` (numpy or TF alike)."""
    return low + (action + 1.0) * 0.5 * (high - low)


def env_action(action, action_space):
    """The model's actions `[N, A]` (one-hot, or in [-1, 1]) as the env's, in TF: the index
    (from `action_space.start`), or the values rescaled to the Box bounds."""
    if is_discrete(action_space):
        return tf.argmax(action, -1) + int(action_space.start)
    low = tf.constant(action_space.low, tf.float32)
    high = tf.constant(action_space.high, tf.float32)
    return rescale_action(action, low, high)


def obs_storage_dtype(observation_space):
    """numpy dtype observations are stored and fed in: uint8 stays uint8, the rest float32."""
    return np.dtype(np.uint8) if observation_space.dtype == np.uint8 else np.dtype(np.float32)


def is_discrete(action_space):
    return isinstance(action_space, gym.spaces.Discrete)
