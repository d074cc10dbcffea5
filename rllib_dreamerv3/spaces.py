"""Which observation and action spaces DreamerV3 supports, with errors that say what to do."""

import gymnasium as gym
import numpy as np

SUPPORTED = (
    "observations: a 1-D Box of floats (vector observations); "
    "actions: Discrete(n) or a 1-D Box with finite bounds"
)


def check_spaces(observation_space, action_space):
    """Raise a `ValueError` naming the space and listing what is supported, if unsupported."""
    obs = observation_space
    if not isinstance(obs, gym.spaces.Box):
        raise ValueError(
            f"Unsupported observation space {obs!r}. DreamerV3 supports {SUPPORTED}. "
            "Flatten Dict/Tuple/MultiBinary observations into a 1-D Box, e.g. with "
            "gymnasium.wrappers.FlattenObservation.")
    if len(obs.shape) != 1:
        raise ValueError(
            f"Unsupported observation shape {obs.shape} of {obs!r}. DreamerV3 supports "
            f"{SUPPORTED}. Image observations are not supported yet; for other 2-D or larger "
            "arrays, flatten them with gymnasium.wrappers.FlattenObservation.")
    act = action_space
    if isinstance(act, gym.spaces.Discrete):
        return
    if isinstance(act, gym.spaces.Box) and len(act.shape) == 1:
        if not (np.all(np.isfinite(act.low)) and np.all(np.isfinite(act.high))):
            raise ValueError(
                f"Action space {act!r} has infinite bounds. DreamerV3 supports {SUPPORTED}: "
                "its continuous actor acts in [-1, 1] and rescales to the bounds. Give the Box "
                "finite low/high, e.g. with gymnasium.wrappers.ClipAction and RescaleAction.")
        return
    raise ValueError(
        f"Unsupported action space {act!r}. DreamerV3 supports {SUPPORTED}. MultiDiscrete, "
        "MultiBinary, Dict and Tuple action spaces are not supported.")


def action_dim(action_space):
    """Width of the action vector the model uses: one-hot size or continuous dims."""
    if isinstance(action_space, gym.spaces.Discrete):
        return int(action_space.n)
    return int(action_space.shape[0])


def rescale_action(action, low, high):
    """Map a model action in [-1, 1] to the env's `[low, high]` (numpy or TF alike)."""
    return low + (action + 1.0) * 0.5 * (high - low)


def obs_storage_dtype(observation_space):
    """numpy dtype observations are stored and fed in: uint8 stays uint8, the rest float32."""
    return np.dtype(np.uint8) if observation_space.dtype == np.uint8 else np.dtype(np.float32)


def is_discrete(action_space):
    return isinstance(action_space, gym.spaces.Discrete)
