"""Keeping TensorFlow 2 working inside Ray RLlib 2.60, and the run-time patches of Ray.

RLlib's new API stack assumes torch in a few places (`utils/framework.py`'s `get_device`,
`learner_group._get_backend_config`, the numpy-to-tensor connectors). Everything that has to
touch RLlib internals to work around that lives in this module, guarded by the pinned Ray
version, so that a Ray upgrade only has to revisit this file. The second patch gives
`Algorithm.from_checkpoint` and `Checkpointable.from_checkpoint` a hook that checks a local
checkpoint before RLlib reads any of it (:func:`register_restore_check`); the third has Ray
Tune record every trial checkpoint in its experiment state at once, so that a resumed
experiment continues from each trial's newest checkpoint.
"""

import logging
import os

import tensorflow as tf
from tensorflow.python import tf2

logger = logging.getLogger(__name__)

PINNED_RAY_VERSION = "2.60.0"


def ensure_tf2_behavior():
    """Undo `tf.compat.v1.disable_v2_behavior()`, which RLlib calls if it imports TF first.

    RLlib only turns eager execution back on, which leaves TF1 semantics (tensor equality,
    control flow, shapes of `Dimension`s) in every process where RLlib imported TF before us,
    e.g. inside Ray actors. Cheap and idempotent: call it wherever TF work starts in a process.
    """
    if not tf2.enabled() or not tf.executing_eagerly():
        tf.compat.v1.enable_v2_behavior()


def limit_tf_threads(num_threads):
    """Cap TF's intra-/inter-op thread pools (Ray actors otherwise start dozens of threads).

    Only effective before TF has run its first op in this process; later calls are ignored.
    """
    if not num_threads:
        return
    try:
        tf.config.threading.set_intra_op_parallelism_threads(num_threads)
        tf.config.threading.set_inter_op_parallelism_threads(num_threads)
    except RuntimeError:
        logger.debug("TF already initialised; thread limits unchanged.")


def _tf_backend_config(original):
    """Wrap `learner_group._get_backend_config` (which raises for anything but torch): TF
    Learners get Ray Train's `TensorflowConfig`, whose backend writes `TF_CONFIG` (all
    Learners' addresses, this one's index) on every Learner actor before it is built; with
    `num_learners >= 2`, `TfLearner.build` joins that cluster (see `collectives`).
    """

    def get_backend_config(learner_class):
        if learner_class.framework == "tf2":
            from ray.train.tensorflow import TensorflowConfig

            return TensorflowConfig()
        return original(learner_class)

    get_backend_config._rllib_dreamerv3_patch = True
    return get_backend_config


_RESTORE_CHECKS = []


def register_restore_check(check):
    """Have `check(path)` run on every local checkpoint path before `Algorithm.from_checkpoint`
    or `Checkpointable.from_checkpoint` reads anything of it (e.g. to verify checksums, or to
    finish an interrupted save). `check` raises to refuse the checkpoint. Idempotent."""
    if check not in _RESTORE_CHECKS:
        _RESTORE_CHECKS.append(check)


def _checked_from_checkpoint(original):
    """Wrap the classmethod `original` so the registered checks see a local path first."""
    func = original.__func__

    def from_checkpoint(cls, path, filesystem=None, **kwargs):
        local_fs = filesystem is None or type(filesystem).__name__ == "LocalFileSystem"
        if isinstance(path, (str, os.PathLike)) and local_fs and "://" not in str(path):
            for check in _RESTORE_CHECKS:
                check(os.fspath(path))
        return func(cls, path, filesystem=filesystem, **kwargs)

    from_checkpoint.__doc__ = func.__doc__
    from_checkpoint._rllib_dreamerv3_patch = True
    from_checkpoint._original = original
    return classmethod(from_checkpoint)


def _patch_from_checkpoint():
    from ray.rllib.algorithms.algorithm import Algorithm
    from ray.rllib.utils.checkpoints import Checkpointable

    for owner in (Checkpointable, Algorithm):
        current = owner.__dict__["from_checkpoint"]
        if not getattr(current.__func__, "_rllib_dreamerv3_patch", False):
            owner.from_checkpoint = _checked_from_checkpoint(current)


