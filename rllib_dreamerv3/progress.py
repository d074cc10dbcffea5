"""One progress line per training iteration: env steps, updates, return, losses, wall time.

`DreamerV3.train()` logs it outside Ray Tune (under Tune, the `rllib train` CLI prints the same
line from a Tune callback). The lines go to the logger `rllib_dreamerv3.progress`, which writes
them to stdout unless configured otherwise; turn them off with
`DreamerV3Config().training(log_progress=False)` or by raising that logger's level.
"""

import logging
import math
import sys

# The learner-side metrics shown in the progress line, in this order.
PROGRESS_LOSSES = ("L_world_model", "L_actor", "L_critic")


class _StdoutHandler(logging.Handler):
    """Writes each record's message to the current `sys.stdout` (looked up per record, so that
    redirections made after import, e.g. by pytest or notebooks, are followed)."""

    def emit(self, record):
        try:
            sys.stdout.write(self.format(record) + "\n")
            sys.stdout.flush()
        except Exception:  # noqa: BLE001 - logging must not raise into training
            self.handleError(record)


logger = logging.getLogger(__name__)
if not logger.handlers:
    logger.addHandler(_StdoutHandler())
    logger.setLevel(logging.INFO)
    logger.propagate = False  # the line is printed once, also where the root logger prints


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


def progress_line(trial_name, result):
    """One line per training iteration: env steps, return, losses, wall time."""
    learner = _nested(result, "learners", "default_policy") or {}
    parts = [
        f"{trial_name} iter {result.get('training_iteration', '?')}",
        f"env steps {int(_nested(result, 'env_runners', 'num_env_steps_sampled_lifetime') or 0)}",
        f"updates {int(result.get('num_updates_lifetime') or 0)}",
        f"return {format_number(_nested(result, 'env_runners', 'episode_return_mean'))}",
    ]
    evaluation = _nested(result, "evaluation", "env_runners", "episode_return_mean")
    if evaluation is not None:
        parts.append(f"eval return {format_number(evaluation)}")
    parts.append(" ".join(f"{k} {format_number(learner.get(k))}" for k in PROGRESS_LOSSES))
    parts.append(f"{result.get('time_total_s', 0.0):.0f} s")
    return " | ".join(parts)


def log_progress(result, name="DreamerV3"):
    """Log :func:`progress_line` of `result` at INFO level."""
    logger.info("%s", progress_line(name, result))
