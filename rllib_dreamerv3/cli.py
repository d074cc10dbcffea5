"""The `rllib` command: train RLlib-style YAML experiments with Ray Tune, evaluate checkpoints.

    rllib train file tuned_examples/cartpole.yaml [--stop '{training_iteration: 5}'] ...
    rllib train --env CartPole-v1 --config '{model_size: micro}' --stop '{training_iteration: 5}'
    rllib evaluate ~/ray_results/EXPERIMENT/TRIAL/checkpoint_000000 --episodes 10

Ray 2.60 installs no `rllib` command, so this package does; `rllib-dreamerv3` and
`python -m rllib_dreamerv3` are the same program under names nothing else claims.
"""

import argparse
import dataclasses
import difflib
import importlib.metadata
import importlib.util
import json
import logging
import os
import pickle
import sys
import time

import numpy as np
import ray
import yaml
from ray import tune
from ray.rllib.algorithms.algorithm_config import AlgorithmConfig
from ray.rllib.utils.checkpoints import Checkpointable
from tqdm import tqdm

from rllib_dreamerv3 import checkpoints
from rllib_dreamerv3.algorithm import DreamerV3
from rllib_dreamerv3.config import DreamerV3Config
from rllib_dreamerv3.env_runner import DreamerV3EnvRunner, make_env
from rllib_dreamerv3.export import MODULE_PATH as MODULE_STATE_DIR
from rllib_dreamerv3.export import (
    export_policy,
    export_tflite,
    read_metadata,
    run_saved_model,
    saved_model_bytes,
)
from rllib_dreamerv3.progress import PROGRESS_LOSSES, ProgressLines, progress_line
from rllib_dreamerv3.progress import format_duration as progress_format_duration
from rllib_dreamerv3.progress import format_number as fmt
from rllib_dreamerv3.stopping import StopCriteria, StopCriteriaError

ALIAS = "rllib-dreamerv3"
ALGORITHMS = {"DreamerV3": DreamerV3}
# An experiment is what `tune.Experiment.from_json` reads: `run`, RLlib's `env` (moved into
# `config`) and these arguments of `tune.Experiment`. Not its others: DreamerV3 requests its own
# resources (`resources_per_trial` would fail), `time_budget_s` is `stop: {time_total_s: N}`.
EXPERIMENT_KEYS = (
    "run",
    "env",
    "stop",
    "config",
    "checkpoint_config",
    "num_samples",
    "storage_path",
    "max_failures",
)
CHECKPOINT_CONFIG_KEYS = tuple(
    f.name for f in dataclasses.fields(tune.CheckpointConfig) if not f.name.startswith("_")
)
_RLLIB_SUPPRESS_HINT = "\nTo suppress all validation errors"
# Checkpoints kept per trial unless checkpoint_config says otherwise (Tune deletes older ones).
DEFAULT_NUM_TO_KEEP = 3


class CliError(Exception):
    """A user error: printed as one paragraph (no traceback), exit code 2."""


# --- experiments ----------------------------------------------------------------------------------
def load_experiments(path):
    """`{name: spec}` from an RLlib-style YAML file, or a `CliError` that names the file."""
    if not os.path.isfile(path):
        hint = (
            " It is a directory; give the .yaml file inside it."
            if os.path.isdir(path)
            else " Check the path (relative paths start from the current directory, "
            f"{os.getcwd()})."
        )
        raise CliError(f"{path}: no such file.{hint}")
    try:
        with open(path) as f:
            experiments = yaml.safe_load(f)
    except yaml.YAMLError as err:
        where = getattr(err, "problem_mark", None)
        line = f" (line {where.line + 1}, column {where.column + 1})" if where else ""
        problem = getattr(err, "problem", None) or str(err)
        raise CliError(
            f"{path}: not valid YAML{line}: {problem}. Fix the syntax; the file "
            "maps experiment names to {env, run, stop, config}."
        ) from None
    if not isinstance(experiments, dict) or not experiments:
        raise CliError(
            f"{path}: expected a mapping of experiment names to experiments "
            "(`my-experiment: {env: CartPole-v1, run: DreamerV3, stop: {...}, "
            f"config: {{...}}}}`), found {type(experiments).__name__}."
        )
    for name, spec in experiments.items():
        if not isinstance(spec, dict):
            raise CliError(
                f"{path}: experiment {name!r} must be a mapping with the keys "
                f"{list(EXPERIMENT_KEYS)}, found {type(spec).__name__}."
            )
    return experiments


def _closest(word, choices, cutoff):
    """The choice most like `word` (difflib's ratio at least `cutoff`), or None."""
    close = difflib.get_close_matches(word, sorted(choices), n=1, cutoff=cutoff)
    return close[0] if close else None


def _did_you_mean(word, choices):
    close = _closest(str(word), [c for c in choices if not c.startswith("_")], 0.6)
    return f" Did you mean {close!r}?" if close else ""


