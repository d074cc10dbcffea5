"""Stop criteria checked against DreamerV3's results, with the fix for a misspelt key.

Ray Tune ends a trial once a result reaches any threshold of `stop={key: value}`, and waits
forever for a key that no result has. `check_stop` rejects the criteria that cannot work before
anything runs (values that are not numbers, RLlib's old API names, groups named as values,
near-identical misspellings); `StopCriteria` is Tune's stop dict as a `tune.Stopper` that also
checks its keys against each result and stops the experiment, with the reason in `problem`,
when a key cannot be right:

    stopper = StopCriteria({"env_runners/episode_return_mean": 450}, "my experiment")
    tune.Tuner(DreamerV3, ..., run_config=tune.RunConfig(stop=stopper)).fit()
    if stopper.problem:
        raise ValueError(stopper.problem)
"""

import difflib
import math
import numbers
import sys

from ray import tune
from ray.tune.utils import flatten_dict

from rllib_dreamerv3.progress import PROGRESS_LOSSES


class StopCriteriaError(ValueError):
    """Stop criteria that cannot work; the message names the key and the fix."""


# The result keys that `stop` criteria name, '/'-separated where nested (Tune flattens results).
# Top-level numbers every DreamerV3 iteration reports (Tune's, RLlib's and DreamerV3's counters):
# a stop key very close to one of them but not equal is a misspelling, caught before Ray starts.
TOP_LEVEL_RESULT_KEYS = (
    "episode_return_mean",
    *PROGRESS_LOSSES,
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


def _closest(word, choices, cutoff):
    """The choice most like `word` (difflib's ratio at least `cutoff`), or None."""
    close = difflib.get_close_matches(word, sorted(choices), n=1, cutoff=cutoff)
    return close[0] if close else None


def check_stop(where, stop):
    """Raise a `StopCriteriaError` for a stop criterion that cannot work, before Ray starts.

    Every value must be a number (Tune ends a trial once the result reaches it). Keys are checked
    only where DreamerV3's results are known without running it: old-API-stack names, groups
    named as values, and near-identical misspellings of the top-level keys. Any other key may be
    a metric of a later iteration or of a callback; `StopCriteria` checks it against the results.
    """
    for key, value in stop.items():
        if not isinstance(key, str):
            raise StopCriteriaError(
                f"{where}: stop key {key!r} must be the name of a result, e.g. training_iteration."
            )
        if isinstance(value, dict):  # Tune compares flattened keys: `group/name`, not a mapping
            inner = next(iter(value), "episode_return_mean")
            raise StopCriteriaError(
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
            raise StopCriteriaError(
                f"{where}: stop: {key}: {value!r} is not a number. A stop criterion "
                f"ends training once the result {key!r} reaches its value, e.g. "
                f"`{key}: 100`.{hint}"
            )
        if key in OLD_API_RESULT_KEYS:
            raise StopCriteriaError(
                f"{where}: stop key {key!r} is a result of RLlib's old API stack, "
                f"which DreamerV3 does not report; use "
                f"{OLD_API_RESULT_KEYS[key]!r}. {STOP_KEYS_HELP}"
            )
        first, _, rest = key.partition("/")
        if not rest and first in RESULT_GROUPS:
            raise StopCriteriaError(
                f"{where}: stop key {key!r} is a group of results, not a number; "
                f"name one inside it, e.g. 'env_runners/episode_return_mean'. "
                f"{STOP_KEYS_HELP}"
            )
        if rest and first in TOP_LEVEL_RESULT_KEYS:
            raise StopCriteriaError(
                f"{where}: stop key {key!r}: {first!r} is a number, not a group of "
                f"results; stop on {first!r} itself. {STOP_KEYS_HELP}"
            )
        known = TOP_LEVEL_RESULT_KEYS if not rest else RESULT_GROUPS
        close = first not in known and _closest(first, known, STATIC_TYPO_CUTOFF)
        if close:
            fix = f"{close}/{rest}" if rest else close
            raise StopCriteriaError(
                f"{where}: unknown stop key {key!r}. Did you mean {fix!r}? {STOP_KEYS_HELP}"
            )


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
    experiment and is kept in `problem` (the `rllib` command raises it once Tune has returned).
    A key that is merely absent is reported once (on stderr) and waited for. `where` names the
    criteria's source in the messages; `check_stop` runs on construction.
    """

    def __init__(self, stop, where="stop"):
        check_stop(where, stop)
        self.stop = dict(stop)
        self.where = where
        self.problem = None
        self._seen = set()
        self._reported = set()

    def __deepcopy__(self, memo):
        # `tune.Experiment.from_json` deep-copies its spec; `problem` is read off this object.
        return self

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
