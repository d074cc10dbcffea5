"""DreamerV3 in TensorFlow 2 as an algorithm plugin for Ray RLlib 2.60's new API stack.

>>> from rllib_dreamerv3 import DreamerV3Config
>>> config = DreamerV3Config().environment("CartPole-v1").training(model_size="XS")
>>> algo = config.build_algo()  # doctest: +SKIP

Importing the package also registers the Ray Tune trainable `"DreamerV3"`.
"""

# TF must be imported before RLlib: if RLlib imports it first, it disables TF2 behaviour.
import tensorflow as tf  # noqa: F401

from rllib_dreamerv3.tf_rllib import apply_ray_patches, ensure_tf2_behavior

ensure_tf2_behavior()
apply_ray_patches()

from rllib_dreamerv3.algorithm import DreamerV3, DreamerV3Config  # noqa: E402
from rllib_dreamerv3.learner import DreamerV3Learner  # noqa: E402
from rllib_dreamerv3.rl_module import DreamerV3RLModule  # noqa: E402


def _register_with_tune():
    from ray.tune.registry import register_trainable

    register_trainable("DreamerV3", DreamerV3)


_register_with_tune()

__all__ = ["DreamerV3", "DreamerV3Config", "DreamerV3Learner", "DreamerV3RLModule"]
__version__ = "0.1.0"
