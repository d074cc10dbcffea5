"""The type, finiteness and range of every numeric DreamerV3 hyperparameter, as one table.

`RULES` maps each numeric key of `HYPERPARAMETERS` (in :mod:`rllib_dreamerv3.algorithm`),
plus RLlib's `gamma`, to what it may be; :func:`numeric_errors` yields one message per value
that breaks its rule. `DreamerV3Config.validate()` raises the first as a ValueError before
training starts; such a value would otherwise fail only inside training (`critic_lr=inf`: NaN
updates; `num_bins=1`: a zero division in the two-hot bins). Checks between keys (`actor_min_std <
actor_max_std`, `dream_burn_in < batch_length_T`, ...) stay in `DreamerV3Config`. Pure Python:
no TensorFlow.
"""

import math
import numbers
from typing import NamedTuple


class Rule(NamedTuple):
    """An int or a finite float in the interval `low .. high` (`brackets`: which ends are in).

    `none`: if set, None is allowed too and means this. `why`: the reason for a bound that is
    not obvious, appended to the message.
    """

    kind: type
    low: float
    high: float = math.inf
    brackets: str = "[)"
    none: str = ""
    why: str = ""

    def allows(self, value):
        if value is None:
            return bool(self.none)
        if isinstance(value, bool) or not isinstance(value, self._types()):
            return False
        if not isinstance(value, numbers.Integral) and not math.isfinite(value):
            return False  # inf, nan (an int is finite; a huge one would overflow isfinite)
        above = value >= self.low if self.brackets[0] == "[" else value > self.low
        below = value <= self.high if self.brackets[1] == "]" else value < self.high
        return above and below

    def _types(self):
        return numbers.Integral if self.kind is int else numbers.Real

    def describe(self):
        """What is allowed, after 'must': e.g. 'be a positive integer', 'lie in [0.0, 1.0)'."""
        if self.high != math.inf:
            return f"lie in {self.brackets[0]}{self.low}, {self.high}{self.brackets[1]}"
        if self.kind is int:
            return "be a positive integer" if self.low == 1 else f"be an integer >= {self.low}"
        if self.brackets[0] == "(" and self.low == 0:
            return "be a positive number (finite)"
        return f"be a number >= {self.low} (finite)"


def positive_int(none=""):
    return Rule(int, 1, none=none)


def int_at_least(low, why=""):
    return Rule(int, low, why=why)


def positive_float():
    return Rule(float, 0, brackets="()")


def non_negative_float():
    return Rule(float, 0)


def interval(low, high, brackets):
    return Rule(float, low, high, brackets)


# name -> Rule. Ranges follow the paper (Hafner et al. 2023, arXiv 2301.04104) and how each
# value is used here; tests/test_config.py checks that every numeric hyperparameter has one.
# Learning rates, Adam's ε, gradient clips (inf: gradients * inf / inf = NaN), actor_max_std
# and the peer timeout (int(inf * 1000) overflows): > 0 and finite. Loss weights, free bits,
# the entropy scale and actor_min_std: >= 0 and finite. EMA decays [0, 1) and rates (0, 1]
# (1: copy); λ [0, 1]; γ (0, 1]; unimix [0, 1) (1: a uniform policy). Counts: ints >= 1 (>= 0
# where 0 means off or none); batch_length_T >= 2 (transitions), num_bins >= 2 (two-hot).
RULES = {
    "training_ratio": positive_int(),
    "batch_size_B": positive_int(),
    "batch_length_T": int_at_least(
        2, why="the world model learns from transitions within sequences"
    ),
    "horizon_H": positive_int(),
    "gamma": interval(0.0, 1.0, "(]"),
    "gae_lambda": interval(0.0, 1.0, "[]"),
    "entropy_scale": non_negative_float(),
    "return_normalization_decay": interval(0.0, 1.0, "[)"),
    "world_model_lr": positive_float(),
    "actor_lr": positive_float(),
    "critic_lr": positive_float(),
    "world_model_adam_eps": positive_float(),
    "actor_adam_eps": positive_float(),
    "critic_adam_eps": positive_float(),
    "world_model_grad_clip": positive_float(),
    "actor_grad_clip": positive_float(),
    "critic_grad_clip": positive_float(),
    "free_bits": non_negative_float(),
    "pred_loss_scale": non_negative_float(),
    "dyn_loss_scale": non_negative_float(),
    "rep_loss_scale": non_negative_float(),
    "critic_ema_rate": interval(0.0, 1.0, "(]"),
    "critic_ema_regularizer": non_negative_float(),
    "unimix": interval(0.0, 1.0, "[)"),
    "num_bins": int_at_least(2, why="a two-hot target is spread over two neighbouring bins"),
    "cnn_kernel": positive_int(),
    "vector_mlp_units": positive_int(none="for the model size's"),
    "vector_mlp_layers": positive_int(none="for the model size's"),
    "actor_min_std": non_negative_float(),
    "actor_max_std": positive_float(),
    "replay_capacity": positive_int(),
    "num_steps_sampled_before_learning_starts": int_at_least(0),
    "checkpoint_interval_s": non_negative_float(),  # 0: off
    "sync_weights_every_n_updates": positive_int(),
    "dream_every_n_updates": int_at_least(0),
    "dream_burn_in": positive_int(),
    "dream_num_sequences": positive_int(),
    "learner_peer_timeout_s": positive_float(),
    "tf_num_threads": positive_int(none="for TF's default"),
    "max_skipped_updates_in_a_row": int_at_least(0),
}


def numeric_errors(values, defaults=None):
    """Yield a message for each `values[name]` (for each name of `RULES` in `values`) that its
    rule rejects: the key, the bad value, what is allowed, and `defaults[name]` where given."""
    defaults = defaults or {}
    for name, rule in RULES.items():
        if name not in values or rule.allows(values[name]):
            continue
        none = f", or None {rule.none}" if rule.none else ""
        why = f" ({rule.why})" if rule.why else ""
        default = f" Default: {defaults[name]!r}." if name in defaults else ""
        yield f"{name}={values[name]!r} must {rule.describe()}{none}{why}.{default}"
