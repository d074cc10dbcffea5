"""The HLO FLOP counter of benchmarks/update_speed.py against FLOPs counted by hand."""

import flops
import tensorflow as tf


def _count(fn, *args):
    return flops.compiled_flops(tf.function(fn, jit_compile=True, autograph=False), *args)


def test_one_dense_layer():
    x, w = tf.ones([8, 16]), tf.ones([16, 32])
    count = _count(lambda x, w: tf.nn.silu(x @ w), x, w)
    assert count.total == count.dot == 2 * 8 * 16 * 32
    assert count.exact


def test_scan_and_its_gradient_count_every_step():
    steps, n, d = 5, 4, 8
    w0, xs = tf.ones([d, d]) * 0.01, tf.ones([steps, n, d])

    def loss_and_grad(w, xs):
        with tf.GradientTape() as tape:
            tape.watch(w)
            hs = tf.scan(lambda h, x: tf.tanh(h @ w + x), xs, initializer=tf.zeros([n, d]))
            loss = tf.reduce_sum(hs)
        return loss, tape.gradient(loss, w)

    count = _count(loss_and_grad, w0, xs)
    # Forward h @ w per step; backward d(loss)/dh @ w^T and h^T @ d(loss)/d(h @ w) per step.
    assert count.dot == 3 * steps * 2 * n * d * d
    assert [trip for _, trip in count.loops] == [steps] * len(count.loops)
    assert count.exact


def test_strided_convolution_counts_only_real_input_taps():
    images, kernel = tf.ones([2, 8, 8, 3]), tf.ones([4, 4, 3, 5])
    valid = _count(lambda x, k: tf.nn.conv2d(x, k, 2, "VALID"), images, kernel)
    assert valid.convolution == 2 * 2 * (3 * 3) * (4 * 4) * 3 * 5
    # SAME pads one pixel on each side: per dimension the 4 outputs see 3 + 4 + 4 + 3 taps.
    same = _count(lambda x, k: tf.nn.conv2d(x, k, 2, "SAME"), images, kernel)
    assert same.convolution == 2 * 2 * (14 * 14) * 3 * 5


def test_transposed_convolution_skips_the_holes_of_the_dilated_input():
    small, kernel = tf.ones([1, 4, 4, 5]), tf.ones([4, 4, 3, 5])
    count = _count(
        lambda x, k: tf.nn.conv2d_transpose(x, k, [1, 8, 8, 3], 2, "SAME"), small, kernel
    )
    # Each input pixel meets every kernel tap once (4 * 4 taps), minus taps that fall off
    # the 8x8 output: per dimension 4 inputs x 4 taps = 16, of which 2 fall outside.
    assert count.convolution == 2 * 1 * 3 * 5 * (14 * 14)


def test_conditionals_count_their_costliest_branch():
    x, w = tf.ones([4, 8]), tf.ones([8, 8])

    def predicated(x, w):  # HLO: true_computation= / false_computation=
        return tf.cond(x[0, 0] > 0.0, lambda: x @ w, lambda: x)

    def indexed(x, w):  # HLO: branch_computations={...}
        return tf.switch_case(
            tf.cast(x[0, 0], tf.int32), [lambda: x, lambda: x @ w @ w, lambda: x @ w]
        )

    assert _count(predicated, x, w).dot == 2 * 4 * 8 * 8
    assert _count(indexed, x, w).dot == 2 * 2 * 4 * 8 * 8
