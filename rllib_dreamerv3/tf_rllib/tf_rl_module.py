"""`TfRLModule`: an RLlib `RLModule` whose networks are `tf.Module`s, with numpy-dict state."""

import numpy as np
import tensorflow as tf
from ray.rllib.core.rl_module.rl_module import RLModule

from rllib_dreamerv3.tf_rllib.compat import ensure_tf2_behavior


def _is_variable(x):
    return isinstance(x, tf.Variable)


class TfRLModule(RLModule):
    """Base class for TF2 RLModules.

    Subclasses build their networks in `setup()` as `tf.Module` attributes of `self`; every
    `tf.Variable` reachable from them is part of the module's state, keyed by its attribute path
    (e.g. `"model/world_model/gru/dense/w"`). State is a flat dict of numpy arrays, so it pickles
    into checkpoints and travels through Ray cheaply.

    `inference_only_excluded` lists path prefixes that inference (EnvRunners) does not need;
    `get_state(inference_only=True)` leaves them out.
    """

    framework = "tf2"
    inference_only_excluded = ()

    def __init__(self, *args, **kwargs):
        ensure_tf2_behavior()
        super().__init__(*args, **kwargs)

    def tf_variables(self):
        """`{path: tf.Variable}` of every variable of every `tf.Module` attribute, sorted."""
        out = {}
        for attr, value in sorted(vars(self).items()):
            if isinstance(value, tf.Module):
                for path, var in value._flatten(predicate=_is_variable, with_path=True):
                    out["/".join([attr, *map(str, path)])] = var
        return out

    @property
    def trainable_variables(self):
        """All trainable variables, in the sorted order of :meth:`tf_variables`."""
        return [v for v in self.tf_variables().values() if v.trainable]

    def _included(self, name, inference_only):
        return not (inference_only and name.startswith(tuple(self.inference_only_excluded)))

    def get_state(self, components=None, *, not_components=None, inference_only=False, **kwargs):
        """`{path: numpy array}`; with `inference_only`, without the excluded prefixes."""
        return {name: var.numpy() for name, var in self.tf_variables().items()
                if self._included(name, inference_only)}

    def set_state(self, state):
        """Assign the arrays of `state` (a full or partial :meth:`get_state` dict)."""
        variables = self.tf_variables()
        for name, value in state.items():
            if name not in variables:
                raise ValueError(
                    f"State entry {name!r} matches no variable of {type(self).__name__}; the "
                    "state comes from a different model (check model_size and the spaces).")
            var = variables[name]
            if tuple(var.shape) != np.shape(value):
                raise ValueError(
                    f"State entry {name!r} has shape {np.shape(value)}, the variable "
                    f"{tuple(var.shape)}; the state comes from a differently sized model.")
            var.assign(value)
