"""Seconds per `algo.train()` iteration with DreamerV3's default config on one env.

Usage: python benchmarks/iteration_time.py ALE/Pong-v5 [--iterations 2] [--config '{"k": v}']

Builds `DreamerV3Config().environment(ENV)` (all defaults, plus the optional JSON overrides) and
prints one JSON line per iteration: wall seconds, env steps, updates, and the env steps sampled
per second of that iteration. The first iteration includes the random warm-up and compiling
the update; later ones are steady state.
"""

import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from rllib_dreamerv3 import DreamerV3Config  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("env")
    parser.add_argument("--iterations", type=int, default=2)
    parser.add_argument("--config", default="{}", help="JSON dict of config overrides")
    args = parser.parse_args()
    config = DreamerV3Config().environment(args.env).update_from_dict(json.loads(args.config))
    start = time.perf_counter()
    algo = config.build_algo()
    print(
        json.dumps(
            {
                "env": args.env,
                "build_s": round(time.perf_counter() - start, 1),
                "model_size": config.model_size,
                "training_ratio": config.training_ratio,
            }
        ),
        flush=True,
    )
    steps_before = 0
    for _ in range(args.iterations):
        start = time.perf_counter()
        result = algo.train()
        seconds = time.perf_counter() - start
        steps = result["env_runners"]["num_env_steps_sampled_lifetime"]
        print(
            json.dumps(
                {
                    "iteration": result["training_iteration"],
                    "seconds": round(seconds, 1),
                    "env_steps": steps,
                    "updates": result["num_updates_lifetime"],
                    "env_steps_per_s": round((steps - steps_before) / seconds, 2),
                }
            ),
            flush=True,
        )
        steps_before = steps
    algo.stop()


if __name__ == "__main__":
    main()
