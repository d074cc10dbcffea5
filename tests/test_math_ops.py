"""The pure math of the paper's symlog, two-hot, percentile and return equations against values
worked out by hand."""

import math

import numpy as np
import pytest
import tensorflow as tf
from helpers import PERCENTILE_CASES, float64_softmax, normal, two_hot_hand_case

from rllib_dreamerv3 import math_ops

# Float32 error budget. The two-hot sums run over 255 bins in an order that depends on the
# machine (SIMD width, oneDNN's and XLA's kernels): tolerances must hold for any order, so they
# use the worst-case bound of a float32 sum of n terms, n·eps·sum(|terms|) (eps = 2**-24, the
# unit roundoff), never a margin that merely passed once. Reference values are float64.
EPS32 = 2.0**-24
NUM_BINS, MAX_BIN = 255, 20.0
# log(sum(exp)): the sum's relative error n·eps is the log's absolute error (≈ 1.5e-5).
LSE_ATOL = NUM_BINS * EPS32
# expected = sum(p·bins) / sum(p), |bins| ≤ 20: n·eps·20 for the numerator, n·eps·|expected| ≤
# n·eps·20 from the denominator: ≈ 6.1e-4 in symlog space. symexp multiplies an error there by
# exp|expected| = 1 + |mean|: real-space means get rtol = atol = EXPECTED_ATOL.
EXPECTED_ATOL = 2 * NUM_BINS * EPS32 * MAX_BIN
# p = exp(logit - lse): lse's error, plus the rounding of |logit - lse| < 64 and of exp.
PROB_RTOL = LSE_ATOL + 64 * EPS32


def test_symlog_symexp_values_and_inverse():
    x = np.array([-10.0, -1.0, 0.0, 1.0, math.e - 1.0, 1000.0], np.float32)
    expected = np.array(
        [-math.log(11.0), -math.log(2.0), 0.0, math.log(2.0), 1.0, math.log(1001.0)], np.float32
    )
    # float32 log1p (a few ulps) and the rounded constants: < 8 ulps = 1e-6 relative.
    np.testing.assert_allclose(math_ops.symlog(x), expected, rtol=1e-6)
    # expm1 turns symlog's absolute error (a few ulps of 6.9 ≈ 1.5e-6) into a relative one.
    np.testing.assert_allclose(math_ops.symexp(math_ops.symlog(x)), x, rtol=1e-5)


def test_two_hot_between_bins_on_bin_and_clipped():
    bins = tf.constant([-2.0, 0.0, 2.0, 4.0])  # exact arithmetic: powers of two, default rtol
    # 0.5 lies a quarter of the way from bin 1 (0.0) to bin 2 (2.0).
    np.testing.assert_allclose(math_ops.two_hot(0.5, bins), [0.0, 0.75, 0.25, 0.0])
    np.testing.assert_allclose(math_ops.two_hot(2.0, bins), [0.0, 0.0, 1.0, 0.0])
    np.testing.assert_allclose(math_ops.two_hot(4.0, bins), [0.0, 0.0, 0.0, 1.0])
    np.testing.assert_allclose(math_ops.two_hot(-9.0, bins), [1.0, 0.0, 0.0, 0.0])
    np.testing.assert_allclose(math_ops.two_hot(99.0, bins), [0.0, 0.0, 0.0, 1.0])


def test_two_hot_matches_a_search_over_the_bins():
    """The arithmetic bin index agrees with numpy's searchsorted on the real 255 bins."""
    bins = math_ops.two_hot_bins()
    y = np.random.default_rng(0).uniform(-25.0, 25.0, 2_000).astype(np.float32)
    y[:255] = bins.numpy()  # exactly on every bin
    b = bins.numpy().astype(np.float64)
    yc = np.clip(y, b[0], b[-1])
    below = np.clip(np.searchsorted(b, yc, side="right") - 1, 0, len(b) - 2)
    w = (yc - b[below]) / (b[below + 1] - b[below])
    expected = np.zeros([len(y), len(b)])
    expected[np.arange(len(y)), below] += 1.0 - w
    expected[np.arange(len(y)), below + 1] += w
    # Our bin positions (low + k·step) and the float32 bins (ulp 1.9e-6 near ±20) differ by up to
    # 2 ulps, and so do the widths: ≤ 2·2·1.9e-6 / step (0.157) ≈ 5e-5 of a weight.
    np.testing.assert_allclose(math_ops.two_hot(y, bins), expected, atol=5e-5)


def test_two_hot_bins_match_spec():
    bins = math_ops.two_hot_bins()
    assert bins.shape == (255,)
    # The ends are exact; bins[127] = -20 + 127·step rounds at ulp(20) = 1.9e-6.
    np.testing.assert_allclose([bins[0], bins[127], bins[-1]], [-20.0, 0.0, 20.0], atol=2e-6)