def known_config_keys():
    """Every key `DreamerV3Config().update_from_dict` understands (attributes and old names)."""
    config = DreamerV3Config()
    return set(vars(config)) | set(config.to_dict()) | {"multiagent"}


def unknown_config_key(config_dict):
    """The first key of `config_dict` that `DreamerV3Config` does not have, or None.

    `update_from_dict` would set any key silently (as a new attribute), so a misspelt
    hyperparameter would be ignored; this is checked first. Keys RLlib translates (`lambda`,
    `num_workers`, ...) set an existing attribute and pass; keys it passes to a method as
    keywords (`evaluation_*`) raise a `TypeError` there when the method has no such argument.
    """
    known = known_config_keys()
    for key, value in config_dict.items():
        if key in known:
            continue
        probe = DreamerV3Config()
        before = set(vars(probe))
        try:
            probe.update_from_dict({key: _first_variant(value)})
        except TypeError:  # an unexpected keyword argument
            return key
        except Exception:  # noqa: BLE001 - a known key with a bad value: validate() says which
            continue
        if set(vars(probe)) - before:
            return key
    return None


def _first_variant(value):
    """A Tune `{"grid_search": [...]}` (or a `tune.grid_search`/`choice` object) -> one value."""
    if isinstance(value, dict) and set(value) == {"grid_search"} and value["grid_search"]:
        return value["grid_search"][0]
    if hasattr(value, "sample") and callable(value.sample):  # a tune search-space Domain
        return value.sample()
    return value


def _yaml_number_hint(config_dict):
    for key, value in config_dict.items():
        if isinstance(value, str):
            try:
                float(value)
            except ValueError:
                continue
            return (
                f" Note: YAML reads `{key}: {value}` as a string; write it with a dot "
                f"(e.g. 1.0e-3) or as a decimal (0.001)."
            )
    return ""


def _one_paragraph(text):
    return " ".join(str(text).split())


def _env_problem(env, err):
    """Why `validate()` could not create `env` (an env registered with Tune would have been)."""
    import gymnasium as gym

    if isinstance(env, str) and "." not in env and env not in gym.registry:
        return (
            f"env: {env!r} is neither a gymnasium id nor registered with "
            f"ray.tune.register_env.{_did_you_mean(env, gym.registry)} Use a gymnasium id "
            "(e.g. CartPole-v1), a module.Class path, or register the env in Python first."
        )
    return (
        f"env: {env!r} could not be created: {_one_paragraph(err.__cause__)[:500]} Check "
        "the env's name and its env_config."
    )


def _checked_config_keys(where, config):
    """The experiment's `config`, a `CliError` unless it maps known config keys."""
    if not isinstance(config, dict):
        raise CliError(
            f"{where}: config must be a mapping of config keys to values, found "
            f"{type(config).__name__}."
        )
    key = unknown_config_key(config)
    if key is not None:
        raise CliError(
            f"{where}: unknown config key {key!r}.{_did_you_mean(key, known_config_keys())} "
            "DreamerV3's hyperparameters are the names in HYPERPARAMETERS "
            "(rllib_dreamerv3/algorithm.py); any other key must be an AlgorithmConfig setting "
            "(e.g. num_env_runners, gamma)."
        )
    return config


def _check_checkpoint_config(where, checkpoint_config):
    """A `CliError` unless `checkpoint_config` is a valid `tune.CheckpointConfig` mapping."""
    if not isinstance(checkpoint_config, dict):
        raise CliError(
            f"{where}: checkpoint_config must be a mapping, e.g. "
            "{checkpoint_frequency: 10, checkpoint_at_end: true}."
        )
    for key in checkpoint_config:
        if key not in CHECKPOINT_CONFIG_KEYS:
            raise CliError(
                f"{where}: unknown checkpoint_config key {key!r}."
                f"{_did_you_mean(key, CHECKPOINT_CONFIG_KEYS)} Use {list(CHECKPOINT_CONFIG_KEYS)}"
                " (ray.tune.CheckpointConfig)."
            )
    try:
        tune.CheckpointConfig(**checkpoint_config)
    except (ValueError, TypeError) as err:
        raise CliError(f"{where}: checkpoint_config: {_one_paragraph(err)}") from None


