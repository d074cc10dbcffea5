"""The `rllib` command: train RLlib-style YAML experiments with Ray Tune, evaluate checkpoints.

    rllib train file tuned_examples/cartpole.yaml [--stop '{training_iteration: 5}'] ...
    rllib train --env CartPole-v1 --config '{model_size: micro}' --stop '{training_iteration: 5}'
    rllib evaluate ~/ray_results/EXPERIMENT/TRIAL/checkpoint_000000 --episodes 10

Ray 2.60 installs no `rllib` command, so this package does; `rllib-dreamerv3` and
`python -m rllib_dreamerv3` are the same program under names nothing else claims.
"""

import argparse
import difflib
import importlib.metadata
import importlib.util
import json
import math
import numbers
import os
import pickle
import sys
import time

import ray
import yaml
from ray import tune
from ray.rllib.algorithms.algorithm_config import AlgorithmConfig
from ray.tune.utils import flatten_dict

from rllib_dreamerv3 import checkpoints
from rllib_dreamerv3.algorithm import DreamerV3
from rllib_dreamerv3.config import DreamerV3Config
from rllib_dreamerv3.env_runner import DreamerV3EnvRunner
from rllib_dreamerv3.progress import format_number as fmt
from rllib_dreamerv3.progress import progress_line

ALIAS = "rllib-dreamerv3"
ALGORITHMS = {"DreamerV3": DreamerV3}
EXPERIMENT_KEYS = (
    "env",
    "run",
    "stop",
    "config",
    "checkpoint_config",
    "num_samples",
    "storage_path",
)
CHECKPOINT_CONFIG_KEYS = (
    "checkpoint_frequency",
    "checkpoint_at_end",
    "num_to_keep",
    "checkpoint_score_attribute",
    "checkpoint_score_order",
)
_RLLIB_SUPPRESS_HINT = "\nTo suppress all validation errors"

