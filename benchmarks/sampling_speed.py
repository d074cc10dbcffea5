"""Env steps per second of one EnvRunner with the policy in the loop: ours vs RLlib's DreamerV3.

Usage:
    python benchmarks/sampling_speed.py --quick        # CartPole, nano, 1 env: a smoke test
    python benchmarks/sampling_speed.py                # CartPole and Pong, 1 and 8 envs, XS

Each setting builds one EnvRunner per side in this process (ours: `DreamerV3EnvRunner`;
RLlib's: the `SingleAgentEnvRunner` its torch DreamerV3 samples with), takes a warm-up sample
(compiles our policy), then times `--repeats` calls of `sample(num_timesteps=--steps,
explore=True)`: the stateful policy picks every action (no random actions). One JSON line per
setting with the median env steps per second of each side and `speedup` (ours / theirs).

Pong: ours is `ALE/Pong-v5` through our Atari factory with `protocol="atari100k"` (64×64×3
uint8, action repeat 4 with max-pooling, no sticky actions, 18 actions); RLlib's is the same game
wrapped as its DreamerV3 Atari example does (`wrap_atari_for_new_api_stack`, 64×64×3 RGB
normalised to float32, frame skip 4 with max-pooling, no sticky actions, 6 actions, plus its
no-op starts, life-loss episodes and FIRE on reset). RLlib's side needs torch (the `[bench]`
extra) and runs with as many torch threads as this process may use cores (its fastest setting
here; `--torch-threads 1` was slower). Ours runs with `--tf-threads` TF threads (default 1: what
a remote EnvRunner with `num_cpus_per_env_runner=1` uses; idle TF threads spinning beside the
envs slow sampling down) and its default `overlap_policy_and_envs` ("auto": Pong with 8 envs
steps one half of the envs while the policy acts for the other half; CartPole runs in lockstep).
"""

import argparse
import json
import os
import sys
import time
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

from rllib_dreamerv3 import DreamerV3Config  # noqa: E402
from rllib_dreamerv3.env_runner import DreamerV3EnvRunner  # noqa: E402

ENVS = {"CartPole": "CartPole-v1", "Pong": "ALE/Pong-v5"}
OUR_ENV_CONFIG = {"Pong": {"protocol": "atari100k"}}
THEIR_PONG = "rllib_dreamerv3_benchmark_rllib_pong"  # a Tune name that does not shadow ours
THEIR_PONG_ENV_CONFIG = {
    "repeat_action_probability": 0.0,
    "full_action_space": False,
    "frameskip": 1,
}
QUICK = {"envs": ["CartPole"], "num_envs": [1], "sizes": ["nano"], "steps": 200, "repeats": 2}
FULL = {
    "envs": ["CartPole", "Pong"],
    "num_envs": [1, 8],
    "sizes": ["XS"],
    "steps": 1000,
    "repeats": 3,
}


def log(message):
    print(message, file=sys.stderr, flush=True)