def check_experiment(source, name, spec):
    """One experiment checked, as the spec `tune.Experiment.from_json` reads (see
    :func:`make_experiment`), or a `CliError` naming the source and the key, raised before Ray
    starts.

    The spec's `config` is the YAML's `config` (Tune search spaces kept) plus `env`; its `stop`
    is a `StopCriteria` of the YAML's `stop` (None without one).
    """
    where = f"{source}, experiment {name!r}"
    for key in spec:
        if key not in EXPERIMENT_KEYS:
            raise CliError(
                f"{where}: unknown key {key!r}.{_did_you_mean(key, EXPERIMENT_KEYS)}"
                f" An experiment has the keys {list(EXPERIMENT_KEYS)}."
            )
    run = spec.get("run")
    if run not in ALGORITHMS:
        raise CliError(
            f"{where}: run: {run!r} is not an algorithm this command knows."
            f"{_did_you_mean(run, ALGORITHMS)} Use one of {list(ALGORITHMS)} (rllib-dreamerv3 "
            "provides DreamerV3 only; RLlib's own algorithms run from Python)."
        )
    config = _checked_config_keys(where, spec.get("config") or {})
    env = spec.get("env", config.get("env"))
    if env is None:
        raise CliError(
            f"{where}: no env. Add `env: CartPole-v1` (a gymnasium id, a name "
            "registered with ray.tune.register_env, or a module.Class path)."
        )
    param_space = {**config, "env": env}
    try:
        DreamerV3Config().update_from_dict(
            {k: _first_variant(v) for k, v in param_space.items()}
        ).validate()
    except (ValueError, TypeError) as err:
        if err.__cause__ is not None:  # `make_env` could not create the env
            raise CliError(f"{where}: {_env_problem(env, err)}") from None
        message = _one_paragraph(str(err).split(_RLLIB_SUPPRESS_HINT)[0])
        raise CliError(f"{where}: {message}{_yaml_number_hint(config)}") from None
    stop = spec.get("stop") or {}
    if not isinstance(stop, dict):
        raise CliError(
            f"{where}: stop must map result keys to thresholds, e.g. "
            "{training_iteration: 10, env_runners/episode_return_mean: 450}."
        )
    _check_checkpoint_config(where, spec.get("checkpoint_config") or {})
    for key, low in (("num_samples", 1), ("max_failures", -1)):
        value = spec.get(key, low)
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise CliError(f"{where}: {key}={value!r} must be an integer >= {low}.")
    spec = {**spec, "config": param_space, "stop": StopCriteria(stop, where) if stop else None}
    spec.pop("env", None)
    if spec.get("storage_path"):
        spec["storage_path"] = os.path.abspath(os.path.expanduser(spec["storage_path"]))
    return spec


def make_experiment(name, spec, where):
    """The `tune.Experiment` of a checked spec (it makes the experiment's directory)."""
    try:
        return tune.Experiment.from_json(name, spec)
    except (tune.TuneError, ValueError, TypeError, OSError, RuntimeError) as err:
        raise CliError(f"{where}: {_one_paragraph(err)[:500]}") from None


def _parse_mapping(text, option):
    """A JSON or YAML mapping given on the command line (`'{"a": 1}'` or `'{a: 1}'`)."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as err:
        problem = getattr(err, "problem", None) or _one_paragraph(err)
        raise CliError(
            f"{option} {text!r} is not valid JSON/YAML ({problem}). Quote it for "
            'the shell, e.g. --config \'{"model_size": "micro"}\'.'
        ) from None
    if not isinstance(value, dict):
        raise CliError(f'{option} {text!r} must be a mapping, e.g. \'{{"model_size": "micro"}}\'.')
    return value


def apply_overrides(experiments, args):
    """The command line's `--env`, `--config`, `--stop`, ... applied to every experiment."""
    config = _parse_mapping(args.config, "--config") if getattr(args, "config", None) else {}
    stop = _parse_mapping(args.stop, "--stop") if getattr(args, "stop", None) else None
    out = {}
    for name, spec in experiments.items():
        spec = dict(spec)
        if isinstance(spec.get("config") or {}, dict):  # else check_experiment says what's wrong
            spec["config"] = {**(spec.get("config") or {}), **config}
            if getattr(args, "env", None):
                spec["config"].pop("env", None)
        if getattr(args, "env", None):
            spec["env"] = args.env
        if stop is not None:
            spec["stop"] = stop
        if isinstance(spec.get("checkpoint_config") or {}, dict):
            checkpoint_config = dict(spec.get("checkpoint_config") or {})
            if getattr(args, "checkpoint_freq", None) is not None:
                checkpoint_config["checkpoint_frequency"] = args.checkpoint_freq
            if getattr(args, "checkpoint_at_end", None) is not None:
                checkpoint_config["checkpoint_at_end"] = args.checkpoint_at_end
            checkpoint_config.setdefault("checkpoint_at_end", True)
            checkpoint_config.setdefault("num_to_keep", DEFAULT_NUM_TO_KEEP)
            spec["checkpoint_config"] = checkpoint_config
        if getattr(args, "num_samples", None) is not None:
            spec["num_samples"] = args.num_samples
        if getattr(args, "max_failures", None) is not None:
            spec["max_failures"] = args.max_failures
        if getattr(args, "storage_path", None):
            spec["storage_path"] = args.storage_path
        out[name] = spec
    return out


