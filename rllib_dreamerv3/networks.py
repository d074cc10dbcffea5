"""Building blocks shared by the world model, actor and critic (SPEC §2).

Every hidden layer is `Dense (or Conv) without bias -> LayerNorm -> SiLU` (:class:`DenseBlock`,
:class:`ConvBlock`); output layers have a bias. Networks are plain `tf.Module`s holding `tf.Variable`s, so that one compiled
function can read and update all of them.
"""

import contextlib
import math

import tensorflow as tf
from tensorflow.python.ops import list_ops  # TensorList ops (no public API; TF is pinned)

from rllib_dreamerv3 import math_ops


def _glorot_uniform(shape):
    """Glorot-uniform init of a dense `[in, out]` or conv `[k, k, in, out]` kernel."""
    receptive = math.prod(shape[:-2])
    fan_in, fan_out = receptive * shape[-2], receptive * shape[-1]
    limit = math.sqrt(6.0 / (fan_in + fan_out))
    return tf.random.uniform(shape, -limit, limit)


def set_matmul_dtype(module, dtype):
    """Run the matmuls and convolutions of every :class:`Dense` and :class:`Conv` inside
    `module` in `dtype` (e.g. `tf.bfloat16` on GPUs). Variables, normalisation, activations
    and outputs stay float32 (mixed precision)."""
    for sub in module.submodules:
        if isinstance(sub, (Dense, Conv)):
            sub.matmul_dtype = tf.as_dtype(dtype)


def _in(dtype, *tensors):
    return [t if t.dtype == dtype else tf.cast(t, dtype) for t in tensors]


def _out(y):
    return y if y.dtype == tf.float32 else tf.cast(y, tf.float32)


def _matmul(x, w):
    """`x @ w` over the last axis of `x`, of any rank."""
    return tf.matmul(x, w) if x.shape.rank == 2 else tf.tensordot(x, w, 1)


MASKED_LOGIT = -1e30
"""The value of the masked outputs of a :class:`Dense` with `masked_out`: a logit whose softmax
probability is exactly 0 (`exp(-1e30 - anything finite)` is 0 in float32)."""


