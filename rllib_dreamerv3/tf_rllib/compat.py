"""Keeping TensorFlow 2 working inside Ray RLlib 2.60, and the one run-time patch of Ray.

RLlib's new API stack assumes torch in a few places (see `RLLIB_TF_NOTES.md`). Everything that
has to touch RLlib internals to work around that lives in this module, guarded by the pinned Ray
version, so that a Ray upgrade only has to revisit this file.
"""

import logging

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
# gputil" (system monitoring works without it on machines without GPUs) and the note, at every
# `ray.init` that starts a local cluster, that token authentication is on (Ray's default).
RAY_NOTICES = {
    "ray.tune.utils.util": ("Install gputil",),
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
        named = logging.getLogger(name)
        if not any(isinstance(f, _DropMessages) for f in named.filters):
            named.addFilter(_DropMessages(prefixes))
