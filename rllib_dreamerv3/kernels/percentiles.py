"""The return scale's percentiles by a bitwise search instead of a sort.

The reference is :func:`rllib_dreamerv3.math_ops.percentiles` (tensorflow-probability's, which
sorts); XLA:CPU compiles a sort of the imagined returns into a slow comparison sort, while the
search below is 32 rounds of one comparison and one matrix-vector product.
"""

import math

import tensorflow as tf

from rllib_dreamerv3 import math_ops


def order_statistics(flat, ranks):
    """The `ranks`-th smallest entries (0-based Python ints) of the float32 vector `flat`.

    float32 values map to int32 keys that order like the floats (negative floats' magnitude
    bits flipped), and 32 halvings of the key range, each counting the keys at or below the
    candidates, pin down every order statistic at once.
    """
    bits = tf.bitcast(flat, tf.int32)
    flip = tf.constant(0x7FFFFFFF, tf.int32)
    keys = tf.cast(tf.where(bits < 0, tf.bitwise.bitwise_xor(bits, flip), bits), tf.int64)
    need = tf.constant([r + 1 for r in ranks], tf.float32)  # entries at or below each rank
    ones = tf.ones([flat.shape[0], 1], tf.float32)
    lo = tf.fill([len(ranks)], tf.reduce_min(keys))
    hi = tf.fill([len(ranks)], tf.reduce_max(keys))
    for _ in range(32):  # hi - lo < 2**32 halves to 0 in 32 steps
        mid = lo + (hi - lo) // 2
        at_or_below = tf.cast(keys[None, :] <= mid[:, None], tf.float32) @ ones  # exact < 2**24
        enough = at_or_below[:, 0] >= need
        hi = tf.where(enough, mid, hi)
        lo = tf.where(enough, lo, mid + 1)
    found = tf.cast(lo, tf.int32)
    return tf.bitcast(tf.where(found < 0, tf.bitwise.bitwise_xor(found, flip), found), tf.float32)


def percentiles(x, qs):
    """:func:`rllib_dreamerv3.math_ops.percentiles`: `[len(qs)]`, linear interpolation like
    numpy. Needs a static size below 2**24 (exact counts in float32) and float32 entries, as
    inside the compiled update; other inputs go to the reference."""
    flat = tf.reshape(tf.convert_to_tensor(x), [-1])
    size = flat.shape[0]
    if size is None or flat.dtype != tf.float32 or not 0 < size < 2**24:
        return math_ops.percentiles(x, qs)
    places = []
    for q in qs:
        pos = q / 100.0 * (size - 1)
        lo = min(int(math.floor(pos)), size - 1)
        frac = pos - math.floor(pos)
        places.append((lo, min(lo + 1, size - 1) if frac else lo, frac))
    ranks = sorted({r for lo, hi, _ in places for r in (lo, hi)})
    values = order_statistics(flat, ranks)
    at = {r: values[i] for i, r in enumerate(ranks)}
    # Exact ranks need no interpolation: a rank at ±inf would give 0 * inf = NaN.
    return tf.stack(
        [at[lo] * (1.0 - frac) + at[hi] * frac if frac else at[lo] for lo, hi, frac in places]
    )
