"""The plain layers of `rllib_dreamerv3.networks` against numpy and TF's own ops: Dense,
LayerNorm, convolutions, MLPs and the GRU cell. (Their fast forms: tests/test_kernels.py.)"""

import numpy as np
import pytest
import tensorflow as tf
from helpers import layer_norm_case, normal

from rllib_dreamerv3 import networks
from rllib_dreamerv3.networks import MLP, Conv, LayerNorm

# Tolerances: our layers and the references (numpy in float64, TF's ops) sum in different
# orders, and which order depends on the machine (SIMD width, oneDNN's and XLA's kernels). A
# float32 sum of n terms of magnitude m is within ~n·eps·m whatever the order (eps = 2**-24).
EPS32 = 2.0**-24


@pytest.fixture(autouse=True)
def _global_seed():
    """Layers draw their initial weights from TF's global seed: reset it, so that every test
    sees the same weights in any test order."""
    tf.random.set_seed(0)


@pytest.mark.parametrize("shape", [(7, 24), (3, 5, 5, 24)])
@pytest.mark.parametrize("compiled", [False, True])
def test_layer_norm_matches_numpy(shape, compiled):
    norm, x, expected = layer_norm_case(LayerNorm, shape)
    fn = tf.function(norm.__call__, jit_compile=True) if compiled else norm
    # Row means of 24 entries |x| ≲ 11: 24·eps·11 ≈ 1.6e-5 before the division by the rows'
    # standard deviation (~3), then scaled by ≤ 1.5: ≲ 8e-6 absolute.
    np.testing.assert_allclose(fn(x), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(5, 7), (2, 3, 7)])
@pytest.mark.parametrize("dtype", [tf.float32, tf.bfloat16])
def test_dense_with_bias_equals_matmul_plus_bias(shape, dtype):
    """`Dense`: values and gradients of `x @ w + b`; with bfloat16 matmuls the output and the
    gradients stay float32, close to float32's."""
    dense = networks.Dense(7, 4)
    dense.b.assign(tf.constant([0.5, -1.0, 2.0, 0.25]))
    dense.matmul_dtype = dtype
    x = normal(shape, seed=3)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(x)
        ours = dense(x)
        reference = tf.tensordot(x, dense.w, 1) + dense.b
    # float32: sums of 7 products (the kernel's gradient: ≤ 6 rows of x) of magnitude ≲ 3 in
    # another order, then the bias: 8·eps·3 ≈ 1.4e-6. bfloat16 (eps 2**-9): x, w and the
    # product rounded, ~3·2**-9 ≈ 6e-3 of each of 7 products |x·w| ≲ 0.5: ≈ 2e-2.
    tol = 2e-6 if dtype == tf.float32 else 3e-2
    assert ours.shape == (*shape[:-1], 4) and ours.dtype == tf.float32
    np.testing.assert_allclose(ours, reference, rtol=tol, atol=tol)
    for a, b in zip(
        tape.gradient(ours, [x, dense.w, dense.b]), tape.gradient(reference, [x, dense.w, dense.b])
    ):
        assert a.dtype == tf.float32
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol)


def test_dense_without_bias_and_zero_init():
    dense = networks.Dense(3, 5, bias=False)
    assert dense.b is None and len(dense.trainable_variables) == 1
    x = normal([4, 3], seed=1)
    np.testing.assert_array_equal(dense(x), tf.matmul(x, dense.w))  # the same op
    zero = networks.Dense(3, 5, zero_init=True)
    np.testing.assert_array_equal(zero(x), np.zeros([4, 5], np.float32))


