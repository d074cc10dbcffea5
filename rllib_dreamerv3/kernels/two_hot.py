"""Two-hot heads in one pass over their logits: fused statistics and cross-entropy.

The reference computations are :func:`~rllib_dreamerv3.math_ops.two_hot_mean` and
:func:`~rllib_dreamerv3.math_ops.two_hot_log_prob` (a softmax and a log-softmax over the bins).
Here the normaliser, the expected bin and the cross-entropy towards one or more targets share one
pass over the logits, with the gradient written out as one elementwise pass, and the logits may
carry masked columns that round their width up to a multiple of the SIMD width.
"""

import tensorflow as tf

from rllib_dreamerv3.math_ops import symexp, symlog, two_hot_from_parts, two_hot_parts

MASKED_LOGIT = -1e30
"""The value of a masked logit column (:func:`masked_columns`): its softmax probability is
exactly 0 (`exp(-1e30 - anything finite)` is 0 in float32)."""


def masked_columns(num_bins, multiple=16):
    """How many masked columns (`masked_out` of :func:`~.layers.dense`) round a
    head of `num_bins` logits up to a multiple of `multiple` (1 for 255 bins). The two-hot
    functions below take such padded logits with the unpadded `bins`."""
    return -num_bins % multiple


def _check_width(bins, width):
    """Raise unless logits of `width` columns have one per bin (plus masked columns)."""
    if width is None or width < bins.shape[0]:
        raise ValueError(
            f"two-hot logits have {width} columns for {bins.shape[0]} bins; they "
            "need one per bin (plus masked columns, see masked_columns)."
        )


def _padded_bins(bins, width):
    """`bins` followed by zeros up to the logits' `width` (masked columns have probability 0)."""
    _check_width(bins, width)
    num_bins = bins.shape[0]
    return bins if width == num_bins else tf.concat([bins, tf.zeros([width - num_bins])], 0)


def two_hot_stats(logits, bins, shift=None, keep_exp=False):
    """`(mean, log_normalizer)` of a two-hot head, `[...]` each, in one pass over its logits.

    `mean` is the real-space prediction `symexp(sum(softmax(logits) * bins))` and
    `log_normalizer` is `logsumexp(logits)`, so that `log_softmax(logits) = logits -
    log_normalizer` (see :func:`two_hot_cross_entropy`).

    `shift` `[...]`: any per-row value; the normaliser is computed as `shift + log(sum(exp(logits
    - shift)))`, which is exact for every shift but overflows when a logit exceeds it by more than
    ~88. The row's maximum (the default) is the safe choice, but takes a pass over the logits of
    its own, and XLA:CPU reduces rows of 255 bins slowly; the row's mean logit, which
    :func:`~.layers.mlp_with_mean` gets from the output layer's input for the price of a
    matrix-vector product, is the fast one. Rows are checked: if any overflowed, all are
    recomputed with the maximum. The sums over the bins are matrix-vector products (XLA:CPU
    computes them with the exponentials fused in), and the gradient
    `softmax * (d_lse + d_mean' * (bins - expected))` is one elementwise pass, where a
    log-softmax and its gradient take several.

    `keep_exp`: keep the forward pass's exponentials for the gradient, which then scales them
    (`softmax = exp(logits - shift) / sum`) instead of exponentiating the logits again: one
    buffer of the logits' size is written in the forward pass and one exponential pass saved in
    the backward. For a head that is differentiated (the critic's); a head without gradient
    would only pay for the buffer.

    `logits` may have more columns than `bins`: trailing masked logits
    (:data:`MASKED_LOGIT`, probability 0) that pad a head to an aligned width.
    """
    logits = tf.convert_to_tensor(logits, tf.float32)
    width = logits.shape[-1]
    bins = _padded_bins(bins, width)
    flat = tf.reshape(logits, [-1, width])
    ones, bin_values = tf.ones([width, 1]), tf.reshape(bins, [width, 1])

    def normaliser_and_expected(shift):  # and, with keep_exp, exp(flat - shift) and its sums
        e = tf.exp(flat - shift)
        total = tf.matmul(e, ones)
        out = (shift + tf.math.log(total), tf.matmul(e, bin_values) / total)
        return out + (e, total) if keep_exp else out

    @tf.custom_gradient
    def stats(flat):
        if shift is None:
            out = normaliser_and_expected(tf.reduce_max(flat, -1, keepdims=True))
        else:
            given = tf.stop_gradient(tf.reshape(tf.cast(shift, tf.float32), [-1, 1]))
            out = normaliser_and_expected(given)
            out = tf.cond(
                tf.reduce_all(tf.math.is_finite(out[0])),
                lambda: out,
                lambda: normaliser_and_expected(tf.reduce_max(flat, -1, keepdims=True)),
            )
        lse, expected = out[:2]

        def grad(d_lse, d_expected):
            d_lse = 0.0 if d_lse is None else d_lse
            d_expected = 0.0 if d_expected is None else d_expected
            d_probs = d_lse + d_expected * (bins - expected)
            if keep_exp:
                e, total = out[2:]
                return e * (d_probs / total)
            return tf.exp(flat - lse) * d_probs

        return (lse, expected), grad

    lse, expected = stats(flat)
    shape = tf.shape(logits)[:-1]
    return symexp(tf.reshape(expected, shape)), tf.reshape(lse, shape)


