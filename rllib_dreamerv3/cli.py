"""The `rllib` command: train RLlib-style YAML experiments with Ray Tune's own runner.

    rllib train file tuned_examples/cartpole.yaml [--stop '{training_iteration: 5}'] ...
    rllib train --env CartPole-v1 --config '{model_size: micro}' --stop '{training_iteration: 5}'
    rllib evaluate ~/ray_results/EXPERIMENT/TRIAL/checkpoint_000000 --episodes 10

A YAML file is what `tune.run_experiments` reads: its experiments are checked here first, so a
misspelt key or a bad value is named before Ray starts, then `tune.Experiment.from_json` makes
them. `rllib evaluate` and `rllib export` live in `rllib_dreamerv3.evaluate`. Ray 2.60 installs
no `rllib` command, so this package does; `rllib-dreamerv3` and `python -m rllib_dreamerv3` are
the same program under names nothing else claims.
"""

import argparse
import dataclasses
import glob
import importlib.metadata
import logging
import os
import sys

import ray
import yaml
from ray import tune

from rllib_dreamerv3.algorithm import NEXT_CHECKPOINT_S, DreamerV3
from rllib_dreamerv3.config import DreamerV3Config
from rllib_dreamerv3.evaluate import (  # noqa: F401 - load_checkpoint_config, as cli's before
    MODULE_STATE_DIR,
    CliError,
    add_commands,
    evaluate_command,
    export_command,
    load_checkpoint_config,
)
from rllib_dreamerv3.progress import PROGRESS_LOSSES, ProgressLines, format_duration, progress_line
from rllib_dreamerv3.stopping import StopCriteria, StopCriteriaError, closest
from rllib_dreamerv3.tf_rllib.compat import drop_messages

ALIAS = "rllib-dreamerv3"
ALGORITHMS = {"DreamerV3": DreamerV3}
# An experiment is what `tune.Experiment.from_json` reads: `run`, RLlib's `env` (moved into
# `config`) and these arguments of `tune.Experiment`. Not its others: DreamerV3 requests its own
# resources (`resources_per_trial` would fail), `time_budget_s` is `stop: {time_total_s: N}`.
EXPERIMENT_KEYS = tuple(
    "run env stop config checkpoint_config num_samples storage_path max_failures".split()
)
CHECKPOINT_CONFIG_KEYS = tuple(
    f.name for f in dataclasses.fields(tune.CheckpointConfig) if not f.name.startswith("_")
)
_RLLIB_SUPPRESS_HINT = "\nTo suppress all validation errors"
# Checkpoints kept per trial unless checkpoint_config says otherwise (Tune deletes older ones).
DEFAULT_NUM_TO_KEEP = 3
TUNE_INTERRUPT_NOTICES = ("Stop signal received", "Experiment has been interrupted")


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


def _did_you_mean(word, choices):
    close = closest(str(word), [c for c in choices if not c.startswith("_")], 0.6)
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


def _versioned(env, where):
    """A gymnasium id given without its version (`CartPole`) as its latest version's id,
    said on stderr (gymnasium would pick it too, with two warnings); any other env as given."""
    from gymnasium.envs import registration

    if not isinstance(env, str) or env in registration.registry:
        return env
    try:
        namespace, name, version = registration.parse_env_id(env)
    except Exception:  # noqa: BLE001 - not an id gymnasium can parse: checked as it is later
        return env
    latest = registration.find_highest_version(namespace, name) if version is None else None
    if latest is None:
        return env
    versioned = registration.get_env_id(namespace, name, latest)
    print(f"{where}: env {env!r} names no version; using {versioned!r}.", file=sys.stderr)
    return versioned


def _blame(where, keys, from_command_line):
    """`where`, or the --config option if it gave one of `keys` (the keys a problem names)."""
    given = [key for key in from_command_line if key in keys]
    return f"--config {given[0]}=..., applied to {where}" if given else where


def _checked_config_keys(where, config, from_command_line=()):
    """The experiment's `config`, a `CliError` unless it maps known config keys."""
    if not isinstance(config, dict):
        raise CliError(
            f"{where}: config must be a mapping of config keys to values, found "
            f"{type(config).__name__}."
        )
    key = unknown_config_key(config)
    if key is not None:
        where = _blame(where, [key], from_command_line)
        raise CliError(
            f"{where}: unknown config key {key!r}.{_did_you_mean(key, known_config_keys())} "
            "DreamerV3's hyperparameters are the names in HYPERPARAMETERS "
            "(rllib_dreamerv3/algorithm.py); any other key must be an AlgorithmConfig setting "
            "(e.g. num_env_runners, gamma)."
        )
    return config