class Dense(tf.Module):
    """`x @ w (+ b)`; `zero_init` starts the output at exactly zero (reward and critic heads).

    `masked_out`: that many constant :data:`MASKED_LOGIT` columns appended to the output (needs
    the bias), so a softmax head's width can be rounded up to a multiple of the SIMD width: the
    two-hot heads' 255 bins are computed as 256 columns, which XLA:CPU multiplies ~20 % faster
    (a critic head's forward and backward at 16384 rows: 7.5 → 6.4 ms at nano's width;
    :func:`~rllib_dreamerv3.math_ops.two_hot_stats` takes such logits). They are part of the
    kernel (a zero column, `MASKED_LOGIT` in the bias row), not variables: checkpoints and the
    gradients keep the `out_units` columns.
    """

    matmul_dtype = tf.float32  # see `set_matmul_dtype`

    def __init__(self, in_units, out_units, bias=True, zero_init=False, masked_out=0, name=None):
        super().__init__(name=name)
        if masked_out and not bias:
            raise ValueError(f"Dense: masked_out={masked_out} needs bias=True (the masked "
                             "columns' constant sits in the bias row of the kernel).")
        init = tf.zeros([in_units, out_units]) if zero_init else _glorot_uniform([in_units, out_units])
        self.w = tf.Variable(init, name="w")
        self.b = tf.Variable(tf.zeros([out_units]), name="b") if bias else None
        self.masked_out = masked_out

    def __call__(self, x):
        if self.b is None:
            return self.partial(x, 0, self.w.shape[0])
        if self.matmul_dtype != tf.float32 or not isinstance(self.w, tf.Variable):
            # bfloat16 keeps the bias in float32; weights read once for a loop
            # (`variables_read_once`) keep it apart too: the folded kernel would be a new tensor
            # every step, which the loop's gradient stores once per step ([64, 257, 1024] at XS).
            y = self.partial(x, 0, self.w.shape[0]) + self.b
            if self.masked_out:
                masked = tf.fill(tf.concat([tf.shape(y)[:-1], [self.masked_out]], 0),
                                 MASKED_LOGIT)
                y = tf.concat([y, masked], -1)
            return y
        # The bias as one more kernel row, on a constant-1 feature: XLA:CPU then neither adds
        # it in a pass of its own over the output nor sums its gradient in another (both cost
        # more than the matmul for the 255-bin heads at small sizes: -8 % of a nano update).
        x = tf.concat([x, tf.ones_like(x[..., :1])], -1)
        w = tf.concat([self.w, self.b[None]], 0)
        if self.masked_out:
            w = tf.concat([w, self._masked_columns()], 1)
        return _matmul(x, w)

    def _masked_columns(self):
        """`[in_units + 1, masked_out]`: zero kernel rows, :data:`MASKED_LOGIT` in the bias row."""
        in_units = self.w.shape[0]
        return tf.concat([tf.zeros([in_units, self.masked_out]),
                          tf.fill([1, self.masked_out], MASKED_LOGIT)], 0)

    def partial(self, x, start, stop):
        """`x @ w[start:stop]` without the bias: the contribution of input features
        `start:stop` (`x` holds only those). `partial(a, 0, n) + partial(b, n, in_units)` is
        `self(concat([a, b]))` minus the bias, so a part that many calls share can be computed
        once, e.g. outside a recurrence."""
        if x.shape[-1] is not None and x.shape[-1] != stop - start:
            raise ValueError(f"Dense.partial: x has {x.shape[-1]} features, rows {start}:{stop} "
                             f"of the kernel need {stop - start}.")
        read_once = _READ_ONCE.get((self, start, stop))  # see `variables_read_once`
        if read_once is not None and x.shape.rank == 2 and self.matmul_dtype == tf.float32:
            return _matmul_given_transpose(x, *read_once)
        w = self.w if (start, stop) == (0, self.w.shape[0]) else self.w[start:stop]
        x, w = _in(self.matmul_dtype, x, w)
        return _out(_matmul(x, w))

    def onehot_partial(self, index, start, num_classes, onehot=None):
        """`partial(onehot(index), start, ...)` without the one-hot: `index` `[..., K]` holds the
        classes of K one-hot groups of `num_classes` features each (flattened group-major, like
        the latent `z`), so the product is a sum of K kernel rows — K gathers instead of a
        matmul whose input is almost all zeros (8× faster for the XS latent).

        The kernel's gradient is the matmul's, `onehot^T @ dy`, computed as K segment sums of
        `dy` over the classes (3× faster than that matmul at XS, where it was 8.6 GFLOP for the
        critic alone). Without `onehot` no gradient reaches the features; with `onehot` (the
        features themselves, `[..., K * num_classes]`, e.g. a straight-through sample) they get
        the matmul's gradient `dy @ kernel^T`.

        In a loop whose weights are read once (`variables_read_once`, these rows among its
        `row_blocks`), and with `onehot` given, both gradients are small matmuls instead
        (`onehot^T @ dy`, and `dy` times the rows' transpose made before the loop): 32 segment
        sums per step cost more than the matmul at a loop's 16 rows.
        """
        stop = start + index.shape[-1] * num_classes
        read_once = _READ_ONCE.get((self, start, stop))  # rows sliced before a loop
        rows = self.w[start:stop] if read_once is None else read_once[0]
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
                d_rows = tf.concat([tf.math.unsorted_segment_sum(flat_dy, flat_index[:, k],
                                                                 num_classes)
                                    for k in range(index.shape[-1])], 0)
                if not features:
                    return d_rows
                d_features = tf.matmul(flat_dy, rows, transpose_b=True)
                return d_rows, tf.reshape(d_features, tf.shape(features[0]))

            return _row_sums(rows, index, num_classes), grad

        return row_sums(rows) if onehot is None else row_sums(rows, onehot)


