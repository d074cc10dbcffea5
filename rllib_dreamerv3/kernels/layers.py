"""Fast forward passes of the layers in :mod:`rllib_dreamerv3.networks`.

Each function here computes what the module's `__call__` computes, from the same variables,
in a form that XLA:CPU runs faster; none adds a variable, so checkpoints do not depend on the
path. `weights` (a :class:`LoopWeights`, or None) supplies variables read once before a loop.
"""

import tensorflow as tf

from rllib_dreamerv3.encoders import (
    DictDecoder,
    DictEncoder,
    ImageDecoder,
    ImageEncoder,
    VectorDecoder,
    VectorEncoder,
    flatten_leading,
    restore_leading,
)
from rllib_dreamerv3.kernels.loops import materialized
from rllib_dreamerv3.kernels.two_hot import MASKED_LOGIT
from rllib_dreamerv3.math_ops import symlog
from rllib_dreamerv3.networks import Dense, in_dtype, matmul, out_float32


class LoopWeights:
    """The variables of some modules read once, to be passed to the layers of a loop body.

    A variable read inside a loop body (`tf.while_loop`, :func:`~.loops.scan`) is a new tensor
    every iteration, and its gradient makes TF stack one copy of every weight per iteration.
    Read here, before the loop, the weights are loop invariants, and the gradients still reach
    the variables (any active tape records the read). Every :class:`Dense` kernel is also
    transposed here, once, for the gradient of its products with the loop's rank-2 inputs (see
    :func:`_matmul_given_transpose`).

    Args:
        modules: the modules whose variables the loop reads.
        row_blocks: `(dense, start, stop)` for each part of a kernel that the loop multiplies
            on its own (:func:`dense_partial`, :func:`onehot_partial`): those rows are sliced
            and transposed here too (sliced in the loop, they would be stacked like a read).
    """

    def __init__(self, modules, row_blocks=()):
        self._tensors = {}
        denses = []
        for module in modules:
            for var in module.variables:
                self._tensors[var.ref()] = tf.convert_to_tensor(var)
            denses += [sub for sub in (module, *module.submodules) if isinstance(sub, Dense)]
        self._rows = {}
        blocks = [(dense, 0, dense.w.shape[0]) for dense in denses]
        for dense, start, stop in row_blocks:
            if dense not in denses:
                raise ValueError(
                    f"LoopWeights: row_blocks names {dense.name!r}, which is not "
                    "inside the modules given; add its module to them."
                )
            blocks.append((dense, start, stop))
        for dense, start, stop in blocks:
            kernel = self.read(dense.w)
            rows = kernel if (start, stop) == (0, dense.w.shape[0]) else kernel[start:stop]
            self._rows[(id(dense), start, stop)] = (rows, tf.transpose(rows))

    def __contains__(self, variable):
        return variable.ref() in self._tensors

    def read(self, variable):
        """The tensor read for `variable`, or the variable itself if it was not read here."""
        return self._tensors.get(variable.ref(), variable)

    def rows(self, dense, start, stop):
        """`(rows, rows^T)` of `dense`'s kernel rows `start:stop`, or None."""
        return self._rows.get((id(dense), start, stop))


def _read(weights, variable):
    return variable if weights is None else weights.read(variable)


def _matmul_given_transpose(x, w, w_t):
    """`x @ w` for a kernel read once before a loop, whose input gradient `dy @ w^T` multiplies
    `w_t`, the transpose made once before the loop too: XLA:CPU multiplies a loop's small
    `[batch, out]` gradients by a transposed operand more slowly than by a plain one, and these
    products are the observe loop's backward critical path."""

    @tf.custom_gradient
    def product(x, w):
        def grad(dy):
            return tf.matmul(dy, w_t), tf.matmul(x, dy, transpose_a=True)

        return tf.matmul(x, w), grad

    return product(x, w)


