"""Categorical samples with the cumulative sums as one matrix product.

The reference is :func:`rllib_dreamerv3.random_ops.categorical`: the same uniforms, the same
inverse-CDF rule, so the same classes. XLA:CPU compiles a cumulative sum into a windowed
reduction; here it is a small matmul with an upper-triangular ones matrix instead.
"""

import numpy as np
import tensorflow as tf

from rllib_dreamerv3 import random_ops


def categorical(probs, seed):
    """:func:`rllib_dreamerv3.random_ops.categorical`: one index per row of `probs` `[N, C]`."""
    probs = tf.stop_gradient(tf.convert_to_tensor(probs, tf.float32))
    num, num_classes = random_ops.shape_of(probs)
    upper = tf.constant(np.triu(np.ones([num_classes, num_classes], np.float32)))
    cdf = tf.matmul(probs, upper)  # cdf[:, j] = sum(probs[:, :j + 1])
    return random_ops.inverse_cdf(cdf, seed)
