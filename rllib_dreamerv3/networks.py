"""Building blocks shared by the world model, actor and critic.

Every hidden layer is `Dense (or Conv) without bias -> LayerNorm -> SiLU` (:class:`DenseBlock`,
:class:`ConvBlock`), as in the author's implementation of DreamerV3; output layers have a bias.
Networks are plain `tf.Module`s holding `tf.Variable`s, so that one compiled function can read
and update all of them.

This module is the reference: each layer's `__call__` is the textbook computation.
:mod:`rllib_dreamerv3.kernels` computes the same functions of the same variables faster
(`fast_kernels=True`); the tests check that both agree.
"""

import math

import tensorflow as tf


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


def in_dtype(dtype, *tensors):
    """`tensors` cast to `dtype` (a layer's `matmul_dtype`) where they are not already."""
    return [t if t.dtype == dtype else tf.cast(t, dtype) for t in tensors]


def out_float32(y):
    """A matmul's or convolution's output back in float32."""
    return y if y.dtype == tf.float32 else tf.cast(y, tf.float32)


def matmul(x, w):
    """`x @ w` over the last axis of `x`, of any rank."""
    return tf.matmul(x, w) if x.shape.rank == 2 else tf.tensordot(x, w, 1)


class Dense(tf.Module):
    """`x @ w (+ b)`; `zero_init` starts the output at exactly zero (reward and critic heads)."""

    matmul_dtype = tf.float32  # see `set_matmul_dtype`

    def __init__(self, in_units, out_units, bias=True, zero_init=False, name=None):
        super().__init__(name=name)
        shape = [in_units, out_units]
        init = tf.zeros(shape) if zero_init else _glorot_uniform(shape)
        self.w = tf.Variable(init, name="w")
        self.b = tf.Variable(tf.zeros([out_units]), name="b") if bias else None

    def __call__(self, x):
        x, w = in_dtype(self.matmul_dtype, x, self.w)
        y = out_float32(matmul(x, w))
        return y if self.b is None else y + self.b


class LayerNorm(tf.Module):
    """Layer normalisation over the last axis with a learned scale and offset."""

    def __init__(self, units, eps=1e-3, name=None):
        super().__init__(name=name)
        self.eps = eps
        self.scale = tf.Variable(tf.ones([units]), name="scale")
        self.offset = tf.Variable(tf.zeros([units]), name="offset")

    def __call__(self, x):
        mean, var = tf.nn.moments(x, axes=[-1], keepdims=True)
        return (x - mean) * tf.math.rsqrt(var + self.eps) * self.scale + self.offset


class DenseBlock(tf.Module):
    """The hidden layer of every MLP: Dense without bias -> LayerNorm -> SiLU."""

    def __init__(self, in_units, out_units, name=None):
        super().__init__(name=name)
        self.dense = Dense(in_units, out_units, bias=False)
        self.norm = LayerNorm(out_units)

    def __call__(self, x):
        return tf.nn.silu(self.norm(self.dense(x)))


class Conv(tf.Module):
    """2-D convolution on `[N, H, W, C]`, stride `stride`, "same" padding.

    `transpose=True` is the transposed convolution that multiplies height and width by `stride`
    (the decoder's upsampling step).
    """

    matmul_dtype = tf.float32  # see `set_matmul_dtype`

    def __init__(
        self, in_channels, out_channels, kernel, stride, transpose=False, bias=True, name=None
    ):
        super().__init__(name=name)
        self.stride, self.transpose, self.out_channels = stride, transpose, out_channels
        shape = (
            [kernel, kernel, out_channels, in_channels]
            if transpose
            else [kernel, kernel, in_channels, out_channels]
        )
        self.w = tf.Variable(_glorot_uniform(shape), name="w")
        self.b = tf.Variable(tf.zeros([out_channels]), name="b") if bias else None

    def __call__(self, x):
        x, w = in_dtype(self.matmul_dtype, x, self.w)
        if self.transpose:
            n, height, width = tf.shape(x)[0], x.shape[1], x.shape[2]
            out_shape = tf.stack([n, height * self.stride, width * self.stride, self.out_channels])
            y = tf.nn.conv2d_transpose(x, w, out_shape, self.stride, padding="SAME")
        else:
            y = tf.nn.conv2d(x, w, self.stride, padding="SAME")
        y = out_float32(y)
        return y if self.b is None else y + self.b


class ConvBlock(tf.Module):
    """The hidden layer of the CNNs: Conv (or transposed Conv) without bias -> LayerNorm over
    channels -> SiLU."""

    def __init__(self, in_channels, out_channels, kernel, stride, transpose=False, name=None):
        super().__init__(name=name)
        self.conv = Conv(in_channels, out_channels, kernel, stride, transpose, bias=False)
        self.norm = LayerNorm(out_channels)

    def __call__(self, x):
        return tf.nn.silu(self.norm(self.conv(x)))


class MLP(tf.Module):
    """`num_layers` :class:`DenseBlock`s of `units` each, optionally followed by an output
    layer of `out_units`."""

    def __init__(self, in_units, units, num_layers, out_units=None, zero_init_out=False, name=None):
        super().__init__(name=name)
        sizes = [in_units] + [units] * num_layers
        self.blocks = [DenseBlock(a, b) for a, b in zip(sizes[:-1], sizes[1:])]
        self.out = Dense(sizes[-1], out_units, zero_init=zero_init_out) if out_units else None
        self.out_units = out_units or sizes[-1]

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return self.out(x) if self.out is not None else x


def two_hot_head(in_units, size, num_bins):
    """The MLP of a two-hot head (reward, critic): `size`'s hidden layers and a zero-initialised
    output layer of `num_bins` logits, so that the head predicts 0 at the start."""
    return MLP(in_units, size.dense_units, size.mlp_layers, out_units=num_bins, zero_init_out=True)


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
        return self.gate(self.norm(self.dense(tf.concat([x, h], -1))), h)

    @staticmethod
    def gate(parts, h):
        """The new state from the normalised pre-activations `parts` `[N, 3 * units]`."""
        reset, cand, update = tf.split(parts, 3, axis=-1)
        cand = tf.tanh(tf.sigmoid(reset) * cand)
        update = tf.sigmoid(update - 1.0)
        return update * cand + (1.0 - update) * h