# The result keys that `stop` criteria name, '/'-separated where nested (Tune flattens results).
# Top-level numbers every DreamerV3 iteration reports (Tune's, RLlib's and DreamerV3's counters):
# a stop key very close to one of them but not equal is a misspelling, caught before Ray starts.
TOP_LEVEL_RESULT_KEYS = (
    "training_iteration",
    "time_total_s",
    "time_this_iter_s",
    "time_since_restore",
    "iterations_since_restore",
    "timestamp",
    "num_env_steps_sampled_lifetime",
    "num_env_steps_trained_lifetime",
    "num_updates_lifetime",
    "num_training_step_calls_per_iteration",
    "training_ratio_achieved",
)
# Top-level groups of a DreamerV3 result: `env_runners/episode_return_mean` names a value inside.
RESULT_GROUPS = (
    "env_runners",
    "learners",
    "evaluation",
    "replay_buffer",
    "timers",
    "perf",
    "fault_tolerance",
    "env_runner_group",
    "dreams",
    "config",
)
# Result keys of RLlib's old API stack, which DreamerV3 (new API stack) never reports.
OLD_API_RESULT_KEYS = {
    "timesteps_total": "num_env_steps_sampled_lifetime",
    "num_env_steps_sampled": "num_env_steps_sampled_lifetime",
    "episodes_total": "env_runners/num_episodes_lifetime",
    "episode_reward_mean": "env_runners/episode_return_mean",
    "episode_reward_min": "env_runners/episode_return_min",
    "episode_reward_max": "env_runners/episode_return_max",
    "episode_len_mean": "env_runners/episode_len_mean",
    "sampler_results/episode_reward_mean": "env_runners/episode_return_mean",
    "env_runners/episode_reward_mean": "env_runners/episode_return_mean",
    "evaluation/episode_reward_mean": "evaluation/env_runners/episode_return_mean",
}
# Names in DreamerV3 results that only some iterations report: episode statistics once an
# episode has ended, evaluation results once evaluation has run, dream summaries every
# `dream_every_n_updates` updates, throughputs (any `*_throughput`) from the second report on,
# counters of rare events. A stop key naming one of them is waited for, never called misspelt.
LATE_RESULT_NAMES = frozenset(
    (
        "episode_return_mean",
        "episode_return_min",
        "episode_return_max",
        "episode_len_mean",
        "episode_len_min",
        "episode_len_max",
        "num_episodes",
        "num_episodes_lifetime",
        "evaluation",
        "dreams",
        "throughput_since_last_reduce",
        "throughput_since_last_restore",
        "evaluation_iteration",
        "restore_eval_env_runners",
        "synch_env_connectors",
        "actor_manager_num_outstanding_async_reqs",
        "num_healthy_workers",
        "num_env_runners_dropped_lifetime",
        "num_remote_worker_restarts",
        "num_nonfinite_env_steps_skipped",
        "num_sub_env_restarts",
    )
)
# How alike (difflib's ratio) a name must be to a known one to be called its misspelling: the
# static check, which sees no result, only flags near-identical names.
STATIC_TYPO_CUTOFF = 0.9
RESULT_TYPO_CUTOFF = 0.8
STOP_KEYS_HELP = (
    "Stop keys name numbers in the training results, '/'-separated where nested "
    "(e.g. training_iteration, num_env_steps_sampled_lifetime, "
    "env_runners/episode_return_mean); every result key is a column of a trial's "
    "progress.csv."
)


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

    `update_from_dict` would set any key silently, so a misspelt hyperparameter would be
    ignored; this is checked first.
    """
    known = known_config_keys()
    for key in config_dict:
        if AlgorithmConfig._translate_special_keys(key, warn_deprecated=False) not in known:
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
    import gymnasium as gym
    from ray.tune.registry import ENV_CREATOR, _global_registry

    unknown_id = (
        isinstance(env, str)
        and "." not in env
        and env not in gym.registry
        and not _global_registry.contains(ENV_CREATOR, env)
    )
    if unknown_id:
        return (
            f"env: {env!r} is neither a gymnasium id nor registered with "
            f"ray.tune.register_env.{_did_you_mean(env, gym.registry)} Use a gymnasium id "
            "(e.g. CartPole-v1), a module.Class path, or register the env in Python first."
        )
    return (
        f"env: {env!r} could not be created: {_one_paragraph(err.__cause__)[:500]} Check "
        "the env's name and its env_config."
    )


def check_stop(where, stop):
    """Raise a `CliError` for a stop criterion that cannot work, before Ray starts.

    Every value must be a number (Tune ends a trial once the result reaches it). Keys are checked
    only where DreamerV3's results are known without running it: old-API-stack names, groups
    named as values, and near-identical misspellings of the top-level keys. Any other key may be
    a metric of a later iteration or of a callback; `StopCriteria` checks it against the results.
    """
    for key, value in stop.items():
        if not isinstance(key, str):
            raise CliError(
                f"{where}: stop key {key!r} must be the name of a result, e.g. training_iteration."
            )
        if isinstance(value, dict):  # Tune compares flattened keys: `group/name`, not a mapping
            inner = next(iter(value), "episode_return_mean")
            raise CliError(
                f"{where}: stop: {key}: {value!r} is a mapping, not a number; write "
                f"nested result keys with slashes, e.g. `{key}/{inner}: 450`."
            )
        number = isinstance(value, numbers.Real) and not isinstance(value, bool)
        if not number or math.isnan(value):
            hint = ""
            if isinstance(value, str):
                try:
                    parsed = float(value)
                except ValueError:
                    parsed = math.nan
                if math.isfinite(parsed):  # YAML reads 1e5 (no dot) and "100" as strings
                    plain = int(parsed) if parsed.is_integer() else parsed
                    hint = (
                        f" YAML reads {value!r} as a string (a quoted number, or an exponent "
                        f"without a dot); write {plain!r}."
                    )
            raise CliError(
                f"{where}: stop: {key}: {value!r} is not a number. A stop criterion "
                f"ends training once the result {key!r} reaches its value, e.g. "
                f"`{key}: 100`.{hint}"
            )
        if key in OLD_API_RESULT_KEYS:
            raise CliError(
                f"{where}: stop key {key!r} is a result of RLlib's old API stack, "
                f"which DreamerV3 does not report; use "
                f"{OLD_API_RESULT_KEYS[key]!r}. {STOP_KEYS_HELP}"
            )
        first, _, rest = key.partition("/")
        if not rest and first in RESULT_GROUPS:
            raise CliError(
                f"{where}: stop key {key!r} is a group of results, not a number; "
                f"name one inside it, e.g. 'env_runners/episode_return_mean'. "
                f"{STOP_KEYS_HELP}"
            )
        if rest and first in TOP_LEVEL_RESULT_KEYS:
            raise CliError(
                f"{where}: stop key {key!r}: {first!r} is a number, not a group of "
                f"results; stop on {first!r} itself. {STOP_KEYS_HELP}"
            )
        known = TOP_LEVEL_RESULT_KEYS if not rest else RESULT_GROUPS
        close = first not in known and _closest(first, known, STATIC_TYPO_CUTOFF)
        if close:
            fix = f"{close}/{rest}" if rest else close
            raise CliError(
                f"{where}: unknown stop key {key!r}. Did you mean {fix!r}? {STOP_KEYS_HELP}"
            )


def check_experiment(source, name, spec):
    """Resolve one experiment into Tune's arguments, or raise a `CliError` naming source/key.

    Returns `(trainable, param_space, stop, checkpoint_config, num_samples, storage_path)`;
    `param_space` is the YAML's `config` (Tune search spaces kept) plus `env`.
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
    config = spec.get("config") or {}
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
    except ValueError as err:
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
    check_stop(where, stop)
    checkpoint_config = spec.get("checkpoint_config") or {}
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
    num_samples = spec.get("num_samples", 1)
    if not isinstance(num_samples, int) or isinstance(num_samples, bool) or num_samples < 1:
        raise CliError(f"{where}: num_samples={num_samples!r} must be a positive integer.")
    return run, param_space, stop, checkpoint_config, num_samples, spec.get("storage_path")


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
            spec["checkpoint_config"] = checkpoint_config
        if getattr(args, "num_samples", None) is not None:
            spec["num_samples"] = args.num_samples
        if getattr(args, "storage_path", None):
            spec["storage_path"] = args.storage_path
        out[name] = spec
    return out


