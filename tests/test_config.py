"""DreamerV3Config: the paper's defaults, and a clear early error for every bad value."""

import inspect
import math
import numbers
import re
import typing

import gymnasium as gym
import numpy as np
import pytest
from ray.tune.registry import register_env

from rllib_dreamerv3 import DreamerV3Config
from rllib_dreamerv3.config import HYPERPARAMETERS
from rllib_dreamerv3.validation import RULES, numeric_errors


def test_paper_defaults():
    c = DreamerV3Config()
    assert (c.model_size, c.training_ratio, c.batch_size_B, c.batch_length_T, c.horizon_H) == (
        "XS",
        1024,
        16,
        64,
        15,
    )
    assert c.gamma == pytest.approx(1 - 1 / 333) and c.gae_lambda == 0.95
    assert c.entropy_scale == 3e-4 and c.return_normalization_decay == 0.99
    assert (c.world_model_lr, c.actor_lr, c.critic_lr) == (1e-4, 3e-5, 3e-5)
    assert (c.world_model_adam_eps, c.actor_adam_eps, c.critic_adam_eps) == (1e-8, 1e-5, 1e-5)
    assert (c.world_model_grad_clip, c.actor_grad_clip, c.critic_grad_clip) == (1000, 100, 100)
    assert c.free_bits == 1.0
    assert (c.pred_loss_scale, c.dyn_loss_scale, c.rep_loss_scale) == (1.0, 0.5, 0.1)
    assert c.critic_ema_rate == 0.02 and c.critic_ema_regularizer == 1.0
    assert c.unimix == 0.01 and c.num_bins == 255 and c.replay_capacity == 1_000_000
    assert c.framework_str == "tf2"


def test_training_sets_every_hyperparameter_and_round_trips_through_dict():
    c = DreamerV3Config().training(model_size="S", training_ratio=512, horizon_H=10, gamma=0.99)
    assert (c.model_size, c.training_ratio, c.horizon_H, c.gamma) == ("S", 512, 10, 0.99)
    restored = DreamerV3Config.from_dict(c.to_dict())
    for name in HYPERPARAMETERS:
        assert getattr(restored, name) == getattr(c, name), name
    with pytest.raises(TypeError):
        DreamerV3Config().training(not_a_hyperparameter=1)


@pytest.mark.parametrize(
    "key,value,message",
    [
        ("model_size", "XXL", "Unknown model_size='XXL'"),
        ("training_ratio", 0, "training_ratio=0 must be a positive integer"),
        ("batch_size_B", -1, "batch_size_B=-1 must be a positive integer"),
        ("batch_length_T", 1, "batch_length_T=1 must be an integer >= 2"),
        ("horizon_H", 0, "horizon_H=0 must be a positive integer"),
        ("gamma", 1.5, "gamma=1.5 must lie in (0.0, 1.0]"),
        ("gae_lambda", -0.1, "gae_lambda=-0.1 must lie in [0.0, 1.0]"),
        ("world_model_lr", 0.0, "world_model_lr=0.0 must be a positive number"),
        ("actor_adam_eps", -1e-5, "actor_adam_eps=-1e-05 must be a positive number"),
        ("critic_grad_clip", 0, "critic_grad_clip=0 must be a positive number"),
        ("free_bits", -1.0, "free_bits=-1.0 must be a number >= 0"),
        ("entropy_scale", -1.0, "entropy_scale=-1.0 must be a number >= 0"),
        ("return_normalization_decay", 1.0, "return_normalization_decay=1.0 must lie in"),
        ("critic_ema_rate", 0.0, "critic_ema_rate=0.0 must lie in (0.0, 1.0]"),
        ("unimix", 1.0, "unimix=1.0 must lie in [0.0, 1.0)"),
        ("replay_capacity", 10, "replay_capacity=10 must hold at least one sequence"),
        ("actor_min_std", 2.0, "actor_min_std=2.0 must be smaller than actor_max_std"),
        ("cnn_kernel", 0, "cnn_kernel=0 must be a positive integer"),
        (
            "sync_weights_every_n_updates",
            0,
            "sync_weights_every_n_updates=0 must be a positive integer",
        ),
        ("vector_mlp_units", 0, "vector_mlp_units=0 must be a positive integer, or None"),
        ("vector_mlp_layers", 2.5, "vector_mlp_layers=2.5 must be a positive integer, or None"),
        ("dream_every_n_updates", -1, "dream_every_n_updates=-1 must be an integer >= 0"),
        ("dream_burn_in", 64, "dream_burn_in=64 must be an integer in [1, batch_length_T=64)"),
        ("dream_num_sequences", 0, "dream_num_sequences=0 must be a positive integer"),
        ("precision", "float16", "precision='float16' must be one of ('float32', 'bfloat16')"),
        ("overlap_policy_and_envs", "yes", "overlap_policy_and_envs='yes' must be 'auto', True"),
        (
            "overlap_policy_and_envs",
            True,
            "overlap_policy_and_envs=True needs num_envs_per_env_runner >= 2 (got 1)",
        ),
        ("fast_kernels", "yes", "fast_kernels='yes' must be True or False"),
        ("fast_kernels", 1, "fast_kernels=1 must be True or False"),
    ],
)
def test_bad_values_are_named(key, value, message):
    config = DreamerV3Config().environment("CartPole-v1").training(**{key: value})
    with pytest.raises(ValueError, match=re.escape(message)):
        config.validate()