def _matmul_given_transpose(x, w, w_t):
    """`x @ w` for a kernel read once before a loop, whose input gradient `dy @ w^T` multiplies
    `w_t`, the transpose made once before the loop too: XLA:CPU multiplies a loop's small
    `[batch, out]` gradients by a transposed operand ~25 % slower than by a plain one, and
    these products are the observe loop's backward critical path."""
    @tf.custom_gradient
    def matmul(x, w):
        def grad(dy):
            return tf.matmul(dy, w_t), tf.matmul(x, dy, transpose_a=True)
        return tf.matmul(x, w), grad

    return matmul(x, w)


def _row_sums(rows, index, num_classes):
    """`sum_k rows[k * num_classes + index[..., k]]`, `[..., units]`."""
    flat = index + num_classes * tf.range(index.shape[-1])
    out = tf.gather(rows, flat[..., 0])
    for k in range(1, index.shape[-1]):
        out += tf.gather(rows, flat[..., k])
    return out


class LayerNorm(tf.Module):
    """Layer normalisation over the last axis with a learned scale and offset."""

    def __init__(self, units, eps=1e-3, name=None):
        super().__init__(name=name)
        self.eps = eps
        self.scale = tf.Variable(tf.ones([units]), name="scale")
        self.offset = tf.Variable(tf.zeros([units]), name="offset")

    def __call__(self, x):
        return _layer_norm(x, self.scale, self.offset, self.eps)


def _layer_norm(x, scale, offset, eps):
    """`(x - mean) / sqrt(var + eps) * scale + offset` over the last axis, with its gradient
    written out: the row means (two forward, two backward) are matrix-vector products with a
    `1 / units` vector, into which XLA:CPU fuses the elementwise work (a reduction along the last
    axis it splits into reduce-windows, unvectorised): LayerNorm and SiLU, forward and backward,
    15–25 % faster in a microbenchmark from `[1024, 16]` to `[16384, 256]`. The scale and offset
    gradients are column sums of the gradient viewed as a matrix `[rows, units]` (over the
    leading axes of `[T, N, units]` XLA:CPU would sum in reduce-windows that stride through
    memory)."""
    units = x.shape[-1]
    average = tf.fill([units, 1], 1.0 / units)

    def row_mean(v):  # [..., units] -> [..., 1]
        return tf.matmul(v, average) if v.shape.rank == 2 else tf.tensordot(v, average, 1)

    @tf.custom_gradient
    def norm(x, scale, offset):
        centred = x - row_mean(x)
        inv_std = tf.math.rsqrt(row_mean(centred * centred) + eps)
        normed = centred * inv_std

        def grad(dy):
            d_normed = dy * scale
            dx = inv_std * (d_normed - row_mean(d_normed) - normed * row_mean(d_normed * normed))
            flat_dy = tf.reshape(dy, [-1, units])
            return (dx, tf.reduce_sum(flat_dy * tf.reshape(normed, [-1, units]), 0),
                    tf.reduce_sum(flat_dy, 0))

        return normed * scale + offset, grad

    return norm(x, scale, offset)


class DenseBlock(tf.Module):
    """The hidden layer of every MLP: Dense without bias -> LayerNorm -> SiLU."""

    def __init__(self, in_units, out_units, name=None):
        super().__init__(name=name)
        self.dense = Dense(in_units, out_units, bias=False)
        self.norm = LayerNorm(out_units)

    def __call__(self, x, rest=None):
        """`x`: the input; or its first features, with `rest` the other features' contribution
        (`self.dense.partial(...)`, see :meth:`Dense.partial`)."""
        pre = self.dense(x) if rest is None else self.dense.partial(x, 0, x.shape[-1]) + rest
        return self.activate(pre)

    def activate(self, pre):
        """LayerNorm -> SiLU of a pre-activation computed by the caller from `self.dense`."""
        return tf.nn.silu(self.norm(pre))


