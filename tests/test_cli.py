"""The `rllib` command: end to end in a subprocess, every error path, help, the entry point."""

import glob
import importlib.metadata
import importlib.util
import json
import math
import os
import pickle
import re
import subprocess
import sys
import sysconfig
from types import SimpleNamespace

import pytest
import yaml

from rllib_dreamerv3 import checkpoints, cli

TINY = {
    "tiny-cartpole": {
        "env": "CartPole-v1",
        "run": "DreamerV3",
        "stop": {"training_iteration": 2},
        "config": {
            "model_size": "nano",
            "batch_size_B": 4,
            "batch_length_T": 8,
            "horizon_H": 3,
            "training_ratio": 32,
            "num_steps_sampled_before_learning_starts": 16,
            "min_sample_timesteps_per_iteration": 16,
            "jit_compile": False,
        },
    },
}


def script(name):
    path = os.path.join(sysconfig.get_path("scripts"), name)
    if not os.path.isfile(path):
        pytest.fail(f"{path} is missing: install the package (pip install -e .)")
    return path


def write_yaml(path, experiments):
    path.write_text(yaml.safe_dump(experiments))
    return str(path)


def run(args, timeout):
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env)


def test_train_file_then_evaluate_the_checkpoint(tmp_path):
    tiny = write_yaml(tmp_path / "tiny.yaml", TINY)
    train = run(
        [
            script("rllib"),
            "train",
            "file",
            tiny,
            "--storage-path",
            str(tmp_path / "results"),
            "--num-cpus",
            "2",
            "--verbose",
            "0",
        ],
        timeout=300,
    )
    assert train.returncode == 0, train.stdout[-3000:] + train.stderr[-3000:]
    # What comes before the first result (warm-up, compile), a progress line per iteration,
    # then the checkpoint and how to evaluate it.
    assert re.search(r": started: 16 warm-up env steps of random actions", train.stdout)
    for iteration in (1, 2):
        line = re.search(
            rf"iter {iteration} \| env steps (\d+) .*L_world_model (\S+)", train.stdout
        )
        assert line, train.stdout
    assert math.isfinite(float(line.group(2)))
    checkpoint = re.search(r"checkpoint: (\S+)", train.stdout).group(1)
    assert checkpoint.startswith(str(tmp_path / "results" / "tiny-cartpole"))
    assert os.path.isfile(os.path.join(checkpoint, "rllib_checkpoint.json"))

    # Videos too, where the optional packages for them are installed.
    video = all(importlib.util.find_spec(m) for m in ("moviepy", "pygame"))
    video_args = ["--video-dir", str(tmp_path / "videos")] if video else []
    evaluate = run(
        [script("rllib"), "evaluate", checkpoint, "--episodes", "3", "--json", *video_args],
        timeout=120,
    )
    assert evaluate.returncode == 0, evaluate.stderr[-3000:]
    if video:
        assert len(glob.glob(str(tmp_path / "videos" / "*.mp4"))) == 3
    result = json.loads(next(line for line in evaluate.stdout.splitlines() if line[:1] == "{"))
    assert result["episodes"] == 3 and result["env"] == "CartPole-v1"
    assert all(math.isfinite(result[k]) for k in ("return_mean", "return_min", "return_max"))
    # CartPole pays 1 per step: returns are lengths, at least 8 steps long.
    assert 8 <= result["return_min"] <= result["return_mean"] <= result["return_max"]
    assert result["length_mean"] == pytest.approx(result["return_mean"])


