"""The fast kernels (`rllib_dreamerv3.kernels`) equal the plain reference.

Piece by piece (matmul convolutions, the written-out LayerNorm gradient, one-hot row sums, loops
and read-once weights, fused two-hot statistics, the latent-class recurrence), then the three
functions of the update (world-model loss, imagination and actor-critic losses: losses, metrics
and gradients) and one whole update with `fast_kernels` on and off.
"""

import contextlib
from types import SimpleNamespace

import numpy as np
import pytest
import tensorflow as tf
from helpers import (
    PERCENTILE_CASES,
    float64_softmax,
    layer_norm_case,
    normal,
    reference_critic_loss,
    two_hot_hand_case,
)

from rllib_dreamerv3 import kernels, losses, math_ops, networks, random_ops, world_model
from rllib_dreamerv3.config import HYPERPARAMETERS
from rllib_dreamerv3.kernels import layers, loops, percentiles, rssm, sampling, two_hot
from rllib_dreamerv3.kernels.two_hot import MASKED_LOGIT, masked_columns
from rllib_dreamerv3.model import DreamerV3Model
from rllib_dreamerv3.model_sizes import MODEL_SIZES
from rllib_dreamerv3.networks import MLP, Conv, LayerNorm
from rllib_dreamerv3.tf_rllib import make_adam
from rllib_dreamerv3.update import batch_signature, make_update_fn

# Tolerances: two code paths (our matmuls vs TF's convolutions, XLA vs eager, fused vs plain ...)
# sum in different orders, and which order depends on the machine (SIMD width, oneDNN's and
# XLA's kernels). A float32 sum of n terms of magnitude m is within ~n·eps·m whatever the order
# (eps = 2**-24): atol covers that for sums that cancel to near 0, rtol (≥ n·eps plus the chain's
# roundings) the rest.
EPS32 = 2.0**-24
NUM_BINS, MAX_BIN = 255, 20.0
# log(sum(exp)) over the bins: the sum's relative error n·eps is the log's absolute error.
LSE_ATOL = NUM_BINS * EPS32
# expected = sum(p·bins) / sum(p), |bins| ≤ 20: n·eps·20 for the numerator, n·eps·|expected| ≤
# n·eps·20 from the denominator: ≈ 6.1e-4 in symlog space (real space: relative, via symexp).
EXPECTED_ATOL = 2 * NUM_BINS * EPS32 * MAX_BIN
# p = exp(logit - lse): lse's error, plus the rounding of |logit - lse| < 64 and of exp.
PROB_RTOL = LSE_ATOL + 64 * EPS32
# What a value collects over a few steps of a small recurrence: sums of ≲ 16 terms and tanh,
# sigmoid, sin and cos, XLA's and Eigen's a few ulps apart: ~100 roundings, ≈ 6e-6; 1e-5.
RECURRENCE_RTOL = 1e-5
# Two paths through a model (latent classes vs one-hot matmuls, fused vs step by step) sum in
# different orders: a layer's sums of n ≲ 300 terms round ~sqrt(n)·eps ≈ 1e-6 of its outputs'
# scale apart, over ≲ 30 layers along a recurrence: ≲ 3e-5 of an array's largest entry, which
# entries that cancel to near 0 need as atol.
SCALE_RTOL = 1e-4


@pytest.fixture(autouse=True)
def _global_seed():
    """Layers draw their initial weights from TF's global seed: reset it, so that every test
    sees the same weights in any test order."""
    tf.random.set_seed(0)


def _assert_close_in_scale(actual, desired, rtol, scale_rtol=None, scale=None, err_msg=""):
    """`actual` within `rtol` of each entry of `desired`, and within `scale_rtol` (default
    `rtol`) of `scale` (default: its largest entry): an entry that is a sum cancelling to near 0
    has the rounding error of its terms, of the size of the array's large entries (or of
    `scale`, for a scalar loss: the sum of its terms' sizes)."""
    desired = np.asarray(desired)
    scale = np.abs(desired).max() if scale is None else scale
    scale_rtol = rtol if scale_rtol is None else scale_rtol
    np.testing.assert_allclose(actual, desired, rtol=rtol, atol=scale_rtol * scale, err_msg=err_msg)


def _assert_same_gradients(ours, reference, variables, rtol, scale_rtol):
    """Gradients per variable: both None or both close in their array's scale."""
    assert len(ours) == len(reference) == len(variables)
    checked = 0
    for i, (a, b, variable) in enumerate(zip(ours, reference, variables)):
        name = variable.name if isinstance(variable, tf.Variable) else f"source {i}"
        assert (a is None) == (b is None), name
        if b is not None:
            _assert_close_in_scale(a, b, rtol, scale_rtol, err_msg=name)
            checked += 1
    assert checked > 0


# --- models and batches -------------------------------------------------------------------------
def hparams(**overrides):
    values = {name: default for name, (default, _) in HYPERPARAMETERS.items()}
    values.update(gamma=1 - 1 / 333, horizon_H=5)
    values.update(overrides)
    return SimpleNamespace(**values)


def perturb_heads(model, seed=7):
    """Non-zero reward and critic heads (zero-initialised outputs would make every two-hot
    prediction uniform): N(0, 1/in_units) kernels give logits of order 1 at any size, and a
    slow critic a little off the critic."""
    rng = np.random.default_rng(seed)
    for variable in (model.world_model.reward_head.out.w, model.critic.mlp.out.w):
        noise = rng.normal(size=variable.shape) / np.sqrt(variable.shape[0])
        variable.assign_add(noise.astype(np.float32))
    for slow, fast in zip(model.critic_ema.variables, model.critic.variables):
        slow.assign(fast + rng.normal(size=fast.shape).astype(np.float32) * 0.01)


def build(obs_shape=(3,), action_dim=2, discrete=True, size="nano", seed=0, **kwargs):
    """A model with weights from `seed` and non-trivial heads: the same weights for the same
    arguments."""
    tf.random.set_seed(seed)
    model = DreamerV3Model(obs_shape, action_dim, discrete, MODEL_SIZES[size], **kwargs)
    perturb_heads(model, seed)
    return model