# --- training with Tune ---------------------------------------------------------------------------
def run_experiments(experiments, source, args):
    """Run every experiment with Tune (`tune.run` of each `tune.Experiment`, one after the
    other); 0 if every trial finished cleanly, 1 if one failed, 130 if interrupted."""
    checked = {name: check_experiment(source, name, spec) for name, spec in experiments.items()}
    todo = [
        make_experiment(name, spec, f"{source}, experiment {name!r}")
        for name, spec in checked.items()
    ]
    # Tune's classic output engine: it prints nothing at verbose=0 and takes a `CLIReporter`
    # with chosen columns (the default engine prints its banners at any verbosity).
    os.environ["RAY_AIR_NEW_OUTPUT"] = "0"
    verbose = getattr(args, "verbose", 0)
    ray.init(
        num_cpus=getattr(args, "num_cpus", None),
        include_dashboard=False,
        ignore_reinit_error=True,
        logging_level=logging.INFO if verbose else logging.WARNING,
    )
    failed = False
    resume = getattr(args, "resume", None)
    for experiment in todo:
        stopper, name = experiment.stopper, experiment.storage.experiment_dir_name
        path = experiment.storage.experiment_fs_path
        _check_resume(name, path, resume, source)
        print(f"{name}: results in {path}; watch with: tensorboard --logdir {path}", flush=True)
        print(f"{name}: {_checkpoint_plan(experiment)}", flush=True)
        if stopper is None:
            print(
                f"{name}: no stop criterion, training runs until Ctrl-C (add "
                "--stop '{training_iteration: 10}').",
                flush=True,
            )
        analysis = tune.run(
            experiment,
            verbose=verbose,
            progress_reporter=status_table(experiment.spec["config"]),
            raise_on_failed_trial=False,
            callbacks=[ProgressLines(stopper and stopper.stop)],
            resume_config=RESUME if resume else None,
        )
        if stopper is not None and stopper.problem:  # Tune stopped cleanly; say why, exit 2
            raise CliError(stopper.problem)
        ends = [_report_trial(trial) for trial in analysis.trials]
        if "interrupted" in ends:  # Tune handled Ctrl-C and returned: no further experiments
            print(
                f"{name}: interrupted; results so far in {path}. Continue with the same "
                "command and --resume.",
                file=sys.stderr,
            )
            return 130
        failed = failed or "failed" in ends
    return 1 if failed else 0


# `--resume`: unfinished trials (a killed run leaves them RUNNING) and errored ones continue from
# their latest checkpoint; finished ones are kept as they are.
RESUME = tune.ResumeConfig(
    unfinished=tune.ResumeConfig.ResumeType.RESUME,
    errored=tune.ResumeConfig.ResumeType.RESUME,
)


def unfinished_trials(path):
    """`[(trial id, status)]` of the trials of the experiment at `path` that did not finish
    (Tune's experiment state; empty where there is none)."""
    if not os.path.isdir(path) or not any(
        f.startswith("experiment_state") for f in os.listdir(path)
    ):
        return []
    from ray.tune import ExperimentAnalysis

    try:
        trials = ExperimentAnalysis(path).trials
    except Exception:  # noqa: BLE001 - an unreadable state: Tune itself says more on resume
        return []
    return [(t.trial_id, t.status) for t in trials if t.status != "TERMINATED"]


def _check_resume(name, path, resume, source):
    """`--resume` needs an experiment to continue; a run without it over unfinished trials is
    refused with the command that continues them (`--no-resume` starts new trials beside)."""
    if resume is False:
        return
    unfinished = unfinished_trials(path)
    if resume and not os.path.isdir(path):
        raise CliError(
            f"{name}: --resume, but {path} holds no experiment to continue. Run without "
            "--resume to start it (or give the --storage-path of the first run)."
        )
    if resume is None and unfinished:
        trials = ", ".join(f"{trial} ({status})" for trial, status in unfinished[:5])
        again = source if source.endswith((".yaml", ".yml")) else "..."
        raise CliError(
            f"{name}: {path} holds trials that did not finish: {trials}. Continue them from "
            f"their latest checkpoints with `rllib train file {again} --resume` (same "
            "options), or start new trials beside them with --no-resume."
        )


def _checkpoint_plan(experiment):
    """One sentence on when this experiment checkpoints and how many checkpoints it keeps."""
    config = experiment.spec["config"]
    interval = _first_variant(config.get("checkpoint_interval_s", 900.0))
    keep = experiment.checkpoint_config.num_to_keep
    every = f"every {progress_format_duration(interval)} of training" if interval else "never"
    kept = f"the last {keep} kept" if keep else "all kept"
    return (
        f"checkpoints {every} (checkpoint_interval_s) and at the end; {kept} "
        "(checkpoint_config: {num_to_keep: N})."
    )


