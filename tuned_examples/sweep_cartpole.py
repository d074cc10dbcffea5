"""A DreamerV3 sweep on CartPole-v1 with Ray Tune and ASHA, sized for a 2-core CPU machine.

Run: python tuned_examples/sweep_cartpole.py [--num-samples 2] [--max-env-steps 20000]

Grid over the training ratio, a random choice of world-model learning rate, `num_samples`
trials per grid point. Two trials run at a time, one CPU each (sampling and the local Learner
share the trial's process; TF is held to one thread). ASHA compares trials on
`env_runners/episode_return_mean` at rungs of env steps and stops the worse half early. It
prints a progress line per result (a trial's first line names its parameters), not Tune's
status tables, and at the end the best trial.
"""

import argparse
import logging
import os

from ray import tune  # noqa: E402
from ray.tune.schedulers import ASHAScheduler  # noqa: E402

from rllib_dreamerv3 import DreamerV3  # noqa: E402
from rllib_dreamerv3.progress import ProgressLines  # noqa: E402

METRIC = "env_runners/episode_return_mean"
NAME = "sweep-cartpole-dreamerv3"


def build_tuner(num_samples=2, max_env_steps=20_000, storage_path=None):
    # Only the settings that differ from DreamerV3Config's defaults: Tune then lists just these
    # as a trial's parameters (a whole DreamerV3Config also works as `param_space`).
    param_space = {
        "env": "CartPole-v1",
        "model_size": "micro",
        "training_ratio": tune.grid_search([256, 512]),
        "world_model_lr": tune.choice([3e-4, 1e-3]),
        "actor_lr": 1e-4,
        "critic_lr": 3e-4,
        "tf_num_threads": 1,
        "min_sample_timesteps_per_iteration": 500,
        "metrics_num_episodes_for_smoothing": 10,
    }
    stop = {"num_env_steps_sampled_lifetime": max_env_steps, METRIC: 450}
    # The metric goes to the scheduler, not to TuneConfig: with a TuneConfig metric, Tune's
    # status prints the best trial's whole config every 30 s.
    scheduler = ASHAScheduler(
        metric=METRIC,
        mode="max",
        time_attr="num_env_steps_sampled_lifetime",
        max_t=max_env_steps,
        grace_period=max_env_steps // 4,
        reduction_factor=2,
    )
    return tune.Tuner(
        DreamerV3,
        param_space=param_space,
        tune_config=tune.TuneConfig(
            scheduler=scheduler,
            num_samples=num_samples,
            max_concurrent_trials=2,
        ),
        run_config=tune.RunConfig(
            name=NAME,
            storage_path=storage_path,
            stop=stop,
            checkpoint_config=tune.CheckpointConfig(checkpoint_at_end=True, num_to_keep=1),
            callbacks=[ProgressLines(stop)],
            verbose=0,  # with RAY_AIR_NEW_OUTPUT=0 (main): no tables, banners or hints
        ),
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-samples", type=int, default=2, help="trials per grid point")
    parser.add_argument("--max-env-steps", type=int, default=20_000)
    parser.add_argument("--storage-path", help="default ~/ray_results")
    args = parser.parse_args()
    import ray

    storage = os.path.abspath(args.storage_path or os.path.expanduser("~/ray_results"))
    print(
        f"sweep: {2 * args.num_samples} trials, two at a time; results in "
        f"{os.path.join(storage, NAME)}",
        flush=True,
    )
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")  # Tune's classic output, as `rllib train`
    ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.WARNING)
    results = build_tuner(
        args.num_samples,
        args.max_env_steps,
        storage,
    ).fit()
    best = results.get_best_result(metric=METRIC, mode="max")
    print(
        f"best: {METRIC}={best.metrics['env_runners']['episode_return_mean']:.1f} with "
        f"training_ratio={best.config['training_ratio']}, "
        f"world_model_lr={best.config['world_model_lr']}; checkpoint "
        f"{best.checkpoint.path if best.checkpoint else None}"
    )


if __name__ == "__main__":
    main()
