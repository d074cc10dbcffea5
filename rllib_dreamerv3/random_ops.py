"""Counter-based random numbers that are bit-identical compiled (XLA) and uncompiled.

TF's stateless RNG ops draw different numbers under XLA than in eager mode, which would make
"compiled update == eager update" untestable. These functions hash `(seed, element index)` with
an integer mixer (lowbias32, 32-bit multiply/xor-shift) instead: plain integer ops, the same on
every backend. Seeds are `[2]` int32 tensors. Shapes are lists of ints, where a dimension may
also be a scalar int tensor (a batch size known only at run time, as in an exported policy);
element `i` of a draw depends only on the seed and `i`.

Within :func:`sharded` (`index`, `count`), every draw is the `index`-th of `count` equal,
contiguous blocks of the draw `count` times as large: data-parallel Learners that each hold
`1/count` of a batch's rows (batch dimension first) draw exactly the numbers that one Learner
with the whole batch draws for those rows.
"""

import contextlib
import math
import threading

import numpy as np
import tensorflow as tf

_GOLDEN = 0x9E3779B9
_shard = threading.local()


@contextlib.contextmanager
def sharded(index, count):
    """Draws inside are block `index` of `count` (see the module doc); read at trace time."""
    previous = getattr(_shard, "value", (0, 1))
    _shard.value = (index, count)
    try:
        yield
    finally:
        _shard.value = previous


def _mix(x):
    """lowbias32 integer hash, uint32 -> uint32."""
    x = tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, 16))
    x = x * tf.constant(0x7FEB352D, tf.uint32)
    x = tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, 15))
    x = x * tf.constant(0x846CA68B, tf.uint32)
    return tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, 16))


def _key(seed):
    seed = tf.cast(seed, tf.uint32)
    return _mix(tf.bitwise.bitwise_xor(_mix(seed[0] + tf.constant(_GOLDEN, tf.uint32)), seed[1]))


def split(seed, num):
    """`num` independent seeds `[num, 2]` int32 derived from `seed`."""
    key = _key(seed)
    counter = tf.cast(tf.range(2 * num), tf.uint32)
    bits = _mix(tf.bitwise.bitwise_xor(_mix(counter + tf.constant(_GOLDEN, tf.uint32)), key))
    return tf.reshape(tf.bitcast(bits, tf.int32), [num, 2])


def fold_in(seed, data):
    """A seed derived from `seed` and the Python int `data`."""
    return split(seed, data + 1)[data]


def shape_of(x):
    """`x`'s shape as :func:`uniform` takes it: static dims as ints, the others as tensors."""
    dynamic = tf.shape(x)
    return [dim if dim is not None else dynamic[i] for i, dim in enumerate(x.shape)]


def _num_elements(shape):
    if all(isinstance(dim, int | np.integer) for dim in shape):
        return int(np.prod(shape))
    return tf.reduce_prod(tf.stack([tf.cast(dim, tf.int32) for dim in shape]))


def uniform(shape, seed):
    """Uniform floats in the open interval (0, 1), `shape` (see the module doc)."""
    num = _num_elements(shape)
    counter = tf.cast(tf.range(num), tf.uint32)
    index, _ = getattr(_shard, "value", (0, 1))
    if index:
        counter += tf.cast(num, tf.uint32) * tf.constant(index, tf.uint32)
    key = _key(seed)
    bits = _mix(tf.bitwise.bitwise_xor(_mix(counter), key) + key)
    values = (tf.cast(tf.bitwise.right_shift(bits, 8), tf.float32) + 0.5) * (2.0**-24)
    return tf.reshape(values, shape)


def normal(shape, seed):
    """Standard normal floats (Box–Muller), `shape` (see the module doc)."""
    # The pair of uniforms of one normal is adjacent, so that a block of normals is a block of
    # uniforms (see `sharded`).
    u1, u2 = tf.unstack(uniform([*shape, 2], seed), num=2, axis=-1)
    return tf.sqrt(-2.0 * tf.math.log(u1)) * tf.cos(2.0 * math.pi * u2)


def categorical(probs, seed):
    """One index per row of `probs` `[N, C]` (rows sum to 1): `[N]` int32, by inverse
    transform sampling, one uniform per row (see :func:`inverse_cdf`)."""
    probs = tf.stop_gradient(tf.convert_to_tensor(probs, tf.float32))
    return inverse_cdf(tf.math.cumsum(probs, -1), seed)


def inverse_cdf(cdf, seed):
    """The class of each row of cumulative probabilities `cdf` `[N, C]` that a uniform `u`
    falls in: the count of entries at or below `u * cdf[:, -1]` (scaled by the row's total, so
    rounding never leaves a row unsampled), `[N]` int32."""
    num, num_classes = shape_of(cdf)
    target = uniform([num, 1], seed) * cdf[:, -1:]
    count = tf.reduce_sum(tf.cast(cdf <= target, tf.int32), -1)
    return tf.minimum(count, num_classes - 1)
