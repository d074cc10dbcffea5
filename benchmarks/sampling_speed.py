"""Env steps per second of one EnvRunner with the policy in the loop: ours vs RLlib's DreamerV3.

Backs docs/performance.md: the summary's sampling rows and *Sampling* under *Ours vs RLlib's
torch DreamerV3 on CPUs*.

Usage:
    python benchmarks/sampling_speed.py                # CartPole and Pong, 1 and 8 envs, XS
    python benchmarks/sampling_speed.py --smoke        # CartPole, nano, 1 env: checks it runs

Per setting and side, one EnvRunner in this process (ours: `DreamerV3EnvRunner`; RLlib's: the
`SingleAgentEnvRunner` of its torch DreamerV3, with every core), a warm-up sample, then the
median env steps/s of `--repeats` samples of `--steps` steps, the policy picking every action.
Pong is 64×64×3 frames, frame skip 4 with max-pooling and no sticky actions on both sides (ours:
`protocol="atari100k"`, 18 actions; RLlib's: its DreamerV3 Atari wrapping, 6 actions, with no-op
starts, life-loss episodes and FIRE on reset). Ours runs with `--tf-threads` TF threads (default
1, as a remote EnvRunner) and overlaps policy and envs where "auto" does (Pong with 8 envs).
"""

import time

import common
import numpy as np

from rllib_dreamerv3 import DreamerV3Config
from rllib_dreamerv3.env_runner import DreamerV3EnvRunner

ENVS = {"CartPole": "CartPole-v1", "Pong": "ALE/Pong-v5"}
OUR_ENV_CONFIG = {"Pong": {"protocol": "atari100k"}}
THEIR_ENV_CONFIG = {
    "Pong": {
        "repeat_action_probability": 0.0,
        "full_action_space": False,
        "frameskip": 1,
        "render_mode": "rgb_array",
    }
}


def our_runner(env, num_envs, size):
    """`(runner, count)`: `count(sample)` is the env steps that `sample` took."""
    config = (
        DreamerV3Config()
        .environment(ENVS[env], env_config=OUR_ENV_CONFIG.get(env, {}))
        .env_runners(num_envs_per_env_runner=num_envs)
        .training(model_size=size)
    )
    runner = DreamerV3EnvRunner(config=config, worker_index=0, num_workers=0)
    lifetime = [0]

    def count(_):
        lifetime.append(runner.num_env_steps_sampled_lifetime)
        return lifetime[-1] - lifetime[-2]

    return runner, count


def their_runner(env, num_envs, size):
    from ray.rllib.algorithms.dreamerv3 import DreamerV3Config as RLlibDreamerV3Config
    from ray.rllib.env.single_agent_env_runner import SingleAgentEnvRunner

    config = (
        RLlibDreamerV3Config()
        .framework("torch")
        .environment(
            common.rllib_atari(ENVS[env]) if env == "Pong" else ENVS[env],
            env_config=THEIR_ENV_CONFIG.get(env, {}),
        )
        .env_runners(num_envs_per_env_runner=num_envs)
        .training(model_size=size)
    )
    runner = SingleAgentEnvRunner(config=config, worker_index=0, num_workers=0)
    return runner, lambda episodes: sum(len(e) for e in episodes)


def steps_per_second(runner, count, args):
    """Median env steps/s over `args.repeats` timed samples, after one warm-up sample."""

    def sample(steps):
        return count(runner.sample(num_timesteps=steps, explore=True, random_actions=False))

    sample(max(args.steps // 4, 64))  # warm-up: compile the policy, reset the envs
    rates = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        rates.append(sample(args.steps) / (time.perf_counter() - start))
    return round(float(np.median(rates)), 1)


def measure(env, num_envs, size, args):
    row = {"env": ENVS[env], "num_envs": num_envs, "size": size, "steps": args.steps}
    row.update(repeats=args.repeats, tf_threads=args.tf_threads, torch_threads=args.torch)
    row["loadavg_1m"] = common.loadavg()
    sides = {"ours": our_runner, "theirs": their_runner} if args.torch else {"ours": our_runner}
    for side, build in sides.items():
        common.log(f"[sampling_speed] {env} x{num_envs} {size}: measuring {side} ...")
        runner, count = build(env, num_envs, size)
        try:
            row[f"{side}_steps_per_s"] = steps_per_second(runner, count, args)
        finally:
            runner.stop()
    if args.torch:
        row["speedup"] = round(row["ours_steps_per_s"] / row["theirs_steps_per_s"], 2)
    common.emit(row)


def main(argv=None):
    parser = common.parser(__doc__)
    parser.add_argument("--envs", nargs="+", choices=list(ENVS), default=["CartPole", "Pong"])
    parser.add_argument("--num-envs", nargs="+", type=int, default=[1, 8], help="per EnvRunner")
    parser.add_argument("--sizes", nargs="+", default=["XS"])
    parser.add_argument("--steps", type=int, default=1000, help="env steps per timed sample")
    parser.add_argument("--repeats", type=int, default=3, help="timed samples per side")
    parser.add_argument("--no-torch", dest="torch", action="store_false")
    parser.add_argument("--tf-threads", type=int, default=1, help="ours; 0: TF's default")
    smoke = {"envs": ["CartPole"], "num_envs": [1], "sizes": ["nano"], "steps": 200, "repeats": 2}
    args = common.parse(parser, argv, smoke)
    if args.tf_threads:  # before TF runs its first op, or it has no effect
        from rllib_dreamerv3.tf_rllib import limit_tf_threads

        limit_tf_threads(args.tf_threads)
    args.torch = args.torch and common.torch_threads()  # the thread count, or False
    common.emit(common.machine())
    for env in args.envs:
        for num_envs in args.num_envs:
            for size in args.sizes:
                measure(env, num_envs, size, args)


if __name__ == "__main__":
    main()