class Conv(tf.Module):
    """2-D convolution on `[N, H, W, C]`, stride `stride`, "same" padding.

    `transpose=True` is the transposed convolution that multiplies height and width by `stride`
    (the decoder's upsampling step).
    """

    matmul_dtype = tf.float32  # see `set_matmul_dtype`

    def __init__(self, in_channels, out_channels, kernel, stride, transpose=False, bias=True,
                 name=None):
        super().__init__(name=name)
        self.stride, self.transpose, self.out_channels = stride, transpose, out_channels
        shape = ([kernel, kernel, out_channels, in_channels] if transpose
                 else [kernel, kernel, in_channels, out_channels])
        self.w = tf.Variable(_glorot_uniform(shape), name="w")
        self.b = tf.Variable(tf.zeros([out_channels]), name="b") if bias else None

    def __call__(self, x):
        x, w = _in(self.matmul_dtype, x, self.w)
        if _matmul_conv_applies(x, w, self.stride):
            y = (_conv_transpose_s2_matmul(x, w) if self.transpose
                 else _conv_s2_matmul(x, w))
            # Summed once, not in each of the norm's passes that read it (XS images -10 %); the
            # predicate reads the input, else XLA materialises the transposed conv's parts for it.
            y = materialized(y, decider=x)
        elif self.transpose:
            n, height, width = tf.shape(x)[0], x.shape[1], x.shape[2]
            out_shape = tf.stack([n, height * self.stride, width * self.stride,
                                  self.out_channels])
            y = tf.nn.conv2d_transpose(x, w, out_shape, self.stride, padding="SAME")
        else:
            y = tf.nn.conv2d(x, w, self.stride, padding="SAME")
        y = _out(y)
        return y + self.b if self.b is not None else y


# Stride-2 convolutions with an even kernel k as one matmul. XLA:CPU runs tf.nn.conv2d and its
# transpose at a third to a half of its matmul throughput on our layer shapes; the same maps
# written as space-to-depth plus one matmul are about twice as fast forward and backward on the
# update's 16×64 frames, and numerically equal (tests/test_networks.py). For small batches (the
# policy's one frame per env) TF's own convolution is faster, so it is kept there. "same"
# padding of an even size with stride 2 pads (k - 2) / 2 on each side; after space-to-depth by 2
# the convolution is a (k/2)×(k/2) valid one, whose k/2 · k/2 shifted windows are concatenated
# into the matmul's input.
MATMUL_CONV_MIN_BATCH = 64


def _matmul_conv_applies(x, w, stride):
    return (stride == 2 and w.shape[0] == w.shape[1] and w.shape[0] % 2 == 0
            and None not in x.shape[:3] and x.shape[0] >= MATMUL_CONV_MIN_BATCH
            and x.shape[1] % 2 == 0 and x.shape[2] % 2 == 0)


def _kernel_matrix(w):
    """`[k, k, c, o]` -> `[(k/2)² · 4c, o]`, rows in (a, b, dy, dx, c) order: kernel tap
    `(2a + dy, 2b + dx)` of channel `c` (space-to-depth's channel order is (dy, dx, c))."""
    k, _, c, o = w.shape
    m = k // 2
    w = tf.reshape(w, [m, 2, m, 2, c, o])
    return tf.reshape(tf.transpose(w, [0, 2, 1, 3, 4, 5]), [m * m * 4 * c, o])


# Each of the (k/2)² windows can also multiply its own rows of the kernel matrix, the products
# summed: that skips writing the concatenated input (forward) and slicing its gradient
# (backward), 10-30 % faster per layer on the update's S and XS layers, but slower where the
# window is thin (the RGB input and output layers, 4 · 3 columns). Both ways are equal up to
# float rounding.
WINDOW_MATMULS_MIN_WIDTH = 32