@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("kernel, stride", [(4, 2), (3, 1)])
def test_conv_is_tfs_convolution_plus_bias(transpose, kernel, stride):
    """`Conv`: "same" padding, stride `stride` (transposed: height and width times `stride`),
    TF's convolution plus the bias; the kernel of a transposed one is `[k, k, out, in]`."""
    conv = Conv(3, 5, kernel, stride, transpose=transpose)
    conv.b.assign(tf.range(5, dtype=tf.float32) / 4.0)
    x = normal([2, 8, 6, 3], seed=2)
    y = conv(x)
    if transpose:
        assert conv.w.shape == (kernel, kernel, 5, 3)
        assert y.shape == (2, 8 * stride, 6 * stride, 5)
        reference = tf.nn.conv2d_transpose(
            x, conv.w, [2, 8 * stride, 6 * stride, 5], stride, "SAME"
        )
    else:
        assert conv.w.shape == (kernel, kernel, 3, 5)
        assert y.shape == (2, 8 // stride, 6 // stride, 5)
        reference = tf.nn.conv2d(x, conv.w, stride, "SAME")
    # The same ops; the bias added exactly.
    np.testing.assert_allclose(y, reference + conv.b, rtol=1e-6, atol=1e-6)


def test_mlp_blocks_follow_dense_layer_norm_silu():
    """An MLP is `num_layers` blocks `silu(LayerNorm(x @ w))` (no bias) and an output layer
    with a bias; without `out_units` it ends with the last block."""
    mlp = MLP(6, 8, 2, out_units=3)
    assert [block.dense.b for block in mlp.blocks] == [None, None]
    assert mlp.out.b is not None and mlp.out_units == 3
    x = normal([4, 6], seed=3)
    h = x
    for block in mlp.blocks:
        h = tf.nn.silu(block.norm(h @ block.dense.w))
    np.testing.assert_allclose(mlp(x), h @ mlp.out.w + mlp.out.b, rtol=1e-6, atol=1e-6)
    hidden = MLP(6, 8, 2)
    assert hidden.out is None and hidden.out_units == 8 and hidden(x).shape == (4, 8)


def test_two_hot_heads_start_at_zero_logits():
    from rllib_dreamerv3.model_sizes import get_model_size

    head = networks.two_hot_head(10, get_model_size("nano"), 255)
    x = normal([3, 10], seed=4)
    assert head.out.w.shape == (16, 255)
    np.testing.assert_array_equal(head(x), np.zeros([3, 255], np.float32))


def test_gru_cell_follows_its_formula():
    """`h' = u * tanh(sigmoid(r) * c) + (1 - u) * h`, `u = sigmoid(update - 1)`, with the three
    pre-activations from one LayerNorm'ed Dense on `[x, h]` (numpy in float64)."""
    cell = networks.GRUCell(3, 4)
    cell.norm.scale.assign(tf.linspace(0.5, 1.5, 12))
    cell.norm.offset.assign(tf.linspace(-0.2, 0.2, 12))
    x, h = normal([5, 3], seed=5), normal([5, 4], seed=6)
    inputs = np.concatenate([x.numpy(), h.numpy()], -1).astype(np.float64)
    pre = inputs @ cell.dense.w.numpy().astype(np.float64)
    mean, var = pre.mean(-1, keepdims=True), pre.var(-1, keepdims=True)
    normed = (pre - mean) / np.sqrt(var + 1e-3) * cell.norm.scale.numpy() + cell.norm.offset.numpy()
    reset, cand, update = np.split(normed, 3, -1)

    def sigmoid(v):
        return 1.0 / (1.0 + np.exp(-v))

    cand = np.tanh(sigmoid(reset) * cand)
    update = sigmoid(update - 1.0)
    expected = update * cand + (1.0 - update) * h.numpy()
    # 7-term sums (|x·w| ≲ 2), normalised (gain ≲ 3 for 12 units), through sigmoid and tanh
    # (gain ≤ 1): ≲ 1e-6.
    np.testing.assert_allclose(cell(x, h), expected, rtol=1e-5, atol=2e-6)


def test_set_matmul_dtype_reaches_every_dense_and_conv_inside():
    class Net(tf.Module):
        def __init__(self):
            super().__init__()
            self.mlp = MLP(4, 8, 1, out_units=2)
            self.conv = networks.ConvBlock(3, 4, 4, 2)

    net = Net()
    networks.set_matmul_dtype(net, "bfloat16")
    layers = [m for m in net.submodules if isinstance(m, (networks.Dense, Conv))]
    assert len(layers) == 3 and all(m.matmul_dtype == tf.bfloat16 for m in layers)
    assert all(v.dtype == tf.float32 for v in net.variables)  # variables stay float32
    assert net.mlp(normal([2, 4], seed=7)).dtype == tf.float32
    assert networks.Dense(2, 2).matmul_dtype == tf.float32  # the class default is untouched