def test_an_error_exits_non_zero_with_one_paragraph_and_no_traceback(tmp_path):
    missing = str(tmp_path / "missing.yaml")
    proc = run([sys.executable, "-m", "rllib_dreamerv3", "train", "file", missing], timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    error = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(error) == 1 and missing in error[0] and "no such file" in error[0]


def _error(capsys, argv):
    code = cli.main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    return err


def _variant(**changes):
    experiment = {**TINY["tiny-cartpole"], **changes}
    return {"tiny-cartpole": experiment}


TUNED_EXAMPLES = sorted(
    glob.glob(os.path.join(os.path.dirname(__file__), "..", "tuned_examples", "*.yaml"))
)


@pytest.mark.parametrize("path", TUNED_EXAMPLES, ids=os.path.basename)
def test_every_tuned_example_passes_the_checks(path):
    for name, spec in cli.load_experiments(path).items():
        checked = cli.check_experiment(path, name, spec)
        assert checked["run"] == "DreamerV3" and checked["config"]["env"]


@pytest.fixture
def captured_run(monkeypatch):
    """`rllib train` up to the point where Tune would start: the checked experiments."""
    calls = []

    def run_experiments(experiments, source, args):
        calls.append(
            {name: cli.check_experiment(source, name, spec) for name, spec in experiments.items()}
        )
        return 0

    monkeypatch.setattr(cli, "run_experiments", run_experiments)
    return calls


def test_a_bad_config_override_of_a_file_is_blamed_on_the_option(capsys, tmp_path):
    path = write_yaml(tmp_path / "tiny.yaml", TINY)
    err = _error(capsys, ["train", "file", path, "--config", '{"model_size": "huge"}'])
    assert f"--config model_size=..., applied to {path}, experiment 'tiny-cartpole'" in err
    assert "'huge'" in err
    err = _error(capsys, ["train", "file", path, "--config", "{modl_size: nano}"])
    assert "--config modl_size=..., applied to" in err and "Did you mean 'model_size'" in err
    # The file's own mistakes stay the file's.
    bad = {"x": {**TINY["tiny-cartpole"], "config": {"model_size": "huge"}}}
    err = _error(capsys, ["train", "file", write_yaml(tmp_path / "bad.yaml", bad)])
    assert "--config" not in err and "bad.yaml, experiment 'x'" in err


def test_an_env_id_without_its_version_trains_the_latest_version_and_says_so(capsys):
    spec = {**TINY["tiny-cartpole"], "env": "CartPole"}
    checked = cli.check_experiment("exp.yaml", "x", spec)
    assert checked["config"]["env"] == "CartPole-v1"
    assert "exp.yaml, experiment 'x': env 'CartPole' names no version; using 'CartPole-v1'." in (
        capsys.readouterr().err
    )
    spec = {**TINY["tiny-cartpole"], "env": "CartPole-v1"}
    assert cli.check_experiment("exp.yaml", "x", spec)["config"]["env"] == "CartPole-v1"
    assert capsys.readouterr().err == ""


def test_command_line_overrides_of_a_file(captured_run, tmp_path):
    path = write_yaml(tmp_path / "tiny.yaml", TINY)
    assert (
        cli.main(
            [
                "train",
                "file",
                path,
                "--env",
                "Pendulum-v1",
                "--config",
                '{"training_ratio": 64}',
                "--stop",
                "{training_iteration: 7}",
                "--checkpoint-freq",
                "3",
                "--num-samples",
                "2",
                "--storage-path",
                str(tmp_path / "out"),
            ]
        )
        == 0
    )
    [spec] = captured_run[0].values()
    param_space = spec["config"]
    assert spec["run"] == "DreamerV3" and param_space["env"] == "Pendulum-v1"
    assert param_space["training_ratio"] == 64 and param_space["model_size"] == "nano"
    assert spec["stop"].stop == {"training_iteration": 7}  # replaces the file's
    assert spec["checkpoint_config"] == {
        "checkpoint_frequency": 3,
        "checkpoint_at_end": True,
        "num_to_keep": cli.DEFAULT_NUM_TO_KEEP,  # bounded disk use unless the file says more
    }
    assert spec["num_samples"] == 2 and spec["storage_path"] == str(tmp_path / "out")
    # What Tune runs: `Experiment.from_json` of the spec.
    experiment = cli.make_experiment("tiny-cartpole", spec, "test")
    assert experiment.stopper is spec["stop"] and experiment.spec["num_samples"] == 2
    assert experiment.checkpoint_config.checkpoint_frequency == 3
    assert experiment.storage.experiment_fs_path == str(tmp_path / "out" / "tiny-cartpole")


def test_quick_train_without_a_file(captured_run):
    assert (
        cli.main(
            [
                "train",
                "--algo",
                "DreamerV3",
                "--env",
                "CartPole-v1",
                "--config",
                '{"model_size": "nano", "batch_size_B": 4, "batch_length_T": 8}',
                "--no-checkpoint-at-end",
            ]
        )
        == 0
    )
    [(name, spec)] = captured_run[0].items()
    assert name == "DreamerV3_CartPole-v1" and spec["run"] == "DreamerV3"
    assert spec["config"] == {
        "model_size": "nano",
        "batch_size_B": 4,
        "batch_length_T": 8,
        "env": "CartPole-v1",
    }
    assert spec["stop"] is None and spec["checkpoint_config"] == {
        "checkpoint_at_end": False,
        "num_to_keep": cli.DEFAULT_NUM_TO_KEEP,
    }


def test_missing_yaml(capsys, tmp_path):
    path = str(tmp_path / "nope.yaml")
    err = _error(capsys, ["train", "file", path])
    assert path in err and "no such file" in err


def test_malformed_yaml_names_the_line(capsys, tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("exp:\n  env: CartPole-v1\n  config: {model_size: nano\n")
    err = _error(capsys, ["train", "file", str(path)])
    assert str(path) in err and "not valid YAML" in err and "line" in err


def test_yaml_that_is_not_a_mapping(capsys, tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- CartPole-v1\n")
    err = _error(capsys, ["train", "file", str(path)])
    assert str(path) in err and "mapping of experiment names" in err


def test_unknown_algorithm(capsys, tmp_path):
    path = write_yaml(tmp_path / "algo.yaml", _variant(run="DreamerV2"))
    err = _error(capsys, ["train", "file", path])
    assert path in err and "'DreamerV2'" in err and "Did you mean 'DreamerV3'" in err


def test_unknown_config_key_suggests_the_close_one(capsys, tmp_path):
    config = {**TINY["tiny-cartpole"]["config"], "training_ration": 64}
    path = write_yaml(tmp_path / "key.yaml", _variant(config=config))
    err = _error(capsys, ["train", "file", path])
    assert path in err and "'training_ration'" in err and "Did you mean 'training_ratio'" in err


def test_unknown_experiment_key(capsys, tmp_path):
    path = write_yaml(tmp_path / "exp.yaml", _variant(stopp={"training_iteration": 1}))
    err = _error(capsys, ["train", "file", path])
    assert path in err and "'stopp'" in err and "Did you mean 'stop'" in err


def test_misspelt_evaluation_key_is_named(capsys, tmp_path):
    # RLlib passes `evaluation_*` keys to `config.evaluation(...)` as keywords.
    config = {**TINY["tiny-cartpole"]["config"], "evaluation_intervall": 2}
    path = write_yaml(tmp_path / "key.yaml", _variant(config=config))
    err = _error(capsys, ["train", "file", path])
    assert "'evaluation_intervall'" in err and "Did you mean 'evaluation_interval'" in err


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("resources_per_trial", {"cpu": 1}, "unknown key 'resources_per_trial'"),
        ("time_budget_s", 60, "unknown key 'time_budget_s'"),
        ("max_failures", "3", "max_failures='3' must be an integer >= -1"),
        ("num_samples", 0, "num_samples=0 must be an integer >= 1"),
        ("checkpoint_config", {"num_to_keep": 0}, "checkpoint_config: .*num_to_keep"),
    ],
)
def test_experiment_values_tune_would_reject_are_named_first(capsys, tmp_path, key, value, match):
    path = write_yaml(tmp_path / "exp.yaml", _variant(**{key: value}))
    err = _error(capsys, ["train", "file", path])
    assert re.search(match, err), err


def test_unregistered_env(capsys, tmp_path):
    path = write_yaml(tmp_path / "env.yaml", _variant(env="CartPol-v1"))
    err = _error(capsys, ["train", "file", path])
    assert path in err and "'CartPol-v1'" in err and "register_env" in err
    assert "Did you mean 'CartPole-v1'" in err and len(err.strip().splitlines()) == 1


def test_invalid_value_and_yaml_number_pitfall(capsys, tmp_path):
    path = tmp_path / "value.yaml"
    path.write_text(
        "exp:\n  env: CartPole-v1\n  run: DreamerV3\n  config: {world_model_lr: 1e-3}\n"
    )
    err = _error(capsys, ["train", "file", str(path)])
    assert str(path) in err and "world_model_lr" in err and "1.0e-3" in err
    assert "_validate_config=False" not in err  # RLlib's "suppress all validation" hint


def test_quick_train_errors_name_the_option(capsys):
    err = _error(capsys, ["train", "--env", "CartPole-v1", "--config", "{training_ration: 2}"])
    assert "the command line" in err and "Did you mean 'training_ratio'" in err
    err = _error(capsys, ["train", "--env", "CartPole-v1", "--config", "[1, 2]"])
    assert "--config" in err and "mapping" in err
    err = _error(capsys, ["train"])
    assert "rllib train file PATH.yaml" in err


def test_missing_checkpoint(capsys, tmp_path):
    path = str(tmp_path / "checkpoint_000003")
    err = _error(capsys, ["evaluate", path])
    assert path in err and "no such checkpoint" in err


def test_directory_that_is_not_a_checkpoint_lists_the_ones_below_it(capsys, tmp_path):
    inner = tmp_path / "trial" / "checkpoint_000000"
    inner.mkdir(parents=True)
    (inner / "rllib_checkpoint.json").write_text("{}")
    err = _error(capsys, ["evaluate", str(tmp_path)])
    assert "not an RLlib Algorithm checkpoint" in err and str(inner) in err


def test_video_without_moviepy(capsys, monkeypatch, tmp_path):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        cli.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "moviepy" else find_spec(name, *a),
    )
    err = _error(capsys, ["evaluate", str(tmp_path), "--video-dir", str(tmp_path / "v")])
    assert "pip install moviepy" in err