def status_table(param_space):
    """Tune's status table for DreamerV3 trials: return, losses and env steps, and only the
    swept parameters (the `grid_search`/search-space entries of `param_space`)."""
    swept = [k for k, v in param_space.items() if _first_variant(v) is not v]
    return tune.CLIReporter(
        metric_columns={
            "num_env_steps_sampled_lifetime": "env steps",
            "episode_return_mean": "return",
            **{name: name for name in PROGRESS_LOSSES},
        },
        parameter_columns=swept,
        max_report_frequency=30,
    )


def _report_trial(trial):
    """Print how `trial` ended (its checkpoint and how to evaluate it); "done", "failed" or
    "interrupted"."""
    iteration = trial.last_result.get("training_iteration", 0)
    if trial.status == trial.ERROR:
        where = trial.error_file or "the trial's directory"
        last_line = ""
        if trial.error_file and os.path.isfile(trial.error_file):
            with open(trial.error_file) as f:
                last_line = ([""] + f.read().strip().splitlines())[-1]
        print(
            f"{trial}: FAILED after {iteration} iterations ({last_line or 'see the traceback'}). "
            f"Full traceback: {where}",
            file=sys.stderr,
            flush=True,
        )
        return "failed"
    ended = trial.status == trial.TERMINATED
    label = "done," if ended else f"stopped ({trial.status}),"
    print(f"{trial}: {progress_line(label, trial.last_result)}", flush=True)
    checkpoint = trial.checkpoint
    if checkpoint is not None:
        print(
            f"  checkpoint: {checkpoint.path}\n  evaluate:   rllib evaluate {checkpoint.path} "
            "--episodes 10",
            flush=True,
        )
    return "done" if ended else "interrupted"


# --- evaluation -----------------------------------------------------------------------------------
CTOR_FILE = Checkpointable.CLASS_AND_CTOR_ARGS_FILE_NAME


def _checkpoint_candidates(path):
    found = []
    for root, dirs, files in os.walk(path):
        if "rllib_checkpoint.json" in files:
            found.append(root)
            dirs.clear()
    return sorted(found)


def load_checkpoint_config(path):
    """The `DreamerV3Config` saved in an Algorithm checkpoint, or a `CliError` that says why not.

    It is the first constructor argument that RLlib's `Checkpointable.save_to_path` stores in
    `CTOR_FILE`; `Algorithm.from_checkpoint` would read it the same way, but would also build
    the Learner and restore the replay buffer, which evaluation does not need.
    """
    if not os.path.exists(path):
        raise CliError(
            f"{path}: no such checkpoint directory. Give the checkpoint_NNNNNN "
            "directory printed at the end of `rllib train`, or the path of "
            "`algo.save_to_path()`."
        )
    if not os.path.isdir(path):
        raise CliError(f"{path}: is a file; a checkpoint is a directory (checkpoint_NNNNNN).")
    ctor_file = os.path.join(path, CTOR_FILE)
    checkpoints.recover_interrupted_save(path)
    if not os.path.isfile(ctor_file) or not os.path.isdir(os.path.join(path, MODULE_STATE_DIR)):
        candidates = _checkpoint_candidates(path)
        hint = (
            f" Checkpoints below it: {', '.join(candidates[-3:])}."
            if candidates
            else " Nothing below it looks like one either; was the run checkpointed "
            "(--checkpoint-freq, checkpoint_at_end)?"
        )
        raise CliError(
            f"{path}: not an RLlib Algorithm checkpoint (no {CTOR_FILE}"
            f" and {MODULE_STATE_DIR}).{hint}"
        )
    try:  # the files evaluation reads: the config and the policy's weights
        checkpoints.verify(path, prefixes=(CTOR_FILE, MODULE_STATE_DIR.replace(os.sep, "/")))
    except checkpoints.CheckpointError as err:
        raise CliError(str(err)) from None
    try:
        with open(ctor_file, "rb") as f:
            saved = pickle.load(f)
        algo_class = saved["class"]
        config = AlgorithmConfig.from_state(saved["ctor_args_and_kwargs"][0][0])
    except Exception as err:  # a truncated or foreign pickle fails in many ways
        raise CliError(
            f"{path}: the checkpoint is corrupt or from an incompatible version "
            f"({ctor_file}: {type(err).__name__}: {err}). Use another checkpoint of "
            "the run, or re-save it with this version."
        ) from None
    if not (isinstance(algo_class, type) and issubclass(algo_class, DreamerV3)):
        raise CliError(
            f"{path}: a checkpoint of {getattr(algo_class, '__name__', algo_class)},"
            " not DreamerV3; `rllib evaluate` evaluates DreamerV3 checkpoints."
        )
    return config