# --- training with Tune ---------------------------------------------------------------------------
class ProgressLines(tune.Callback):
    """Print `progress_line` for every result Tune receives."""

    def on_trial_result(self, iteration, trials, trial, result, **info):
        print(progress_line(str(trial), result), flush=True)


def _names_below(flat_result, prefix):
    head = f"{prefix}/" if prefix else ""
    return {key[len(head) :].split("/")[0] for key in flat_result if key.startswith(head)}


def diagnose_stop_key(key, flat_result):
    """Why the stop key `key` is not in the flattened result `flat_result`.

    Returns `(True, message)` when the key cannot be right: it names a group, descends into a
    number, or has a misspelt name (one close to a name the result has at that level, and not a
    name DreamerV3 reports only in some iterations). Returns `(False, message)` for a name that is
    neither reported nor close to one (maybe a callback's metric that comes later), and `None`
    for a name that DreamerV3 reports only in some iterations (`LATE_RESULT_NAMES`, throughputs).
    """
    parts = key.split("/")
    for depth, name in enumerate(parts):
        prefix = "/".join(parts[:depth])
        if prefix in flat_result:
            return True, f"{prefix!r} is a number, not a group of results; stop on it itself."
        names = _names_below(flat_result, prefix)
        if name not in names:
            break
    else:  # every name exists, yet the key is no value: it is a group
        inside = min(
            (k for k in flat_result if k.startswith(f"{key}/")), key=lambda k: ("/_" in k, k)
        )  # not one of RLlib's `__all_modules__`
        return True, (
            f"it is a group of results, not a number; name one inside it, e.g. {inside!r}."
        )
    if name in LATE_RESULT_NAMES or name.endswith("_throughput"):
        return None
    close = _closest(name, names, RESULT_TYPO_CUTOFF)
    if close is None:
        return False, "and no result key is close to it"
    fix = "/".join([*parts[:depth], close, *parts[depth + 1 :]])
    if fix not in flat_result:  # later names may be misspelt too: the nearest key in that group
        group = "/".join([*parts[:depth], close])
        fix = _closest(
            fix, [k for k in flat_result if k == group or k.startswith(f"{group}/")], 0.0
        )
    return True, f"Did you mean {fix!r}?"


