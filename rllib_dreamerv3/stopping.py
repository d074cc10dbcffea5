"""Stop criteria checked against the keys of the first result, with the fix for a misspelt key.

Ray Tune ends a trial once a result reaches any threshold of `stop={key: value}`, and waits
forever for a key that no result has. `StopCriteria` is that stop dict as a `tune.Stopper`: its
values are checked when it is made, its keys against the first result (and RLlib's metric names,
for what RLlib reports only later, such as episode returns). A key that cannot be right stops the
experiment, with the reason and the closest key of the result in `problem`:

    stopper = StopCriteria({"env_runners/episode_return_mean": 450}, "my experiment")
    tune.run(DreamerV3, config=..., stop=stopper)
    if stopper.problem:
        raise ValueError(stopper.problem)
"""

import difflib
import math
import numbers
import sys

from ray import tune
from ray.rllib.utils import metrics
from ray.tune.result import AUTO_RESULT_KEYS
from ray.tune.utils import flatten_dict

# The names RLlib's results use (`ray.rllib.utils.metrics`): a stop key naming one that the first
# result lacks (episode statistics before an episode has ended, evaluation) is waited for.
RLLIB_NAMES = frozenset(v for k, v in vars(metrics).items() if k.isupper() and isinstance(v, str))
# Result names of RLlib's old API stack (still in old tutorials), which DreamerV3 never reports.
OLD_API_NAMES = {
    "timesteps_total": "num_env_steps_sampled_lifetime",
    "episode_reward_mean": "env_runners/episode_return_mean",
}
# What a stop key's first name can be without any result: RLlib's names and those Tune adds.
KNOWN_FIRST_NAMES = (RLLIB_NAMES | frozenset(AUTO_RESULT_KEYS)) - set(OLD_API_NAMES)
TYPO_CUTOFF = 0.8  # difflib's ratio from which a name is called a misspelling of another
# Before any result, only near-identical names are called misspelt: a user's own top-level
# metric must not be refused for resembling one of RLlib's hundreds of names.
STATIC_TYPO_CUTOFF = 0.9
STOP_KEYS_HELP = (
    "Stop keys name numbers in the training results, '/'-separated where nested "
    "(e.g. training_iteration, num_env_steps_sampled_lifetime, "
    "env_runners/episode_return_mean); every result key is a column of a trial's "
    "progress.csv."
)


class StopCriteriaError(ValueError):
    """Stop criteria that cannot work; the message names the key and the fix."""


def closest(word, choices, cutoff):
    """The choice most like `word` (difflib's ratio at least `cutoff`), or None."""
    close = difflib.get_close_matches(word, sorted(choices), n=1, cutoff=cutoff)
    return close[0] if close else None


def misspelt_first_name(key):
    """Why the stop key `key` cannot be right, as far as names alone tell (an old-API name, a
    misspelling of RLlib's or Tune's names), or None."""
    first, *rest = key.split("/")
    if first in OLD_API_NAMES:
        return (
            f"is a result of RLlib's old API stack, which DreamerV3 does not report; "
            f"use {OLD_API_NAMES[first]!r}."
        )
    known = first in KNOWN_FIRST_NAMES
    close = None if known else closest(first, KNOWN_FIRST_NAMES, STATIC_TYPO_CUTOFF)
    return f"is not a result name. Did you mean {'/'.join([close, *rest])!r}?" if close else None


def check_stop(where, stop):
    """Raise a `StopCriteriaError`, before Ray starts, for a stop value that is not a number or
    a key that names alone show to be wrong (the rest waits for the first result)."""
    for key, value in stop.items():
        if not isinstance(key, str):
            raise StopCriteriaError(
                f"{where}: stop key {key!r} must be the name of a result, e.g. training_iteration."
            )
        problem = misspelt_first_name(key)
        if problem:
            raise StopCriteriaError(f"{where}: stop key {key!r} {problem} {STOP_KEYS_HELP}")
        if isinstance(value, dict):  # Tune compares flattened keys: `group/name`, not a mapping
            inner = next(iter(value), "episode_return_mean")
            raise StopCriteriaError(
                f"{where}: stop: {key}: {value!r} is a mapping, not a number; write "
                f"nested result keys with slashes, e.g. `{key}/{inner}: 450`."
            )
        if not isinstance(value, numbers.Real) or isinstance(value, bool) or math.isnan(value):
            hint = ""
            try:  # YAML reads 1e5 (no dot) and "100" as strings
                parsed = float(value) if isinstance(value, str) else math.nan
            except ValueError:
                parsed = math.nan
            if math.isfinite(parsed):
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