# --- Dense ------------------------------------------------------------------------------------
def dense(layer, x, weights=None, masked_out=0):
    """`layer(x)` (a :class:`~rllib_dreamerv3.networks.Dense`).

    The bias is one more kernel row, on a constant-1 feature: XLA:CPU then neither adds it in a
    pass of its own over the output nor sums its gradient in another (for the two-hot heads'
    wide outputs both cost more than the matmul at small sizes). `masked_out`: that many
    constant :data:`~.two_hot.MASKED_LOGIT` columns appended to the output (a zero kernel
    column, `MASKED_LOGIT` in the bias row; needs the bias), so a softmax head's width is a
    multiple of the SIMD width (255 bins as 256 columns); not variables, so the gradients and
    checkpoints keep the layer's own columns.
    """
    in_units = layer.w.shape[0]
    if layer.b is None:
        if masked_out:
            raise ValueError(
                f"dense: masked_out={masked_out} needs a layer with a bias (the "
                "masked columns' constant sits in the bias row of the kernel)."
            )
        return dense_partial(layer, x, 0, in_units, weights)
    if layer.matmul_dtype != tf.float32 or (weights is not None and layer.w in weights):
        # bfloat16 keeps the bias in float32; weights read once for a loop keep it apart too:
        # the folded kernel would be a new tensor every step, which the loop's gradient stores.
        y = dense_partial(layer, x, 0, in_units, weights) + _read(weights, layer.b)
        if masked_out:
            masked = tf.fill(tf.concat([tf.shape(y)[:-1], [masked_out]], 0), MASKED_LOGIT)
            y = tf.concat([y, masked], -1)
        return y
    x = tf.concat([x, tf.ones_like(x[..., :1])], -1)
    w = tf.concat([layer.w, layer.b[None]], 0)
    if masked_out:
        w = tf.concat(
            [
                w,
                tf.concat(
                    [tf.zeros([in_units, masked_out]), tf.fill([1, masked_out], MASKED_LOGIT)], 0
                ),
            ],
            1,
        )
    return matmul(x, w)


def dense_partial(layer, x, start, stop, weights=None):
    """`x @ w[start:stop]` without the bias: the contribution of input features `start:stop`
    (`x` holds only those). `dense_partial(layer, a, 0, n) + dense_partial(layer, b, n, in)` is
    `layer(concat([a, b]))` minus the bias, so a part that many calls share can be computed
    once, e.g. outside a recurrence."""
    if x.shape[-1] is not None and x.shape[-1] != stop - start:
        raise ValueError(
            f"dense_partial: x has {x.shape[-1]} features, rows {start}:{stop} "
            f"of the kernel need {stop - start}."
        )
    read_once = None if weights is None else weights.rows(layer, start, stop)
    if read_once is not None and x.shape.rank == 2 and layer.matmul_dtype == tf.float32:
        return _matmul_given_transpose(x, *read_once)
    kernel = _read(weights, layer.w)
    w = kernel if (start, stop) == (0, layer.w.shape[0]) else kernel[start:stop]
    x, w = in_dtype(layer.matmul_dtype, x, w)
    return out_float32(matmul(x, w))


def onehot_partial(layer, index, start, num_classes, onehot=None, weights=None):
    """`dense_partial(layer, onehot(index), start, ...)` without the one-hot: `index` `[..., K]`
    holds the classes of K one-hot groups of `num_classes` features each (flattened group-major,
    like the latent `z`), so the product is a sum of K kernel rows: K gathers instead of a
    matmul whose input is almost all zeros.

    The kernel's gradient is the matmul's, `onehot^T @ dy`, computed as K segment sums of `dy`
    over the classes. Without `onehot` no gradient reaches the features; with `onehot` (the
    features themselves, `[..., K * num_classes]`, e.g. a straight-through sample) they get the
    matmul's gradient `dy @ kernel^T`.

    With these rows read once for a loop (`weights`) and `onehot` given, both gradients are
    small matmuls instead (`onehot^T @ dy`, and `dy` times the transpose made before the loop):
    at a loop step's few rows, K segment sums cost more than the matmul.
    """
    stop = start + index.shape[-1] * num_classes
    read_once = None if weights is None else weights.rows(layer, start, stop)
    rows = _read(weights, layer.w)[start:stop] if read_once is None else read_once[0]
    if read_once is not None and onehot is not None and onehot.shape.rank == 2:
        rows_t = read_once[1]

        @tf.custom_gradient
        def looped(rows, features):
            def grad(dy):
                return (tf.matmul(features, dy, transpose_a=True), tf.matmul(dy, rows_t))

            return _row_sums(rows, index, num_classes), grad

        return looped(rows, onehot)

    @tf.custom_gradient
    def row_sums(rows, *features):
        def grad(dy):
            flat_dy = tf.reshape(dy, [-1, dy.shape[-1]])
            flat_index = tf.reshape(index, [-1, index.shape[-1]])
            d_rows = tf.concat(
                [
                    tf.math.unsorted_segment_sum(flat_dy, flat_index[:, k], num_classes)
                    for k in range(index.shape[-1])
                ],
                0,
            )
            if not features:
                return d_rows
            d_features = tf.matmul(flat_dy, rows, transpose_b=True)
            return d_rows, tf.reshape(d_features, tf.shape(features[0]))

        return _row_sums(rows, index, num_classes), grad

    return row_sums(rows) if onehot is None else row_sums(rows, onehot)