def test_checkpoint_without_manifest_is_refused_unless_allowed(capsys, tmp_path, monkeypatch):
    (tmp_path / cli.MODULE_STATE_DIR).mkdir(parents=True)
    (tmp_path / "class_and_ctor_args.pkl").write_bytes(b"x")
    err = _error(capsys, ["evaluate", str(tmp_path)])
    assert checkpoints.MANIFEST in err and checkpoints.ALLOW_UNVERIFIED in err


def test_corrupt_checkpoint(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv(checkpoints.ALLOW_UNVERIFIED, "1")  # an old checkpoint, no manifest
    (tmp_path / cli.MODULE_STATE_DIR).mkdir(parents=True)
    (tmp_path / "class_and_ctor_args.pkl").write_bytes(pickle.dumps({"class": 1})[:7])
    err = _error(capsys, ["evaluate", str(tmp_path)])
    assert str(tmp_path) in err and "corrupt" in err


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["train", "--help"],
        ["train", "file", "--help"],
        ["evaluate", "--help"],
        ["export", "--help"],
    ],
)
def test_help_at_every_level(capsys, argv):
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: rllib") and "--help" in out


def test_console_scripts_resolve_to_this_package():
    for name in ("rllib", "rllib-dreamerv3"):
        entry_points = importlib.metadata.entry_points(group="console_scripts", name=name)
        assert [ep.value for ep in entry_points] == ["rllib_dreamerv3.cli:main"], name
        # pip writes either a direct import (PEP 660 editable, wheels) or, with the legacy
        # `setup.py develop`, a lookup of this distribution's entry point of that name, which
        # the line above pins to our CLI.
        text = open(script(name)).read()
        legacy = f"load_entry_point('rllib-dreamerv3', 'console_scripts', '{name}')"
        assert "rllib_dreamerv3.cli" in text or legacy in text, text
    assert cli.other_rllib_commands() == []