def _numeric_hyperparameters():
    """The keys of HYPERPARAMETERS whose default or `training()` type is an int or a float."""
    params = inspect.signature(DreamerV3Config.training).parameters

    def numeric(name):
        annotation = params[name].annotation if name in params else None
        default = HYPERPARAMETERS[name][0]
        typed = any(t in (int, float) for t in typing.get_args(annotation) or (annotation,))
        return typed or (isinstance(default, numbers.Real) and not isinstance(default, bool))

    return [name for name in HYPERPARAMETERS if numeric(name)]


# A value just outside each numeric hyperparameter's range (one per key: a new numeric
# hyperparameter needs one here, and a rule in rllib_dreamerv3/validation.py).
OUT_OF_RANGE = {
    "training_ratio": 0,
    "batch_size_B": 0,
    "batch_length_T": 1,
    "horizon_H": 0,
    "gamma": 0.0,
    "gae_lambda": 1.5,
    "entropy_scale": -1e-4,
    "return_normalization_decay": 1.0,
    "world_model_lr": 0.0,
    "actor_lr": -3e-5,
    "critic_lr": 0.0,
    "world_model_adam_eps": 0.0,
    "actor_adam_eps": -1e-5,
    "critic_adam_eps": 0.0,
    "world_model_grad_clip": 0.0,
    "actor_grad_clip": -1.0,
    "critic_grad_clip": 0.0,
    "free_bits": -0.5,
    "pred_loss_scale": -1.0,
    "dyn_loss_scale": -0.5,
    "rep_loss_scale": -0.1,
    "critic_ema_rate": 0.0,
    "critic_ema_regularizer": -1.0,
    "unimix": 1.0,
    "num_bins": 1,  # two-hot needs two bins
    "cnn_kernel": 0,
    "vector_mlp_units": 0,
    "vector_mlp_layers": -1,
    "actor_min_std": -0.1,
    "actor_max_std": 0.0,
    "replay_capacity": 0,
    "num_steps_sampled_before_learning_starts": -1,
    "checkpoint_interval_s": -1.0,
    "sync_weights_every_n_updates": 0,
    "dream_every_n_updates": -1,
    "dream_burn_in": 0,
    "dream_num_sequences": 0,
    "learner_peer_timeout_s": 0.0,
    "tf_num_threads": 0,
    "max_skipped_updates_in_a_row": -1,
}


@pytest.mark.parametrize("kind", ["inf", "nan", "out_of_range"])
@pytest.mark.parametrize("key", [*_numeric_hyperparameters(), "gamma"])
def test_every_numeric_hyperparameter_rejects_inf_nan_and_out_of_range(key, kind):
    value = {"inf": math.inf, "nan": math.nan}.get(kind, OUT_OF_RANGE.get(key))
    assert kind != "out_of_range" or key in OUT_OF_RANGE, f"add {key} to OUT_OF_RANGE"
    config = DreamerV3Config().environment("CartPole-v1").training(**{key: value})
    with pytest.raises(ValueError, match=rf"^{re.escape(f'{key}={value!r} must ')}"):
        config.validate()