class StopCriteria(tune.Stopper):
    """Tune's `stop={key: threshold}` that also checks its keys against the results.

    A trial stops once a result reaches any threshold, as with a `stop` dict. In addition, every
    key is looked up in each result until it has been seen: a key that cannot be right (see
    `diagnose_stop_key`: a misspelling of a key the result has, a group) stops the whole
    experiment and is kept in `problem`, which `run_experiments` raises as a `CliError` once
    Tune has returned. A key that is merely absent is reported once and waited for.
    """

    def __init__(self, stop, where):
        self.stop = dict(stop)
        self.where = where
        self.problem = None
        self._seen = set()
        self._reported = set()

    def __call__(self, trial_id, result):
        flat = flatten_dict(result, delimiter="/")
        iteration = result.get("training_iteration", "?")
        for key in self.stop:
            if key in self._seen:
                continue
            if key in flat:
                self._seen.add(key)
                continue
            # Checked again at every result until the key appears: a misspelling of a late
            # name (episode returns, say) shows once that name is in the results.
            diagnosis = diagnose_stop_key(key, flat)
            if diagnosis is None:
                continue
            fatal, detail = diagnosis
            if fatal:
                self.problem = (
                    f"{self.where}: stop key {key!r} is not in the results of "
                    f"iteration {iteration}: {detail} {STOP_KEYS_HELP} Training "
                    "was stopped."
                )
                return True
            if key not in self._reported:
                self._reported.add(key)
                print(
                    f"{self.where}: warning: stop key {key!r} is not in the results of "
                    f"iteration {iteration} ({detail}); if it is never reported, only the "
                    "other stop keys or Ctrl-C end training.",
                    file=sys.stderr,
                    flush=True,
                )
        for key, threshold in self.stop.items():
            if key not in flat:
                continue
            try:
                if flat[key] >= threshold:
                    return True
            except (TypeError, ValueError):  # a string, or an array with several entries
                self.problem = (
                    f"{self.where}: stop key {key!r} is {flat[key]!r} in the "
                    f"results, not a number that can reach {threshold!r}. "
                    f"{STOP_KEYS_HELP} Training was stopped."
                )
                return True
        return False

    def stop_all(self):
        return self.problem is not None


def run_experiments(experiments, source, args):
    """Run every experiment with Tune, one after the other; 0 if every trial finished cleanly."""
    checked = {name: check_experiment(source, name, spec) for name, spec in experiments.items()}
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # inherited by Ray's worker processes
    ray.init(
        num_cpus=getattr(args, "num_cpus", None), include_dashboard=False, ignore_reinit_error=True
    )
    failed = 0
    for name, (run, param_space, stop, checkpoint_config, num_samples, storage) in checked.items():
        if not stop:
            print(
                f"{name}: no stop criterion, training runs until Ctrl-C (add "
                "--stop '{training_iteration: 10}').",
                flush=True,
            )
        stopper = StopCriteria(stop, f"{source}, experiment {name!r}") if stop else None
        tuner = tune.Tuner(
            run,
            param_space=param_space,
            tune_config=tune.TuneConfig(num_samples=num_samples),
            run_config=tune.RunConfig(
                name=name,
                stop=stopper,
                storage_path=storage and os.path.abspath(storage),
                checkpoint_config=tune.CheckpointConfig(**checkpoint_config),
                callbacks=[ProgressLines()],
                verbose=getattr(args, "verbose", 1),
            ),
        )
        results = tuner.fit()
        if stopper is not None and stopper.problem:  # Tune stopped cleanly; say why, exit 2
            raise CliError(stopper.problem)
        for result in results:
            label = os.path.basename(result.path)
            if result.error is not None:
                failed += 1
                last_line = (str(result.error).strip().splitlines() or [""])[-1]
                print(
                    f"{label}: FAILED ({type(result.error).__name__}: {last_line}). "
                    f"Full traceback: {os.path.join(result.path, 'error.txt')}",
                    file=sys.stderr,
                    flush=True,
                )
                continue
            checkpoint = result.checkpoint.path if result.checkpoint else None
            print(f"{label}: {progress_line('done,', result.metrics)}", flush=True)
            if checkpoint:
                print(
                    f"  checkpoint: {checkpoint}\n  evaluate:   rllib evaluate {checkpoint} "
                    "--episodes 10",
                    flush=True,
                )
        print(
            f"{name}: results in {results.experiment_path} (tensorboard --logdir "
            f"{results.experiment_path})",
            flush=True,
        )
    return 1 if failed else 0


