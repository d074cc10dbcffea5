"""DreamerV3 with Ray Tune: a 2-trial grid, checkpoints, TensorBoard logs, resource requests."""

import glob
import importlib.util
import math
import os

import helpers
import pytest
from ray import tune
from ray.tune.schedulers import ASHAScheduler

from rllib_dreamerv3 import DreamerV3, DreamerV3Config

SWEEP = os.path.join(os.path.dirname(__file__), "..", "tuned_examples", "sweep_cartpole.py")


def tiny_config():
    return helpers.tiny_config(
        batch_size_B=4,
        num_steps_sampled_before_learning_starts=16,
        jit_compile=False,
        tf_num_threads=1,
    )


def test_grid_of_two_trials_with_checkpoints_and_tensorboard(ray_session, tmp_path):
    config = tiny_config().training(
        training_ratio=tune.grid_search([16, 32]), critic_lr=tune.choice([1e-4, 3e-4])
    )
    tuner = tune.Tuner(
        DreamerV3,
        param_space=config,
        run_config=tune.RunConfig(
            name="grid",
            storage_path=str(tmp_path),
            stop={"training_iteration": 1},
            checkpoint_config=tune.CheckpointConfig(checkpoint_at_end=True),
            verbose=0,
        ),
    )
    results = tuner.fit()

    assert results.num_errors == 0, [r.error for r in results]
    assert len(results) == 2
    assert sorted(r.config["training_ratio"] for r in results) == [16, 32]
    for result in results:
        assert result.config["critic_lr"] in (1e-4, 3e-4)
        assert result.metrics["training_iteration"] == 1
        learner = result.metrics["learners"]["default_policy"]
        for key in ("L_world_model", "L_actor", "L_critic"):
            assert math.isfinite(learner[key]), key
        assert result.metrics["num_updates_lifetime"] >= 1
        assert glob.glob(os.path.join(result.path, "events.out.tfevents.*")), (
            f"no TensorBoard event file in {result.path}"
        )
        assert result.checkpoint is not None

    result = min(results, key=lambda r: r.config["training_ratio"])
    restored = DreamerV3.from_checkpoint(result.checkpoint.path)
    try:
        assert restored.training_iteration == 1
        assert restored.config.training_ratio == 16
        assert restored._counters["num_updates"] == result.metrics["num_updates_lifetime"]
    finally:
        restored.stop()


@pytest.mark.parametrize(
    "num_env_runners,num_learners,eval_runners,expected",
    [
        (0, 0, 0, [{"CPU": 1}]),  # sampling and the local Learner in the trial's process
        # The trial's process, two EnvRunners, one evaluation EnvRunner, one remote Learner.
        (2, 1, 1, [{"CPU": 1}] * 5),
    ],
)
def test_trial_resource_request(num_env_runners, num_learners, eval_runners, expected):
    config = (
        tiny_config()
        .env_runners(num_env_runners=num_env_runners)
        .learners(num_learners=num_learners)
        .evaluation(evaluation_num_env_runners=eval_runners)
    )
    bundles = DreamerV3.default_resource_request(config.to_dict()).bundles
    assert bundles == expected


def test_sweep_example_fits_two_cores():
    spec = importlib.util.spec_from_file_location("sweep_cartpole", SWEEP)
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    tuner = sweep.build_tuner(num_samples=1, max_env_steps=4000, storage_path="/tmp/unused")
    tune_config = tuner._local_tuner._tune_config  # Tuner has no public getters for these
    assert isinstance(tune_config.scheduler, ASHAScheduler)
    assert tune_config.max_concurrent_trials == 2
    # The metric is the scheduler's: a TuneConfig metric makes Tune's status print the best
    # trial's whole config every 30 s.
    assert tune_config.metric is None and tune_config.scheduler.metric == sweep.METRIC
    assert tune_config.scheduler._mode == "max"
    param_space = tuner._local_tuner._param_space
    assert param_space["training_ratio"] == {"grid_search": [256, 512]}
    config = DreamerV3Config().update_from_dict(
        {k: v for k, v in param_space.items() if k not in ("training_ratio", "world_model_lr")}
    )
    config.validate()
    bundles = DreamerV3.default_resource_request(config).bundles
    assert sum(b.get("CPU", 0) for b in bundles) == 1  # two trials at a time on two cores