def _conv_s2_matmul(x, w):
    """`tf.nn.conv2d(x, w, 2, "SAME")` for an even kernel and even height and width."""
    height, width, c = x.shape[1], x.shape[2], x.shape[3]
    k, m = w.shape[0], w.shape[0] // 2
    pad = (k - 2) // 2
    blocks = tf.nn.space_to_depth(tf.pad(x, [[0, 0], [pad, pad], [pad, pad], [0, 0]]), 2)
    ho, wo = height // 2, width // 2
    windows = [blocks[:, a:a + ho, b:b + wo, :] for a in range(m) for b in range(m)]
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
    blocks = tf.add_n([tf.pad(parts[a * m + b], [[0, 0], [a, m - 1 - a], [b, m - 1 - b], [0, 0]])
                       for a in range(m) for b in range(m)])
    pad = (k - 2) // 2
    return tf.nn.depth_to_space(blocks, 2)[:, pad:pad + 2 * height, pad:pad + 2 * width, :]


class ConvBlock(tf.Module):
    """The hidden layer of the CNNs: Conv (or transposed Conv) without bias -> LayerNorm over
    channels -> SiLU."""

    def __init__(self, in_channels, out_channels, kernel, stride, transpose=False, name=None):
        super().__init__(name=name)
        self.conv = Conv(in_channels, out_channels, kernel, stride, transpose, bias=False)
        self.norm = LayerNorm(out_channels)

    def __call__(self, x):
        # Norm and SiLU on the feature map viewed as a matrix `[N * H * W, channels]`: over the
        # 4-D map, the gradients of the norm's scale and offset are sums over three leading axes,
        # which XLA:CPU splits into reduce-windows that stride through memory (58 ms for one
        # `[1024, 32, 32, 32]` sum at S); over the matrix they are column sums read in order
        # (5-9 ms). (Doing the same for the MLPs' rank-3 inputs made the update slower.)
        y = self.conv(x)
        flat = tf.reshape(y, [-1, y.shape[-1]])
        return tf.reshape(tf.nn.silu(self.norm(flat)), tf.shape(y))


class MLP(tf.Module):
    """`num_layers` :class:`DenseBlock`s of `units` each, optionally followed by an output layer
    (`masked_out`: see :class:`Dense`; the output then has `out_units + masked_out` columns)."""

    def __init__(self, in_units, units, num_layers, out_units=None, zero_init_out=False,
                 masked_out=0, name=None):
        super().__init__(name=name)
        sizes = [in_units] + [units] * num_layers
        self.blocks = [DenseBlock(a, b) for a, b in zip(sizes[:-1], sizes[1:])]
        self.out = (Dense(sizes[-1], out_units, zero_init=zero_init_out, masked_out=masked_out)
                    if out_units else None)
        self.out_units = out_units or sizes[-1]

    def __call__(self, x, rest=None):
        """`rest`: as in :meth:`DenseBlock.__call__`, for the first layer (`x` then holds only the
        first input features)."""
        x = self._hidden(x, rest)
        return self.out(x) if self.out is not None else x

    def _hidden(self, x, rest):
        for i, block in enumerate(self.blocks):
            x = block(x, rest if i == 0 else None)
        return x

    def with_mean_output(self, x, rest=None):
        """`(self(x, rest), mean)`: the output `[..., out_units (+ masked_out)]` and the mean of
        its `out_units` units `[...]`, without gradient, for the price of a matrix-vector product
        of the output layer's input with the kernel's row means (a cheap shift for
        :func:`~rllib_dreamerv3.math_ops.two_hot_stats`)."""
        if self.out is None:
            raise ValueError("MLP.with_mean_output needs an output layer; this MLP was built "
                             "without `out_units`.")
        x = self._hidden(x, rest)
        out = self.out
        mean = tf.tensordot(tf.stop_gradient(x), tf.stop_gradient(tf.reduce_mean(out.w, 1)), 1)
        if out.b is not None:
            mean += tf.stop_gradient(tf.reduce_mean(out.b))
        return out(x), mean

    def first_layer_part(self, x, start):
        """The first layer's pre-activation contribution of input features `start:` (in `x`)."""
        dense = self.blocks[0].dense
        return dense.partial(x, start, dense.w.shape[0])

    def first_layer_onehot_part(self, index, start, num_classes, onehot=None):
        """:meth:`first_layer_part` of one-hot features given by their class indices (see
        :meth:`Dense.onehot_partial`)."""
        return self.blocks[0].dense.onehot_partial(index, start, num_classes, onehot)