def evaluate_checkpoint(path, episodes, env=None, explore=False, seed=None, video_dir=None):
    """Run `episodes` episodes of a checkpoint's policy on one env in this process.

    Only the policy is restored (not the learner or the replay buffer), so this is quick even
    for large runs. Returns `{"episodes", "return_mean", "return_min", "return_max",
    "length_mean", "env"}`.
    """
    from gymnasium.error import DependencyNotInstalled

    if episodes < 1:
        raise CliError(f"--episodes {episodes}: give at least 1.")
    if video_dir is not None and importlib.util.find_spec("moviepy") is None:
        raise CliError(
            "--video-dir needs moviepy, which is not installed: pip install moviepy "
            "(or pip install -e '.[video]')."
        )
    config = load_checkpoint_config(path).copy(copy_frozen=False)
    if env is not None:
        config.environment(env)
    if video_dir is not None:
        config.environment(env_config={**config.env_config, "render_mode": "rgb_array"})
    config.env_runners(num_env_runners=0, num_envs_per_env_runner=1, explore=explore)
    config.reporting(metrics_num_episodes_for_smoothing=episodes)
    if seed is not None:
        config.debugging(seed=seed)
    try:
        runner = DreamerV3EnvRunner(config=config, worker_index=0)
    except ValueError as err:
        raise CliError(f"{path}: could not create the env {config.env!r}: {err}") from None
    try:
        if video_dir is not None:
            runner.envs = [_record_video(runner.envs[0], video_dir, episodes)]
        try:
            runner.module.restore_from_path(os.path.abspath(os.path.join(path, MODULE_STATE_DIR)))
        except (ValueError, OSError, EOFError, pickle.UnpicklingError) as err:
            raise CliError(
                f"{path}: could not load the policy weights ({type(err).__name__}: "
                f"{err}). The checkpoint is corrupt, or --env has other spaces than "
                "the env it was trained on."
            ) from None
        bar = tqdm(total=episodes, desc="evaluating", unit="episode", leave=False, disable=None)
        try:
            with bar:
                runner.sample(num_episodes=episodes, progress=lambda n: bar.update(n - bar.n))
        except DependencyNotInstalled as err:  # e.g. the renderer for --video-dir
            raise CliError(f"{config.env}: {err}") from None
        metrics = runner.get_metrics()
    finally:
        runner.stop()
    return {
        "env": str(config.env),
        "episodes": episodes,
        "return_mean": float(metrics["episode_return_mean"]),
        "return_min": float(metrics["episode_return_min"]),
        "return_max": float(metrics["episode_return_max"]),
        "length_mean": float(metrics["episode_len_mean"]),
    }


def _record_video(env, video_dir, episodes):
    import gymnasium as gym

    try:  # not the episode the env resets into after the last one
        return gym.wrappers.RecordVideo(
            env,
            os.path.abspath(video_dir),
            episode_trigger=lambda episode: episode < episodes,
            disable_logger=True,
        )
    except gym.error.Error as err:
        raise CliError(f"--video-dir: the env cannot render frames ({err}).") from None


# --- command line ---------------------------------------------------------------------------------
def _add_run_options(parser):
    """Options shared by `rllib train` and `rllib train file` (absent unless given)."""
    parser.add_argument("--env", help="env id (overrides the file's env)")
    parser.add_argument(
        "--config",
        help="JSON/YAML mapping merged into each experiment's "
        'config, e.g. \'{"model_size": "micro", "training_ratio": 512}\'',
    )
    parser.add_argument(
        "--stop",
        help="JSON/YAML mapping that replaces the stop criteria, e.g. "
        "'{\"training_iteration\": 10}'",
    )
    parser.add_argument(
        "--checkpoint-freq",
        type=int,
        metavar="N",
        help="save a checkpoint every N iterations (default: the file's, or 0)",
    )
    parser.add_argument(
        "--checkpoint-at-end",
        action=argparse.BooleanOptionalAction,
        help="save a checkpoint when a trial ends (default: yes)",
    )
    parser.add_argument(
        "--storage-path",
        metavar="DIR",
        help="where Tune writes results and checkpoints (default ~/ray_results)",
    )
    parser.add_argument(
        "--num-samples",
        type=int,
        metavar="N",
        help="trials per experiment (times each grid_search combination)",
    )
    parser.add_argument(
        "--max-failures",
        type=int,
        metavar="N",
        help="restart a crashed trial from its latest checkpoint up to N times (default: the "
        "file's, or 0)",
    )
    parser.add_argument(
        "--resume",
        action=argparse.BooleanOptionalAction,
        help="continue the experiment's unfinished trials from their latest checkpoints, in the "
        "same experiment directory (--no-resume: start new trials beside them)",
    )
    parser.add_argument("--num-cpus", type=int, metavar="N", help="CPUs Ray may use (default: all)")
    parser.add_argument(
        "-v",
        "--verbose",
        type=int,
        choices=(0, 1, 2),
        help="Tune's own output: 0 none (default), 1 status table, 2 also brief "
        "results and Ray's info logs; a progress line per iteration is printed in any case",
    )