@pytest.mark.parametrize("y", [-300.0, -1.0, 0.0, 0.3, 7.0, 12345.0])
def test_two_hot_round_trip_through_logits(y):
    """Logits equal to log(two-hot weights) predict y back (in real space)."""
    bins = math_ops.two_hot_bins()
    weights = math_ops.two_hot(math_ops.symlog(tf.constant(y)), bins)
    logits = tf.math.log(weights + 1e-30)
    # Two bins carry the mass (the others e^-69 each): the symlog-space error is a few ulps of 20
    # (bins and weights, ~5e-6), well inside 1e-4 (relative in real space, absolute near 0).
    np.testing.assert_allclose(math_ops.two_hot_mean(logits, bins), y, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("compiled", [False, True])
def test_two_hot_mean_and_log_prob_of_batched_logits_and_their_gradients(compiled):
    """`two_hot_mean` (softmax-weighted bins, in real space) and `two_hot_log_prob` (the two-hot
    label's weighted log-softmax) equal numpy's float64, and so do their gradients."""
    bins = math_ops.two_hot_bins()
    logits = normal([2, 3, 255], seed=4, scale=3.0)
    targets = tf.constant([[0.5, -3.0, 1e9], [0.0, 7.5, -40.0]])
    b, p = bins.numpy().astype(np.float64), float64_softmax(logits)
    expected = (p * b).sum(-1)
    labels = math_ops.two_hot(math_ops.symlog(targets), bins).numpy().astype(np.float64)
    log_prob_ref = (labels * np.log(p)).sum(-1)

    def run(logits):
        with tf.GradientTape() as tape:
            tape.watch(logits)
            mean = math_ops.two_hot_mean(logits, bins)
            log_prob = math_ops.two_hot_log_prob(logits, targets, bins)
            # symlog(mean): the mean's gradient in symlog space, p * (bins - expected); a
            # function of the real-space mean (up to e^20) would magnify its rounding.
            total = tf.reduce_sum(math_ops.symlog(mean)) + tf.reduce_sum(log_prob)
        return mean, log_prob, tape.gradient(total, logits)

    mean, log_prob, grad = (tf.function(run, jit_compile=True) if compiled else run)(logits)
    assert mean.shape == (2, 3) and log_prob.shape == (2, 3)
    np.testing.assert_allclose(
        mean.numpy(),
        np.sign(expected) * np.expm1(np.abs(expected)),
        rtol=EXPECTED_ATOL,
        atol=EXPECTED_ATOL,
    )
    # lse's error, plus the label weights' (the same float32 numbers) sums of two entries.
    np.testing.assert_allclose(
        log_prob.numpy(), log_prob_ref, rtol=4 * EPS32, atol=LSE_ATOL + 64 * EPS32
    )
    # Per bin, divided by p: (bins - expected) + labels / p - 1, off by expected's error (in
    # the first term) and by p's relative error (in the last), and the labels' term by its
    # own rounding, relative to it.
    d_ref = p * (b - expected[..., None]) + labels - p
    np.testing.assert_allclose(
        np.asarray(grad, np.float64) / p,
        d_ref / p,
        rtol=PROB_RTOL,
        atol=(1 + 2 * MAX_BIN) * EXPECTED_ATOL + PROB_RTOL,
    )


def test_two_hot_log_prob_is_minus_the_cross_entropy():
    bins, logits, target, expected = two_hot_hand_case()
    np.testing.assert_allclose(
        -math_ops.two_hot_log_prob(logits, target, bins), expected, rtol=1e-5
    )


def test_unimix_probs():
    probs = math_ops.unimix_probs(tf.constant([[0.0, 0.0, 100.0, -100.0]]), unimix=0.01)
    np.testing.assert_allclose(probs, [[0.0025, 0.0025, 0.99 + 0.0025, 0.0025]], atol=1e-6)


def test_straight_through_value_and_gradient():
    probs = tf.Variable([0.2, 0.8])
    with tf.GradientTape() as tape:
        out = math_ops.straight_through(tf.constant([0.0, 1.0]), probs)
        loss = tf.reduce_sum(out * tf.constant([3.0, 5.0]))
    # sample + p - p rounds: within an ulp of 1 (2**-23 above it is over the default rtol).
    np.testing.assert_allclose(out, [0.0, 1.0], rtol=1e-6)
    np.testing.assert_allclose(tape.gradient(loss, probs), [3.0, 5.0])


def test_categorical_kl_sums_over_categoricals():
    p = tf.constant([[[0.5, 0.5], [0.9, 0.1]]])  # [1, K=2, C=2]
    q = tf.constant([[[0.25, 0.75], [0.9, 0.1]]])
    expected = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)  # second one is 0
    np.testing.assert_allclose(math_ops.categorical_kl(p, q), [expected], rtol=1e-5)


def test_free_bits_clamps_below_one_nat():
    np.testing.assert_allclose(
        math_ops.free_bits(tf.constant([0.2, 1.0, 3.5]), 1.0), [1.0, 1.0, 3.5]
    )


def test_free_bits_blocks_gradient_below_threshold():
    kl = tf.Variable([0.5, 2.0])
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(math_ops.free_bits(kl, 1.0))
    np.testing.assert_allclose(tape.gradient(loss, kl), [0.0, 1.0])