def two_hot_head(in_units, size, num_bins):
    """The MLP of a two-hot head (reward, critic): `size`'s hidden layers and a zero-initialised
    output layer of `num_bins` logits, rounded up by masked columns
    (:func:`~rllib_dreamerv3.math_ops.two_hot_masked_columns`; its output is that wide)."""
    return MLP(in_units, size.dense_units, size.mlp_layers, out_units=num_bins,
               zero_init_out=True, masked_out=math_ops.two_hot_masked_columns(num_bins))


class GRUCell(tf.Module):
    """DreamerV3's GRU: LayerNorm on the gate pre-activations, update gate biased to keep `h`.

    `h_t = u * cand + (1 - u) * h_{t-1}` with `u = sigmoid(update - 1)` and
    `cand = tanh(sigmoid(reset) * cand_pre)`; all three pre-activations come from one Dense
    without bias on `[x, h_{t-1}]`, followed by LayerNorm.
    """

    def __init__(self, in_units, units, name=None):
        super().__init__(name=name)
        self.units = units
        self.dense = Dense(in_units + units, 3 * units, bias=False)
        self.norm = LayerNorm(3 * units)

    def __call__(self, x, h):
        parts = self.norm(self.dense(tf.concat([x, h], -1)))
        reset, cand, update = tf.split(parts, 3, axis=-1)
        cand = tf.tanh(tf.sigmoid(reset) * cand)
        update = tf.sigmoid(update - 1.0)
        return update * cand + (1.0 - update) * h


# --- compilation aids for loops and their gradients (XLA) -------------------------------
def scan(fn, elems, initializer):
    """`tf.scan(fn, elems, initializer)` for loops whose per-step outputs are the new carries,
    with those outputs gathered in a way that XLA differentiates without copies.

    `tf.scan` writes each step's output into a list with `TensorListSetItem`, whose gradient
    reads the item and writes zeros over it in the same buffer: XLA then copies the whole
    `[T, ...]` gradient buffer twice per step (7 % of an XS update's time, measured A/B).
    Here outputs are pushed (`TensorListPushBack`, the gradient pops them), as TF's own loop
    gradients do with the tensors they keep. `elems` and `initializer` are nests of tensors with
    static shapes; `elems` are unstacked along their first axis (the number of steps).
    """
    flat_elems = tf.nest.flatten(elems)
    steps = flat_elems[0].shape[0]
    arrays = [tf.TensorArray(e.dtype, size=steps, element_shape=e.shape[1:]).unstack(e)
              for e in flat_elems]
    flat_init = [tf.convert_to_tensor(x) for x in tf.nest.flatten(initializer)]
    lists = [list_ops.empty_tensor_list(x.shape, x.dtype, max_num_elements=steps)
             for x in flat_init]

    def body(t, carry, lists):
        inputs = tf.nest.pack_sequence_as(elems, [array.read(t) for array in arrays])
        new = tf.nest.flatten(fn(tf.nest.pack_sequence_as(initializer, carry), inputs))
        return t + 1, new, [list_ops.tensor_list_push_back(out, x) for out, x in zip(lists, new)]

    _, _, lists = tf.while_loop(lambda t, *_: t < steps, body,
                                (tf.constant(0), flat_init, lists), maximum_iterations=steps)
    return tf.nest.pack_sequence_as(initializer, [
        list_ops.tensor_list_stack(out, x.dtype, num_elements=steps, element_shape=x.shape)
        for out, x in zip(lists, flat_init)])


# (dense, start, stop) -> (kernel rows, their transpose), read once: see `variables_read_once`
_READ_ONCE = {}


