"""Which observation and action spaces DreamerV3 supports, with errors that say what to do, and
:class:`ObsFormat`: how the model sees, stores and is fed an env's observations."""

import re

import gymnasium as gym
import numpy as np
import tensorflow as tf

IMAGE_SIZE = 64  # the CNN encoder takes 64×64 images, as in the DreamerV3 paper

SUPPORTED = (
    "observations: a 1-D Box (vectors), a Box(0, 255, (64, 64, C), uint8) image with C in "
    "{1, 3}, Discrete(n) (one-hot), or a Dict of these (and of scalar Boxes); actions: "
    "Discrete(n) or a 1-D Box with finite bounds"
)


def check_spaces(observation_space, action_space):
    """Raise a `ValueError` naming the space and listing what is supported, if unsupported."""
    obs = observation_space
    if isinstance(obs, gym.spaces.Dict):
        _dict_leaves(obs)
    elif not isinstance(obs, (gym.spaces.Box, gym.spaces.Discrete)):
        raise ValueError(
            f"Unsupported observation space {obs!r}. DreamerV3 supports {SUPPORTED}. "
            "Flatten Tuple/MultiBinary observations into a 1-D Box, e.g. with "
            "gymnasium.wrappers.FlattenObservation."
        )
    elif isinstance(obs, gym.spaces.Box) and len(obs.shape) == 3:
        _check_image_space(obs)
    elif isinstance(obs, gym.spaces.Box) and len(obs.shape) != 1:
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


def _check_image_space(obs, key=None):
    try:
        _check_image_shape(obs)
    except ValueError as err:
        if key is None:
            raise
        raise ValueError(f"Dict observation {key!r}: {err}") from None


def _check_image_shape(obs):
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
    """Whether observations are images, encoded by the CNN (for a Dict: whether any leaf is)."""
    if isinstance(observation_space, gym.spaces.Dict):
        return any(len(space.shape) == 3 for space in _dict_leaves(observation_space).values())
    return len(observation_space.shape or ()) == 3


def _dict_leaves(space, prefix=""):
    """`{key: leaf space}` of a Dict space, nested keys joined with "/", sorted by key; raises a
    `ValueError` naming the first unsupported leaf."""
    leaves = {}
    for name, leaf in space.spaces.items():
        key = f"{prefix}{name}"
        if isinstance(leaf, gym.spaces.Dict):
            nested = _dict_leaves(leaf, key + "/")
            clash = sorted(set(nested) & set(leaves))
            if clash:
                raise ValueError(f"The Dict observation space has the key {clash[0]!r} twice.")
            leaves.update(nested)
            continue
        if key in leaves:
            raise ValueError(f"The Dict observation space has the key {key!r} twice.")
        if isinstance(leaf, gym.spaces.Discrete):
            leaves[key] = leaf
        elif isinstance(leaf, gym.spaces.Box) and len(leaf.shape) == 3:
            _check_image_space(leaf, key)
            leaves[key] = leaf
        elif isinstance(leaf, gym.spaces.Box) and len(leaf.shape) <= 1:
            if not np.issubdtype(leaf.dtype, np.number) and leaf.dtype != np.bool_:
                raise ValueError(f"Dict observation {key!r} has dtype {leaf.dtype}: {SUPPORTED}.")
            leaves[key] = leaf
        else:
            raise ValueError(
                f"Unsupported Dict observation {key!r}: {leaf!r}. DreamerV3 supports {SUPPORTED}. "
                f"Drop or flatten that entry, e.g. with gymnasium.wrappers.FilterObservation or "
                "TransformObservation."
            )
    if not prefix and not leaves:
        raise ValueError(f"The Dict observation space {space!r} has no entries: {SUPPORTED}.")
    return dict(sorted(leaves.items()))