def test_every_numeric_hyperparameter_has_a_rule():
    numeric = _numeric_hyperparameters()
    assert {"critic_lr", "num_bins", "vector_mlp_units", "tf_num_threads"} <= set(numeric)
    missing = [name for name in numeric if name not in RULES]
    assert not missing, f"add a rule for {missing} to RULES in rllib_dreamerv3/validation.py"
    assert set(RULES) <= {*HYPERPARAMETERS, "gamma"}, "a rule for an unknown key"
    assert list(numeric_errors(DreamerV3Config().hyperparameters)) == []  # the defaults pass


def test_numeric_bounds_none_and_numpy_values_are_accepted():
    DreamerV3Config().environment("CartPole-v1").training(
        gae_lambda=1.0,
        unimix=0.0,
        return_normalization_decay=0.0,
        critic_ema_rate=1.0,
        free_bits=0,
        entropy_scale=0.0,
        num_bins=2,
        critic_lr=np.float32(1e-4),
        batch_size_B=np.int64(8),
        num_steps_sampled_before_learning_starts=0,
        dream_every_n_updates=0,
        vector_mlp_units=None,
        tf_num_threads=None,
    ).validate()


@pytest.mark.parametrize(
    "key,value", [("critic_lr", True), ("batch_size_B", 8.0), ("free_bits", "1.0")]
)
def test_numeric_hyperparameters_reject_other_types(key, value):
    config = DreamerV3Config().environment("CartPole-v1").training(**{key: value})
    with pytest.raises(ValueError, match=re.escape(f"{key}={value!r} must be")):
        config.validate()


def test_torch_framework_is_rejected():
    config = DreamerV3Config().environment("CartPole-v1").framework("torch")
    with pytest.raises(ValueError, match="TensorFlow 2 only"):
        config.validate()


def test_bad_rollout_fragment_length():
    config = DreamerV3Config().environment("CartPole-v1")
    config.rollout_fragment_length = 0  # e.g. from a dict; `.env_runners()` rejects it too
    with pytest.raises(ValueError, match="rollout_fragment_length"):
        config.validate()


def test_unknown_env_is_a_clear_error():
    config = DreamerV3Config().environment("NoSuchEnv-v0")
    with pytest.raises(ValueError, match="Could not create env 'NoSuchEnv-v0'"):
        config.validate()


def _env_with(obs_space, act_space):
    class Env(gym.Env):
        observation_space = obs_space
        action_space = act_space

        def __init__(self, config=None):
            pass

    return Env


@pytest.mark.parametrize(
    "obs_space,act_space,message",
    [
        (
            gym.spaces.Tuple([gym.spaces.Box(0, 1, (2,))]),
            gym.spaces.Discrete(2),
            "Unsupported observation space Tuple",
        ),
        (
            gym.spaces.Tuple([gym.spaces.Box(0, 1, (2,))]),
            gym.spaces.Discrete(2),
            "Unsupported observation space Tuple",
        ),
        (gym.spaces.MultiBinary(3), gym.spaces.Discrete(2), "Unsupported observation space Multi"),
        (
            gym.spaces.Box(0, 1, (3, 4)),
            gym.spaces.Discrete(2),
            r"Unsupported observation shape \(3, 4\)",
        ),
        (
            gym.spaces.Box(0, 1, (3,)),
            gym.spaces.MultiDiscrete([2, 2]),
            "Unsupported action space MultiDiscrete",
        ),
        (gym.spaces.Box(0, 1, (3,)), gym.spaces.MultiBinary(2), "Unsupported action space Multi"),
        (gym.spaces.Box(0, 1, (3,)), gym.spaces.Box(-np.inf, np.inf, (2,)), "infinite bounds"),
        (
            gym.spaces.Box(0, 255, (84, 84, 3), np.uint8),
            gym.spaces.Discrete(2),
            r"Unsupported image shape \(84, 84, 3\).*ResizeObservation\(env, \(64, 64\)\)",
        ),
        (
            gym.spaces.Box(0, 255, (64, 64, 4), np.uint8),
            gym.spaces.Discrete(2),
            r"Unsupported image shape \(64, 64, 4\)",
        ),
        (
            gym.spaces.Box(0, 255, (3, 64, 64), np.uint8),
            gym.spaces.Discrete(2),
            r"channels-first \(3, 64, 64\)",
        ),
        (
            gym.spaces.Box(0, 1, (64, 64, 3), np.float32),
            gym.spaces.Discrete(2),
            "dtype float32; DreamerV3 needs uint8",
        ),
        (
            gym.spaces.Dict(
                {"pos": gym.spaces.Box(0, 1, (3,)), "grid": gym.spaces.Box(0, 1, (4, 4))}
            ),
            gym.spaces.Discrete(2),
            r"Unsupported Dict observation 'grid': Box\(0.0, 1.0, \(4, 4\)",
        ),
        (
            gym.spaces.Dict({"a": gym.spaces.Dict({"note": gym.spaces.Text(5)})}),
            gym.spaces.Discrete(2),
            "Unsupported Dict observation 'a/note': Text",
        ),
        (
            gym.spaces.Dict({"cam": gym.spaces.Box(0, 255, (84, 84, 3), np.uint8)}),
            gym.spaces.Discrete(2),
            r"Dict observation 'cam': Unsupported image shape \(84, 84, 3\)",
        ),
        (
            gym.spaces.Dict({"pair": gym.spaces.Tuple([gym.spaces.Discrete(2)] * 2)}),
            gym.spaces.Discrete(2),
            "Unsupported Dict observation 'pair': Tuple",
        ),
    ],
)
def test_unsupported_spaces_list_what_is_supported(obs_space, act_space, message):
    config = DreamerV3Config().environment(_env_with(obs_space, act_space))
    with pytest.raises(ValueError, match=message) as info:
        config.validate()
    assert "Discrete(n) or a 1-D Box" in str(info.value)