def build_parser(prog="rllib"):
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Train and evaluate DreamerV3 (rllib-dreamerv3) with RLlib and Ray Tune.",
        epilog=f"The same program runs as `{ALIAS}` and `python -m rllib_dreamerv3`.",
    )
    commands = parser.add_subparsers(dest="command", metavar="{train,evaluate,export}")
    commands.required = True

    train = commands.add_parser(
        "train",
        argument_default=argparse.SUPPRESS,
        help="train with Ray Tune (`rllib train file X.yaml` or `rllib train --env ENV`)",
        description="Train with Ray Tune: `rllib train file PATH.yaml` runs the experiments of "
        "a YAML file; `rllib train --algo DreamerV3 --env ENV --config '{...}'` runs one.",
    )
    train.add_argument(
        "--algo",
        "--run",
        dest="algo",
        help=f"algorithm (default DreamerV3; one of {list(ALGORITHMS)})",
    )
    _add_run_options(train)
    sources = train.add_subparsers(dest="source", metavar="{file}")
    train_file = sources.add_parser(
        "file",
        argument_default=argparse.SUPPRESS,
        help="run every experiment of a YAML file",
        description="Run every experiment of an RLlib-style YAML file (experiment name -> env, "
        "run, stop, config, optional checkpoint_config, num_samples, storage_path) with Tune.",
    )
    train_file.add_argument("path", help="the YAML file, e.g. tuned_examples/cartpole.yaml")
    _add_run_options(train_file)

    evaluate = commands.add_parser(
        "evaluate",
        help="report the return of N episodes of a checkpoint's policy",
        description="Restore a checkpoint's policy and report the mean/min/max return of N "
        "episodes (greedy actions unless --explore).",
    )
    evaluate.add_argument(
        "checkpoint", nargs="?", help="a checkpoint directory (checkpoint_NNNNNN)"
    )
    evaluate.add_argument(
        "--saved-model",
        metavar="DIR",
        help="evaluate a policy exported by `rllib export` instead of a checkpoint",
    )
    evaluate.add_argument("--episodes", type=int, default=10, help="episodes (default 10)")
    evaluate.add_argument("--env", help="evaluate on this env instead of the trained one")
    evaluate.add_argument(
        "--explore",
        action="store_true",
        help="sample actions as in training instead of greedy ones",
    )
    evaluate.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the env resets and the policy (default 0: a checkpoint and its exported "
        "policy play the same episodes)",
    )
    evaluate.add_argument(
        "--video-dir", metavar="DIR", help="write a video of every episode here (needs moviepy)"
    )
    evaluate.add_argument("--json", action="store_true", help="print the results as one JSON line")

    export = commands.add_parser(
        "export",
        help="write a checkpoint's policy as a TensorFlow SavedModel (runs without Ray)",
        description="Write the acting policy of a checkpoint (encoder, RSSM posterior step, "
        "actor) as a TensorFlow SavedModel with the signatures initial_state, step (greedy) "
        "and step_sample; loading it needs only TensorFlow.",
    )
    export.add_argument("checkpoint", help="a checkpoint directory (checkpoint_NNNNNN)")
    export.add_argument("out_dir", help="the SavedModel directory to write")
    export.add_argument(
        "--no-jit",
        action="store_true",
        help="plain TensorFlow steps instead of XLA-compiled ones (the default follows the "
        "training config; XLA gives exactly the actions of `rllib evaluate`)",
    )
    export.add_argument(
        "--tflite",
        action="store_true",
        help="also write OUT_DIR/policy.tflite of the greedy step where TFLite's ops allow "
        "(implies --no-jit)",
    )
    return parser


def other_rllib_commands():
    """Installed distributions other than this one that also declare an `rllib` command."""
    others = []
    for entry_point in importlib.metadata.entry_points(group="console_scripts", name="rllib"):
        if entry_point.value.split(":")[0] == __name__:
            continue
        dist = getattr(entry_point, "dist", None)
        name = dist.metadata["Name"] if dist is not None else "an unknown package"
        others.append(f"{name} ({entry_point.value})")
    return others


def _warn_if_shadowing(prog):
    if prog != "rllib":
        return
    others = other_rllib_commands()
    if others:
        print(
            f"rllib: warning: {', '.join(others)} also install(s) an `rllib` command; this is "
            f"rllib-dreamerv3's, whichever package was installed last owns the name. Run "
            f"`{ALIAS}` or `python -m rllib_dreamerv3` to be sure which one you get.",
            file=sys.stderr,
        )