def _row_sums(rows, index, num_classes):
    """`sum_k rows[k * num_classes + index[..., k]]`, `[..., units]`."""
    flat = index + num_classes * tf.range(index.shape[-1])
    out = tf.gather(rows, flat[..., 0])
    for k in range(1, index.shape[-1]):
        out += tf.gather(rows, flat[..., k])
    return out


# --- LayerNorm, blocks, MLPs, GRU ---------------------------------------------------------------
def layer_norm(norm, x, weights=None):
    """`norm(x)` (a :class:`~rllib_dreamerv3.networks.LayerNorm`) with its gradient written out.

    The row means (two forward, two backward) are matrix-vector products with a `1 / units`
    vector, into which XLA:CPU fuses the elementwise work (a reduction along the last axis it
    splits into unvectorised reduce-windows). The scale and offset gradients are column sums of
    the gradient viewed as a matrix `[rows, units]` (over the leading axes of `[T, N, units]`
    XLA:CPU would sum in reduce-windows that stride through memory).
    """
    scale, offset, eps = _read(weights, norm.scale), _read(weights, norm.offset), norm.eps
    units = x.shape[-1]
    average = tf.fill([units, 1], 1.0 / units)

    def row_mean(v):  # [..., units] -> [..., 1]
        return tf.matmul(v, average) if v.shape.rank == 2 else tf.tensordot(v, average, 1)

    @tf.custom_gradient
    def normalize(x, scale, offset):
        centred = x - row_mean(x)
        inv_std = tf.math.rsqrt(row_mean(centred * centred) + eps)
        normed = centred * inv_std

        def grad(dy):
            d_normed = dy * scale
            dx = inv_std * (d_normed - row_mean(d_normed) - normed * row_mean(d_normed * normed))
            flat_dy = tf.reshape(dy, [-1, units])
            return (
                dx,
                tf.reduce_sum(flat_dy * tf.reshape(normed, [-1, units]), 0),
                tf.reduce_sum(flat_dy, 0),
            )

        return normed * scale + offset, grad

    return normalize(x, scale, offset)


def activate(block, pre, weights=None):
    """LayerNorm -> SiLU of a :class:`~rllib_dreamerv3.networks.DenseBlock`'s pre-activation,
    computed by the caller from `block.dense`."""
    return tf.nn.silu(layer_norm(block.norm, pre, weights))


def dense_block(block, x, rest=None, weights=None):
    """`block(x)`; or, with `rest`, `block(concat([x, features]))` where `rest` is the other
    features' contribution to the pre-activation (from :func:`dense_partial`)."""
    if rest is None:
        return activate(block, dense(block.dense, x, weights), weights)
    return activate(block, dense_partial(block.dense, x, 0, x.shape[-1], weights) + rest, weights)


def mlp_hidden(net, x, rest=None, weights=None):
    """The hidden layers of an :class:`~rllib_dreamerv3.networks.MLP` (`rest`: as in
    :func:`dense_block`, for the first layer)."""
    for i, block in enumerate(net.blocks):
        x = dense_block(block, x, rest if i == 0 else None, weights)
    return x


def mlp(net, x, rest=None, weights=None, masked_out=0):
    """`net(x)` (an :class:`~rllib_dreamerv3.networks.MLP`); `rest` as in :func:`dense_block`;
    `masked_out` masked output columns (see :func:`dense`)."""
    x = mlp_hidden(net, x, rest, weights)
    return dense(net.out, x, weights, masked_out) if net.out is not None else x


