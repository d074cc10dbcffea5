"""DreamerV3 in TensorFlow 2 as an algorithm plugin for Ray RLlib 2.60's new API stack.

>>> from rllib_dreamerv3 import DreamerV3Config
>>> config = DreamerV3Config().environment("CartPole-v1").training(model_size="XS")
>>> algo = config.build_algo()  # doctest: +SKIP

Importing the package also registers the Ray Tune trainable `"DreamerV3"`, and sets
`TF_CPP_MIN_LOG_LEVEL` (unless set) to hide TensorFlow's C++ start-up messages.
"""

import contextlib
import logging
import os
import sys

# TF's C++ start-up messages (CUDA probing, oneDNN and CPU-feature notes) are noise for users,
# and on machines without an NVIDIA driver its failed CUDA probe logs at error level. Set
# TF_CPP_MIN_LOG_LEVEL yourself (0: everything) to see them.
os.environ.setdefault(
    "TF_CPP_MIN_LOG_LEVEL", "2" if os.path.exists("/proc/driver/nvidia/version") else "3"
)


def _import_tensorflow():
    """Import TF; unless TF_CPP_MIN_LOG_LEVEL is 0 or 1, its C++ libraries' load-time messages
    go to /dev/null: they are written to stderr before TF's logging is initialised, where
    TF_CPP_MIN_LOG_LEVEL does not reach them. Errors still raise, after stderr is restored."""
    if "tensorflow" in sys.modules or os.environ["TF_CPP_MIN_LOG_LEVEL"] in ("0", "1"):
        import tensorflow  # noqa: F401

        return
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        import tensorflow  # noqa: F401
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


# TF must be imported before RLlib: if RLlib imports it first, it disables TF2 behaviour.
_import_tensorflow()

from rllib_dreamerv3.envs.dmc import opengl_disabled  # noqa: E402


@contextlib.contextmanager
def _root_logging_kept():
    """Undo handlers that libraries add to the root logger while our imports run: dm_control's
    import logs through absl, which calls `logging.basicConfig()` when the root has none. The
    process's logging configuration stays the user's."""
    handlers = list(logging.root.handlers)
    try:
        yield
    finally:
        logging.root.handlers[:] = handlers


# RLlib imports dm_control where it is installed: no OpenGL in TF processes (see the function).
with opengl_disabled(), _root_logging_kept():
    from rllib_dreamerv3 import checkpoints
    from rllib_dreamerv3.tf_rllib import apply_ray_patches, ensure_tf2_behavior
    from rllib_dreamerv3.tf_rllib.compat import register_restore_check

    ensure_tf2_behavior()
    apply_ray_patches()
    # Every way RLlib restores a checkpoint checks ours first (checksums, interrupted saves).
    register_restore_check(checkpoints.check_before_restore)

    from rllib_dreamerv3.algorithm import DreamerV3, DreamerV3Config
    from rllib_dreamerv3.export import export_policy
    from rllib_dreamerv3.learner import DreamerV3Learner
    from rllib_dreamerv3.rl_module import DreamerV3RLModule


def _register_with_tune():
    from ray.tune.registry import register_trainable

    register_trainable("DreamerV3", DreamerV3)


_register_with_tune()

__all__ = [
    "DreamerV3",
    "DreamerV3Config",
    "DreamerV3Learner",
    "DreamerV3RLModule",
    "export_policy",
]
__version__ = "0.1.0"