def _reference_lambda_returns(reward, cont, value, gamma, lam):
    horizon = len(reward) - 1
    returns = np.zeros((horizon,) + reward.shape[1:])
    next_return = value[horizon]
    for t in reversed(range(horizon)):
        next_return = reward[t + 1] + gamma * cont[t + 1] * (
            (1 - lam) * value[t + 1] + lam * next_return
        )
        returns[t] = next_return
    return returns


def test_lambda_returns_hand_computed():
    # H = 2, one trajectory. R_1 = r2 + g c2 v2 (λ-weights sum to one at the end);
    # R_0 = r1 + g c1 ((1-λ) v1 + λ R_1).
    reward = np.array([[0.0], [1.0], [2.0]], np.float32)
    cont = np.array([[1.0], [1.0], [1.0]], np.float32)
    value = np.array([[0.0], [10.0], [20.0]], np.float32)
    gamma, lam = 0.5, 0.5
    r1 = 2.0 + 0.5 * 20.0
    r0 = 1.0 + 0.5 * (0.5 * 10.0 + 0.5 * r1)
    np.testing.assert_allclose(
        math_ops.lambda_returns(reward, cont, value, gamma, lam), [[r0], [r1]], rtol=1e-6
    )


def test_lambda_returns_match_reference_loop():
    rng = np.random.default_rng(0)
    reward = rng.normal(size=(16, 5)).astype(np.float32)
    cont = (rng.random((16, 5)) > 0.2).astype(np.float32)
    value = rng.normal(size=(16, 5)).astype(np.float32)
    reference = _reference_lambda_returns(
        *(x.astype(np.float64) for x in (reward, cont, value)), 0.997, 0.95
    )
    # float32: ~5 roundings a step of values up to m = max(|R|, |r|, |v|), each step's error
    # damped by γλ on the way back: ≤ 5·eps·m / (1 - γλ).
    m = max(np.abs(reference).max(), np.abs(reward).max(), np.abs(value).max())
    np.testing.assert_allclose(
        math_ops.lambda_returns(reward, cont, value, 0.997, 0.95),
        reference,
        rtol=0,
        atol=5 * EPS32 * m / (1 - 0.997 * 0.95),
    )


def test_trajectory_weights():
    cont = tf.constant([[1.0, 0.0], [1.0, 1.0], [0.0, 1.0], [1.0, 1.0]])  # [H+1=4, N=2]
    g = 0.9
    np.testing.assert_allclose(
        math_ops.trajectory_weights(cont, g), [[1.0, 0.0], [g, 0.0], [0.0, 0.0]], rtol=1e-6
    )


@pytest.mark.parametrize("case", sorted(PERCENTILE_CASES))
def test_percentile_matches_numpy(case):
    x = PERCENTILE_CASES[case].astype(np.float32)
    qs = (0.0, 5.0, 33.3, 50.0, 95.0, 100.0)
    expected = [np.percentile(x.astype(np.float64), q) for q in qs]
    static = math_ops.percentiles(x, qs)
    dynamic = tf.function(
        lambda v: math_ops.percentiles(v, qs),
        autograph=False,
        input_signature=[tf.TensorSpec(None, tf.float32)],
    )(x)
    # Order statistics are exact; interpolating between two of one sign (in every case here)
    # rounds a few times (< 8 ulps = 1e-6 relative); no reduction whose order could vary.
    np.testing.assert_allclose(static, expected, rtol=1e-6)
    np.testing.assert_allclose(dynamic, expected, rtol=1e-6)


def test_percentiles_compiled_with_xla_and_at_infinities():
    x = np.random.default_rng(2).normal(size=(15, 1024)).astype(np.float32)
    compiled = tf.function(lambda v: math_ops.percentiles(v, [5.0, 95.0]), jit_compile=True)
    # As above (the tails: neighbours of one sign): a few roundings, < 1e-6 relative.
    np.testing.assert_allclose(
        compiled(x), np.percentile(x.astype(np.float64), [5.0, 95.0]), rtol=1e-6
    )
    y = np.array([1.0, np.inf, -np.inf, 0.5], np.float32)  # exact ranks: no 0 * inf = NaN
    assert math_ops.percentile(y, 100.0).numpy() == np.inf
    assert math_ops.percentile(y, 0.0).numpy() == -np.inf


def test_return_normalization():
    returns = tf.constant(np.arange(101, dtype=np.float32))  # P5 = 5, P95 = 95
    scale = math_ops.return_scale_update(tf.constant(10.0), returns, decay=0.99)
    np.testing.assert_allclose(scale, 0.99 * 10.0 + 0.01 * 90.0, rtol=1e-6)
    # Small return ranges are not scaled up: divide by max(1, S).
    np.testing.assert_allclose(math_ops.normalized_advantage(3.0, 1.0, 0.25), 2.0)
    np.testing.assert_allclose(math_ops.normalized_advantage(3.0, 1.0, 4.0), 0.5)
