"""Building blocks shared by the world model, actor and critic (SPEC §2).

Every hidden layer is `Dense without bias -> LayerNorm -> SiLU` (:class:`DenseBlock`); output
layers have a bias. Networks are plain `tf.Module`s holding `tf.Variable`s, so that one compiled
function can read and update all of them.
"""

import math

import tensorflow as tf


def _glorot_uniform(shape):
    fan_in, fan_out = shape[0], shape[-1]
    limit = math.sqrt(6.0 / (fan_in + fan_out))
    return tf.random.uniform(shape, -limit, limit)


class Dense(tf.Module):
    """`x @ w (+ b)`; `zero_init` starts the output at exactly zero (reward and critic heads)."""

    def __init__(self, in_units, out_units, bias=True, zero_init=False, name=None):
        super().__init__(name=name)
        init = tf.zeros([in_units, out_units]) if zero_init else _glorot_uniform([in_units, out_units])
        self.w = tf.Variable(init, name="w")
        self.b = tf.Variable(tf.zeros([out_units]), name="b") if bias else None

    def __call__(self, x):
        y = tf.matmul(x, self.w) if x.shape.rank == 2 else tf.tensordot(x, self.w, 1)
        return y + self.b if self.b is not None else y


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


class MLP(tf.Module):
    """`num_layers` :class:`DenseBlock`s of `units` each, optionally followed by an output layer."""

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
