"""Networks: stride-2 convs equal TF's convolutions (values, gradients); LayerNorm equals numpy;
an MLP with its first layer split in two parts equals the MLP on the concatenation."""

import contextlib

import numpy as np
import pytest
import tensorflow as tf

from rllib_dreamerv3 import networks
from rllib_dreamerv3.networks import MLP, Conv, LayerNorm

# Tolerances: two code paths (our matmuls vs TF's convolutions, XLA vs eager, ...) sum in
# different orders, and which order depends on the machine (SIMD width, oneDNN's and XLA's
# kernels). A float32 sum of n terms of magnitude m is within ~n·eps·m whatever the order
# (eps = 2**-24): atol covers that for sums that cancel to near 0, rtol (≥ n·eps plus the chain's
# roundings) the rest.
EPS32 = 2.0 ** -24


@pytest.fixture(autouse=True)
def _global_seed():
    """Layers draw their initial weights from TF's global seed: reset it, so that every test
    sees the same weights in any test order."""
    tf.random.set_seed(0)


# What a value collects over a few steps of a small recurrence: sums of ≲ 16 terms and tanh,
# sigmoid, sin and cos, XLA's and Eigen's a few ulps apart: ~100 roundings, ≈ 6e-6; 1e-5.
RECURRENCE_RTOL = 1e-5


def _assert_close_in_scale(actual, desired, rtol, scale=None):
    """`actual` within `rtol` of `desired` relative to each entry and to `scale` (by default the
    largest entry): an entry that is a sum cancelling to near 0 has the rounding error of its
    terms, of the size of the array's large entries (or of `scale`, for a scalar loss: the sum
    of its terms' sizes)."""
    desired = np.asarray(desired)
    scale = np.abs(desired).max() if scale is None else scale
    np.testing.assert_allclose(actual, desired, rtol=rtol, atol=rtol * scale)


def _normal(shape, seed, scale=1.0):
    """Float32 N(0, scale²) inputs from numpy: the same numbers in any test order (TF's op-seeded
    ops depend on the global seed and on earlier calls with the same op seed)."""
    return tf.constant((np.random.default_rng(seed).normal(size=shape) * scale)
                       .astype(np.float32))


def _matmul(conv, x):
    if conv.transpose:
        return networks._conv_transpose_s2_matmul(x, conv.w)
    return networks._conv_s2_matmul(x, conv.w)


def _reference(conv, x):
    if conv.transpose:
        n, h, w = x.shape[:3]
        return tf.nn.conv2d_transpose(x, conv.w, [n, h * conv.stride, w * conv.stride,
                                                  conv.out_channels], conv.stride, "SAME")
    return tf.nn.conv2d(x, conv.w, conv.stride, "SAME")


@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("kernel, size", [(4, 16), (4, 8), (2, 8), (6, 12), (4, 2)])
@pytest.mark.parametrize("channels", [3, 8])  # 8: one matmul per window; 3: one for all
def test_stride_two_conv_matches_tf_values_and_gradients(transpose, kernel, size, channels):
    conv = Conv(channels, channels + 2, kernel, 2, transpose=transpose, bias=False)
    thin = 4 * (channels + 2 if transpose else channels)
    assert (thin >= networks.WINDOW_MATMULS_MIN_WIDTH) == (channels == 8)
    x = _normal([2, size, size + 2, channels], seed=0)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(x)
        ours, ref = _matmul(conv, x), _reference(conv, x)
        loss_ours = tf.reduce_sum(ours * tf.sin(ours))
        loss_ref = tf.reduce_sum(ref * tf.sin(ref))
    scale = 2 if transpose else 0.5
    assert ours.shape == (2, int(size * scale), int((size + 2) * scale), channels + 2)
    # Outputs: sums of ≤ 6·6·8 = 288 products |x·w| ≲ 0.3: 288·eps·0.3 ≈ 5e-6. Gradients: the
    # kernel's sums over ≤ 576 positions of |x · dloss/dy| ~ 1: ≈ 3.5e-5 (the input's are smaller).
    np.testing.assert_allclose(ours.numpy(), ref.numpy(), rtol=1e-4, atol=1e-5)
    for a, b in zip(tape.gradient(loss_ours, [x, conv.w]), tape.gradient(loss_ref, [x, conv.w])):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("transpose", [False, True])
