"""Train one tuned example until its stop criterion; print one JSON line per iteration.

Usage: python benchmarks/learning.py tuned_examples/cartpole.yaml [--max-minutes 60] [--seed 0]
       [--config '{world_model_lr: 1.0e-4}'] [--env DMC/reacher-easy]
       [--dreams-dir benchmarks/out/dreams] [--save-checkpoint DIR]

Each line: iteration, env steps sampled, updates, wall seconds since the start (build included),
episode return mean, and the world-model losses. The last line has "done": true and the reason.
Runs in-process (no Ray Tune), with the YAML's `config` applied via `update_from_dict`. Dream
summaries (every `dream_every_n_updates` updates) are saved as PNG/MP4 under `--dreams-dir`.
`--save-checkpoint DIR` saves the algorithm there when the run stops (`rllib evaluate DIR`).
"""

import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import yaml  # noqa: E402

from rllib_dreamerv3 import DreamerV3Config  # noqa: E402
from rllib_dreamerv3.dreams import save_dreams  # noqa: E402


def nested_get(result, path):
    for key in path.split("/"):
        if not isinstance(result, dict) or key not in result:
            return None
        result = result[key]
    return result


def stop_reached(result, stop):
    """The first stop criterion (`path: threshold`) whose value has reached its threshold."""
    for path, threshold in stop.items():
        value = nested_get(result, path)
        if value is not None and value >= threshold:
            return path
    return None


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("yaml_file")
    parser.add_argument("--max-minutes", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--config",
        type=yaml.safe_load,
        default={},
        help="JSON/YAML mapping merged into the example's config, e.g. '{actor_lr: 3.0e-5}'",
    )
    parser.add_argument("--env", help="env id, in place of the example's")
    parser.add_argument("--dreams-dir", default=os.path.join("benchmarks", "out", "dreams"))
    parser.add_argument("--save-checkpoint", metavar="DIR", help="save the algorithm at the end")
    args = parser.parse_args()
    with open(args.yaml_file) as f:
        experiments = yaml.safe_load(f)
    name, spec = next(iter(experiments.items()))
    if args.env:
        name = f"{name}-{args.env.replace('/', '-')}"
    config = (
        DreamerV3Config()
        .update_from_dict({**spec.get("config", {}), **args.config})
        .environment(args.env or spec["env"])
        .debugging(seed=args.seed)
        .training(log_progress=False)  # the JSON lines are the progress
    )
    start = time.time()
    algo = config.build_algo()
    reason = None
    while reason is None:
        result = algo.train()
        elapsed = time.time() - start
        learner = nested_get(result, "learners/default_policy") or {}
        print(
            json.dumps(
                {
                    "experiment": name,
                    "iteration": result["training_iteration"],
                    "env_steps": result["env_runners"]["num_env_steps_sampled_lifetime"],
                    "updates": result.get("num_updates_lifetime"),
                    "wall_s": round(elapsed, 1),
                    "episode_return_mean": nested_get(result, "env_runners/episode_return_mean"),
                    **{
                        key: learner.get(key)
                        for key in (
                            "L_world_model",
                            "L_decoder",
                            "L_continue",
                            "kl_dyn_before_free_bits",
                            "actor_entropy",
                            "critic_value_mean",
                            "imagined_continue_mean",
                            "return_scale",
                        )
                    },
                },
                default=float,
            ),
            flush=True,
        )
        if "dreams" in result:
            directory = os.path.join(args.dreams_dir, name)
            paths = save_dreams(
                result["dreams"], directory, prefix=f"updates{result['num_updates_lifetime']}"
            )
            print(
                json.dumps(
                    {
                        "dreams": paths,
                        **{k: v for k, v in result["dreams"].items() if isinstance(v, float)},
                    }
                ),
                flush=True,
            )
        reason = stop_reached(result, spec.get("stop", {}))
        if reason is None and elapsed > args.max_minutes * 60:
            reason = f"max_minutes={args.max_minutes}"
    wall_s = round(time.time() - start, 1)
    checkpoint = (
        algo.save_to_path(os.path.abspath(args.save_checkpoint)) if args.save_checkpoint else None
    )
    print(
        json.dumps(
            {
                "experiment": name,
                "done": True,
                "stop": reason,
                "wall_s": wall_s,
                **({"checkpoint": checkpoint} if checkpoint else {}),
            }
        ),
        flush=True,
    )
    algo.stop()


if __name__ == "__main__":
    main()
