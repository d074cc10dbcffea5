"""What a user sees while DreamerV3 trains: a progress line per iteration, a result summary.

`DreamerV3.train()` logs one line per iteration outside Ray Tune (env steps, updates, episode
return, losses, wall time; with the stop criteria known, an ETA). Under Tune, `ProgressLines`
(a Tune callback, used by the `rllib` command and the sweep example) prints the same line. The
lines go to the logger `rllib_dreamerv3.progress`: to stdout, or, once the process configures
logging (a handler on the root logger, e.g. `logging.basicConfig(filename=...)`), where that
configuration sends them; turn them off with `DreamerV3Config().training(log_progress=False)`
or by raising that logger's level.

Every DreamerV3 result also begins with `summary(result)`: the episode return and the three
losses as top-level numbers. Ray Tune's status table shows the first few top-level numbers of a
result as columns, so these are the ones it shows (next to the iteration and the time).
"""

import logging
import math
import sys

from ray import tune

# The learner-side metrics shown in the progress line, in this order.
PROGRESS_LOSSES = ("L_world_model", "L_actor", "L_critic")


class _StdoutHandler(logging.Handler):
    """Writes each record's message to the current `sys.stdout` (looked up per record, so that
    redirections made after import, e.g. by pytest or notebooks, are followed), unless logging
    is configured: where a handler of an ancestor logger (the root's, e.g. from
    `logging.basicConfig`) receives the record, that configuration decides where it goes."""

    def emit(self, record):
        if _configured(logging.getLogger(record.name)):
            return
        try:
            sys.stdout.write(self.format(record) + "\n")
            sys.stdout.flush()
        except Exception:  # noqa: BLE001 - logging must not raise into training
            self.handleError(record)


def _configured(log):
    """Whether a handler above `log` (not its own) receives what it logs."""
    while log.propagate and log.parent is not None:
        log = log.parent
        if log.handlers:
            return True
    return False


logger = logging.getLogger(__name__)
if not any(isinstance(handler, _StdoutHandler) for handler in logger.handlers):
    logger.addHandler(_StdoutHandler())
    logger.setLevel(logging.INFO)


def _nested(result, *keys):
    for key in keys:
        if not isinstance(result, dict) or key not in result:
            return None
        result = result[key]
    return result


def format_number(value, digits=4):
    """`value` with `digits` significant digits; "-" for None."""
    if value is None:
        return "-"
    value = float(value)
    return f"{value:.{digits}g}" if math.isfinite(value) else str(value)


# Result counters that only grow: a stop criterion on one of them has a predictable ETA.
COUNTERS = (
    "training_iteration",
    "num_env_steps_sampled_lifetime",
    "num_updates_lifetime",
    "time_total_s",
)


def summary(result):
    """The top-level summary DreamerV3 puts first in each result: `episode_return_mean` (of
    `env_runners`) and the losses in `PROGRESS_LOSSES` (of `learners/default_policy`); NaN
    where an iteration has none yet (no finished episode, no update)."""
    learner = _nested(result, "learners", "default_policy") or {}
    values = {"episode_return_mean": _nested(result, "env_runners", "episode_return_mean")}
    values.update((name, learner.get(name)) for name in PROGRESS_LOSSES)
    return {k: math.nan if v is None else float(v) for k, v in values.items()}


def _counter(result, key):
    if key == "num_env_steps_sampled_lifetime":
        return _nested(result, "env_runners", key) or result.get(key)
    return result.get(key)