def num_cores():
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def steps_per_second(sample, count, args):
    """Median env steps/s over `args.repeats` timed samples, after one warm-up sample."""
    count(sample(max(args.steps // 4, 64)))  # warm-up: compile the policy, reset the envs
    rates = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        steps = count(sample(args.steps))
        rates.append(steps / (time.perf_counter() - start))
    return round(float(np.median(rates)), 1)


def describe(side, rate, obs_space, action_space):
    """The measured rate with the spaces the policy saw, so that the settings can be checked."""
    return {
        f"{side}_steps_per_s": rate,
        f"{side}_obs": f"{obs_space.dtype}{list(obs_space.shape)}",
        f"{side}_actions": int(getattr(action_space, "n", 0)) or list(action_space.shape),
    }


def measure_ours(env, num_envs, size, args):
    config = (
        DreamerV3Config()
        .environment(ENVS[env], env_config=OUR_ENV_CONFIG.get(env, {}))
        .env_runners(num_envs_per_env_runner=num_envs)
        .training(model_size=size)
    )
    runner = DreamerV3EnvRunner(config=config, worker_index=0, num_workers=0)
    try:
        before = [0]

        def count(_):
            steps = runner.num_env_steps_sampled_lifetime - before[0]
            before[0] = runner.num_env_steps_sampled_lifetime
            return steps

        rate = steps_per_second(
            lambda n: runner.sample(num_timesteps=n, explore=True, random_actions=False),
            count,
            args,
        )
        return {
            **describe("ours", rate, runner.envs[0].observation_space, runner.envs[0].action_space),
            "ours_overlap": runner.overlaps_policy_and_envs,
        }
    finally:
        runner.stop()


def register_their_pong():
    import gymnasium as gym
    from ray.rllib.env.wrappers.atari_wrappers import wrap_atari_for_new_api_stack
    from ray.tune.registry import register_env

    register_env(
        THEIR_PONG,
        lambda cfg: wrap_atari_for_new_api_stack(
            gym.make("ale_py:ALE/Pong-v5", **cfg, render_mode="rgb_array"),
            framestack=None,
            grayscale=False,
        ),
    )


def measure_theirs(env, num_envs, size, args):
    from ray.rllib.algorithms.dreamerv3 import DreamerV3Config as RLlibDreamerV3Config
    from ray.rllib.env.single_agent_env_runner import SingleAgentEnvRunner

    if env == "Pong":
        register_their_pong()
        env_spec = {"env": THEIR_PONG, "env_config": THEIR_PONG_ENV_CONFIG}
    else:
        env_spec = {"env": ENVS[env]}
    config = (
        RLlibDreamerV3Config()
        .framework("torch")
        .environment(**env_spec)
        .env_runners(num_envs_per_env_runner=num_envs)
        .training(model_size=size)
    )
    runner = SingleAgentEnvRunner(config=config, worker_index=0, num_workers=0)
    try:
        rate = steps_per_second(
            lambda n: runner.sample(num_timesteps=n, explore=True, random_actions=False),
            lambda episodes: sum(len(e) for e in episodes),
            args,
        )
        return describe(
            "theirs", rate, runner.env.single_observation_space, runner.env.single_action_space
        )
    finally:
        runner.stop()


def measure(env, num_envs, size, args):
    row = {
        "env": env,
        "env_id": ENVS[env],
        "num_envs": num_envs,
        "size": size,
        "steps": args.steps,
        "repeats": args.repeats,
        "loadavg_1m": os.getloadavg()[0],
    }  # other processes on the machine skew timings
    ok = True
    sides = [("ours", measure_ours)] + ([("theirs", measure_theirs)] if args.torch else [])
    for side, run in sides:
        log(f"[sampling_speed] {env} x{num_envs} {size}: measuring {side} ...")
        try:
            row.update(run(env, num_envs, size, args))
        except Exception as err:  # keep going: one broken setting must not end the run
            traceback.print_exc()
            row[f"{side}_error"] = f"{type(err).__name__}: {err}"[:300]
            ok = False
    row["tf_threads"] = args.tf_threads or "default"
    if args.torch:
        row["torch_threads"] = args.torch_threads
    if "ours_steps_per_s" in row and "theirs_steps_per_s" in row:
        row["speedup"] = round(row["ours_steps_per_s"] / row["theirs_steps_per_s"], 2)
    print(json.dumps(row), flush=True)
    return ok


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke-test defaults: {QUICK} (explicit flags still win)",
    )
    parser.add_argument("--envs", nargs="+", choices=list(ENVS), help=f"default {FULL['envs']}")
    parser.add_argument(
        "--num-envs", nargs="+", type=int, help=f"envs per EnvRunner, default {FULL['num_envs']}"
    )
    parser.add_argument("--sizes", nargs="+", help=f"model sizes, default {FULL['sizes']}")
    parser.add_argument(
        "--steps", type=int, help=f"env steps per timed sample, default {FULL['steps']}"
    )
    parser.add_argument(
        "--repeats", type=int, help=f"timed samples per side, default {FULL['repeats']}"
    )
    parser.add_argument(
        "--no-torch", dest="torch", action="store_false", help="skip RLlib's torch DreamerV3"
    )
    parser.add_argument(
        "--torch-threads",
        type=int,
        help="torch threads for RLlib's side (default: the usable cores)",
    )
    parser.add_argument(
        "--tf-threads",
        type=int,
        default=1,
        help="TF threads for our side (default 1, a remote EnvRunner's; 0: TF's default)",
    )
    args = parser.parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.tf_threads:  # before TF runs its first op, or it has no effect
        from rllib_dreamerv3.tf_rllib import limit_tf_threads

        limit_tf_threads(args.tf_threads)
    if args.torch:
        try:
            import torch
        except ImportError:
            log(
                "[sampling_speed] torch is not installed (pip install -e '.[bench]'): "
                "RLlib's DreamerV3 is skipped."
            )
            args.torch = False
        else:
            args.torch_threads = args.torch_threads or num_cores()
            torch.set_num_threads(args.torch_threads)
    ok = True
    for env in args.envs:
        for num_envs in args.num_envs:
            for size in args.sizes:
                ok &= measure(env, num_envs, size, args)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