def _sync_after_every_checkpoint(original):
    """Wrap `_ExperimentCheckpointManager.on_trial_checkpoint`, which forces Tune to save its
    experiment state only every `num_to_keep` trial checkpoints (otherwise every 10 s or more,
    self-adjusted to 19 times the time a save takes). Resuming an experiment restores each
    trial from the checkpoint that state names, so a kill after a trial checkpoint but before
    that save lost everything since the checkpoint before it (or several). Forcing the save at
    every trial checkpoint bounds what a kill loses to one checkpoint interval; the state is a
    small file, written once per trial checkpoint."""

    def on_trial_checkpoint(self, trial):
        original(self, trial)
        self._should_force_sync_up = True

    on_trial_checkpoint._rllib_dreamerv3_patch = True
    on_trial_checkpoint._original = original
    return on_trial_checkpoint


def _patch_experiment_state_sync():
    from ray.tune.execution.experiment_state import _ExperimentCheckpointManager as manager

    if not getattr(manager.on_trial_checkpoint, "_rllib_dreamerv3_patch", False):
        manager.on_trial_checkpoint = _sync_after_every_checkpoint(manager.on_trial_checkpoint)


def apply_ray_patches():
    """Patch Ray at run time where RLlib 2.60 refuses TF; no-op on any other Ray version.

    Returns the names of the applied patches (empty if the Ray version is not the pinned one).
    """
    import ray
    from ray.rllib.core.learner import learner_group

    if ray.__version__ != PINNED_RAY_VERSION:
        logger.warning(
            "rllib_dreamerv3 was written for ray==%s but ray==%s is installed: run-time patches "
            "are not applied, so num_learners >= 1 may fail. Install ray[rllib]==%s.",
            PINNED_RAY_VERSION,
            ray.__version__,
            PINNED_RAY_VERSION,
        )
        return []
    applied = []
    if not getattr(learner_group._get_backend_config, "_rllib_dreamerv3_patch", False):
        learner_group._get_backend_config = _tf_backend_config(learner_group._get_backend_config)
    applied.append("learner_group._get_backend_config")
    _patch_from_checkpoint()
    applied.append("from_checkpoint restore checks")
    _patch_experiment_state_sync()
    applied.append("experiment state saved after every trial checkpoint")
    silence_rllib_notices()
    applied.append("silenced notices")
    return applied


# `ray.util.log_once` keys of RLlib 2.60 notices that say nothing to DreamerV3's users: the
# new-API-stack banner (DreamerV3 exists only there) and the deprecation that RLlib's own
# `RLModule.__init__` triggers for every module by building an `RLModuleConfig`.
RLLIB_NOTICE_KEYS = ("DreamerV3_on_new_api_stack", "RLModule(config=[RLModuleConfig object])")


class _DropMessages(logging.Filter):
    """Drops the records whose message starts with one of `prefixes`."""

    def __init__(self, prefixes):
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record):
        return not str(record.msg).startswith(self.prefixes)


# Logger name -> message prefixes of Ray notices that ask nothing of the user: Tune's "Install
# gputil" (system monitoring works without it on machines without GPUs); its advice to report
# results less often when handling one took over 0.5 s (a DreamerV3 trial reports once per
# training iteration, seconds to minutes apart); its advice to reuse actors when a trainable's
# setup took over 10 s (building the envs and the model takes that; a built algorithm is not
# reused); the note, at every `ray.init` that starts a local cluster, that token
# authentication is on (Ray's default); and the warning that the experiment state was written
# several times within seconds (`_patch_experiment_state_sync` writes it after every trial
# checkpoint on purpose, so that a resume starts from the newest one).
RAY_NOTICES = {
    "ray.tune.utils.util": (
        "Install gputil",
        "Processing trial results took",
        "The `process_trial_result` operation took",
    ),
    "ray.tune.trainable.trainable": ("Trainable.setup took",),
    "ray.tune.execution.experiment_state": (
        "Experiment state snapshotting has been triggered multiple",
    ),
    "ray._private.authentication.authentication_token_setup": (
        "Token authentication is enabled for this Ray cluster",
    ),
}


def silence_rllib_notices():
    """Mark RLlib's banner and self-inflicted deprecation notices as already logged in this
    process, and drop the Ray notices in `RAY_NOTICES`. Idempotent."""
    from ray.util import log_once

    for key in RLLIB_NOTICE_KEYS:
        log_once(key)
    for name, prefixes in RAY_NOTICES.items():
        drop_messages(name, prefixes)


def drop_messages(logger_name, prefixes):
    """Drop the records of the logger `logger_name` whose message starts with one of
    `prefixes`. Idempotent: a logger gets one such filter."""
    named = logging.getLogger(logger_name)
    if not any(isinstance(f, _DropMessages) for f in named.filters):
        named.addFilter(_DropMessages(prefixes))
