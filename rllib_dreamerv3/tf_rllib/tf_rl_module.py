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
        """`{path: tf.Variable}` of every variable of every `tf.Module` attribute, sorted.

        A variable reachable by several paths is listed once. Keras 3 layers are not
        `tf.Module`s and would be silently left out, so they are rejected.
        """
        out, seen = {}, set()
        for attr, value in sorted(vars(self).items()):
            if not isinstance(value, tf.Module):
                if type(value).__module__.startswith("keras"):
                    raise TypeError(
                        f"{type(self).__name__}.{attr} is a Keras 3 object; TfRLModule tracks "
                        "tf.Module attributes only. Wrap it in a tf.Module or use tf_keras."
                    )
                continue
            for path, var in value._flatten(predicate=_is_variable, with_path=True):
                if var.ref() not in seen:
                    seen.add(var.ref())
                    out["/".join([attr, *map(str, path)])] = var
        return dict(sorted(out.items()))

    @property
    def trainable_variables(self):
        """All trainable variables, in the sorted order of :meth:`tf_variables`."""
        return [v for v in self.tf_variables().values() if v.trainable]

    def _included(self, name, inference_only):
        excluded = any(
            name == prefix or name.startswith(prefix.rstrip("/") + "/")
            for prefix in self.inference_only_excluded
        )
        return not (inference_only and excluded)

    def get_state(self, components=None, *, not_components=None, inference_only=False, **kwargs):
        """`{path: numpy array}`; with `inference_only`, without the excluded prefixes."""
        return {
            name: var.numpy()
            for name, var in self.tf_variables().items()
            if self._included(name, inference_only)
        }

    def set_state(self, state):
        """Assign the arrays of `state` (a full or partial :meth:`get_state` dict).

        Every entry is checked before any is written, so a mismatched state changes nothing.
        """
        variables = self.tf_variables()
        for name, value in state.items():
            if name not in variables:
                raise ValueError(
                    f"State entry {name!r} matches no variable of {type(self).__name__}; the "
                    "state comes from a different model (check model_size and the spaces)."
                )
            if tuple(variables[name].shape) != np.shape(value):
                raise ValueError(
                    f"State entry {name!r} has shape {np.shape(value)}, the variable "
                    f"{tuple(variables[name].shape)}; the state comes from a differently sized "
                    "model."
                )
        for name, value in state.items():
            variables[name].assign(value)