@contextlib.contextmanager
def variables_read_once(*modules, row_blocks=()):
    """Within the block, the variables of `modules` (and their submodules) are tensors read once.

    For loops (`tf.scan`, `tf.while_loop`) built inside the block: a variable read inside a
    loop body is a new tensor every iteration, and its gradient makes TF stack one copy of every
    weight per iteration (for the observe loop at XS, 64 copies of each kernel, pushed and
    popped: ~7 % of an update). Read before the loop, the weights are loop invariants and the
    gradients still reach the variables (the read is recorded by any active tape). The modules'
    attributes are swapped for the block's duration, so do not trace other functions of the same
    modules from another thread meanwhile.

    Every :class:`Dense` kernel inside is also transposed here, once, for the gradient of its
    products with the loop's rank-2 inputs (see :func:`_matmul_given_transpose`).
    `row_blocks`: `(dense, start, stop)` for each :meth:`Dense.partial` of a part of the kernel
    the loop calls: those rows are sliced (and transposed) here too (sliced in the loop, the
    rows would be a new tensor per step, stacked for the gradient like a variable read there).
    """
    saved, keys = [], []
    try:
        for module in modules:
            for owner in (module, *module.submodules):
                for name, value in sorted(vars(owner).items()):
                    if isinstance(value, tf.Variable):
                        saved.append((owner, name, value))
                        setattr(owner, name, tf.convert_to_tensor(value))
        denses = [sub for module in modules for sub in (module, *module.submodules)
                  if isinstance(sub, Dense)]
        blocks = [(dense, 0, dense.w.shape[0]) for dense in denses]
        for dense, start, stop in row_blocks:
            if dense not in denses:
                raise ValueError(f"variables_read_once: row_blocks names {dense.name!r}, which "
                                 "is not inside the modules given; add its module to them.")
            blocks.append((dense, start, stop))
        for dense, start, stop in blocks:
            rows = dense.w if (start, stop) == (0, dense.w.shape[0]) else dense.w[start:stop]
            _READ_ONCE[(dense, start, stop)] = (rows, tf.transpose(rows))
            keys.append((dense, start, stop))
        yield
    finally:
        for key in keys:
            del _READ_ONCE[key]
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)


def _through_cond(x, decider=None):
    """`x`, passed through a `tf.cond` whose branches are both the identity (exact for any
    predicate): XLA does not fuse across a conditional, so `x` is computed once, into a buffer
    of its own, and its consumers read that buffer. The predicate reads the first entry of
    `decider` (default `x`)."""
    decider = x if decider is None else decider
    same = lambda: tf.identity(x)  # noqa: E731
    return tf.cond(tf.reshape(decider, [-1])[0] > 0.0, same, same)


def materialized(x, decider=None):
    """Identity that XLA computes once, into a buffer of its own (its gradient passes through).

    A sum of matmul outputs (a convolution written as one matmul per kernel window) feeding a
    LayerNorm would otherwise be fused into each of the norm's passes, forward and backward,
    re-reading every operand each time. `decider`: a tensor computed before `x` (e.g. the
    layer's input) whose first entry is the conditional's predicate; by default `x`'s own,
    which XLA then computes from `x`'s operands in a fusion of its own, and may materialise
    them for it.
    """
    @tf.custom_gradient
    def identity(x):
        return _through_cond(x, decider), lambda dy: dy

    return identity(x)


@tf.custom_gradient
def materialized_gradient(x):
    """Identity whose gradient XLA computes once, into a buffer of its own.

    Backpropagating through an unrolled recurrence such as the GRU in imagination,
    `dh_{t-1} = (1 - u_t) * dh_t + ...` is a chain of elementwise ops; XLA fuses a copy of the
    chain into every consumer of every step's `dh` (up to its operand limit), re-reading dozens
    of buffers each time: ~15 % of an XS update with continuous actions. Here the gradient
    passes through a `tf.cond` whose two branches are the same identity, so it is exact for any
    predicate, and XLA does not fuse across a conditional. (`optimization_barrier` would say
    this directly, but XLA:CPU drops it before fusion.) The predicate reads `x`, computed in
    the forward pass, not the gradient (-2 % at XS continuous, A/B).
    """
    return tf.identity(x), lambda dy: _through_cond(dy, decider=x)
