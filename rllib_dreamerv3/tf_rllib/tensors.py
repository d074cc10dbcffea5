"""numpy <-> TF conversion for RLlib batches, in place of RLlib's torch-only connectors."""

import numpy as np
import tensorflow as tf


def to_tensor(tree):
    """Convert every numpy leaf of a nested structure to a `tf.Tensor` (others pass through).

    float64 becomes float32 (TF networks are float32); other dtypes are kept.
    """

    def convert(x):
        if isinstance(x, np.ndarray):
            if x.dtype == np.float64:
                x = x.astype(np.float32)
            return tf.convert_to_tensor(x)
        return x

    return tf.nest.map_structure(convert, tree)


def to_numpy(tree):
    """Convert every `tf.Tensor`/`tf.Variable` leaf of a nested structure to numpy."""
    return tf.nest.map_structure(
        lambda x: x.numpy() if isinstance(x, (tf.Tensor, tf.Variable)) else x, tree
    )