def test_large_batches_take_the_matmul_path_under_xla(transpose):
    conv = Conv(4, 6, 4, 2, transpose=transpose, bias=False)
    x = _normal([networks.MATMUL_CONV_MIN_BATCH, 8, 8, 4], seed=1)
    assert networks._matmul_conv_applies(x, conv.w, 2)
    ours = tf.function(conv, jit_compile=True)(x)
    # Sums of ≤ 4·4·6 = 96 products |x·w| ≲ 0.5: 96·eps·0.5 ≈ 3e-6.
    np.testing.assert_allclose(ours.numpy(), _reference(conv, x).numpy(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kernel, stride, shape", [
    (3, 2, [64, 8, 8, 2]), (4, 1, [64, 8, 8, 2]), (4, 2, [64, 7, 8, 2]),
    (4, 2, [8, 8, 8, 2]),  # a small batch (the policy's): TF's convolution is faster
])
def test_other_convolutions_use_tf_and_stay_correct(kernel, stride, shape):
    conv = Conv(2, 3, kernel, stride, bias=False)
    x = _normal(shape, seed=2)
    assert not networks._matmul_conv_applies(x, conv.w, stride)
    # TF's convolution on both sides; sums of ≤ 4·4·2 = 32 products |x·w| ≲ 1 if they were not
    # the same: 32·eps ≈ 2e-6.
    np.testing.assert_allclose(conv(x).numpy(), _reference(conv, x).numpy(), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("shape", [(7, 24), (3, 5, 5, 24)])
@pytest.mark.parametrize("compiled", [False, True])
def test_layer_norm_matches_numpy(shape, compiled):
    rng = np.random.default_rng(0)
    x = (rng.normal(size=shape) * 3.0 + 2.0).astype(np.float32)
    norm = LayerNorm(shape[-1])
    norm.scale.assign(rng.uniform(0.5, 1.5, shape[-1]).astype(np.float32))
    norm.offset.assign(rng.normal(size=shape[-1]).astype(np.float32))
    fn = tf.function(norm.__call__, jit_compile=True) if compiled else norm
    x64 = x.astype(np.float64)
    mean, var = x64.mean(-1, keepdims=True), x64.var(-1, keepdims=True)
    expected = (x64 - mean) / np.sqrt(var + 1e-3) * norm.scale.numpy() + norm.offset.numpy()
    # Row means of 24 entries |x| ≲ 11: 24·eps·11 ≈ 1.6e-5 before the division by the rows'
    # standard deviation (~3), then scaled by ≤ 1.5: ≲ 8e-6 absolute.
    np.testing.assert_allclose(fn(tf.constant(x)), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("shape", [(7, 24), (3, 5, 24), (2, 3, 4, 24)])
def test_layer_norm_has_the_formulas_gradients(shape, compiled):
    """The written-out gradient (row means as matrix-vector products; scale and offset gradients
    as column sums of a matrix view) equals autodiff's of the plain formula, eager and
    compiled."""
    rng = np.random.default_rng(1)
    x = tf.constant((rng.normal(size=shape) * 3.0 + 2.0).astype(np.float32))
    weights = tf.constant(rng.normal(size=shape).astype(np.float32))
    norm = LayerNorm(shape[-1])
    norm.scale.assign(rng.uniform(0.5, 1.5, shape[-1]).astype(np.float32))
    norm.offset.assign(rng.normal(size=shape[-1]).astype(np.float32))

    def formula(x):
        mean, var = tf.nn.moments(x, axes=[-1], keepdims=True)
        return (x - mean) * tf.math.rsqrt(var + norm.eps) * norm.scale + norm.offset

    def gradients(fn):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(tf.sin(fn(x)) * weights)
        return tape.gradient(loss, [x, norm.scale, norm.offset])

    grads = [(tf.function(gradients, jit_compile=True) if compiled else gradients)(norm),
             gradients(formula)]
    # Row means of 24 terms (and the scale's and offset's column sums of ≤ 24 rows) of
    # magnitude ≲ 3: 24·eps·3 ≈ 4e-6.
    for ours, reference in zip(*grads):
        np.testing.assert_allclose(ours.numpy(), reference.numpy(), rtol=1e-5, atol=1e-5)


def test_mlp_with_a_precomputed_first_layer_part_equals_the_mlp_on_the_concatenation():
    mlp = MLP(5 + 7, 16, 2, out_units=3)
    a, b = _normal([4, 5], seed=3), _normal([4, 7], seed=4)
    with tf.GradientTape(persistent=True) as tape:
        whole = mlp(tf.concat([a, b], -1))
        split = mlp(a, rest=mlp.first_layer_part(b, 5))
        loss_whole, loss_split = tf.reduce_sum(tf.sin(whole)), tf.reduce_sum(tf.sin(split))
    # Only the first layer's 12-term sums (|x·w| ≲ 1) differ in order: 12·eps ≈ 7e-7, carried
    # through LayerNorms (gain ≲ 2) and layers with gains ~1. The gradients sum 4 rows on top.
    np.testing.assert_allclose(split.numpy(), whole.numpy(), rtol=1e-5, atol=2e-6)
    for g_split, g_whole in zip(tape.gradient(loss_split, mlp.trainable_variables),
                                tape.gradient(loss_whole, mlp.trainable_variables)):
        np.testing.assert_allclose(g_split.numpy(), g_whole.numpy(), rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="rows 5:12"):
        mlp.first_layer_part(a, 5)  # 5 features where the kernel's rows 5:12 need 7


def test_mlp_with_mean_output_gives_the_output_and_its_mean_without_gradient():
    """`with_mean_output`: the MLP's output and the mean of its units (from the output layer's
    input and the kernel's row means); gradients flow through the output only."""
    mlp = MLP(6, 8, 1, out_units=5)
    mlp.out.b.assign(tf.constant([0.5, -1.0, 2.0, 0.25, 3.0]))
    x = _normal([2, 3, 6], seed=3)
    with tf.GradientTape(persistent=True) as tape:
        out, mean = mlp.with_mean_output(x)
        loss = tf.reduce_sum(tf.sin(out))
    np.testing.assert_allclose(out.numpy(), mlp(x).numpy(), rtol=1e-6)  # the same ops
    assert mean.shape == (2, 3)
    # h @ mean(w) vs mean(h @ w): 8-term sums of |h·w| ≲ 2 in another order, ≈ 8·eps·2 = 1e-6.
    np.testing.assert_allclose(mean.numpy(), tf.reduce_mean(out, -1).numpy(), rtol=1e-5,
                               atol=2e-6)
    assert all(g is None for g in tape.gradient(mean, mlp.trainable_variables))
    assert all(g is not None for g in tape.gradient(loss, mlp.trainable_variables))
    with pytest.raises(ValueError, match="out_units"):
        MLP(6, 8, 1).with_mean_output(x)


@pytest.mark.parametrize("shape", [(5, 7), (2, 3, 7)])
@pytest.mark.parametrize("dtype", [tf.float32, tf.bfloat16])
def test_dense_with_bias_equals_matmul_plus_bias(shape, dtype):
    """`Dense` with a bias (folded into the kernel as an extra row in float32, added after the
    matmul in bfloat16): values and gradients of `x @ w + b`."""
    dense = networks.Dense(7, 4)
    dense.b.assign(tf.constant([0.5, -1.0, 2.0, 0.25]))
    dense.matmul_dtype = dtype
    x = _normal(shape, seed=3)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(x)
        ours = dense(x)
        reference = tf.tensordot(x, dense.w, 1) + dense.b
    # float32: sums of 8 terms (7 products and the bias; the kernel's gradient: ≤ 6 rows of x)
    # of magnitude ≲ 3 in another order: 8·eps·3 ≈ 1.4e-6. bfloat16 (eps 2**-9): x, w and the
    # product rounded, ~3·2**-9 ≈ 6e-3 of each of 7 products |x·w| ≲ 0.5: ≈ 2e-2.
    tol = 2e-6 if dtype == tf.float32 else 3e-2
    assert ours.shape == (*shape[:-1], 4) and ours.dtype == tf.float32
    np.testing.assert_allclose(ours, reference, rtol=tol, atol=tol)
    for a, b in zip(tape.gradient(ours, [x, dense.w, dense.b]),
                    tape.gradient(reference, [x, dense.w, dense.b])):
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [tf.float32, tf.bfloat16])
def test_dense_masked_columns_are_constant_and_leave_values_and_gradients_alone(dtype):
    """`masked_out` appends constant MASKED_LOGIT columns (folded kernel in float32, concatenated
    after the matmul in bfloat16): the other columns, and the gradients of a loss on them, are
    the plain layer's; the masked columns pass no gradient; no extra variables."""
    plain, masked = networks.Dense(7, 5), networks.Dense(7, 5, masked_out=3)
    masked.w.assign(plain.w)
    plain.b.assign(tf.constant([0.5, -1.0, 2.0, 0.25, 3.0]))
    masked.b.assign(plain.b)
    plain.matmul_dtype = masked.matmul_dtype = dtype
    x = _normal([2, 4, 7], seed=3)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(x)
        ours, reference = masked(x), plain(x)
        # A softmax over the padded width equals the plain one on the real columns.
        loss_ours = tf.reduce_sum(tf.sin(ours[..., :5]) + tf.nn.softmax(ours)[..., :5])
        loss_ref = tf.reduce_sum(tf.sin(reference) + tf.nn.softmax(reference))
    assert ours.shape == (2, 4, 8) and len(masked.trainable_variables) == 2
    np.testing.assert_array_equal(ours[..., 5:], np.float32(networks.MASKED_LOGIT))
    # Kernels 5 and 8 wide: the same 8-term sums (|x·w| ≲ 3) maybe blocked differently,
    # 8·eps·3 ≈ 1.4e-6; the gradients add 5-term softmax sums and 8 rows: well inside 1e-5.
    np.testing.assert_allclose(ours[..., :5], reference, rtol=1e-6, atol=2e-6)
    for a, b in zip(tape.gradient(loss_ours, [x, masked.w, masked.b]),
                    tape.gradient(loss_ref, [x, plain.w, plain.b])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="masked_out=2 needs bias=True"):
        networks.Dense(7, 5, bias=False, masked_out=2)


def test_a_dense_layer_read_once_for_a_loop_keeps_its_bias_apart():
    """Inside `variables_read_once` a folded kernel would be a new tensor every step, which the
    loop's gradient stores once per step (a `[steps, in + 1, out]` stack); values and gradients
    are those of the plain layer either way."""
    dense = networks.Dense(7, 4)
    dense.b.assign(tf.constant([0.5, -1.0, 2.0, 0.25]))
    xs = _normal([6, 5, 7], seed=3)

    def fn(xs, read_once):
        block = networks.variables_read_once(dense) if read_once else contextlib.nullcontext()
        with tf.GradientTape() as tape, block:
            hs = networks.scan(lambda h, x_t: tf.tanh(dense(x_t) + h), xs, tf.zeros([5, 4]))
            loss = tf.reduce_sum(tf.sin(hs))
        return loss, tape.gradient(loss, dense.trainable_variables)

    ours = tf.function(lambda xs: fn(xs, True), jit_compile=True)
    (loss, grads), (ref_loss, ref_grads) = ours(xs), fn(xs, False)  # XLA vs eager
    _assert_close_in_scale(loss, ref_loss, RECURRENCE_RTOL, scale=6 * 5 * 4)  # of 120 sines
    for a, b in zip(grads, ref_grads):  # sums over 6 steps · 5 rows
        _assert_close_in_scale(a, b, RECURRENCE_RTOL)
    # The program TF hands XLA has no per-step stack of the folded kernel (in a loop this small
    # XLA removes it again; in the observe loop it did not).
    hlo = ours.experimental_get_compiler_ir(xs)(stage="hlo")
    assert "f32[6,5,7]" in hlo and "f32[6,8,4]" not in hlo


def test_onehot_partial_equals_the_matmul_with_the_one_hot_features():
    mlp = MLP(5 + 3 * 4, 8, 1)  # 5 plain features, then 3 one-hot groups of 4 classes
    index = tf.constant([[0, 3, 1], [2, 2, 0], [3, 0, 3]])
    onehot = tf.reshape(tf.one_hot(index, 4), [3, 12])
    # Sums of the same 3 kernel entries (|w| < 0.5; the other products are exact zeros) in
    # another order: 2 roundings, ≲ 1e-7. The MLPs: first-layer sums of 8 non-zero products
    # |x·w| ≲ 1 in another order (8·eps ≈ 5e-7), through a LayerNorm (gain ≲ 2) and a layer.
    np.testing.assert_allclose(mlp.first_layer_onehot_part(index, 5, 4).numpy(),
                               mlp.first_layer_part(onehot, 5).numpy(), rtol=1e-6, atol=1e-6)
    a = _normal([3, 5], seed=1)
    np.testing.assert_allclose(
        mlp(a, rest=mlp.first_layer_onehot_part(index, 5, 4)).numpy(),
        mlp(tf.concat([a, onehot], -1)).numpy(), rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("with_onehot", [True, False])
def test_onehot_partial_has_the_matmuls_gradients(with_onehot):
    # The kernel's gradient (segment sums over the classes) is onehot^T dy either way; the
    # one-hot itself gets dy kernel^T only when it is passed.
    mlp = MLP(5 + 3 * 4, 8, 1, out_units=2)
    index = tf.constant([[[0, 3, 1], [2, 2, 0]], [[3, 0, 3], [0, 1, 2]]])  # [2, 2, 3]
    onehot = tf.reshape(tf.one_hot(index, 4), [2, 2, 12])
    a = _normal([2, 2, 5], seed=1)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch([a, onehot])
        ours = mlp(a, rest=mlp.first_layer_onehot_part(index, 5, 4,
                                                       onehot if with_onehot else None))
        ref = mlp(tf.concat([a, onehot if with_onehot else tf.stop_gradient(onehot)], -1))
        loss_ours, loss_ref = tf.reduce_sum(tf.sin(ours)), tf.reduce_sum(tf.sin(ref))
    # As above; the gradients sum the values' errors (≲ 2e-6 each) over ≤ 4 rows: 1e-5.
    np.testing.assert_allclose(ours.numpy(), ref.numpy(), rtol=1e-5, atol=2e-6)
    sources = [a, *mlp.trainable_variables]
    for g_ours, g_ref in zip(tape.gradient(loss_ours, sources), tape.gradient(loss_ref, sources)):
        np.testing.assert_allclose(g_ours.numpy(), g_ref.numpy(), rtol=1e-4, atol=1e-5)
    d_onehot = tape.gradient(loss_ours, onehot)
    if with_onehot:
        np.testing.assert_allclose(d_onehot.numpy(), tape.gradient(loss_ref, onehot).numpy(),
                                   rtol=1e-4, atol=1e-5)
    else:
        assert d_onehot is None


@pytest.mark.parametrize("identity", [networks.materialized_gradient, networks.materialized,
                                      lambda x: networks.materialized(x, decider=-x)])
@pytest.mark.parametrize("first_sign", [1.0, -1.0])  # the cond's predicate: the first entry
def test_materialized_identities_are_exact_with_the_identitys_gradient(identity, first_sign):
    x = tf.tensor_scatter_nd_update(_normal([3, 4], seed=2), [[0, 0]], [first_sign])
    c = _normal([3, 4], seed=3)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = identity(x)
        loss = tf.reduce_sum(c * y)
    np.testing.assert_array_equal(y.numpy(), x.numpy())
    np.testing.assert_array_equal(tape.gradient(loss, x).numpy(), c.numpy())


@pytest.mark.parametrize("transpose", [False, True])
def test_matmul_conv_output_is_computed_once_under_xla(transpose):
    """The matmul path's output passes `materialized` (one conditional per conv survives XLA;
    if XLA learns to drop it, the norm after the conv re-reads every window's product again)."""
    conv = Conv(8, 6, 4, 2, transpose=transpose, bias=False)
    x = _normal([networks.MATMUL_CONV_MIN_BATCH, 8, 8, 8], seed=1)

    def fn(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = conv(x)
            loss = tf.reduce_sum(tf.sin(y))
        return y, tape.gradient(loss, [x, conv.w])

    compiled = tf.function(fn, jit_compile=True)
    # y: sums of 4·4·8 = 128 products |x·w| ≲ 0.5 (128·eps·0.5 ≈ 4e-6); the input's gradient:
    # ≤ 96 products |w·cos(y)| ≲ 0.2; the kernel's: one product |x·cos(y)| ~ 1 per input
    # position and tap, 64·8·8 = 4096 of them (transposed; 64·4·4 = 1024 else): 4096·eps ≈ 2.4e-4.
    for a, b, atol in zip(tf.nest.flatten(compiled(x)), tf.nest.flatten(fn(x)),
                          [1e-5, 1e-5, 2.5e-4]):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4, atol=atol)
    hlo = compiled.experimental_get_compiler_ir(x)(stage="optimized_hlo")
    assert hlo.count(" conditional(") == 1


def test_materialized_gradient_keeps_an_unrolled_recurrence_exact_and_unfused_under_xla():
    gru = networks.GRUCell(3, 8)
    x = _normal([6, 5, 3], seed=4)
    h0 = _normal([5, 8], seed=5)

    def grads(materialize):
        def fn(x, h0):
            with tf.GradientTape() as tape:
                tape.watch(h0)
                h, total = h0, 0.0
                for t in range(6):
                    h = gru(x[t], h)
                    if materialize:
                        h = networks.materialized_gradient(h)
                    total += tf.reduce_sum(tf.sin(h))
            return tape.gradient(total, [h0, *gru.trainable_variables])
        return fn

    plain = tf.function(grads(False), jit_compile=True)
    ours = tf.function(grads(True), jit_compile=True)
    for a, b in zip(ours(x, h0), plain(x, h0)):  # fused differently: sums over 6 steps · 5 rows
        _assert_close_in_scale(a, b, RECURRENCE_RTOL)
    # One conditional per step survives XLA's optimisation (if XLA learns to drop it, the
    # speed-up is gone: see materialized_gradient).
    hlo = ours.experimental_get_compiler_ir(x, h0)(stage="optimized_hlo")
    assert hlo.count(" conditional(") == 6


def test_variables_read_once_gives_a_loops_exact_gradients_and_restores_the_variables():
    mlp = MLP(3 + 4, 8, 1, out_units=4)
    xs = _normal([5, 2, 3], seed=6)

    def loop(x, read_once):
        def step(h, x_t):
            return tf.tanh(mlp(tf.concat([x_t, h], -1)))
        block = networks.variables_read_once(mlp) if read_once else contextlib.nullcontext()
        with tf.GradientTape() as tape, block:
            # Inside the block the weights are plain tensors.
            assert read_once != any(isinstance(v, tf.Variable) for v in vars(mlp.out).values())
            hs = tf.scan(step, x, initializer=tf.zeros([2, 4]))
            loss = tf.reduce_sum(tf.sin(hs))
        return loss, tape.gradient(loss, mlp.trainable_variables)

    ours = tf.function(lambda x: loop(x, True), jit_compile=True)(xs)
    ref = tf.function(lambda x: loop(x, False), jit_compile=True)(xs)
    _assert_close_in_scale(ours[0], ref[0], RECURRENCE_RTOL, scale=5 * 2 * 4)  # of 40 sines
    assert len(ours[1]) == len(mlp.trainable_variables) == 5
    for a, b in zip(ours[1], ref[1]):  # sums over 5 steps · 2 rows
        _assert_close_in_scale(a, b, RECURRENCE_RTOL)
    # The variables are back afterwards, also when the block raises.
    with pytest.raises(RuntimeError), networks.variables_read_once(mlp):
        raise RuntimeError
    assert isinstance(mlp.out.w, tf.Variable) and len(mlp.trainable_variables) == 5


def test_variables_read_once_slices_row_blocks_and_transposes_kernels_before_the_loop():
    """A loop calling `partial` on part of a kernel gets the rows sliced once, and every
    product's input gradient multiplies a kernel transposed once: the program TF hands XLA
    stacks no per-step copy of the rows and has no dot with a transposed right operand. Values
    and gradients equal those of the plain loop; the slices are dropped after the block."""
    mlp = MLP(4 + 3, 6, 1, out_units=4)
    first = mlp.blocks[0].dense
    xs = _normal([5, 2, 3], seed=8)

    def fn(xs, read_once):
        def step(h, part):
            return tf.tanh(mlp(h, rest=part))

        block = (networks.variables_read_once(mlp, row_blocks=[(first, 0, 4)]) if read_once
                 else contextlib.nullcontext())
        with tf.GradientTape() as tape:
            tape.watch(xs)
            parts = first.partial(xs, 4, 7)  # the input's share, for all steps at once
            with block:
                hs = networks.scan(step, parts, tf.zeros([2, 4]))
            loss = tf.reduce_sum(tf.sin(hs))
        return loss, tape.gradient(loss, [xs, *mlp.trainable_variables])

    ours = tf.function(lambda xs: fn(xs, True), jit_compile=True)
    (loss, grads), (ref_loss, ref_grads) = ours(xs), fn(xs, False)  # XLA vs eager
    _assert_close_in_scale(loss, ref_loss, RECURRENCE_RTOL, scale=5 * 2 * 4)  # of 40 sines
    for a, b in zip(grads, ref_grads):  # sums over 5 steps · 2 rows
        _assert_close_in_scale(a, b, RECURRENCE_RTOL)
    hlo = ours.experimental_get_compiler_ir(xs)(stage="hlo")
    assert "f32[5,4,6]" not in hlo  # the rows [4, 6], once per step
    loop_dots = [line for line in hlo.splitlines() if " dot(" in line and "while/" in line
                 and " = f32[2,1]" not in line]  # (the LayerNorm's row means are dots too)
    assert len(loop_dots) == 6  # forward: 2 products; backward: their inputs' and kernels'
    assert not [line for line in loop_dots if "rhs_contracting_dims={1}" in line]
    assert not networks._READ_ONCE
    with pytest.raises(ValueError, match="row_blocks"):
        with networks.variables_read_once(mlp.out, row_blocks=[(first, 0, 4)]):
            pass


@pytest.mark.parametrize("compiled", [False, True])
def test_scan_equals_tf_scan_in_values_and_gradients(compiled):
    gru = networks.GRUCell(3, 4)
    xs = _normal([7, 2, 3], seed=7)
    masks = tf.constant([1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0])

    def step(carry, inputs):
        h, total = carry
        x, m = inputs
        h = gru(x, h) * m + h * (1.0 - m)
        return h, total + tf.reduce_sum(h, -1)

    def run(scan):
        def fn(xs):
            with tf.GradientTape() as tape:
                tape.watch(xs)
                hs, totals = scan(step, (xs, masks), (tf.zeros([2, 4]), tf.zeros([2])))
                loss = tf.reduce_sum(tf.sin(hs)) + tf.reduce_sum(totals ** 2)
            return hs, totals, tape.gradient(loss, [xs, *gru.trainable_variables])
        return tf.function(fn, jit_compile=True) if compiled else fn

    ours = run(networks.scan)(xs)
    ref = run(lambda f, e, i: tf.scan(f, e, initializer=i))(xs)
    assert ours[0].shape == (7, 2, 4) and ours[1].shape == (7, 2)
    for a, b in zip(tf.nest.flatten(ours), tf.nest.flatten(ref)):  # loops fused differently
        _assert_close_in_scale(a, b, RECURRENCE_RTOL)