# --- evaluation -----------------------------------------------------------------------------------
MODULE_STATE_DIR = os.path.join("learner_group", "learner", "rl_module", "default_policy")


def _checkpoint_candidates(path):
    found = []
    for root, dirs, files in os.walk(path):
        if "rllib_checkpoint.json" in files:
            found.append(root)
            dirs.clear()
    return sorted(found)


def load_checkpoint_config(path):
    """The `DreamerV3Config` saved in an Algorithm checkpoint, or a `CliError` that says why not."""
    if not os.path.exists(path):
        raise CliError(
            f"{path}: no such checkpoint directory. Give the checkpoint_NNNNNN "
            "directory printed at the end of `rllib train`, or the path of "
            "`algo.save_to_path()`."
        )
    if not os.path.isdir(path):
        raise CliError(f"{path}: is a file; a checkpoint is a directory (checkpoint_NNNNNN).")
    ctor_file = os.path.join(path, "class_and_ctor_args.pkl")
    checkpoints.recover_interrupted_save(path)
    try:  # the files evaluation reads: the config and the policy's weights
        checkpoints.verify(
            path, prefixes=("class_and_ctor_args.pkl", MODULE_STATE_DIR.replace(os.sep, "/"))
        )
    except checkpoints.CheckpointError as err:
        raise CliError(str(err)) from None
    if not os.path.isfile(ctor_file) or not os.path.isdir(os.path.join(path, MODULE_STATE_DIR)):
        candidates = _checkpoint_candidates(path)
        hint = (
            f" Checkpoints below it: {', '.join(candidates[-3:])}."
            if candidates
            else " Nothing below it looks like one either; was the run checkpointed "
            "(--checkpoint-freq, checkpoint_at_end)?"
        )
        raise CliError(
            f"{path}: not an RLlib Algorithm checkpoint (no class_and_ctor_args.pkl"
            f" and {MODULE_STATE_DIR}).{hint}"
        )
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
        try:
            runner.sample(num_episodes=episodes)
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
    parser.add_argument("--num-cpus", type=int, metavar="N", help="CPUs Ray may use (default: all)")
    parser.add_argument(
        "-v",
        "--verbose",
        type=int,
        choices=(0, 1, 2),
        help="Tune's own output: 0 none, 1 status table (default), 2 every "
        "result; a progress line per iteration is printed in any case",
    )


def build_parser(prog="rllib"):
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Train and evaluate DreamerV3 (rllib-dreamerv3) with RLlib and Ray Tune.",
        epilog=f"The same program runs as `{ALIAS}` and `python -m rllib_dreamerv3`.",
    )
    commands = parser.add_subparsers(dest="command", metavar="{train,evaluate}")
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
    evaluate.add_argument("checkpoint", help="a checkpoint directory (checkpoint_NNNNNN)")
    evaluate.add_argument("--episodes", type=int, default=10, help="episodes (default 10)")
    evaluate.add_argument("--env", help="evaluate on this env instead of the trained one")
    evaluate.add_argument(
        "--explore",
        action="store_true",
        help="sample actions as in training instead of greedy ones",
    )
    evaluate.add_argument("--seed", type=int, help="seed of the env resets and the policy")
    evaluate.add_argument(
        "--video-dir", metavar="DIR", help="write a video of every episode here (needs moviepy)"
    )
    evaluate.add_argument("--json", action="store_true", help="print the results as one JSON line")
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
        if args.command == "evaluate":
            return _evaluate_command(args)
        return _train_command(args, parser)
    except CliError as err:
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


def _evaluate_command(args):
    start = time.time()
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
            f"{result['episodes']} {mode} episodes of {result['env']}: return mean "
            f"{fmt(result['return_mean'])}, min {fmt(result['return_min'])}, max "
            f"{fmt(result['return_max'])}; length mean {fmt(result['length_mean'])} "
            f"({time.time() - start:.0f} s)"
        )
    if args.video_dir:
        print(f"videos in {os.path.abspath(args.video_dir)}")
    return 0
