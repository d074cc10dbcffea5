"""Counter-based RNG: identical compiled and eager, and distributed as claimed."""

import numpy as np
import tensorflow as tf

from rllib_dreamerv3 import random_ops


def _draws(seed):
    # Probabilities that are sums of powers of two: their cumulative sums are exact in any
    # order, so the sampled indices are too (with 0.1, 0.2, 0.7 the row total could differ by
    # an ulp between XLA's and TF's matmul, moving a uniform across a class boundary).
    return (
        random_ops.uniform([1000], seed),
        random_ops.normal([1000], seed),
        random_ops.categorical(tf.constant([[0.125, 0.25, 0.625]] * 1000), seed),
        random_ops.split(seed, 3),
    )


def test_compiled_and_eager_draw_identical_numbers():
    seed = tf.constant([3, 4])
    eager = _draws(seed)
    compiled = tf.function(_draws, jit_compile=True, autograph=False)(seed)
    for i, (a, b) in enumerate(zip(eager, compiled)):
        if i == 1:  # normals go through log/cos, whose XLA versions differ in the last ulps:
            # ≤ 4 ulps of the radius (≤ 6) and cos's absolute few ulps (≲ 2.4e-7) times it.
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=2e-6)
        else:  # integer hashing, exact float conversion, exact cumulative sums: bit-identical
            np.testing.assert_array_equal(a, b)


def test_seeds_give_different_streams_and_are_reproducible():
    a = random_ops.uniform([100], tf.constant([1, 2]))
    np.testing.assert_array_equal(a, random_ops.uniform([100], tf.constant([1, 2])))
    assert not np.allclose(a, random_ops.uniform([100], tf.constant([1, 3])))
    assert not np.allclose(a, random_ops.uniform([100], tf.constant([2, 2])))
    seeds = random_ops.split(tf.constant([1, 2]), 50).numpy()
    assert len({tuple(s) for s in seeds}) == 50


def test_distributions():
    # Fixed draws (integer hashing: the same on every machine); the bounds are ≥ 4 standard
    # errors of the sample statistics wide.
    u = random_ops.uniform([200_000], tf.constant([7, 7])).numpy()
    assert u.min() > 0.0 and u.max() < 1.0
    assert abs(u.mean() - 0.5) < 0.005 and abs(u.var() - 1 / 12) < 0.002
    n = random_ops.normal([200_000], tf.constant([8, 8])).numpy()
    assert abs(n.mean()) < 0.01 and abs(n.std() - 1.0) < 0.01
    probs = np.array([0.1, 0.2, 0.7], np.float32)
    idx = random_ops.categorical(np.tile(probs, (100_000, 1)), tf.constant([9, 9]))
    freq = np.bincount(idx.numpy(), minlength=3) / 100_000
    np.testing.assert_allclose(freq, probs, atol=0.01)


def test_categorical_never_picks_zero_probability_classes():
    probs = np.array(
        [[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.5, 0.0, 0.5]],
        np.float32,
    )
    idx = random_ops.categorical(np.tile(probs, (5_000, 1)), tf.constant([5, 6])).numpy()
    idx = idx.reshape(5_000, 4)
    assert (idx[:, 0] == 1).all() and (idx[:, 1] == 3).all() and (idx[:, 2] == 0).all()
    assert set(np.unique(idx[:, 3])) == {1, 3}
    assert abs((idx[:, 3] == 3).mean() - 0.5) < 0.03


def test_a_batch_size_known_only_at_run_time_draws_the_same_numbers():
    # An exported policy has a dynamic batch dimension; its draws must equal the static ones.
    seed = tf.constant([7, 11])
    probs = tf.nn.softmax(tf.reshape(tf.range(24, dtype=tf.float32) % 5, [6, 4]))

    @tf.function(input_signature=[tf.TensorSpec([None, 4], tf.float32)])
    def dynamic(p):
        assert p.shape[0] is None
        return (
            random_ops.uniform(random_ops.shape_of(p), seed),
            random_ops.normal(random_ops.shape_of(p), seed),
            random_ops.categorical(p, seed),
        )

    static = (
        random_ops.uniform([6, 4], seed),
        random_ops.normal([6, 4], seed),
        random_ops.categorical(probs, seed),
    )
    for a, b in zip(dynamic(probs), static):
        np.testing.assert_array_equal(a, b)


def test_sharded_draws_are_blocks_of_the_whole_draw():
    # Data-parallel Learners with 2 of 6 rows each draw exactly their rows of the 6-row draw.
    seed = tf.constant([5, 6])
    probs = np.random.default_rng(0).dirichlet(np.ones(4), size=6).astype(np.float32)
    whole = (
        random_ops.uniform([6, 3], seed),
        random_ops.normal([6, 3], seed),
        random_ops.categorical(probs, seed),
    )
    for index in range(3):
        rows = slice(2 * index, 2 * index + 2)
        with random_ops.sharded(index, 3):
            shard = (
                random_ops.uniform([2, 3], seed),
                random_ops.normal([2, 3], seed),
                random_ops.categorical(probs[rows], seed),
            )
        np.testing.assert_array_equal(shard[0], whole[0][rows])  # the same uniforms, so
        # the same normals up to the ulps in which vectorised log/cos differ with the length
        np.testing.assert_allclose(shard[1], whole[1][rows], rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(shard[2], whole[2][rows])
    # Outside the context, draws are the first block again.
    np.testing.assert_array_equal(random_ops.uniform([2, 3], seed), whole[0][:2])
    with random_ops.sharded(1, 3):
        assert not np.array_equal(random_ops.uniform([2, 3], seed), whole[0][:2])