def eta_seconds(result, stop):
    """Seconds until the first counter stop criterion in `stop` is reached, at the rate since
    the result's `eta_reference` (DreamerV3's results: the end of the first iteration with
    updates, so warm-up and compilation do not count; None until an iteration after it), or at
    the average rate so far for results without one. None when no stop key is a counter."""
    start = {"time_total_s": 0.0}
    if "eta_reference" in result:
        if result["eta_reference"] is None:
            return None
        start = result["eta_reference"]
    elapsed = (result.get("time_total_s") or 0.0) - start["time_total_s"]
    etas = []
    for key, threshold in (stop or {}).items():
        if key not in COUNTERS:
            continue
        value = _counter(result, key)
        done = None if value is None else value - start.get(key, 0)
        if not done or done <= 0 or elapsed <= 0:
            continue
        etas.append(max(0.0, (threshold - value) * elapsed / done))
    return min(etas) if etas else None


def format_duration(seconds):
    """`seconds` as "42 s", "7 min" or "2.5 h"."""
    if seconds < 100:
        return f"{seconds:.0f} s"
    if seconds < 6000:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _episode_return(result):
    value = _nested(result, "env_runners", "episode_return_mean")
    # NaN: no episode has ended in the metrics window yet
    return "-" if value is None or math.isnan(value) else format_number(value)


def progress_line(trial_name, result, stop=None):
    """One line per training iteration: env steps, return, losses, wall time, and the ETA to
    the nearest counter criterion of `stop` (e.g. `{"num_env_steps_sampled_lifetime": 1e5}`)."""
    learner = _nested(result, "learners", "default_policy") or {}
    parts = [
        f"{trial_name} iter {result.get('training_iteration', '?')}",
        f"env steps {int(_nested(result, 'env_runners', 'num_env_steps_sampled_lifetime') or 0)}",
        f"updates {int(result.get('num_updates_lifetime') or 0)}",
        f"return {_episode_return(result)}",
    ]
    evaluation = _nested(result, "evaluation", "env_runners", "episode_return_mean")
    if evaluation is not None:
        parts.append(f"eval return {format_number(evaluation)}")
    parts.append(" ".join(f"{k} {format_number(learner.get(k))}" for k in PROGRESS_LOSSES))
    parts.append(f"{result.get('time_total_s', 0.0):.0f} s")
    eta = eta_seconds(result, stop)
    if eta is not None:
        parts.append(f"ETA {format_duration(eta)}")
    checkpoint = result.get("next_checkpoint_s")
    if checkpoint is not None:
        parts.append(
            f"checkpoint {'now' if checkpoint <= 0 else 'in ' + format_duration(checkpoint)}"
        )
    return " | ".join(parts)


def log_progress(result, name="DreamerV3", stop=None):
    """Log :func:`progress_line` of `result` at INFO level."""
    logger.info("%s", progress_line(name, result, stop))


def _sampled(trial):
    """The values Tune chose for a trial of a search, as " (training_ratio=256,lr=0.001)" (its
    `experiment_tag` after the trial's index); "" for a trial without any."""
    tag = str(getattr(trial, "experiment_tag", "") or "")
    values = tag.split("_", 1)[-1]
    return f" ({values})" if "=" in values else ""


class ProgressLines(tune.Callback):
    """A Ray Tune callback that prints :func:`progress_line` for every result Tune receives:
    `tune.RunConfig(callbacks=[ProgressLines(stop)])`; with the run's `stop` dict, the line
    also shows the ETA. When a DreamerV3 trial starts it says what comes before the first
    result (the warm-up and the first compile) and, in a search, the values of its parameters."""

    def __init__(self, stop=None):
        self.stop = stop if isinstance(stop, dict) else None

    def on_trial_start(self, iteration, trials, trial, **info):
        if not str(getattr(trial, "trainable_name", "")).startswith("DreamerV3"):
            return
        config = trial.config if isinstance(trial.config, dict) else {}
        warmup = config.get("num_steps_sampled_before_learning_starts", 1024)
        print(
            f"{trial}{_sampled(trial)}: started: {warmup} warm-up env steps of random actions, "
            "then XLA compiles the update (a minute or more on a CPU) before the first result.",
            flush=True,
        )

    def on_trial_result(self, iteration, trials, trial, result, **info):
        print(progress_line(str(trial), result, self.stop), flush=True)