def two_hot_cross_entropy(logits, log_normalizer, targets, weights, bins):
    """`sum_k weights[k] * CE(two_hot(symlog(targets[k])), softmax(logits))`, `[...]`.

    `log_normalizer`: `logsumexp(logits)` from :func:`two_hot_stats` (the loss's gradient
    reaches the logits through it too). `targets`: real-space labels `[...]` (no gradient reaches
    them). Each label has two non-zero bins, so `sum(labels * logits)` is gathered (4 entries a row
    for two targets) instead of summed over all bins; its gradient is the labels themselves, made
    in the elementwise pass that XLA fuses with :func:`two_hot_stats`'s. `logits` may have
    trailing masked columns, as in :func:`two_hot_stats`.
    """
    if len(targets) != len(weights) or not targets:
        raise ValueError(
            f"two_hot_cross_entropy: {len(targets)} targets and {len(weights)} "
            "weights; give one weight per target (at least one)."
        )
    logits = tf.convert_to_tensor(logits, tf.float32)
    num_bins = logits.shape[-1]
    _check_width(bins, num_bins)
    flat = tf.reshape(logits, [-1, num_bins])
    parts = [two_hot_parts(symlog(tf.reshape(tf.stop_gradient(t), [-1])), bins) for t in targets]
    weights = [tf.cast(w, tf.float32) for w in weights]

    @tf.custom_gradient
    def labelled(flat):
        out = 0.0
        for (below, above), weight in zip(parts, weights):
            pair = tf.gather(flat, tf.stack([below, below + 1], -1), batch_dims=1)  # [rows, 2]
            out += weight * ((1.0 - above) * pair[:, 0] + above * pair[:, 1])

        def grad(dy):
            labels = tf.add_n(
                [
                    weight * two_hot_from_parts(below, above, num_bins)
                    for (below, above), weight in zip(parts, weights)
                ]
            )
            return dy[:, None] * labels

        return out, grad

    total_weight = tf.add_n(weights) if len(weights) > 1 else weights[0]
    return total_weight * log_normalizer - tf.reshape(labelled(flat), tf.shape(logits)[:-1])


def two_hot_loss(logits, target, bins, shift=None):
    """Cross-entropy of a two-hot head towards a real-space `target` (symlog'ed here), [...].
    `shift`: as in :func:`two_hot_stats`."""
    return two_hot_cross_entropy(
        logits, two_hot_stats(logits, bins, shift)[1], [target], [1.0], bins
    )