def main(argv=None, prog=None):
    """Entry point of `rllib`, `rllib-dreamerv3` and `python -m rllib_dreamerv3`; exit code."""
    if prog is None:
        prog = os.path.basename(sys.argv[0]) if argv is None else "rllib"
        prog = prog if prog in ("rllib", ALIAS) else "rllib"
    _warn_if_shadowing(prog)
    parser = build_parser(prog)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help, or argparse's own usage error
        return exit_.code
    try:
        if args.command == "export":
            return _export_command(args)
        if args.command == "evaluate":
            return _evaluate_command(args)
        return _train_command(args, parser)
    except (CliError, StopCriteriaError) as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130


def _train_command(args, parser):
    if getattr(args, "source", None) == "file":
        if getattr(args, "algo", None):
            raise CliError(
                "--algo applies to `rllib train --env ...`; a YAML file names its "
                "algorithm under `run:`."
            )
        return run_experiments(apply_overrides(load_experiments(args.path), args), args.path, args)
    if not getattr(args, "env", None):
        raise CliError(
            "rllib train needs a YAML file (`rllib train file PATH.yaml`) or an env "
            "(`rllib train --env CartPole-v1`); see `rllib train --help`."
        )
    algo = getattr(args, "algo", None) or "DreamerV3"
    name = f"{algo}_{args.env}".replace("/", "_")
    spec = {"run": algo, "env": args.env}
    return run_experiments(apply_overrides({name: spec}, args), "the command line", args)


def _export_command(args):
    config = load_checkpoint_config(args.checkpoint)
    jit = False if (args.no_jit or args.tflite) else None
    try:
        out = export_policy(
            args.checkpoint,
            args.out_dir,
            jit_compile=jit,
            env=config.env,
            env_config=config.env_config,
        )
    except ValueError as err:  # e.g. a policy of Dict observations
        raise CliError(f"rllib export {args.checkpoint}: {err}") from None
    size = saved_model_bytes(out)
    print(
        f"{out}: SavedModel of the {config.env} policy ({size / 1e6:.2f} MB). Load it with "
        f"tf.saved_model.load({out!r}); run it with rllib evaluate --saved-model {out}"
    )
    if args.tflite:
        path, reason = export_tflite(out, os.path.join(out, "policy.tflite"))
        if path is None:
            print(f"TFLite: the converter could not convert the step: {reason}", file=sys.stderr)
            return 1
        print(f"TFLite: {path} ({os.path.getsize(path) / 1e6:.2f} MB)")
    return 0


def evaluate_saved_model(path, episodes, env=None, explore=False, seed=None):
    """Run `episodes` episodes with a policy exported by `rllib export` (same result keys as
    :func:`evaluate_checkpoint`; with `seed`, the same env resets)."""
    if episodes < 1:
        raise CliError(f"--episodes {episodes}: give at least 1.")
    if not os.path.isfile(os.path.join(path, "saved_model.pb")):
        raise CliError(f"--saved-model {path}: no saved_model.pb; give a `rllib export` directory.")
    metadata = read_metadata(path)
    env = env or metadata.get("env")
    if env is None:
        raise CliError(f"--saved-model {path}: it records no env; give --env ENV.")
    config = DreamerV3Config().environment(env, env_config=metadata.get("env_config", {}))
    try:
        environment = make_env(config)
    except ValueError as err:
        raise CliError(f"--saved-model {path}: could not create the env {env!r}: {err}") from None
    try:
        returns, lengths = run_saved_model(
            path, environment, episodes, greedy=not explore, seed=seed
        )
    finally:
        environment.close()
    return {
        "env": str(env),
        "episodes": episodes,
        "return_mean": float(np.mean(returns)),
        "return_min": float(np.min(returns)),
        "return_max": float(np.max(returns)),
        "length_mean": float(np.mean(lengths)),
    }


def _evaluate_command(args):
    start = time.time()
    if args.saved_model:
        if args.checkpoint or args.video_dir:
            raise CliError(
                "--saved-model evaluates an exported policy: give no checkpoint and no --video-dir."
            )
        result = evaluate_saved_model(
            args.saved_model, args.episodes, env=args.env, explore=args.explore, seed=args.seed
        )
    elif args.checkpoint is None:
        raise CliError("rllib evaluate needs a checkpoint directory (or --saved-model DIR).")
    else:
        result = evaluate_checkpoint(
            args.checkpoint,
            args.episodes,
            env=args.env,
            explore=args.explore,
            seed=args.seed,
            video_dir=args.video_dir,
        )
    if args.json:
        print(json.dumps(result))
    else:
        mode = "sampled" if args.explore else "greedy"
        print(
            f"{result['episodes']} {mode} episodes of {result['env']} (seed {args.seed}): "
            "return mean "
            f"{fmt(result['return_mean'])}, min {fmt(result['return_min'])}, max "
            f"{fmt(result['return_max'])}; length mean {fmt(result['length_mean'])} "
            f"({time.time() - start:.0f} s)"
        )
    if args.video_dir:
        print(f"videos in {os.path.abspath(args.video_dir)}")
    return 0
