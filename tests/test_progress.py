"""The progress line that `DreamerV3.train()` logs outside Ray Tune."""

import logging
from types import SimpleNamespace

import pytest
from ray.rllib.algorithms.algorithm_config import AlgorithmConfig
from ray.tune.trainable import Trainable

from rllib_dreamerv3 import DreamerV3, DreamerV3Config
from rllib_dreamerv3.progress import ProgressLines, progress_line

RESULT = {
    "training_iteration": 3,
    "env_runners": {"num_env_steps_sampled_lifetime": 1500, "episode_return_mean": 21.5},
    "num_updates_lifetime": 40,
    "learners": {"default_policy": {"L_world_model": 12.345678, "L_actor": -0.5}},
    "time_total_s": 61.7,
}
LINE = (
    "DreamerV3 iter 3 | env steps 1500 | updates 40 | return 21.5 | "
    "L_world_model 12.35 L_actor -0.5 L_critic - | 62 s"
)


def test_progress_line_names_steps_return_losses_and_time():
    assert progress_line("DreamerV3", RESULT) == LINE


@pytest.mark.parametrize(
    "log_progress, storage, trial_info, printed",
    [
        (True, None, None, True),
        (False, None, None, False),
        (True, object(), None, False),
        (True, None, object(), False),
    ],
)
def test_train_logs_one_line_outside_tune_unless_switched_off(
    log_progress, storage, trial_info, printed, monkeypatch, capsys
):
    monkeypatch.setattr(logging.root, "handlers", [])  # logging not configured (pytest's gone)
    assert fake_algo(monkeypatch, log_progress, storage, trial_info).train() is RESULT
    assert capsys.readouterr().out == (LINE + "\n" if printed else "")


def fake_algo(monkeypatch, log_progress=True, storage=None, trial_info=None):
    monkeypatch.setattr(Trainable, "train", lambda self: RESULT)
    algo = object.__new__(DreamerV3)  # no env, no Ray: only what train() reads
    algo.config = SimpleNamespace(log_progress=log_progress)
    # Ray Tune gives the trainables it runs a storage context (and, in some paths, trial info).
    algo._storage, algo._trial_info = storage, trial_info
    return algo


def test_configured_logging_gets_the_line_instead_of_stdout(monkeypatch, capsys):
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    monkeypatch.setattr(logging.root, "handlers", [handler])  # e.g. logging.basicConfig(...)
    fake_algo(monkeypatch).train()
    assert [(r.name, r.levelno, r.getMessage()) for r in records] == [
        ("rllib_dreamerv3.progress", logging.INFO, LINE)
    ]
    assert capsys.readouterr().out == ""


def test_log_progress_must_be_a_bool():
    config = DreamerV3Config().environment("CartPole-v1").training(log_progress="yes")
    with pytest.raises(ValueError, match="log_progress='yes' must be True or False"):
        config.validate()


def test_build_is_build_algo_without_a_deprecation_warning(monkeypatch):
    from ray._common import deprecation  # where RLlib's @Deprecated decorator warns

    warned = []
    monkeypatch.setattr(deprecation, "log_once", lambda key: True)  # else once per process
    monkeypatch.setattr(deprecation, "deprecation_warning", lambda *a, **k: warned.append(a))
    monkeypatch.setattr(DreamerV3Config, "build_algo", lambda self, *a, **k: ("built", a, k))
    config = DreamerV3Config().environment("CartPole-v1")
    assert config.build("env", use_copy=False) == ("built", ("env",), {"use_copy": False})
    assert warned == []
    AlgorithmConfig.build(config)  # RLlib's own `build` warns: the check above can fail
    assert warned


def _import_output(**env):
    import os
    import subprocess
    import sys

    environ = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"} | env
    done = subprocess.run(
        [sys.executable, "-c", "import rllib_dreamerv3"],
        env=environ,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout + done.stderr


def test_importing_the_package_prints_nothing_unless_asked():
    assert _import_output() == ""
    # TF's load-time messages are there to be hidden: asked for, they appear. Which ones depends
    # on the CPU (oneDNN's note only on some x86 CPUs); absl's notice precedes all of them.
    shown = _import_output(TF_CPP_MIN_LOG_LEVEL="0")
    assert "oneDNN" in shown or "absl::InitializeLog" in shown, shown


def test_warm_up_and_compile_notices_are_progress_lines_outside_tune(monkeypatch, capsys):
    monkeypatch.setattr(logging.root, "handlers", [])
    fake_algo(monkeypatch)._notice("warm-up: 600 env steps of random actions")
    fake_algo(monkeypatch, storage=object())._notice("not under Tune")  # Tune: the callback's
    fake_algo(monkeypatch, log_progress=False)._notice("switched off")
    assert capsys.readouterr().out == "DreamerV3 warm-up: 600 env steps of random actions\n"


def test_tune_callback_says_what_comes_before_the_first_result(capsys):
    class Trial:
        trainable_name = "DreamerV3"
        config = {"num_steps_sampled_before_learning_starts": 600}

        def __str__(self):
            return "DreamerV3_CartPole_00000"

    ProgressLines().on_trial_start(0, [], Trial())
    assert capsys.readouterr().out == (
        "DreamerV3_CartPole_00000: started: 600 warm-up env steps of random actions, then XLA "
        "compiles the update (a minute or more on a CPU) before the first result.\n"
    )


def test_tune_callback_names_the_values_a_search_chose_for_a_trial(capsys):
    class Trial:
        trainable_name = "DreamerV3"
        config = {}
        experiment_tag = "1_training_ratio=512,world_model_lr=0.0010"

        def __str__(self):
            return "DreamerV3_CartPole_00001"

    ProgressLines().on_trial_start(0, [], Trial())
    Trial.experiment_tag = "0"  # no search: nothing to name
    ProgressLines().on_trial_start(0, [], Trial())
    first, second = capsys.readouterr().out.splitlines()
    assert first.startswith(
        "DreamerV3_CartPole_00001 (training_ratio=512,world_model_lr=0.0010): started: 1024 "
    )
    assert second.startswith("DreamerV3_CartPole_00001: started: 1024 ")