def _check_checkpoint_config(where, checkpoint_config):
    """A `CliError` unless `checkpoint_config` makes a `tune.CheckpointConfig`."""
    if not isinstance(checkpoint_config, dict):
        raise CliError(
            f"{where}: checkpoint_config must be a mapping, e.g. "
            "{checkpoint_frequency: 10, checkpoint_at_end: true}."
        )
    try:
        tune.CheckpointConfig(**checkpoint_config)
    except TypeError:  # an unexpected keyword argument
        key = next(k for k in checkpoint_config if k not in CHECKPOINT_CONFIG_KEYS)
        raise CliError(
            f"{where}: unknown checkpoint_config key {key!r}."
            f"{_did_you_mean(key, CHECKPOINT_CONFIG_KEYS)} Use {list(CHECKPOINT_CONFIG_KEYS)}"
            " (ray.tune.CheckpointConfig)."
        ) from None
    except ValueError as err:
        raise CliError(f"{where}: checkpoint_config: {_one_paragraph(err)}") from None


def check_experiment(source, name, spec, from_command_line=()):
    """One experiment checked, as the spec `tune.Experiment.from_json` reads (see
    :func:`make_experiment`), or a `CliError` naming the source and the key, raised before Ray
    starts; a problem with a config key in `from_command_line` (given by --config) is blamed on
    --config.

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
    config = _checked_config_keys(where, spec.get("config") or {}, from_command_line)
    env = _versioned(spec.get("env", config.get("env")), where)
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
        where = _blame(where, [k for k in from_command_line if k in message], from_command_line)
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
    given = vars(args)  # only the options given (argparse.SUPPRESS)
    config = _parse_mapping(args.config, "--config") if "config" in given else {}
    top = {k: given[k] for k in ("num_samples", "max_failures", "storage_path") if k in given}
    if "stop" in given:
        top["stop"] = _parse_mapping(args.stop, "--stop")
    if "env" in given:
        top["env"] = args.env
    checkpoint = {"checkpoint_frequency": given.get("checkpoint_freq")}
    checkpoint["checkpoint_at_end"] = given.get("checkpoint_at_end")
    out = {}
    for name, spec in experiments.items():
        spec = {**spec, **top}
        if isinstance(spec.get("config") or {}, dict):  # else check_experiment says what's wrong
            spec["config"] = {**(spec.get("config") or {}), **config}
            if "env" in given:
                spec["config"].pop("env", None)
        if isinstance(spec.get("checkpoint_config") or {}, dict):
            spec["checkpoint_config"] = {
                "checkpoint_at_end": True,
                "num_to_keep": DEFAULT_NUM_TO_KEEP,
                **(spec.get("checkpoint_config") or {}),
                **{k: v for k, v in checkpoint.items() if v is not None},
            }
        out[name] = spec
    return out


# --- training with Tune ---------------------------------------------------------------------------
# `--resume`: unfinished trials (a killed run leaves them RUNNING) and errored ones continue from
# their latest checkpoint; finished ones are kept as they are.
RESUME = tune.ResumeConfig(
    unfinished=tune.ResumeConfig.ResumeType.RESUME,
    errored=tune.ResumeConfig.ResumeType.RESUME,
)


def run_experiments(experiments, source, args):
    """Run the experiments with `tune.run_experiments`, one after the other (each with its own
    stop criteria, checkpoints and directory); 0 if every trial finished cleanly, 1 if one
    failed, 130 if interrupted."""
    cli_keys = list(_parse_mapping(args.config, "--config")) if "config" in vars(args) else []
    checked = {
        name: check_experiment(source, name, spec, cli_keys) for name, spec in experiments.items()
    }
    todo = [
        make_experiment(name, spec, f"{source}, experiment {name!r}")
        for name, spec in checked.items()
    ]
    resume = getattr(args, "resume", None)
    for experiment in todo:
        _check_resume(experiment, resume, source)
    # Tune's classic output engine: it prints nothing at verbose=0 and takes a `CLIReporter`
    # with chosen columns (the default engine prints its banners at any verbosity).
    os.environ["RAY_AIR_NEW_OUTPUT"] = "0"
    # At Ctrl-C Tune advises `tune.run_experiments(..., resume=True)`; the CLI's own line gives
    # the command that resumes (`--resume`).
    drop_messages("ray.tune.tune", TUNE_INTERRUPT_NOTICES)
    verbose = getattr(args, "verbose", 0)
    ray.init(
        num_cpus=getattr(args, "num_cpus", None),
        include_dashboard=False,
        ignore_reinit_error=True,
        logging_level=logging.INFO if verbose else logging.WARNING,
    )
    run = TrainLines(todo)
    tune.run_experiments(
        todo,
        verbose=verbose,
        progress_reporter=status_table({k: v for e in todo for k, v in e.spec["config"].items()}),
        resume_config=RESUME if resume else None,
        raise_on_failed_trial=False,
        concurrent=False,  # a run of all at once would take the first one's stop and checkpoints
        callbacks=[run],
    )
    return 1 if run.failed else 0


class TrainLines(ProgressLines):
    """The progress lines, and per experiment where it writes, when it checkpoints and how its
    trials ended; after an interrupt or a wrong stop key no further experiment starts."""

    def __init__(self, experiments):
        super().__init__()
        self.todo, self.failed = iter(experiments), False

    def setup(self, **info):  # Tune starts the next experiment
        self.experiment = experiment = next(self.todo)
        name, path = experiment.storage.experiment_dir_name, experiment.storage.experiment_fs_path
        self.stop = experiment.stopper and experiment.stopper.stop
        print(f"{name}: results in {path}; watch with: tensorboard --logdir {path}", flush=True)
        print(f"{name}: {_checkpoint_plan(experiment)}", flush=True)
        if experiment.stopper is None:
            print(
                f"{name}: no stop criterion, training runs until Ctrl-C (add "
                "--stop '{training_iteration: 10}').",
                flush=True,
            )

    def on_experiment_end(self, trials, **info):
        stopper, storage = self.experiment.stopper, self.experiment.storage
        if stopper is not None and stopper.problem:  # Tune stopped cleanly; say why, exit 2
            raise CliError(stopper.problem)
        ends = [_report_trial(trial) for trial in trials]
        if "interrupted" in ends:  # Tune handled Ctrl-C: no further experiments
            print(
                f"{storage.experiment_dir_name}: interrupted; results so far in "
                f"{storage.experiment_fs_path}. Continue with the same command and --resume.",
                file=sys.stderr,
            )
            raise KeyboardInterrupt
        self.failed = self.failed or "failed" in ends


def _check_resume(experiment, resume, source):
    """`--resume` needs an experiment to continue; a run without it over unfinished trials is
    refused with the command that continues them (`--no-resume` starts new trials beside)."""
    name, path = experiment.storage.experiment_dir_name, experiment.storage.experiment_fs_path
    if resume and not os.path.isdir(path):
        raise CliError(
            f"{name}: --resume, but {path} holds no experiment to continue. Run without "
            "--resume to start it (or give the --storage-path of the first run)."
        )
    # `tune.run_experiments` leaves an `experiment_state-<time>.json` per run in the directory
    # (no `tuner.pkl`: `Tuner.can_restore` is False for it).
    if resume is not None or not glob.glob(os.path.join(path, "experiment_state-*.json")):
        return
    try:
        trials = tune.ExperimentAnalysis(path).trials
    except Exception:  # noqa: BLE001 - an unreadable state: Tune itself says more on resume
        return
    unfinished = [f"{t.trial_id} ({t.status})" for t in trials if t.status != "TERMINATED"]
    if unfinished:
        again = (
            f"`rllib train file {source} --resume` (same options)"
            if source.endswith((".yaml", ".yml"))
            else "the same command and --resume"
        )
        raise CliError(
            f"{name}: {path} holds trials that did not finish: {', '.join(unfinished[:5])}. "
            f"Continue them from their latest checkpoints with {again}, or start new trials "
            "beside them with --no-resume."
        )


def _checkpoint_plan(experiment):
    """One sentence on when this experiment checkpoints and how many checkpoints it keeps."""
    interval = _first_variant(experiment.spec["config"].get("checkpoint_interval_s", 900.0))
    keep = experiment.checkpoint_config.num_to_keep
    every = f"every {format_duration(interval)} of training" if interval else "never"
    kept = f"the last {keep} kept" if keep else "all kept"
    return (
        f"checkpoints {every} (checkpoint_interval_s) and at the end; {kept} "
        "(checkpoint_config: {num_to_keep: N})."
    )


def status_table(param_space):
    """Tune's status table for DreamerV3 trials: return, losses and env steps, and only the
    swept parameters (the `grid_search`/search-space entries of `param_space`)."""
    return tune.CLIReporter(
        metric_columns={
            "num_env_steps_sampled_lifetime": "env steps",
            "episode_return_mean": "return",
            **{name: name for name in PROGRESS_LOSSES},
        },
        parameter_columns=[k for k, v in param_space.items() if _first_variant(v) is not v],
        max_report_frequency=30,
    )


def _report_trial(trial):
    """Print how `trial` ended (its checkpoint and how to evaluate it); "done", "failed" or
    "interrupted"."""
    if trial.status == trial.ERROR:
        last_line = ""
        if trial.error_file and os.path.isfile(trial.error_file):
            with open(trial.error_file) as f:
                last_line = ([""] + f.read().strip().splitlines())[-1]
        where = trial.error_file or "the trial's directory"
        print(
            f"{trial}: FAILED after {trial.last_result.get('training_iteration', 0)} iterations "
            f"({last_line or 'see the traceback'}). Full traceback: {where}",
            file=sys.stderr,
            flush=True,
        )
        return "failed"
    # Tune marks a trial that met its stop criteria `done` in its last result; a trial it
    # stopped at Ctrl-C ends TERMINATED too, without that mark.
    ended = trial.status == trial.TERMINATED and trial.last_result.get("done", False)
    if trial.status != trial.TERMINATED:
        label = f"stopped ({trial.status}),"
    else:
        label = "done," if ended else "interrupted,"
    last = {k: v for k, v in trial.last_result.items() if k != NEXT_CHECKPOINT_S}
    print(f"{trial}: {progress_line(label, last)}", flush=True)
    if trial.checkpoint is not None:
        path = trial.checkpoint.path
        print(
            f"  checkpoint: {path}\n  evaluate:   rllib evaluate {path} --episodes 10", flush=True
        )
    return "done" if ended else "interrupted"


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
    add_commands(commands)
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
            return export_command(args)
        if args.command == "evaluate":
            return evaluate_command(args)
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