class ObsFormat:
    """How the model sees the observations of `observation_space` (checked with
    :func:`check_spaces`).

    The *model format* of one observation: a Box observation as an array (images uint8, vectors
    float32 unless uint8); `Discrete(n)` as a one-hot float32 vector `[n]`; a Dict as a flat
    dict `{key: leaf}` (nested keys joined with "/", sorted) whose leaves are uint8 images or
    float32 vectors (scalars become `[1]`, Discrete leaves one-hot). The replay buffer stores,
    and the model takes, observations in this format.

    Args:
        observation_space: the env's observation space.
        encoder_keys, decoder_keys: for Dict observations, which leaves the encoder reads and
            the decoder reconstructs: a regular expression that must match a whole key
            (default ".*": all), or a list of keys. Vector leaves go through the MLP, images
            through the CNN, whichever keys are chosen (the author's `mlp_keys`/`cnn_keys`).
    """

    def __init__(self, observation_space, encoder_keys=".*", decoder_keys=".*"):
        self.space = observation_space
        self.is_dict = isinstance(observation_space, gym.spaces.Dict)
        if self.is_dict:
            self._leaves = _dict_leaves(observation_space)
        else:
            self._leaves = {None: observation_space}
        leaves = self._leaves.items()
        self.shapes = {key: _model_shape(space) for key, space in leaves}
        self.dtypes = {key: _model_dtype(space, self.is_dict) for key, space in leaves}
        self.encoder_keys = self._select(encoder_keys, "encoder_keys")
        self.decoder_keys = self._select(decoder_keys, "decoder_keys")

    def _select(self, keys, name):
        if not self.is_dict:
            return [None]
        available = list(self._leaves)
        if isinstance(keys, str):
            try:
                chosen = [key for key in available if re.fullmatch(keys, key)]
            except re.error as err:
                raise ValueError(f"{name}={keys!r} is not a regular expression: {err}.") from None
        else:
            unknown = [key for key in keys if key not in self._leaves]
            if unknown:
                raise ValueError(
                    f"{name}={list(keys)!r} names {unknown}, which the observation space does "
                    f"not have; its keys are {available}."
                )
            chosen = [key for key in available if key in keys]
        if not chosen:
            raise ValueError(
                f"{name}={keys!r} selects none of the observation keys {available}; the "
                f"{name.split('_')[0]} needs at least one (default '.*': all)."
            )
        return chosen

    def structure(self, per_key):
        """`per_key` (`{key: value}`) in the model format's structure: the dict for Dict
        observations, the one value otherwise."""
        return dict(per_key) if self.is_dict else per_key[None]

    def map(self, fn, obs):
        """`fn(leaf)` for every leaf of model-format `obs` (a dict or an array)."""
        return {key: fn(value) for key, value in obs.items()} if self.is_dict else fn(obs)

    def items(self, obs):
        """`[(key, leaf)]` of model-format `obs` (key None for non-Dict observations)."""
        return list(obs.items()) if self.is_dict else [(None, obs)]

    def shape(self, keys=None):
        """Leaf shapes in the model format's structure (only `keys`, if given)."""
        keys = list(self.shapes) if keys is None else keys
        return self.structure({key: self.shapes[key] for key in keys})

    def dtype(self):
        """Leaf numpy dtypes in the model format's structure."""
        return self.structure(self.dtypes)

    def convert(self, obs):
        """One env observation in the model format, or a `ValueError` naming what does not fit
        the observation space (shape, dtype, or a missing key)."""
        if not self.is_dict:
            return self._leaf(None, self.space, obs)
        flat = _flatten(obs)
        missing = [key for key in self._leaves if key not in flat]
        if missing:
            raise ValueError(
                f"an observation without the keys {missing} of its Dict observation_space "
                f"(it has {sorted(flat)})"
            )
        return {key: self._leaf(key, space, flat[key]) for key, space in self._leaves.items()}

    def _leaf(self, key, space, value):
        value = np.asarray(value)
        subject = "an observation" if key is None else f"an observation whose entry {key!r} is"
        if isinstance(space, gym.spaces.Discrete):
            if value.shape != () or not np.issubdtype(value.dtype, np.integer):
                raise ValueError(
                    f"{subject} {value.tolist()!r}, which is not an integer of {space}"
                )
            index = int(value) - int(space.start)
            if not 0 <= index < space.n:
                raise ValueError(f"{subject} {int(value)}, outside {space}")
            one_hot = np.zeros(space.n, np.float32)
            one_hot[index] = 1.0
            return one_hot
        dtype = self.dtypes[key]
        if value.shape != space.shape or not np.can_cast(value.dtype, dtype, "same_kind"):
            raise ValueError(
                f"{subject} of shape {value.shape} and dtype {value.dtype}, but its "
                f"observation_space {space} declares shape {space.shape} and dtype {space.dtype}"
            )
        return value.reshape(self.shapes[key]).astype(dtype, copy=False)

    def stack(self, observations):
        """Model-format observations stacked along a new first axis."""
        if self.is_dict:
            return {key: np.stack([obs[key] for obs in observations]) for key in self._leaves}
        return np.stack(observations)

    def nonfinite(self, obs):
        """`(key, count, first index)` of the first leaf of model-format `obs` holding NaN/inf
        entries, or None."""
        for key, value in self.items(obs):
            if value.dtype.kind == "f" and not np.isfinite(value).all():
                bad = ~np.isfinite(value)
                return key, int(np.sum(bad)), np.argwhere(bad)[0].tolist()
        return None

    def bytes_per_step(self):
        """Bytes one model-format observation takes."""
        return sum(
            int(np.prod(shape)) * self.dtypes[key].itemsize for key, shape in self.shapes.items()
        )


def _flatten(obs, prefix=""):
    flat = {}
    for name, value in obs.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{name}/"))
        else:
            flat[f"{prefix}{name}"] = value
    return flat


def _model_shape(space):
    if isinstance(space, gym.spaces.Discrete):
        return (int(space.n),)
    return tuple(space.shape) if space.shape else (1,)


def _model_dtype(space, in_dict):
    if isinstance(space, gym.spaces.Discrete):
        return np.dtype(np.float32)
    if len(space.shape) == 3 or (not in_dict and space.dtype == np.uint8):
        return np.dtype(np.uint8)
    return np.dtype(np.float32)


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
    """numpy dtype Box observations are stored and fed in: uint8 stays uint8, the rest float32
    (any space: :class:`ObsFormat`)."""
    return _model_dtype(observation_space, in_dict=False)


def is_discrete(action_space):
    return isinstance(action_space, gym.spaces.Discrete)