def diagnose_stop_key(key, flat_result):
    """Why the stop key `key` is not in the flattened result `flat_result`: `(True, message)`
    when it cannot be right (a group, a name below a number, a misspelling of a name the result
    or RLlib has), `(False, message)` for an unknown name not close to any (a callback's metric,
    maybe), None for a name of RLlib's that this result does not have yet."""
    parts = key.split("/")
    for depth, name in enumerate(parts):
        prefix = "/".join(parts[:depth])
        if prefix in flat_result:
            return (
                True,
                f"{prefix!r} is a number, not a group of results; stop on {prefix!r} itself.",
            )
        head = f"{prefix}/" if prefix else ""
        names = {k[len(head) :].split("/")[0] for k in flat_result if k.startswith(head)}
        if name not in names:
            break
    else:  # every name exists, yet the key is no value: it is a group
        inside = min(  # not one of RLlib's `__all_modules__`
            (k for k in flat_result if k.startswith(f"{key}/")), key=lambda k: ("/_" in k, k)
        )
        return True, f"it is a group of results, not a number; name one inside it, e.g. {inside!r}."
    if name in RLLIB_NAMES:
        return None
    close = closest(name, names | RLLIB_NAMES, TYPO_CUTOFF)
    if close is None:
        return False, "and no result key is close to it"
    fix = "/".join([*parts[:depth], close, *parts[depth + 1 :]])
    if fix not in flat_result and not set(parts[depth + 1 :]) <= RLLIB_NAMES:
        group = "/".join([*parts[:depth], close])  # later names misspelt too: the nearest key
        fix = closest(fix, [k for k in flat_result if k.startswith(f"{group}/")], 0.0) or fix
    return True, f"Did you mean {fix!r}?"


class StopCriteria(tune.Stopper):
    """Tune's `stop={key: threshold}` whose keys are checked against the first result.

    A trial stops once a result reaches any threshold. A key that cannot be right (see
    `diagnose_stop_key`) stops the whole experiment and is kept in `problem` (the `rllib`
    command raises it once Tune has returned); one that is merely absent is reported on stderr
    and waited for. `where` names the criteria's source in the messages.
    """

    def __init__(self, stop, where="stop"):
        check_stop(where, stop)
        self.stop, self.where, self.problem, self._checked = dict(stop), where, None, False

    def __deepcopy__(self, memo):
        # `tune.Experiment.from_json` deep-copies its spec; `problem` is read off this object.
        return self

    def _fail(self, message):
        self.problem = f"{self.where}: stop key {message} {STOP_KEYS_HELP} Training was stopped."
        return True

    def __call__(self, trial_id, result):
        flat = flatten_dict(result, delimiter="/")
        iteration = result.get("training_iteration", "?")
        for key in [] if self._checked else self.stop:
            diagnosis = None if key in flat else diagnose_stop_key(key, flat)
            if diagnosis and diagnosis[0]:
                return self._fail(
                    f"{key!r} is not in the results of iteration {iteration}: {diagnosis[1]}"
                )
            if diagnosis:
                print(
                    f"{self.where}: warning: stop key {key!r} is not in the results of "
                    f"iteration {iteration} ({diagnosis[1]}); if it is never reported, only the "
                    "other stop keys or Ctrl-C end training.",
                    file=sys.stderr,
                    flush=True,
                )
        self._checked = True
        for key, threshold in self.stop.items():
            try:
                if key in flat and flat[key] >= threshold:
                    return True
            except (TypeError, ValueError):  # a string, or an array with several entries
                return self._fail(
                    f"{key!r} is {flat[key]!r} in the results, not a number that can reach "
                    f"{threshold!r}."
                )
        return False

    def stop_all(self):
        return self.problem is not None