def mlp_with_mean(net, x, rest=None, masked_out=0):
    """`(mlp(net, x, rest, masked_out=...), mean)`: the output and the mean of its `out_units`
    units `[...]`, without gradient, for the price of a matrix-vector product of the output
    layer's input with the kernel's row means (a cheap shift for
    :func:`~.two_hot.two_hot_stats`)."""
    out = net.out
    if out is None or out.b is None:
        raise ValueError(
            "mlp_with_mean needs an MLP with an output layer that has a bias (a "
            "two-hot head, networks.two_hot_head); this one has "
            f"{'no output layer' if out is None else 'no bias'}."
        )
    x = mlp_hidden(net, x, rest)
    mean = tf.tensordot(tf.stop_gradient(x), tf.stop_gradient(tf.reduce_mean(out.w, 1)), 1)
    mean += tf.stop_gradient(tf.reduce_mean(out.b))
    return dense(out, x, masked_out=masked_out), mean


def first_layer_part(net, x, start, weights=None):
    """The pre-activation contribution of an MLP's input features `start:` (in `x`)."""
    layer = net.blocks[0].dense
    return dense_partial(layer, x, start, layer.w.shape[0], weights)


def gru(cell, x, h, weights=None):
    """`cell(x, h)` (a :class:`~rllib_dreamerv3.networks.GRUCell`)."""
    pre = dense(cell.dense, tf.concat([x, h], -1), weights)
    return cell.gate(layer_norm(cell.norm, pre, weights), h)


# --- convolutions -------------------------------------------------------------------------------
# Stride-2 convolutions with an even kernel k as matmuls. XLA:CPU runs tf.nn.conv2d and its
# transpose well below its matmul throughput on these layer shapes; the same maps written as
# space-to-depth plus matmuls are numerically equal (tests/test_kernels.py). "same" padding of an
# even size with stride 2 pads (k - 2) / 2 on each side; after space-to-depth by 2 the
# convolution is a (k/2)×(k/2) valid one, whose k/2 · k/2 shifted windows are the matmuls'
# inputs. For small batches (the policy's one frame per env) TF's own convolution is faster.
MATMUL_CONV_MIN_BATCH = 64
"""Batches from this size on use the matmul form (the update's frames, not the policy's)."""


def _matmul_conv_applies(x, w, stride):
    return (
        stride == 2
        and w.shape[0] == w.shape[1]
        and w.shape[0] % 2 == 0
        and None not in x.shape[:3]
        and x.shape[0] >= MATMUL_CONV_MIN_BATCH
        and x.shape[1] % 2 == 0
        and x.shape[2] % 2 == 0
    )


def _kernel_matrix(w):
    """`[k, k, c, o]` -> `[(k/2)² · 4c, o]`, rows in (a, b, dy, dx, c) order: kernel tap
    `(2a + dy, 2b + dx)` of channel `c` (space-to-depth's channel order is (dy, dx, c))."""
    k, _, c, o = w.shape
    m = k // 2
    w = tf.reshape(w, [m, 2, m, 2, c, o])
    return tf.reshape(tf.transpose(w, [0, 2, 1, 3, 4, 5]), [m * m * 4 * c, o])


WINDOW_MATMULS_MIN_WIDTH = 32
"""Windows at least this wide (4 · channels) multiply their own rows of the kernel matrix, the
products summed, instead of one matmul on the concatenated windows: that skips writing the
concatenation and slicing its gradient, which pays except for thin windows (RGB layers)."""


def _conv_s2_matmul(x, w):
    """`tf.nn.conv2d(x, w, 2, "SAME")` for an even kernel and even height and width."""
    height, width, c = x.shape[1], x.shape[2], x.shape[3]
    k, m = w.shape[0], w.shape[0] // 2
    pad = (k - 2) // 2
    blocks = tf.nn.space_to_depth(tf.pad(x, [[0, 0], [pad, pad], [pad, pad], [0, 0]]), 2)
    ho, wo = height // 2, width // 2
    windows = [blocks[:, a : a + ho, b : b + wo, :] for a in range(m) for b in range(m)]
    kernel = _kernel_matrix(w)
    if 4 * c >= WINDOW_MATMULS_MIN_WIDTH:
        rows = tf.split(kernel, m * m, 0)
        y = tf.add_n([tf.reshape(win, [-1, 4 * c]) @ r for win, r in zip(windows, rows)])
    else:
        y = tf.reshape(tf.concat(windows, -1), [-1, m * m * 4 * c]) @ kernel
    return tf.reshape(y, [-1, ho, wo, w.shape[3]])