def make_batch(obs_shape=(3,), action_dim=2, discrete=True, batch=4, length=8, seed=0):
    """A `[B, T, ...]` training batch with resets and a terminal mid-sequence."""
    rng = np.random.default_rng(seed)

    def observations(shape):
        if len(shape) == 3:
            return tf.constant(rng.integers(0, 256, (batch, length, *shape), dtype=np.uint8))
        return tf.constant(rng.normal(size=(batch, length, *shape)).astype(np.float32))

    if isinstance(obs_shape, dict):  # Dict observations
        obs = {key: observations(shape) for key, shape in obs_shape.items()}
    else:
        obs = observations(obs_shape)
    if discrete:
        actions = np.eye(action_dim, dtype=np.float32)[rng.integers(0, action_dim, (batch, length))]
    else:
        actions = rng.uniform(-1, 1, (batch, length, action_dim)).astype(np.float32)
    is_first = np.zeros((batch, length), bool)
    is_first[:, 0] = True
    is_first[-1, length // 2 + 1] = True
    is_terminal = np.zeros((batch, length), bool)
    is_terminal[-1, length // 2] = True
    return {
        "obs": obs,
        "actions": tf.constant(actions),
        "rewards": tf.constant(rng.normal(size=(batch, length)).astype(np.float32) * 3.0),
        "is_first": tf.constant(is_first),
        "is_terminal": tf.constant(is_terminal),
    }


def start_states(wm, n, seed=8):
    """`(h, z)` imagination start states `[n, ...]`: a normal `h`, a sampled one-hot `z`."""
    h = normal([n, wm.size.gru_units], seed=seed)
    z = wm.sample_z(normal([n, *wm.stoch_shape], seed=seed + 1), tf.constant([1, 2]))
    return h, z


def observe_inputs(wm, batch, seed):
    """`(embed, prev_actions, is_first, seeds)` of `batch` for `observe`, time-major."""
    embed = wm.encoder(losses.time_major(batch["obs"]))
    actions = losses.time_major(batch["actions"])
    prev_actions = tf.concat([tf.zeros_like(actions[:1]), actions[:-1]], 0)
    seeds = random_ops.split(tf.constant(seed), actions.shape[0])
    return embed, prev_actions, losses.time_major(batch["is_first"]), seeds


# --- convolutions -------------------------------------------------------------------------------
def _matmul_conv(conv, x):
    if conv.transpose:
        return layers._conv_transpose_s2_matmul(x, conv.w)
    return layers._conv_s2_matmul(x, conv.w)


def _reference_conv(conv, x):
    if conv.transpose:
        n, h, w = x.shape[:3]
        return tf.nn.conv2d_transpose(
            x, conv.w, [n, h * conv.stride, w * conv.stride, conv.out_channels], conv.stride, "SAME"
        )
    return tf.nn.conv2d(x, conv.w, conv.stride, "SAME")


@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("kernel, size", [(4, 16), (4, 8), (2, 8), (6, 12), (4, 2)])
@pytest.mark.parametrize("channels", [3, 8])  # 8: one matmul per window; 3: one for all
def test_stride_two_conv_matches_tf_values_and_gradients(transpose, kernel, size, channels):
    conv = Conv(channels, channels + 2, kernel, 2, transpose=transpose, bias=False)
    thin = 4 * (channels + 2 if transpose else channels)
    assert (thin >= layers.WINDOW_MATMULS_MIN_WIDTH) == (channels == 8)
    x = normal([2, size, size + 2, channels], seed=0)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(x)
        ours, ref = _matmul_conv(conv, x), _reference_conv(conv, x)
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
    conv = Conv(4, 6, 4, 2, transpose=transpose, bias=True)
    conv.b.assign(tf.range(6, dtype=tf.float32) / 4.0)
    x = normal([layers.MATMUL_CONV_MIN_BATCH, 8, 8, 4], seed=1)
    assert layers._matmul_conv_applies(x, conv.w, 2)
    ours = tf.function(lambda x: layers.conv(conv, x), jit_compile=True)(x)
    # Sums of ≤ 4·4·6 = 96 products |x·w| ≲ 0.5: 96·eps·0.5 ≈ 3e-6 (the bias adds exactly).
    np.testing.assert_allclose(
        ours.numpy(), (_reference_conv(conv, x) + conv.b).numpy(), rtol=1e-4, atol=1e-5
    )
    np.testing.assert_allclose(ours.numpy(), conv(x).numpy(), rtol=1e-4, atol=1e-5)  # the plain


@pytest.mark.parametrize(
    "kernel, stride, shape",
    [
        (3, 2, [64, 8, 8, 2]),
        (4, 1, [64, 8, 8, 2]),
        (4, 2, [64, 7, 8, 2]),
        (4, 2, [8, 8, 8, 2]),  # a small batch (the policy's): TF's convolution is faster
    ],
)
def test_other_convolutions_use_tf_and_stay_correct(kernel, stride, shape):
    conv = Conv(2, 3, kernel, stride, bias=False)
    x = normal(shape, seed=2)
    assert not layers._matmul_conv_applies(x, conv.w, stride)
    # TF's convolution on both sides; sums of ≤ 4·4·2 = 32 products |x·w| ≲ 1 if they were not
    # the same: 32·eps ≈ 2e-6.
    np.testing.assert_allclose(
        layers.conv(conv, x).numpy(), _reference_conv(conv, x).numpy(), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("transpose", [False, True])
def test_matmul_conv_output_is_computed_once_under_xla(transpose):
    """The matmul path's output passes `materialized` (one conditional per conv survives XLA;
    if XLA learns to drop it, the norm after the conv re-reads every window's product again)."""
    conv = Conv(8, 6, 4, 2, transpose=transpose, bias=False)
    x = normal([layers.MATMUL_CONV_MIN_BATCH, 8, 8, 8], seed=1)

    def fn(x, fast):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layers.conv(conv, x) if fast else conv(x)
            loss = tf.reduce_sum(tf.sin(y))
        return y, tape.gradient(loss, [x, conv.w])

    compiled = tf.function(lambda x: fn(x, True), jit_compile=True)
    # y: sums of 4·4·8 = 128 products |x·w| ≲ 0.5 (128·eps·0.5 ≈ 4e-6); the input's gradient:
    # ≤ 96 products |w·cos(y)| ≲ 0.2; the kernel's: one product |x·cos(y)| ~ 1 per input
    # position and tap, 64·8·8 = 4096 of them (transposed; 64·4·4 = 1024 else): 4096·eps ≈ 2.4e-4.
    for a, b, atol in zip(
        tf.nest.flatten(compiled(x)), tf.nest.flatten(fn(x, False)), [1e-5, 1e-5, 2.5e-4]
    ):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4, atol=atol)
    hlo = compiled.experimental_get_compiler_ir(x)(stage="optimized_hlo")
    assert hlo.count(" conditional(") == 1


DICT_OBS = {"cam": (64, 64, 3), "pos": (5,), "height": (1,)}


@pytest.mark.parametrize("image", [False, True, "dict"])
def test_encoder_and_decoder_equal_the_plain_modules(image, monkeypatch):
    """`encoder`, `decoder` and `decoder_loss` (conv blocks as matmuls with the norm on a matrix
    view) equal the plain modules' calls: values and gradients; for Dict observations too."""
    monkeypatch.setattr(layers, "MATMUL_CONV_MIN_BATCH", 1)  # the matmul path for 6 frames
    obs_shape = DICT_OBS if image == "dict" else (64, 64, 3) if image else (5,)
    model = build(obs_shape, size="nano")
    wm = model.world_model
    obs = make_batch(obs_shape, batch=2, length=3)["obs"]
    feat = normal([2, 3, wm.feat_dim], seed=3)
    if image:
        cnn = wm.encoder.image if image == "dict" else wm.encoder
        assert layers._matmul_conv_applies(tf.zeros([6, 64, 64, 3]), cnn.blocks[0].conv.w, 2)
    variables = wm.encoder.trainable_variables + wm.decoder.trainable_variables

    def run(encode, decode, loss_of):
        with tf.GradientTape() as tape:
            tape.watch(feat)
            embed, prediction, loss = encode(obs), decode(feat), loss_of(feat)
            total = tf.reduce_sum(tf.sin(embed)) + tf.reduce_sum(loss)
        return embed, prediction, loss, tape.gradient(total, [feat, *variables])

    ours = run(
        lambda o: layers.encoder(wm.encoder, o),
        lambda f: layers.decoder(wm.decoder, f),
        lambda f: layers.decoder_loss(wm.decoder, f, obs),
    )
    ref = run(wm.encoder, wm.decoder, lambda f: wm.decoder.loss(f, obs))
    assert ours[0].shape == (2, 3, wm.encoder.out_units)
    if image == "dict":
        assert {k: tuple(v.shape) for k, v in ours[1].items()} == {
            k: (2, 3, *shape) for k, shape in DICT_OBS.items()
        }
        for key in DICT_OBS:  # each entry's prediction as the plain decoder's
            _assert_close_in_scale(ours[1][key], ref[1][key], 1e-4, 1e-5)
        ours, ref = [ours[0], *ours[2:]], [ref[0], *ref[2:]]
    else:
        assert ours[1].shape == (2, 3, *obs_shape)
    # Layers of sums of ≤ 4·4·48 = 768 products (|x·w| ≲ 1) in another order, normalised:
    # ~sqrt(768)·eps ≈ 2e-6 of a layer's scale, over ≤ 5 layers; the losses sum 12288 pixels'
    # squared errors in the same order, so their relative error is the predictions'.
    for a, b in zip(ours[:-1], ref[:-1]):
        _assert_close_in_scale(a, b, 1e-4, 1e-5)
    # Gradients: the kernels' sums over 6 frames' positions (≤ 6·32·32 terms): SCALE_RTOL.
    _assert_same_gradients(ours[-1], ref[-1], [feat, *variables], 1e-3, SCALE_RTOL)
    with pytest.raises(TypeError, match="no fast path"):
        layers.encoder(wm.decoder, obs)


# --- LayerNorm, Dense, MLP, GRU -----------------------------------------------------------------
@pytest.mark.parametrize("shape", [(7, 24), (3, 5, 5, 24)])
@pytest.mark.parametrize("compiled", [False, True])
def test_layer_norm_matches_numpy(shape, compiled):
    norm, x, expected = layer_norm_case(LayerNorm, shape)
    fn = lambda x: layers.layer_norm(norm, x)  # noqa: E731
    fn = tf.function(fn, jit_compile=True) if compiled else fn
    # Row means of 24 entries |x| ≲ 11: 24·eps·11 ≈ 1.6e-5 before the division by the rows'
    # standard deviation (~3), then scaled by ≤ 1.5: ≲ 8e-6 absolute.
    np.testing.assert_allclose(fn(x), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("shape", [(7, 24), (3, 5, 24), (2, 3, 4, 24)])
def test_layer_norm_has_the_plain_layers_gradients(shape, compiled):
    """The written-out gradient (row means as matrix-vector products; scale and offset gradients
    as column sums of a matrix view) equals autodiff's of the plain LayerNorm, eager and
    compiled."""
    rng = np.random.default_rng(1)
    x = tf.constant((rng.normal(size=shape) * 3.0 + 2.0).astype(np.float32))
    weights = tf.constant(rng.normal(size=shape).astype(np.float32))
    norm = LayerNorm(shape[-1])
    norm.scale.assign(rng.uniform(0.5, 1.5, shape[-1]).astype(np.float32))
    norm.offset.assign(rng.normal(size=shape[-1]).astype(np.float32))

    def gradients(fn):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(tf.sin(fn(x)) * weights)
        return tape.gradient(loss, [x, norm.scale, norm.offset])

    fast = lambda x: layers.layer_norm(norm, x)  # noqa: E731
    grads = [
        (tf.function(gradients, jit_compile=True) if compiled else gradients)(fast),
        gradients(norm),
    ]
    # Row means of 24 terms (and the scale's and offset's column sums of ≤ 24 rows) of
    # magnitude ≲ 3: 24·eps·3 ≈ 4e-6.
    for ours, reference in zip(*grads):
        np.testing.assert_allclose(ours.numpy(), reference.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(5, 7), (2, 3, 7)])
@pytest.mark.parametrize("dtype", [tf.float32, tf.bfloat16])
def test_dense_with_bias_equals_the_plain_layer(shape, dtype):
    """`dense` (the bias folded into the kernel as an extra row in float32, added after the
    matmul in bfloat16): values and gradients of the plain layer, `x @ w + b`."""
    dense = networks.Dense(7, 4)
    dense.b.assign(tf.constant([0.5, -1.0, 2.0, 0.25]))
    dense.matmul_dtype = dtype
    x = normal(shape, seed=3)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(x)
        ours = layers.dense(dense, x)
        reference = dense(x)
    # float32: sums of 8 terms (7 products and the bias; the kernel's gradient: ≤ 6 rows of x)
    # of magnitude ≲ 3 in another order: 8·eps·3 ≈ 1.4e-6. bfloat16: the same ops on both sides
    # (x and w rounded, the matmul, the bias added in float32).
    assert ours.shape == (*shape[:-1], 4) and ours.dtype == tf.float32
    np.testing.assert_allclose(ours, reference, rtol=2e-6, atol=2e-6)
    for a, b in zip(
        tape.gradient(ours, [x, dense.w, dense.b]), tape.gradient(reference, [x, dense.w, dense.b])
    ):
        np.testing.assert_allclose(a, b, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("dtype", [tf.float32, tf.bfloat16])
def test_dense_masked_columns_are_constant_and_leave_values_and_gradients_alone(dtype):
    """`masked_out` appends constant MASKED_LOGIT columns (folded kernel in float32, concatenated
    after the matmul in bfloat16): the other columns, and the gradients of a loss on them, are
    the plain layer's; the masked columns pass no gradient; no extra variables."""
    plain = networks.Dense(7, 5)
    plain.b.assign(tf.constant([0.5, -1.0, 2.0, 0.25, 3.0]))
    plain.matmul_dtype = dtype
    x = normal([2, 4, 7], seed=3)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(x)
        ours, reference = layers.dense(plain, x, masked_out=3), plain(x)
        # A softmax over the padded width equals the plain one on the real columns.
        loss_ours = tf.reduce_sum(tf.sin(ours[..., :5]) + tf.nn.softmax(ours)[..., :5])
        loss_ref = tf.reduce_sum(tf.sin(reference) + tf.nn.softmax(reference))
    assert ours.shape == (2, 4, 8) and len(plain.trainable_variables) == 2
    np.testing.assert_array_equal(ours[..., 5:], np.float32(MASKED_LOGIT))
    # Kernels 5 and 8 wide: the same 8-term sums (|x·w| ≲ 3) maybe blocked differently,
    # 8·eps·3 ≈ 1.4e-6; the gradients add 5-term softmax sums and 8 rows: well inside 1e-5.
    np.testing.assert_allclose(ours[..., :5], reference, rtol=1e-6, atol=2e-6)
    for a, b in zip(
        tape.gradient(loss_ours, [x, plain.w, plain.b]),
        tape.gradient(loss_ref, [x, plain.w, plain.b]),
    ):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="masked_out=2 needs a layer with a bias"):
        layers.dense(networks.Dense(7, 5, bias=False), x, masked_out=2)


def test_a_dense_layer_read_once_for_a_loop_keeps_its_bias_apart():
    """With `LoopWeights` a folded kernel would be a new tensor every step, which the loop's
    gradient stores once per step (a `[steps, in + 1, out]` stack); values and gradients are
    those of the plain layer either way."""
    dense = networks.Dense(7, 4)
    dense.b.assign(tf.constant([0.5, -1.0, 2.0, 0.25]))
    xs = normal([6, 5, 7], seed=3)

    def fn(xs, read_once):
        with tf.GradientTape() as tape:
            if read_once:
                weights = layers.LoopWeights([dense])
                step = lambda h, x_t: tf.tanh(layers.dense(dense, x_t, weights) + h)  # noqa
            else:
                step = lambda h, x_t: tf.tanh(dense(x_t) + h)  # noqa: E731
            hs = loops.scan(step, xs, tf.zeros([5, 4]))
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


def test_mlp_with_a_precomputed_first_layer_part_equals_the_mlp_on_the_concatenation():
    mlp = MLP(5 + 7, 16, 2, out_units=3)
    a, b = normal([4, 5], seed=3), normal([4, 7], seed=4)
    with tf.GradientTape(persistent=True) as tape:
        whole = mlp(tf.concat([a, b], -1))  # the plain MLP
        split = layers.mlp(mlp, a, rest=layers.first_layer_part(mlp, b, 5))
        loss_whole, loss_split = tf.reduce_sum(tf.sin(whole)), tf.reduce_sum(tf.sin(split))
    # Only the first layer's 12-term sums (|x·w| ≲ 1) differ in order: 12·eps ≈ 7e-7, carried
    # through LayerNorms (gain ≲ 2) and layers with gains ~1. The gradients sum 4 rows on top.
    np.testing.assert_allclose(split.numpy(), whole.numpy(), rtol=1e-5, atol=2e-6)
    for g_split, g_whole in zip(
        tape.gradient(loss_split, mlp.trainable_variables),
        tape.gradient(loss_whole, mlp.trainable_variables),
    ):
        np.testing.assert_allclose(g_split.numpy(), g_whole.numpy(), rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="rows 5:12"):
        layers.first_layer_part(mlp, a, 5)  # 5 features where the kernel's rows 5:12 need 7


def test_mlp_with_mean_gives_the_output_and_its_mean_without_gradient():
    """`mlp_with_mean`: the MLP's output and the mean of its units (from the output layer's
    input and the kernel's row means); gradients flow through the output only."""
    mlp = MLP(6, 8, 1, out_units=5)
    mlp.out.b.assign(tf.constant([0.5, -1.0, 2.0, 0.25, 3.0]))
    x = normal([2, 3, 6], seed=3)
    with tf.GradientTape(persistent=True) as tape:
        out, mean = layers.mlp_with_mean(mlp, x)
        loss = tf.reduce_sum(tf.sin(out))
    # The plain MLP; the output layer's 9-term sums (8 products and the folded bias, |x·w| ≲ 3)
    # in another order: 9·eps·3 ≈ 1.6e-6.
    np.testing.assert_allclose(out.numpy(), mlp(x).numpy(), rtol=1e-5, atol=2e-6)
    assert mean.shape == (2, 3)
    # h @ mean(w) vs mean(h @ w): 8-term sums of |h·w| ≲ 2 in another order, ≈ 8·eps·2 = 1e-6.
    np.testing.assert_allclose(mean.numpy(), tf.reduce_mean(out, -1).numpy(), rtol=1e-5, atol=2e-6)
    assert all(g is None for g in tape.gradient(mean, mlp.trainable_variables))
    assert all(g is not None for g in tape.gradient(loss, mlp.trainable_variables))
    padded, padded_mean = layers.mlp_with_mean(mlp, x, masked_out=3)
    assert padded.shape == (2, 3, 8)
    np.testing.assert_array_equal(padded[..., :5], out)
    np.testing.assert_array_equal(padded_mean, mean)  # the mean of the real units only


def test_gru_equals_the_plain_cell():
    cell = networks.GRUCell(3, 8)
    cell.norm.scale.assign(tf.linspace(0.5, 1.5, 24))
    x, h = normal([5, 3], seed=4), normal([5, 8], seed=5)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch([x, h])
        ours, ref = layers.gru(cell, x, h), cell(x, h)
        loss_ours, loss_ref = tf.reduce_sum(tf.sin(ours)), tf.reduce_sum(tf.sin(ref))
    # 11-term sums (|x·w| ≲ 1) through the norm (gain ≲ 3), sigmoid and tanh: ≲ 2e-6.
    np.testing.assert_allclose(ours.numpy(), ref.numpy(), rtol=1e-5, atol=2e-6)
    sources = [x, h, *cell.trainable_variables]
    _assert_same_gradients(
        tape.gradient(loss_ours, sources), tape.gradient(loss_ref, sources), sources, 1e-4, 1e-5
    )


def test_onehot_partial_equals_the_matmul_with_the_one_hot_features():
    mlp = MLP(5 + 3 * 4, 8, 1)  # 5 plain features, then 3 one-hot groups of 4 classes
    first = mlp.blocks[0].dense
    index = tf.constant([[0, 3, 1], [2, 2, 0], [3, 0, 3]])
    onehot = tf.reshape(tf.one_hot(index, 4), [3, 12])
    # Sums of the same 3 kernel entries (|w| < 0.5; the other products are exact zeros) in
    # another order: 2 roundings, ≲ 1e-7. The MLPs: first-layer sums of 8 non-zero products
    # |x·w| ≲ 1 in another order (8·eps ≈ 5e-7), through a LayerNorm (gain ≲ 2) and a layer.
    np.testing.assert_allclose(
        layers.onehot_partial(first, index, 5, 4).numpy(),
        layers.dense_partial(first, onehot, 5, 17).numpy(),
        rtol=1e-6,
        atol=1e-6,
    )
    a = normal([3, 5], seed=1)
    np.testing.assert_allclose(
        layers.mlp(mlp, a, rest=layers.onehot_partial(first, index, 5, 4)).numpy(),
        mlp(tf.concat([a, onehot], -1)).numpy(),
        rtol=1e-5,
        atol=2e-6,
    )


@pytest.mark.parametrize("read_once", [False, True])
@pytest.mark.parametrize("with_onehot", [True, False])
def test_onehot_partial_has_the_matmuls_gradients(with_onehot, read_once):
    """The kernel's gradient (segment sums over the classes; with the rows read once for a loop
    and the one-hot given, a small matmul) is onehot^T dy either way; the one-hot itself gets
    dy kernel^T only when it is passed."""
    mlp = MLP(5 + 3 * 4, 8, 1, out_units=2)
    first = mlp.blocks[0].dense
    index = tf.constant([[[0, 3, 1], [2, 2, 0]], [[3, 0, 3], [0, 1, 2]]])  # [2, 2, 3]
    a = normal([2, 2, 5], seed=1)
    if read_once:  # a loop step's rank-2 inputs
        index, a = tf.reshape(index, [4, 3]), tf.reshape(a, [4, 5])
    onehot = tf.reshape(tf.one_hot(index, 4), [*index.shape[:-1], 12])
    with tf.GradientTape(persistent=True) as tape:
        tape.watch([a, onehot])
        weights = layers.LoopWeights([mlp], row_blocks=[(first, 5, 17)]) if read_once else None
        rest = layers.onehot_partial(first, index, 5, 4, onehot if with_onehot else None, weights)
        ours = layers.mlp(mlp, a, rest=rest)
        ref = mlp(tf.concat([a, onehot if with_onehot else tf.stop_gradient(onehot)], -1))
        loss_ours, loss_ref = tf.reduce_sum(tf.sin(ours)), tf.reduce_sum(tf.sin(ref))
    # As above; the gradients sum the values' errors (≲ 2e-6 each) over ≤ 4 rows: 1e-5.
    np.testing.assert_allclose(ours.numpy(), ref.numpy(), rtol=1e-5, atol=2e-6)
    sources = [a, *mlp.trainable_variables]
    for g_ours, g_ref in zip(tape.gradient(loss_ours, sources), tape.gradient(loss_ref, sources)):
        np.testing.assert_allclose(g_ours.numpy(), g_ref.numpy(), rtol=1e-4, atol=1e-5)
    d_onehot = tape.gradient(loss_ours, onehot)
    if with_onehot:
        np.testing.assert_allclose(
            d_onehot.numpy(), tape.gradient(loss_ref, onehot).numpy(), rtol=1e-4, atol=1e-5
        )
    else:
        assert d_onehot is None


# --- loops and read-once weights ----------------------------------------------------------------
@pytest.mark.parametrize(
    "identity",
    [loops.materialized_gradient, loops.materialized, lambda x: loops.materialized(x, decider=-x)],
)
@pytest.mark.parametrize("first_sign", [1.0, -1.0])  # the cond's predicate: the first entry
def test_materialized_identities_are_exact_with_the_identitys_gradient(identity, first_sign):
    x = tf.tensor_scatter_nd_update(normal([3, 4], seed=2), [[0, 0]], [first_sign])
    c = normal([3, 4], seed=3)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = identity(x)
        loss = tf.reduce_sum(c * y)
    np.testing.assert_array_equal(y.numpy(), x.numpy())
    np.testing.assert_array_equal(tape.gradient(loss, x).numpy(), c.numpy())


def test_materialized_gradient_keeps_an_unrolled_recurrence_exact_and_unfused_under_xla():
    gru = networks.GRUCell(3, 8)
    x = normal([6, 5, 3], seed=4)
    h0 = normal([5, 8], seed=5)

    def grads(materialize):
        def fn(x, h0):
            with tf.GradientTape() as tape:
                tape.watch(h0)
                h, total = h0, 0.0
                for t in range(6):
                    h = gru(x[t], h)
                    if materialize:
                        h = loops.materialized_gradient(h)
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


@pytest.mark.parametrize("compiled", [False, True])
def test_scan_equals_tf_scan_in_values_and_gradients(compiled):
    gru = networks.GRUCell(3, 4)
    xs = normal([7, 2, 3], seed=7)
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
                loss = tf.reduce_sum(tf.sin(hs)) + tf.reduce_sum(totals**2)
            return hs, totals, tape.gradient(loss, [xs, *gru.trainable_variables])

        return tf.function(fn, jit_compile=True) if compiled else fn

    ours = run(loops.scan)(xs)
    ref = run(lambda f, e, i: tf.scan(f, e, initializer=i))(xs)
    assert ours[0].shape == (7, 2, 4) and ours[1].shape == (7, 2)
    for a, b in zip(tf.nest.flatten(ours), tf.nest.flatten(ref)):  # loops fused differently
        _assert_close_in_scale(a, b, RECURRENCE_RTOL)


def test_loop_weights_give_a_loops_exact_gradients_and_leave_the_modules_alone():
    mlp = MLP(3 + 4, 8, 1, out_units=4)
    xs = normal([5, 2, 3], seed=6)

    def loop(x, read_once):
        with tf.GradientTape() as tape:
            weights = layers.LoopWeights([mlp]) if read_once else None
            # The read weights are plain tensors; the module keeps its variables.
            assert read_once == (
                weights is not None
                and mlp.out.w in weights
                and not isinstance(weights.read(mlp.out.w), tf.Variable)
            )

            def step(h, x_t):
                return tf.tanh(layers.mlp(mlp, tf.concat([x_t, h], -1), weights=weights))

            hs = tf.scan(step, x, initializer=tf.zeros([2, 4]))
            loss = tf.reduce_sum(tf.sin(hs))
        return loss, tape.gradient(loss, mlp.trainable_variables)

    ours = tf.function(lambda x: loop(x, True), jit_compile=True)(xs)
    ref = tf.function(lambda x: loop(x, False), jit_compile=True)(xs)
    _assert_close_in_scale(ours[0], ref[0], RECURRENCE_RTOL, scale=5 * 2 * 4)  # of 40 sines
    assert len(ours[1]) == len(mlp.trainable_variables) == 5
    for a, b in zip(ours[1], ref[1]):  # sums over 5 steps · 2 rows
        _assert_close_in_scale(a, b, RECURRENCE_RTOL)
    assert isinstance(mlp.out.w, tf.Variable) and len(mlp.trainable_variables) == 5


def test_loop_weights_slice_row_blocks_and_transpose_kernels_before_the_loop():
    """A loop multiplying part of a kernel (`dense_partial`) gets the rows sliced once, and every
    product's input gradient multiplies a kernel transposed once: the program TF hands XLA
    stacks no per-step copy of the rows and has no dot with a transposed right operand. Values
    and gradients equal those of the plain MLP on the concatenation."""
    mlp = MLP(4 + 3, 6, 1, out_units=4)
    first = mlp.blocks[0].dense
    xs = normal([5, 2, 3], seed=8)

    def fast(xs):
        with tf.GradientTape() as tape:
            tape.watch(xs)
            parts = layers.dense_partial(first, xs, 4, 7)  # the input's share, all steps at once
            weights = layers.LoopWeights([mlp], row_blocks=[(first, 0, 4)])
            hs = loops.scan(
                lambda h, part: tf.tanh(layers.mlp(mlp, h, part, weights)), parts, tf.zeros([2, 4])
            )
            loss = tf.reduce_sum(tf.sin(hs))
        return loss, tape.gradient(loss, [xs, *mlp.trainable_variables])

    def plain(xs):
        with tf.GradientTape() as tape:
            tape.watch(xs)
            hs = tf.scan(
                lambda h, x_t: tf.tanh(mlp(tf.concat([h, x_t], -1))),
                xs,
                initializer=tf.zeros([2, 4]),
            )
            loss = tf.reduce_sum(tf.sin(hs))
        return loss, tape.gradient(loss, [xs, *mlp.trainable_variables])

    ours = tf.function(fast, jit_compile=True)
    (loss, grads), (ref_loss, ref_grads) = ours(xs), plain(xs)  # XLA vs eager
    _assert_close_in_scale(loss, ref_loss, RECURRENCE_RTOL, scale=5 * 2 * 4)  # of 40 sines
    for a, b in zip(grads, ref_grads):  # sums over 5 steps · 2 rows
        _assert_close_in_scale(a, b, RECURRENCE_RTOL)
    hlo = ours.experimental_get_compiler_ir(xs)(stage="hlo")
    assert "f32[5,4,6]" not in hlo  # the rows [4, 6], once per step
    loop_dots = [
        line
        for line in hlo.splitlines()
        if " dot(" in line and "while/" in line and " = f32[2,1]" not in line
    ]  # (the LayerNorm's row means are dots too)
    assert len(loop_dots) == 6  # forward: 2 products; backward: their inputs' and kernels'
    assert not [line for line in loop_dots if "rhs_contracting_dims={1}" in line]
    with pytest.raises(ValueError, match="row_blocks"):
        layers.LoopWeights([mlp.out], row_blocks=[(first, 0, 4)])


def _module_state():
    """Every global of the kernels' and the plain model's modules, by identity."""
    from rllib_dreamerv3.kernels import losses as kernel_losses

    modules = [
        kernels,
        layers,
        loops,
        rssm,
        two_hot,
        kernel_losses,
        networks,
        world_model,
        losses,
        math_ops,
    ]
    return {
        module.__name__: {name: id(value) for name, value in vars(module).items()}
        for module in modules
    }


def test_loop_weights_leave_no_module_level_state():
    """`LoopWeights` is an object passed to the layers, not a mode: two over the same modules
    hold their own reads, layers given none read the variables, and a fast observe (and a whole
    fast world-model loss) leaves every module global as it was."""
    mlp = MLP(4 + 3, 6, 1, out_units=4)
    first = mlp.blocks[0].dense
    x = normal([2, 7], seed=9)
    before = mlp(x).numpy()
    a = layers.LoopWeights([mlp])
    b = layers.LoopWeights([mlp], row_blocks=[(first, 0, 4)])
    assert a.rows(first, 0, 4) is None and b.rows(first, 0, 4) is not None
    assert a.read(first.w) is not b.read(first.w)
    other = tf.Variable(1.0)
    assert other not in a and a.read(other) is other
    # A read is a snapshot: a later assignment reaches the variable, and a LoopWeights made
    # after it, only. (Fast and plain layers: sums in other orders, ≲ 1e-6 apart.)
    mlp.out.b.assign_add(tf.ones([4]))
    for weights, expected in [
        (a, before),
        (layers.LoopWeights([mlp]), before + 1.0),
        (None, before + 1.0),
    ]:
        np.testing.assert_allclose(
            layers.mlp(mlp, x, weights=weights), expected, rtol=1e-5, atol=2e-6
        )
    assert all(isinstance(v, tf.Variable) for v in mlp.variables)

    model = build(size="micro")
    wm = model.world_model
    batch = make_batch()
    before = _module_state()
    for by_index in (0, 10**9):
        with _threshold(by_index):
            rssm.observe(wm, *observe_inputs(wm, batch, [5, 6]))
    kernels.world_model_loss(model, batch, random_ops.split(tf.constant([1, 2]), 8), hparams())
    assert _module_state() == before


@contextlib.contextmanager
def _threshold(value):
    """`rssm.OBSERVE_BY_INDEX_MIN_FEATURES = value` inside the block."""
    saved = rssm.OBSERVE_BY_INDEX_MIN_FEATURES
    rssm.OBSERVE_BY_INDEX_MIN_FEATURES = value
    try:
        yield
    finally:
        rssm.OBSERVE_BY_INDEX_MIN_FEATURES = saved


# --- two-hot statistics and cross-entropy -------------------------------------------------------
def _per_bin(grad, probs, scale=1.0):
    """A two-hot gradient, `probs * v - labels`, divided by the bins' (float64) probabilities and
    a row `scale`: its float32 error is then `v`'s (in bin units), not shrunk by small `probs`."""
    return np.asarray(grad, np.float64) / (probs * scale)


# The shift two_hot_stats subtracts before exponentiating: the default (the row maximum), the
# row mean (the fast one the heads use), and shifts by which every row overflows or underflows,
# which must fall back to the maximum (compiled: through XLA's conditional).
SHIFTS = {
    "max": None,
    "mean": lambda x: tf.reduce_mean(x, -1),
    "overflowing": lambda x: tf.reduce_mean(x, -1) - 200.0,
    "underflowing": lambda x: tf.reduce_max(x, -1) + 200.0,
}


@pytest.mark.parametrize("keep_exp", [False, True])
@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("shift", list(SHIFTS))
def test_two_hot_stats_of_batched_logits_and_their_gradients(shift, compiled, keep_exp):
    """The expected bin (matvecs with the bins) and the log-normaliser equal numpy's, and so do
    their gradients, for every shift, with the gradient recomputing the exponentials or reusing
    the forward pass's (`keep_exp`; after an overflowing shift, those of the fallback)."""
    bins = math_ops.two_hot_bins()
    logits = normal([2, 3, 255], seed=4, scale=3.0)
    b, p = bins.numpy().astype(np.float64), float64_softmax(logits)
    expected = (p * b).sum(-1)
    reference = np.sign(expected) * np.expm1(np.abs(expected))
    lse_ref = np.log(np.exp(logits.numpy().astype(np.float64)).sum(-1))
    d_lse_weight = np.linspace(0.5, 2.0, 6).reshape(2, 3).astype(np.float32)

    def run(logits):
        with tf.GradientTape() as tape:
            tape.watch(logits)
            given = None if SHIFTS[shift] is None else SHIFTS[shift](logits)
            mean, lse = two_hot.two_hot_stats(logits, bins, given, keep_exp=keep_exp)
            both = tf.reduce_sum(mean) + tf.reduce_sum(d_lse_weight * lse)
        return mean, lse, tape.gradient(both, logits)

    mean, lse, grad = (tf.function(run, jit_compile=True) if compiled else run)(logits)
    assert mean.shape == (2, 3) and lse.shape == (2, 3)
    np.testing.assert_allclose(mean.numpy(), reference, rtol=EXPECTED_ATOL, atol=EXPECTED_ATOL)
    np.testing.assert_allclose(lse.numpy(), lse_ref, rtol=4 * EPS32, atol=LSE_ATOL)
    # d mean / d logits = p * (bins - expected) * symexp'(expected), d lse / d logits = p. Per bin
    # and over symexp' = exp|expected|: bins - expected + d_lse_weight / exp|expected|, off by
    # expected's error, and by it again times |bins - expected| ≤ 40 through exp|expected|.
    growth = np.exp(np.abs(expected))[..., None]
    d_ref = p * (b - expected[..., None]) * growth + p * d_lse_weight[..., None]
    np.testing.assert_allclose(
        _per_bin(grad, p, growth),
        _per_bin(d_ref, p, growth),
        rtol=PROB_RTOL,
        atol=(1 + 2 * MAX_BIN) * EXPECTED_ATOL,
    )


def test_two_hot_cross_entropy_of_two_targets_and_its_gradient():
    """Weighted cross-entropies towards two two-hot labels equal the dense formula
    `-sum(labels * log_softmax)`, and so does the gradient `S * softmax - labels`."""
    bins = math_ops.two_hot_bins()
    logits = normal([4, 255], seed=5, scale=2.0)
    targets = [tf.constant([0.5, -3.0, 1e9, 0.0]), tf.constant([2.0, 7.5, -40.0, -1e9])]
    weights = [1.0, 0.3]
    labels = sum(
        w * math_ops.two_hot(math_ops.symlog(t), bins).numpy() for t, w in zip(targets, weights)
    )
    p = float64_softmax(logits)
    scale = np.array([1.0, 2.0, 0.0, -1.0])
    with tf.GradientTape() as tape:
        tape.watch(logits)
        _, lse = two_hot.two_hot_stats(logits, bins, tf.reduce_mean(logits, -1))
        ce = two_hot.two_hot_cross_entropy(logits, lse, targets, weights, bins)
        total = tf.reduce_sum(ce * tf.constant(scale, tf.float32))
    # sum(weights) * lse minus the labels' logits (|logits| < 16, a few roundings each).
    np.testing.assert_allclose(
        ce.numpy(),
        -(labels * np.log(p)).sum(-1),
        rtol=4 * EPS32,
        atol=sum(weights) * (LSE_ATOL + 64 * EPS32),
    )
    # Per bin: scale * (sum(weights) - labels / p), off by p's relative error times the first
    # term (the labels are the same float32 numbers).
    d_ref = scale[:, None] * (sum(weights) * p - labels)
    np.testing.assert_allclose(
        _per_bin(tape.gradient(total, logits), p),
        _per_bin(d_ref, p),
        rtol=4 * EPS32,
        atol=2.0 * sum(weights) * PROB_RTOL,
    )
    with pytest.raises(ValueError, match="one weight per target"):
        two_hot.two_hot_cross_entropy(logits, lse, targets, [1.0], bins)


@pytest.mark.parametrize("compiled", [False, True])
def test_two_hot_functions_take_logits_with_masked_columns(compiled):
    """Logits padded with masked columns (a head rounded up to 256 columns) give the unpadded
    logits' mean, normaliser, cross-entropy and gradients, and no gradient in the masked columns;
    logits narrower than the bins are an error."""
    bins = math_ops.two_hot_bins()
    assert masked_columns(255) == 1 and masked_columns(32) == 0 and masked_columns(41) == 7
    # The last real column, beside the masked one, gets probability (~0.1) that an off-by-one
    # at the boundary would lose.
    logits = normal([6, 255], seed=6, scale=2.0) + tf.one_hot(254, 255) * 4.0
    padded = tf.concat([logits, tf.fill([6, 1], MASKED_LOGIT)], -1)
    targets = [tf.constant([0.5, -3.0, 1e9, 0.0, 2.0, -7.0])]

    def run(logits):
        with tf.GradientTape() as tape:
            tape.watch(logits)
            mean, lse = two_hot.two_hot_stats(logits, bins, tf.reduce_mean(logits[:, :255], -1))
            ce = two_hot.two_hot_cross_entropy(logits, lse, targets, [1.0], bins)
            # symlog(mean): the mean's gradient in symlog space, p * (bins - expected); a
            # function of the real-space mean (up to e^20) would magnify its rounding.
            total = tf.reduce_sum(ce) + tf.reduce_sum(math_ops.symlog(mean))
        return mean, lse, ce, tape.gradient(total, logits)

    run = tf.function(run, jit_compile=True) if compiled else run
    ours, reference = run(padded), run(logits)
    # Both sides are float32 sums over the bins (of different widths, so in different orders):
    # twice the error bounds. The cross-entropy is lse minus the same gathered logits.
    np.testing.assert_allclose(
        ours[0], reference[0], rtol=2 * EXPECTED_ATOL, atol=2 * EXPECTED_ATOL
    )
    for a, b in zip(ours[1:3], reference[1:3]):
        np.testing.assert_allclose(a, b, rtol=4 * EPS32, atol=2 * LSE_ATOL)
    # Per bin: 1 - labels / p + (bins - expected) * symlog'(mean) * symexp'(expected); the last
    # factor is 1 up to twice expected's error, which |bins - expected| ≤ 40 multiplies.
    p = float64_softmax(logits)
    np.testing.assert_allclose(
        _per_bin(ours[3][:, :255], p),
        _per_bin(reference[3], p),
        rtol=2 * PROB_RTOL,
        atol=2 * (1 + 4 * MAX_BIN) * EXPECTED_ATOL,
    )
    np.testing.assert_array_equal(ours[3][:, 255], 0.0)  # exactly: exp(-1e30 - lse) is 0
    with pytest.raises(ValueError, match="254 columns for 255 bins"):
        two_hot.two_hot_stats(logits[:, :254], bins)


@pytest.mark.parametrize("compiled", [False, True])
def test_two_hot_stats_and_loss_equal_the_plain_mean_and_log_prob(compiled):
    """On masked-padded logits with the heads' mean shift, `two_hot_stats`' mean and
    `two_hot_loss` equal the plain `two_hot_mean` and `-two_hot_log_prob` on the real columns:
    values and gradients (none in the masked column)."""
    bins = math_ops.two_hot_bins()
    logits = normal([3, 4, 255], seed=10, scale=2.0)
    padded = tf.concat([logits, tf.fill([3, 4, 1], MASKED_LOGIT)], -1)
    target = normal([3, 4], seed=11, scale=30.0)

    def fast(padded):
        with tf.GradientTape() as tape:
            tape.watch(padded)
            shift = tf.reduce_mean(padded[..., :255], -1)
            mean = two_hot.two_hot_stats(padded, bins, shift)[0]
            loss = two_hot.two_hot_loss(padded, target, bins, shift)
            total = tf.reduce_sum(loss) + tf.reduce_sum(math_ops.symlog(mean))
        return mean, loss, tape.gradient(total, padded)

    def plain(logits):
        with tf.GradientTape() as tape:
            tape.watch(logits)
            mean = math_ops.two_hot_mean(logits, bins)
            loss = -math_ops.two_hot_log_prob(logits, target, bins)
            total = tf.reduce_sum(loss) + tf.reduce_sum(math_ops.symlog(mean))
        return mean, loss, tape.gradient(total, logits)

    ours = (tf.function(fast, jit_compile=True) if compiled else fast)(padded)
    ref = plain(logits)
    # Both are float32 sums over the 255 bins, in different orders: twice the bounds.
    np.testing.assert_allclose(ours[0], ref[0], rtol=2 * EXPECTED_ATOL, atol=2 * EXPECTED_ATOL)
    np.testing.assert_allclose(ours[1], ref[1], rtol=4 * EPS32, atol=2 * LSE_ATOL)
    p = float64_softmax(logits)
    np.testing.assert_allclose(
        _per_bin(ours[2][..., :255], p),
        _per_bin(ref[2], p),
        rtol=2 * PROB_RTOL,
        atol=2 * (1 + 4 * MAX_BIN) * EXPECTED_ATOL,
    )
    np.testing.assert_array_equal(ours[2][..., 255], 0.0)


def test_two_hot_loss_is_cross_entropy():
    bins, logits, target, expected = two_hot_hand_case()
    np.testing.assert_allclose(two_hot.two_hot_loss(logits, target, bins), expected, rtol=1e-5)


# --- percentiles by a bitwise search -----------------------------------------------------------
@pytest.mark.parametrize("case", sorted(PERCENTILE_CASES))
def test_percentiles_by_bitwise_search_match_numpy_and_the_reference(case):
    x = PERCENTILE_CASES[case].astype(np.float32)
    qs = (0.0, 5.0, 33.3, 50.0, 95.0, 100.0)
    expected = np.percentile(x.astype(np.float64), qs)
    ours = percentiles.percentiles(x, qs)
    # Order statistics are exact; interpolating between two of one sign (in every case here)
    # rounds a few times (< 8 ulps = 1e-6 relative), on both sides.
    np.testing.assert_allclose(ours, expected, rtol=1e-6)
    np.testing.assert_allclose(ours, math_ops.percentiles(x, qs), rtol=2e-6)


def test_percentiles_by_bitwise_search_compiled_with_xla_and_at_infinities():
    x = np.random.default_rng(2).normal(size=(15, 1024)).astype(np.float32)
    compiled = tf.function(lambda v: percentiles.percentiles(v, [5.0, 95.0]), jit_compile=True)
    np.testing.assert_allclose(
        compiled(x), np.percentile(x.astype(np.float64), [5.0, 95.0]), rtol=1e-6
    )
    y = np.array([1.0, np.inf, -np.inf, 0.5], np.float32)  # exact ranks: no 0 * inf = NaN
    np.testing.assert_array_equal(percentiles.percentiles(y, [0.0, 100.0]), [-np.inf, np.inf])


# --- categorical samples by a matmul ------------------------------------------------------------
def test_categorical_samples_equal_the_reference():
    seed = tf.constant([3, 4])
    # Sums of powers of two: cumulative sums exact in any order, so the very same classes,
    # compiled or not (other probabilities can differ by an ulp of a class boundary).
    exact = tf.constant([[0.125, 0.25, 0.625, 0.0]] * 1000)
    reference = random_ops.categorical(exact, seed)
    np.testing.assert_array_equal(sampling.categorical(exact, seed), reference)
    compiled = tf.function(sampling.categorical, jit_compile=True, autograph=False)
    np.testing.assert_array_equal(compiled(exact, seed), reference)
    probs = np.random.default_rng(0).dirichlet(np.ones(32), size=4096).astype(np.float32)
    ours = sampling.categorical(probs, seed).numpy()
    theirs = random_ops.categorical(probs, seed).numpy()
    assert (ours != theirs).sum() <= 1  # measured: none here; ~4e-6 of rows in general
    with random_ops.sharded(1, 2):  # the uniforms' blocks (see random_ops.sharded)
        shard = sampling.categorical(probs[2048:], seed)
    np.testing.assert_array_equal(shard, ours[2048:])


# --- the world model's recurrence by latent classes ---------------------------------------------
def test_latent_samples_steps_and_prior_equal_the_world_models():
    model = build(size="micro")
    wm = model.world_model
    logits = normal([5, *wm.stoch_shape], seed=2)
    z, index = rssm.sample_z(wm, logits, tf.constant([3, 4]))
    # The same classes (the cumulative sums differ by rounding only), so z up to an ulp.
    np.testing.assert_allclose(z, wm.sample_z(logits, tf.constant([3, 4])), rtol=0, atol=1e-6)
    assert index.shape == (5, wm.size.num_categoricals) and index.dtype == tf.int32
    np.testing.assert_array_equal(index, rssm.z_index(wm, z))
    h = normal([5, wm.size.gru_units], seed=1)
    np.testing.assert_allclose(
        rssm.prior_logits(wm, h), wm.prior_logits(h), rtol=1e-5, atol=2e-6
    )  # the folded bias: sums in another order, ≲ 1e-6
    action = tf.one_hot([0, 1, 1, 0, 1], 2)
    h_fast, z_fast, index_fast = rssm.imagine_step(wm, h, z, index, action, tf.constant([5, 6]))
    h_ref, z_ref = wm.imagine_step(h, z, action, tf.constant([5, 6]))
    # One GRU step, as in the next test.
    np.testing.assert_allclose(h_fast, h_ref, rtol=1e-5, atol=2e-6)
    np.testing.assert_array_equal(index_fast, rssm.z_index(wm, z_ref))  # the same samples
    np.testing.assert_allclose(z_fast, z_ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("by_index", [False, True])
def test_sequence_step_equals_the_one_hot_step(by_index):
    model = build(size="micro")
    wm = model.world_model
    h = normal([5, wm.size.gru_units], seed=1)
    z = wm.sample_z(normal([5, *wm.stoch_shape], seed=2), tf.constant([3, 4]))
    action = tf.one_hot([0, 1, 1, 0, 1], 2)
    index = rssm.z_index(wm, z) if by_index else None
    with tf.GradientTape(persistent=True) as tape:
        tape.watch([h, z])
        ours = rssm.sequence_step(wm, h, z, action, index)
        ref = wm.sequence_step(h, z, action)
        loss_ours, loss_ref = tf.reduce_sum(tf.sin(ours)), tf.reduce_sum(tf.sin(ref))
    # The one-hot matmul's non-zero products, summed in another order with the rest of the
    # input layer (|x·w| ≲ 1, ≲ 64 terms: ≈ 64·eps·0.3 ≈ 1e-6), through a GRU step (gain ≲ 1).
    np.testing.assert_allclose(ours.numpy(), ref.numpy(), rtol=1e-5, atol=2e-6)
    sources = [h, z, *wm.gru_input.trainable_variables, *wm.gru.trainable_variables]
    _assert_same_gradients(
        tape.gradient(loss_ours, sources), tape.gradient(loss_ref, sources), sources, 1e-4, 1e-5
    )


@pytest.mark.parametrize("with_z", [True, False])
@pytest.mark.parametrize("with_mean", [False, True])
def test_head_by_latent_classes_equals_the_mlp_on_the_model_state(with_z, with_mean):
    """`head(wm, net, h, index, z)` is `net(concat([h, z]))` (padded by masked columns), with
    the variables' gradients, `z`'s gradient only where `z` is given, and (`with_mean`) the
    mean of the real output units."""
    model = build(size="micro")
    wm = model.world_model
    net = wm.reward_head
    h = normal([2, 3, wm.size.gru_units], seed=1)
    z = tf.reshape(
        wm.sample_z(normal([6, *wm.stoch_shape], seed=2), tf.constant([3, 4])),
        [2, 3, wm.stoch_dim],
    )
    index = rssm.z_index(wm, z)
    masked = masked_columns(NUM_BINS)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch([h, z])
        out = rssm.head(wm, net, h, index, z if with_z else None, masked, with_mean)
        out, mean = out if with_mean else (out, None)
        ref = net(tf.concat([h, z if with_z else tf.stop_gradient(z)], -1))
        loss_ours = tf.reduce_sum(tf.sin(out[..., :NUM_BINS]))
        loss_ref = tf.reduce_sum(tf.sin(ref))
    assert out.shape == (2, 3, NUM_BINS + masked)
    np.testing.assert_array_equal(out[..., NUM_BINS:], np.float32(MASKED_LOGIT))
    # First-layer sums of ≤ 64 non-zero products (|x·w| ≲ 0.3) in another order (≈ 1e-6),
    # through a LayerNorm (gain ≲ 2) and the output layer.
    np.testing.assert_allclose(out[..., :NUM_BINS], ref, rtol=1e-5, atol=5e-6)
    if with_mean:  # as in test_mlp_with_mean_gives_the_output_and_its_mean_without_gradient
        np.testing.assert_allclose(mean, tf.reduce_mean(ref, -1), rtol=1e-5, atol=2e-6)
    sources = [h, *net.trainable_variables]
    _assert_same_gradients(
        tape.gradient(loss_ours, sources), tape.gradient(loss_ref, sources), sources, 1e-4, 1e-5
    )
    d_z = tape.gradient(loss_ours, z)
    if with_z:
        _assert_close_in_scale(d_z, tape.gradient(loss_ref, z), 1e-4, 1e-5)
    else:
        assert d_z is None


@pytest.mark.parametrize("by_index", [False, True])
def test_observe_matches_a_loop_of_plain_observe_steps(by_index, monkeypatch):
    """The fast `observe` (embedding's posterior share and the prior outside the recurrence;
    with `by_index`, the latent entering the dynamics by its classes) gives the same states and
    logits as the plain one-step path the policy uses, with resets mid-sequence."""
    monkeypatch.setattr(rssm, "OBSERVE_BY_INDEX_MIN_FEATURES", 0 if by_index else 10**9)
    model = build(size="micro")
    wm = model.world_model
    batch = make_batch(seed=3)
    embed, prev_actions, is_first, seeds = observe_inputs(wm, batch, [5, 6])
    h, z, post, prior = rssm.observe(wm, embed, prev_actions, is_first, seeds)
    h_t, z_t = wm.initial_state(batch["rewards"].shape[0])
    for t in range(embed.shape[0]):
        h_t, z_t, post_t = wm.observe_step(
            h_t, z_t, prev_actions[t], embed[t], is_first[t], seeds[t]
        )
        prior_t = wm.prior_logits(h_t)
        for ours, ref in [(h[t], h_t), (z[t], z_t), (post[t], post_t), (prior[t], prior_t)]:
            _assert_close_in_scale(ours, ref, 1e-4, SCALE_RTOL)


def test_observe_by_latent_classes_has_the_plain_observes_gradients():
    """Compiled, the fast observe loop, feeding the latent by its classes (row sums with the
    one-hot matmul's gradients, in the loop) or as a one-hot, gives the plain `tf.scan`
    observe's values and gradients."""
    model = build(size="micro")
    wm = model.world_model
    obs = losses.time_major(make_batch(seed=4)["obs"])
    _, prev_actions, is_first, seeds = observe_inputs(wm, make_batch(seed=4), [7, 8])
    variables = wm.trainable_variables

    def run(threshold):
        def observe(embed, prev_actions, is_first, seeds):
            if threshold is None:
                return wm.observe(embed, prev_actions, is_first, seeds)
            with _threshold(threshold):  # read when the function is traced
                return rssm.observe(wm, embed, prev_actions, is_first, seeds)

        @tf.function(jit_compile=True, autograph=False)
        def fn():
            with tf.GradientTape() as tape:
                outputs = observe(layers.encoder(wm.encoder, obs), prev_actions, is_first, seeds)
                loss = tf.add_n([tf.reduce_sum(tf.sin(x)) for x in outputs])
            return outputs, tape.gradient(loss, variables)

        return fn()

    ref, ref_grads = run(None)
    for threshold in (0, 10**9):
        ours, our_grads = run(threshold)
        for a, b in zip(ours, ref):
            _assert_close_in_scale(a, b, 1e-4, SCALE_RTOL)
        # The gradients through 8 steps of the recurrence: its sums of ≲ 300 terms per layer
        # and step, and some entries near 0 (rtol 1e-3 for those just above the atol).
        _assert_same_gradients(our_grads, ref_grads, variables, 1e-3, SCALE_RTOL)
        kernel = next(i for i, var in enumerate(variables) if var is wm.gru_input.dense.w)
        assert np.abs(our_grads[kernel].numpy()).max() > 0


# --- the losses ---------------------------------------------------------------------------------
def test_heads_are_padded_to_an_aligned_width_by_masked_columns():
    """The fast path runs the two-hot heads 256 wide (255 bins and one masked column, for any
    bin count the next multiple of 16); the plain heads stay 255 wide."""
    for num_bins, width in [(255, 256), (41, 48)]:
        model = build(num_bins=num_bins)
        wm = model.world_model
        feat = normal([4, wm.feat_dim], seed=0)
        for net in (wm.reward_head, model.critic.mlp):
            padded = layers.mlp(net, feat, masked_out=masked_columns(num_bins))
            assert padded.shape == (4, width) and net(feat).shape == (4, num_bins)
            np.testing.assert_array_equal(padded[:, num_bins:], np.float32(MASKED_LOGIT))
            # The output layer's folded bias: sums in another order, ≲ 1e-6.
            np.testing.assert_allclose(padded[:, :num_bins], net(feat), rtol=1e-5, atol=2e-6)


def test_other_bin_counts_take_no_probability_in_the_masked_columns():
    """41 bins: the zero-initialised reward head is uniform over the 41 bins only (log 41, not
    log 48) in the fast world-model loss, and one fast update runs."""
    tf.random.set_seed(0)
    model = DreamerV3Model(3, 2, True, MODEL_SIZES["nano"], num_bins=41)
    batch = make_batch()
    _, metrics, _ = kernels.world_model_loss(
        model, batch, random_ops.split(tf.constant([0, 0]), 8), hparams()
    )
    np.testing.assert_allclose(metrics["L_reward"], np.log(41.0), rtol=1e-5)
    optimizers = {
        name: make_adam(1e-3, 1e-8, part.trainable_variables)
        for name, part in [
            ("world_model", model.world_model),
            ("actor", model.actor),
            ("critic", model.critic),
        ]
    }
    update = make_update_fn(
        model,
        optimizers,
        hparams(fast_kernels=True),
        batch_signature((3,), tf.float32, 2, 4, 8),
        jit_compile=False,
    )
    metrics = update.python_function(batch, tf.constant([0, 1]))  # eager: seconds less
    assert all(np.isfinite(value.numpy()).all() for value in metrics.values())


WORLD_MODEL_CASES = {  # obs_shape, discrete, size, batch size
    "vector-discrete-nano": ((5,), True, "nano", 4),
    "vector-continuous-nano": ((5,), False, "nano", 4),
    "vector-discrete-XS": ((5,), True, "XS", 2),  # 32·32 = 1024 latent features: by index
    "vector-continuous-XS": ((5,), False, "XS", 2),
    # 8 · 8 = 64 frames: the convolutions' matmul path (MATMUL_CONV_MIN_BATCH)
    "image-discrete-nano": ((64, 64, 3), True, "nano", 8),
    "image-discrete-XS": ((64, 64, 3), True, "XS", 8),
}


@pytest.mark.parametrize("case", list(WORLD_MODEL_CASES))
def test_world_model_loss_equals_the_reference(case):
    """`kernels.world_model_loss` gives the reference's loss, metrics, posterior states and
    gradients w.r.t. every world-model variable."""
    obs_shape, discrete, size, batch_size = WORLD_MODEL_CASES[case]
    model = build(obs_shape, 3, discrete, size)
    wm = model.world_model
    assert (wm.stoch_dim >= rssm.OBSERVE_BY_INDEX_MIN_FEATURES) == (size == "XS")
    batch = make_batch(obs_shape, 3, discrete, batch_size, 8, seed=1)
    if len(obs_shape) == 3:
        frames = tf.zeros([batch_size * 8, *obs_shape])
        assert layers._matmul_conv_applies(frames, wm.encoder.blocks[0].conv.w, 2)
    seeds = random_ops.split(tf.constant([1, 2]), 8)
    variables = wm.trainable_variables
    results = []
    for impl in (kernels, losses):
        with tf.GradientTape() as tape:
            loss, metrics, states = impl.world_model_loss(model, batch, seeds, hparams())
        results.append((loss, metrics, states, tape.gradient(loss, variables)))
    (loss, metrics, states, grads), (ref_loss, ref_metrics, ref_states, ref_grads) = results
    # Every prediction is the reference's up to the order of its layers' sums, ~sqrt(n)·eps ≈
    # 1e-6 of its scale per layer (n ≲ 768 terms); losses and metrics are means of them (the
    # image loss: of 12288 pixels' squared errors, summed in the same order on both sides).
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert set(metrics) == set(ref_metrics) and len(metrics) == 11
    for key in ref_metrics:
        np.testing.assert_allclose(
            metrics[key], ref_metrics[key], rtol=1e-5, atol=1e-6, err_msg=key
        )
    for a, b in zip(states, ref_states):  # the same samples: z is one-hot up to an ulp
        _assert_close_in_scale(a, b, 1e-4, SCALE_RTOL)
    # Gradients: sums over B·T steps (and for the convolutions' kernels over every pixel
    # position, ≲ 64·32·32 terms) of the predictions' ~1e-6 relative differences: SCALE_RTOL
    # of each array's largest entry (measured ≲ 1e-5 on a 64x64 image loss of ~2900).
    _assert_same_gradients(grads, ref_grads, variables, 1e-3, SCALE_RTOL)


ACTOR_CRITIC_CASES = {  # discrete, size
    "discrete-nano": (True, "nano"),
    "continuous-nano": (False, "nano"),
    "discrete-XS": (True, "XS"),
    "continuous-XS": (False, "XS"),
}


@pytest.mark.parametrize("case", list(ACTOR_CRITIC_CASES))
def test_imagination_and_actor_critic_losses_equal_the_reference(case):
    """`kernels.imagine` + `kernels.actor_critic_losses` give the reference's trajectory (the
    same samples), actor and critic losses, return scale, metrics, and the actor's and critic's
    gradients (continuous actions backpropagate through the dynamics and the value)."""
    discrete, size = ACTOR_CRITIC_CASES[case]
    model = build((5,), 3, discrete, size)
    model.return_scale.assign(0.5)
    wm, hp = model.world_model, hparams(horizon_H=8)
    h, z = start_states(wm, 8)
    seeds = random_ops.split(tf.constant([3, 4]), 2 * hp.horizon_H)
    start_cont = tf.constant([1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    results = []
    for impl in (kernels, losses):
        with tf.GradientTape(persistent=True) as tape:
            imagined = impl.imagine(model, h, z, hp.horizon_H, seeds)
            out = impl.actor_critic_losses(model, imagined, start_cont, hp)
        results.append(
            (
                imagined,
                out,
                tape.gradient(out[0], model.actor.trainable_variables),
                tape.gradient(out[1], model.critic.trainable_variables),
            )
        )
    (imagined, out, actor_grads, critic_grads), ref = results
    ref_imagined, ref_out, ref_actor_grads, ref_critic_grads = ref
    assert ref_imagined.z_index is None  # the reference keeps no classes; the kernels do:
    np.testing.assert_array_equal(imagined.z_index, rssm.z_index(wm, ref_imagined.z))
    # The states: one GRU step's roundings (≲ 2e-6, as in test_sequence_step_...) per step.
    _assert_close_in_scale(imagined.h, ref_imagined.h, 1e-4, SCALE_RTOL)
    _assert_close_in_scale(imagined.actions, ref_imagined.actions, 1e-4, SCALE_RTOL)
    # Rewards and values are two-hot means: 255-bin sums in other orders (and shifts), up to
    # EXPECTED_ATOL ≈ 6e-4 apart in symlog space in the worst case, ~sqrt(255)·eps·20 ≈ 2e-5
    # typically; symexp makes that a relative error of real-space values, and the losses,
    # returns and statistics inherit it: 1e-4 (the critic's cross-entropies: 2·LSE_ATOL).
    actor_loss, critic_loss, scale, metrics = out
    ref_actor_loss, ref_critic_loss, ref_scale, ref_metrics = ref_out
    np.testing.assert_allclose(actor_loss, ref_actor_loss, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(critic_loss, ref_critic_loss, rtol=1e-5, atol=2 * LSE_ATOL)
    np.testing.assert_allclose(scale, ref_scale, rtol=1e-4, atol=1e-5)
    assert set(metrics) == set(ref_metrics)
    for key in ref_metrics:
        np.testing.assert_allclose(
            metrics[key], ref_metrics[key], rtol=1e-4, atol=1e-5, err_msg=key
        )
    assert abs(float(ref_metrics["imagined_reward_mean"])) > 1e-3  # non-trivial heads
    # Gradients: the softmaxes' relative error PROB_RTOL ≈ 2e-5 (both sides), summed over
    # H · N = 64 states: SCALE_RTOL of each array's largest entry.
    _assert_same_gradients(
        actor_grads, ref_actor_grads, model.actor.trainable_variables, 1e-3, SCALE_RTOL
    )
    _assert_same_gradients(
        critic_grads, ref_critic_grads, model.critic.trainable_variables, 1e-3, SCALE_RTOL
    )


@pytest.mark.parametrize("discrete", [True, False])
def test_critic_loss_and_returns_match_a_direct_evaluation(discrete):
    """The fast critic loss (one log-normaliser for both of its targets and the values, on all
    H + 1 states with the last weighted 0) and the returns (heads run on the imagined states by
    their latent classes) equal the paper's terms computed one by one with the plain heads:
    values, and the critic loss's gradient w.r.t. the critic's variables."""
    model = build(discrete=discrete)
    wm, critic = model.world_model, model.critic
    n, hp = 6, hparams()
    h, z = start_states(wm, n)
    imagined = kernels.imagine(
        model, h, z, hp.horizon_H, random_ops.split(tf.constant([3, 4]), 2 * hp.horizon_H)
    )
    # The classes imagine() keeps are those of its one-hot latents.
    np.testing.assert_array_equal(imagined.z_index, rssm.z_index(wm, imagined.z))
    start_cont = tf.constant([1.0, 1.0, 0.0, 1.0, 1.0, 1.0])
    with tf.GradientTape(persistent=True) as tape:
        _, critic_loss, _, metrics = kernels.actor_critic_losses(model, imagined, start_cont, hp)
        assert imagined.feat.shape == (hp.horizon_H + 1, 6, wm.size.gru_units + wm.stoch_dim)
        reference, returns = reference_critic_loss(model, imagined, start_cont, hp)
    assert abs(float(tf.reduce_mean(returns))) > 1e-3  # the reward head is not zero
    # Rewards and values: two-hot means over 255 bins in other orders (and shifts): ~sqrt(255)·
    # eps·20 ≲ 2e-5 apart in symlog space, a relative error in real space, over ≤ 5 steps.
    np.testing.assert_allclose(
        metrics["imagined_return_mean"], tf.reduce_mean(returns), rtol=1e-4, atol=1e-5
    )
    # Cross-entropies ≈ 5.5 whose log-normalisers (other shifts) differ by ≤ 2·255·eps ≈ 3e-5.
    np.testing.assert_allclose(critic_loss, reference, rtol=1e-5)
    ours = tape.gradient(critic_loss, critic.trainable_variables)
    theirs = tape.gradient(reference, critic.trainable_variables)
    assert max(float(tf.reduce_max(tf.abs(g))) for g in theirs) > 1e-3
    # The softmaxes differ by the log-normalisers' 3e-5, so do the gradients' terms.
    _assert_same_gradients(ours, theirs, critic.trainable_variables, 1e-4, SCALE_RTOL)


# --- one whole update ---------------------------------------------------------------------------
def _assert_same_first_adam_step(weights, reference, max_lr):
    """Weights after one Adam step from the same start agree within rounding, but for rare
    entries. A first Adam step moves a weight by lr·g / (|g| + eps), about ±lr for any gradient
    above eps (1e-8 for the world model): where a gradient sums to within its rounding error
    (~1e-6 of its variable's scale, machine-dependent) of 0, the two steps may differ by up to
    2·lr. With a density ~1/scale of gradients near 0 that is ~1e-5 of the entries: up to 1 in
    1000 may differ, by at most 2·lr."""
    a, b = (np.concatenate([np.ravel(w) for w in ws]) for ws in (weights, reference))
    off = ~np.isclose(a, b, rtol=1e-3, atol=1e-5)
    assert off.sum() <= a.size // 1000, (off.sum(), a.size, np.abs(a - b).max())
    assert np.all(np.abs(a - b)[off] <= 2 * max_lr + 1e-5), np.abs(a - b).max()


UPDATE_CASES = {  # obs_shape, discrete, size, jit_compile of the fast update
    "vector-discrete-nano": ((5,), True, "nano", False),
    "vector-continuous-nano": ((5,), False, "nano", False),
    "vector-discrete-XS": ((5,), True, "XS", False),
    "image-discrete-nano": ((64, 64, 3), True, "nano", False),
    "vector-discrete-nano-xla": ((5,), True, "nano", True),  # XLA vs the eager reference
    "dict-continuous-nano": ({"pos": (5,), "cam": (64, 64, 1)}, False, "nano", False),
}


@pytest.mark.parametrize("case", list(UPDATE_CASES))
def test_one_update_equals_the_reference_update(case, monkeypatch):
    """`make_update_fn` with `fast_kernels` on and off, from the same weights and optimizers:
    the same metrics, and the same weights after one step (Adam's first step is ±lr wherever a
    gradient is not ~0, so this checks the gradients' signs and the update's plumbing; their
    values are checked above)."""
    obs_shape, discrete, size, jit = UPDATE_CASES[case]
    monkeypatch.setattr(layers, "MATMUL_CONV_MIN_BATCH", 1)  # the matmul convs for 2 · 8 frames
    batch_size, length = 2, 8
    batch = make_batch(obs_shape, 3, discrete, batch_size, length, seed=2)
    obs_dtype = tf.nest.map_structure(lambda x: x.dtype, batch["obs"])
    signature = batch_signature(obs_shape, obs_dtype, 3, batch_size, length)
    results, initial = {}, None
    for fast in (True, False):
        model = build(obs_shape, 3, discrete, size, seed=3)
        start = [v.numpy() for v in model.variables]
        if initial is None:
            initial = start
        for a, b in zip(start, initial):  # the same initial weights
            np.testing.assert_array_equal(a, b)
        hp = hparams(fast_kernels=fast)
        optimizers = {
            "world_model": make_adam(
                hp.world_model_lr, hp.world_model_adam_eps, model.world_model.trainable_variables
            ),
            "actor": make_adam(hp.actor_lr, hp.actor_adam_eps, model.actor.trainable_variables),
            "critic": make_adam(hp.critic_lr, hp.critic_adam_eps, model.critic.trainable_variables),
        }
        update = make_update_fn(model, optimizers, hp, signature, jit_compile=jit and fast)
        if not (jit and fast):  # eager: the same function, without seconds of graph building
            update = update.python_function
        metrics = update(batch, tf.constant([5, 7]))
        results[fast] = (
            {k: v.numpy() for k, v in metrics.items()},
            [v.numpy() for v in model.variables],
        )
    (metrics, weights), (ref_metrics, ref_weights) = results[True], results[False]
    assert set(metrics) == set(ref_metrics)
    for key in ("skipped_world_model", "skipped_critic", "skipped_actor"):
        assert metrics[key] == ref_metrics[key] == 0.0, key
    # Losses, gradient norms and statistics: as in the tests of the losses above.
    for key in ref_metrics:
        np.testing.assert_allclose(
            metrics[key], ref_metrics[key], rtol=1e-4, atol=1e-5, err_msg=key
        )
    _assert_same_first_adam_step(weights, ref_weights, max_lr=1e-4)
    moved = [not np.array_equal(w, i) for w, i in zip(weights, initial)]
    assert sum(moved) > len(moved) // 2  # the step changed the weights


@pytest.mark.parametrize("impl", [losses, kernels], ids=["plain", "fast"])
def test_continuous_actor_gradient_includes_the_baseline(impl, monkeypatch):
    """With continuous actions the actor loss `mean(w·(−(R − v(s))/max(1, S) − η·H))` is
    differentiated through the baseline v(s) too (the author's backprop objective): its gradient
    is that of the loss with v stopped plus that of `mean(w·v)/max(1, S)`, which is not zero
    (the states depend on the actor's earlier actions)."""
    model = build((5,), 3, False, "nano")
    wm, hp = model.world_model, hparams(horizon_H=6)
    h, z = start_states(wm, 4)
    seeds = random_ops.split(tf.constant([5, 6]), 2 * hp.horizon_H)
    start_cont = tf.ones([4])
    seen = {}
    advantage, weights = math_ops.normalized_advantage, math_ops.trajectory_weights

    def recording_weights(cont, gamma):
        seen["w"] = weights(cont, gamma)
        return seen["w"]

    def recording_advantage(returns, value, scale, stop=False):
        seen.update(value=value, scale=scale)
        return advantage(returns, tf.stop_gradient(value) if stop else value, scale)

    monkeypatch.setattr(math_ops, "trajectory_weights", recording_weights)
    variables = model.actor.trainable_variables
    grads = {}
    for stop in (False, True):
        monkeypatch.setattr(
            math_ops,
            "normalized_advantage",
            lambda r, v, s, stop=stop: recording_advantage(r, v, s, stop),
        )
        with tf.GradientTape(persistent=True) as tape:
            imagined = impl.imagine(model, h, z, hp.horizon_H, seeds)
            actor_loss = impl.actor_critic_losses(model, imagined, start_cont, hp)[0]
            baseline = tf.reduce_mean(seen["w"] * seen["value"]) / tf.maximum(1.0, seen["scale"])
        grads[stop] = tape.gradient(actor_loss, variables)
        grads["baseline", stop] = tape.gradient(baseline, variables)
    for full, stopped, base in zip(grads[False], grads[True], grads["baseline", False]):
        np.testing.assert_allclose(full, stopped + base, rtol=1e-4, atol=1e-7)
    assert max(float(tf.reduce_max(tf.abs(g))) for g in grads["baseline", False]) > 1e-6