def test_warns_when_another_package_declares_rllib(monkeypatch, capsys):
    ours = SimpleNamespace(
        value="rllib_dreamerv3.cli:main", dist=SimpleNamespace(metadata={"Name": "rllib-dreamerv3"})
    )
    theirs = SimpleNamespace(
        value="ray.rllib.scripts:cli", dist=SimpleNamespace(metadata={"Name": "ray"})
    )
    monkeypatch.setattr(cli.importlib.metadata, "entry_points", lambda **kw: [ours, theirs])
    assert cli.other_rllib_commands() == ["ray (ray.rllib.scripts:cli)"]
    assert cli.main(["--help"], prog="rllib") == 0
    err = capsys.readouterr().err
    assert "ray (ray.rllib.scripts:cli)" in err and "rllib-dreamerv3" in err
    # Under the alias there is nothing to warn about.
    cli.main(["--help"], prog="rllib-dreamerv3")
    assert "warning" not in capsys.readouterr().err


def test_progress_line():
    result = {
        "training_iteration": 3,
        "num_updates_lifetime": 40.0,
        "time_total_s": 12.3,
        "env_runners": {"num_env_steps_sampled_lifetime": 1500.0, "episode_return_mean": 23.456},
        "learners": {"default_policy": {"L_world_model": 1.5, "L_actor": -0.25, "L_critic": 2.0}},
    }
    assert cli.progress_line("trial", result) == (
        "trial iter 3 | env steps 1500 | updates 40 | return 23.46 | "
        "L_world_model 1.5 L_actor -0.25 L_critic 2 | 12 s"
    )
    # With the stop criteria, the ETA of the nearest counter at the rate so far: 1500 steps in
    # 12.3 s, 3000 to go -> 24.6 s; 3 iterations in 12.3 s, 7 to go -> 28.7 s. A threshold on
    # the return has no ETA.
    stop = {"num_env_steps_sampled_lifetime": 4500, "training_iteration": 10, "x/y": 5}
    assert cli.progress_line("trial", result, stop).endswith("| 12 s | ETA 25 s")
    assert cli.progress_line("trial", result, {"time_total_s": 3600}).endswith("ETA 60 min")
    # DreamerV3's results: the rate since the end of the first iteration with updates (warm-up
    # and compile behind it): 1000 steps in 2.3 s since the reference, 3000 to go -> 6.9 s.
    reference = {"training_iteration": 1, "time_total_s": 10.0}
    reference["num_env_steps_sampled_lifetime"] = 500
    with_reference = {**result, "eta_reference": reference}
    assert cli.progress_line("trial", with_reference, stop).endswith("| 12 s | ETA 7 s")
    # Before that iteration is over there is no ETA.
    with_reference["eta_reference"] = None
    assert cli.progress_line("trial", with_reference, stop).endswith("| 12 s")