def _conv_transpose_s2_matmul(x, w):
    """`tf.nn.conv2d_transpose(x, w, [n, 2h, 2w, o], 2, "SAME")` (`w`: `[k, k, o, c]`): the
    adjoint of :func:`_conv_s2_matmul` — matmuls, then the windows added back in place."""
    height, width, c = x.shape[1], x.shape[2], x.shape[3]
    k, o, m = w.shape[0], w.shape[2], w.shape[0] // 2
    flat = tf.reshape(x, [-1, c])
    kernel = tf.transpose(_kernel_matrix(w))
    if 4 * o >= WINDOW_MATMULS_MIN_WIDTH:
        parts = [flat @ cols for cols in tf.split(kernel, m * m, 1)]
    else:
        parts = tf.split(flat @ kernel, m * m, -1)
    parts = [tf.reshape(part, [-1, height, width, 4 * o]) for part in parts]
    blocks = tf.add_n(
        [
            tf.pad(parts[a * m + b], [[0, 0], [a, m - 1 - a], [b, m - 1 - b], [0, 0]])
            for a in range(m)
            for b in range(m)
        ]
    )
    pad = (k - 2) // 2
    return tf.nn.depth_to_space(blocks, 2)[:, pad : pad + 2 * height, pad : pad + 2 * width, :]


def conv(layer, x):
    """`layer(x)` (a :class:`~rllib_dreamerv3.networks.Conv`), as matmuls where they apply."""
    x, w = in_dtype(layer.matmul_dtype, x, layer.w)
    if not _matmul_conv_applies(x, w, layer.stride):
        return layer(x)
    y = _conv_transpose_s2_matmul(x, w) if layer.transpose else _conv_s2_matmul(x, w)
    # Summed once, not in each of the norm's passes that read it; the predicate reads the
    # input, else XLA materialises the transposed convolution's parts for it.
    y = out_float32(materialized(y, decider=x))
    return y if layer.b is None else y + layer.b


def conv_block(block, x):
    """`block(x)` (a :class:`~rllib_dreamerv3.networks.ConvBlock`), with the norm and SiLU on
    the feature map viewed as a matrix `[N * H * W, channels]`: over the 4-D map, the gradients
    of the norm's scale and offset are sums over three leading axes, which XLA:CPU splits into
    reduce-windows that stride through memory; over the matrix they are column sums read in
    order."""
    y = conv(block.conv, x)
    flat = tf.reshape(y, [-1, y.shape[-1]])
    return tf.reshape(tf.nn.silu(layer_norm(block.norm, flat)), tf.shape(y))


# --- encoders and decoders ----------------------------------------------------------------------
def encoder(enc, obs):
    """`enc(obs)` for the encoders of :mod:`rllib_dreamerv3.encoders`."""
    if isinstance(enc, VectorEncoder):
        x, lead = flatten_leading(tf.cast(obs, tf.float32), 1)
        return restore_leading(mlp(enc.mlp, symlog(x)), lead, 1)
    if isinstance(enc, ImageEncoder):
        x, lead = flatten_leading(obs, 3)
        x = tf.cast(x, tf.float32) / 255.0 - 0.5
        for block in enc.blocks:
            x = conv_block(block, x)
        return restore_leading(tf.reshape(x, [-1, enc.out_units]), lead, 1)
    if isinstance(enc, DictEncoder):
        return tf.concat([encoder(part, x) for part, x in zip(enc.parts, enc.inputs(obs))], -1)
    raise TypeError(f"kernels.encoder: no fast path for {type(enc).__name__}.")


def decoder(dec, feat):
    """`dec(feat)` for the decoders of :mod:`rllib_dreamerv3.encoders`."""
    if isinstance(dec, DictDecoder):
        return dec.split([decoder(part, feat) for part in dec.parts])
    x, lead = flatten_leading(feat, 1)
    if isinstance(dec, VectorDecoder):
        return restore_leading(mlp(dec.mlp, x), lead, 1)
    if isinstance(dec, ImageDecoder):
        x = tf.reshape(dense(dec.dense, x), [-1, *dec.start_shape])
        for block in dec.blocks:
            x = conv_block(block, x)
        return restore_leading(conv(dec.out, x), lead, 3)
    raise TypeError(f"kernels.decoder: no fast path for {type(dec).__name__}.")


def decoder_loss(dec, feat, obs):
    """`dec.loss(feat, obs)` with the decoder's forward pass from :func:`decoder`."""
    return dec.loss_of(decoder(dec, feat), obs)