@pytest.mark.parametrize("channels", [1, 3])
def test_64x64_uint8_images_are_supported(channels):
    obs_space = gym.spaces.Box(0, 255, (64, 64, channels), np.uint8)
    DreamerV3Config().environment(_env_with(obs_space, gym.spaces.Discrete(3))).validate()


def test_replay_capacity_beyond_memory_is_rejected():
    obs_space = gym.spaces.Box(0, 255, (64, 64, 3), np.uint8)
    config = (
        DreamerV3Config()
        .environment(_env_with(obs_space, gym.spaces.Discrete(3)))
        .training(replay_capacity=10**9)
    )  # 64*64*3 + 3 actions*4 + 4 + 2 + 24 bytes a step
    with pytest.raises(
        ValueError,
        match=r"replay_capacity=1000000000 steps of 12330 bytes "
        r"need .* GiB, more than this machine's",
    ):
        config.validate()


class _CountingEnv(gym.Env):
    """Counts constructions and closes; raises when built with `{"fail": True}`."""

    observation_space = gym.spaces.Box(0, 1, (3,), np.float32)
    action_space = gym.spaces.Discrete(2)
    built = closed = 0

    def __init__(self, config=None):
        type(self).built += 1
        if (config or {}).get("fail"):
            raise RuntimeError("this env must not be built")

    def close(self):
        type(self).closed += 1


@pytest.fixture
def counting_env():
    _CountingEnv.built = _CountingEnv.closed = 0
    register_env("counting_env", _CountingEnv)
    return _CountingEnv


def test_validate_builds_no_env_when_the_spaces_are_given(counting_env):
    config = DreamerV3Config().environment(
        "counting_env",
        env_config={"fail": True},
        observation_space=counting_env.observation_space,
        action_space=counting_env.action_space,
    )
    config.validate()
    assert counting_env.built == 0


def test_validate_checks_the_given_spaces(counting_env):
    config = DreamerV3Config().environment(
        "counting_env",
        env_config={"fail": True},
        observation_space=gym.spaces.MultiBinary(3),
        action_space=gym.spaces.Discrete(2),
    )
    with pytest.raises(ValueError, match="Unsupported observation space Multi"):
        config.validate()


def test_validate_builds_and_closes_one_env_when_the_spaces_are_unknown(counting_env):
    DreamerV3Config().environment("counting_env").validate()
    assert (counting_env.built, counting_env.closed) == (1, 1)
    # Closed also when the check of its spaces fails.
    config = (
        DreamerV3Config().environment("counting_env").training(replay_capacity=10**15)
    )  # more memory than any machine has
    with pytest.raises(ValueError, match="replay_capacity=1000000000000000 steps"):
        config.validate()
    assert (counting_env.built, counting_env.closed) == (2, 2)
