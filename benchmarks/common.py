"""What the benchmark scripts share: quiet TF, timing, JSON lines, the machine, small settings.

Run a script as `python benchmarks/NAME.py`: Python puts this folder first on `sys.path`, so its
`import common` (before TensorFlow's: this quiets TF's C++ logging) finds this module.
"""

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

UPDATE_SHAPE = {"batch_size_B": 16, "batch_length_T": 64, "horizon_H": 15}  # every figure's
TINY = {"batch_size_B": 2, "batch_length_T": 8, "horizon_H": 3}  # a smoke run's: ms at nano


def log(message):
    print(message, file=sys.stderr, flush=True)


def emit(record):
    """One JSON line, flushed: a long run shows each figure as soon as it is measured."""
    print(json.dumps(record), flush=True)


def num_cores():
    return len(os.sched_getaffinity(0))


def loadavg():
    """Other processes skew every timing: a figure is only as good as the machine was quiet."""
    return round(os.getloadavg()[0], 2)


def machine():
    """What a figure in `docs/` states beside it: CPU, cores, load, commit, date."""
    with open("/proc/cpuinfo") as f:
        cpu = next((line.split(":")[1].strip() for line in f if "model name" in line), "?")
    git = ["git", "-C", os.path.dirname(__file__) or ".", "describe", "--always", "--dirty"]
    commit = subprocess.run(git, capture_output=True, text=True).stdout.strip()
    date = time.strftime("%Y-%m-%d %H:%M")
    return dict(cpu=cpu, cores=num_cores(), loadavg_1m=loadavg(), commit=commit, date=date)


def timed(fn, n):
    """Seconds of each of `n` calls of `fn()`."""
    seconds = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - start)
    return seconds


def median(seconds):
    return round(float(np.median(seconds)), 4)


def parser(doc, update_args=False):
    """An argument parser whose `--help` is the script's docstring; with `update_args`, also
    `--batch-size-B`, `--batch-length-T` and `--horizon-H` (default: every figure's shape)."""
    parser = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    if update_args:
        for key, value in UPDATE_SHAPE.items():
            parser.add_argument("--" + key.replace("_", "-"), type=int, default=value)
    return parser


def update_shape(args):
    """The config's `batch_size_B`, `batch_length_T`, `horizon_H` from the parsed arguments."""
    return {key: getattr(args, key) for key in UPDATE_SHAPE}


def parse(parser, argv, smoke):
    """`parser.parse_args(argv)`, where `--smoke` makes `smoke` the defaults: a run of seconds
    that shows the script works and measures nothing (explicit flags still win)."""
    parser.add_argument("--smoke", action="store_true", help=f"defaults {smoke}")
    if parser.parse_args(argv).smoke:
        parser.set_defaults(**smoke)
    return parser.parse_args(argv)


def torch_threads():
    """Give torch (RLlib's side) every usable core; the thread count, or 0 without torch."""
    try:
        import torch
    except ImportError:
        log("torch is not installed (pip install -e '.[bench]'): RLlib's DreamerV3 is skipped.")
        return 0
    torch.set_num_threads(num_cores())
    return num_cores()


def rllib_atari(env_id):
    """Register `env_id` (`ALE/...`) wrapped as RLlib's DreamerV3 Atari example wraps it (64×64×3
    RGB, frame skip with max-pooling in the wrapper) under a name that does not shadow ours."""
    import gymnasium as gym
    from ray.rllib.env.wrappers.atari_wrappers import wrap_atari_for_new_api_stack
    from ray.tune.registry import register_env

    def make(cfg):
        env = gym.make("ale_py:" + env_id, **cfg)
        return wrap_atari_for_new_api_stack(env, framestack=None, grayscale=False)

    name = "rllib_wrapped_" + env_id.replace("/", "_")
    register_env(name, make)
    return name


def spaces(inputs="vector", actions="discrete"):
    """`(observation space, action space)`: CartPole's 4 floats or 64×64×3 uint8 frames; 2
    discrete actions or a Box in [-1, 1]²."""
    from gymnasium.spaces import Box, Discrete

    obs = Box(0, 255, (64, 64, 3), np.uint8) if inputs == "image" else Box(-np.inf, np.inf, (4,))
    return obs, Discrete(2) if actions == "discrete" else Box(-1.0, 1.0, (2,))


def random_batch(rng, obs_space, action_space, B, T):
    """A `[B, T, ...]` numpy batch in our replay format (episode starts and ends at ~2 %)."""
    if obs_space.dtype == np.uint8:
        obs = rng.integers(0, 256, (B, T, *obs_space.shape), dtype=np.uint8)
    else:
        obs = rng.normal(size=(B, T, *obs_space.shape)).astype(np.float32)
    if hasattr(action_space, "n"):  # one-hot
        actions = np.eye(action_space.n, dtype=np.float32)[rng.integers(0, action_space.n, (B, T))]
    else:
        actions = rng.uniform(-1, 1, (B, T, *action_space.shape)).astype(np.float32)
    is_first = rng.random((B, T)) < 0.02
    is_first[:, 0] = True
    rewards = rng.normal(size=(B, T)).astype(np.float32)
    terminal = rng.random((B, T)) < 0.02
    return dict(obs=obs, actions=actions, rewards=rewards, is_first=is_first, is_terminal=terminal)