def test_status_table_shows_return_losses_and_only_swept_parameters():
    from ray import tune

    reporter = cli.status_table(
        {
            "env": "CartPole-v1",
            "model_size": "nano",
            "training_ratio": {"grid_search": [32, 64]},
            "world_model_lr": tune.choice([1e-4, 3e-4]),
        }
    )
    # CLIReporter has no public getters; these are what its table prints.
    assert reporter._parameter_columns == ["training_ratio", "world_model_lr"]
    assert reporter._metric_columns == {
        "num_env_steps_sampled_lifetime": "env steps",
        "episode_return_mean": "return",
        "L_world_model": "L_world_model",
        "L_actor": "L_actor",
        "L_critic": "L_critic",
    }


def test_a_rerun_over_unfinished_trials_is_refused_with_the_resume_command(tmp_path):
    # `rllib train` runs `tune.run_experiments`, whose directory has no `tuner.pkl`: the check
    # must find the trials from its experiment state, and refuse a rerun over unfinished ones.
    import ray
    from ray import tune

    def fails_after_its_first_result(config):  # nested: Ray's worker gets it by value
        tune.report({"score": 1.0})
        raise RuntimeError("the trial fails after its first result")

    ray.init(num_cpus=1, include_dashboard=False, ignore_reinit_error=True)
    try:
        spec = {"run": fails_after_its_first_result, "storage_path": str(tmp_path)}
        tune.run_experiments({"exp": spec}, verbose=0, raise_on_failed_trial=False)
        experiment = tune.Experiment.from_json("exp", spec)
        with pytest.raises(cli.CliError, match=r"did not finish: .*\(ERROR\).*--resume"):
            cli._check_resume(experiment, None, "exp.yaml")
        cli._check_resume(experiment, True, "exp.yaml")  # --resume continues them
        cli._check_resume(experiment, False, "exp.yaml")  # --no-resume starts new ones
        fresh = tune.Experiment.from_json("other", spec)
        cli._check_resume(fresh, None, "exp.yaml")  # nothing there yet
    finally:
        ray.shutdown()


@pytest.mark.parametrize(
    "status, done, label, end",
    [
        ("TERMINATED", True, "done,", "done"),
        ("TERMINATED", False, "interrupted,", "interrupted"),  # Tune's stop at Ctrl-C
        ("PAUSED", False, "stopped (PAUSED),", "interrupted"),
    ],
)
def test_a_trial_stopped_by_ctrl_c_is_reported_interrupted_not_done(
    capsys, status, done, label, end
):
    result = {"training_iteration": 3, "done": done, "next_checkpoint_s": 600.0}
    trial = SimpleNamespace(
        status=status,
        ERROR="ERROR",
        TERMINATED="TERMINATED",
        last_result=result,
        checkpoint=None,
    )
    assert cli._report_trial(trial) == end
    line = capsys.readouterr().out
    assert label in line and "checkpoint in" not in line
