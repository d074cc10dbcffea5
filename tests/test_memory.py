"""Algorithms built, trained and stopped in one process leave no traced graphs behind.

Every trace of a `tf.custom_gradient` function (the update's kernels, TF's `tf.nn.silu` in the
policy) registers a gradient in TF's process-wide registry that holds the traced graph; the
Learner and the RLModule unregister those of their finished traces (see
rllib_dreamerv3.tf_rllib.custom_gradients). benchmarks/memory.py measures the memory.
"""

import gc
import weakref

import numpy as np
import pytest
import tensorflow as tf
from helpers import tiny_config
from tensorflow.python.framework import ops

from rllib_dreamerv3.tf_rllib.custom_gradients import (
    custom_gradient_names,
    release_custom_gradients,
)


def registry():
    return ops.gradient_registry._registry


@tf.custom_gradient
def scaled_gradient(x):
    return tf.identity(x), lambda dy: 3.0 * dy


def gradient_fn():
    """A function that takes gradients through custom gradients, in and out of a `tf.cond`
    (its own graph); its first output is d/dx sum(silu(x) + scaled_gradient(x))."""

    @tf.function(input_signature=[tf.TensorSpec([3], tf.float32)], autograph=False)
    def f(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = tf.reduce_sum(tf.nn.silu(x) + scaled_gradient(x))
            y += tf.cond(y > -1e9, lambda: tf.reduce_sum(scaled_gradient(x)), lambda: 0.0)
        return tape.gradient(y, x)

    return f


def test_release_unregisters_a_finished_trace_and_it_still_runs():
    before = set(registry())
    fn = gradient_fn().get_concrete_function()
    names = custom_gradient_names(fn.graph)
    assert len(names) == 3  # silu, scaled_gradient, and the one in the cond branch
    assert names == set(registry()) - before
    assert release_custom_gradients(fn.graph) == 3
    assert set(registry()) == before
    x = np.array([-1.0, 0.0, 2.0], np.float32)
    sigmoid = 1 / (1 + np.exp(-x))
    expected = sigmoid * (1 + x * (1 - sigmoid)) + 6.0
    np.testing.assert_allclose(fn(tf.constant(x)).numpy(), expected, rtol=1e-6)
    graph = weakref.ref(fn.graph)
    del fn
    gc.collect()
    assert graph() is None


def test_release_keeps_the_entries_of_other_traces():
    first = gradient_fn().get_concrete_function()
    second = gradient_fn().get_concrete_function()
    release_custom_gradients(first.graph)
    kept = custom_gradient_names(second.graph)
    assert kept and kept <= set(registry())
    release_custom_gradients(second.graph)


@pytest.mark.usefixtures("ray_session")
def test_a_stopped_algorithm_leaves_no_graphs_or_registry_entries():
    # Plain TF (jit_compile=False): XLA's compiled programs stay in TF's compilation cache for
    # the life of the process whatever happens to their functions (docs/performance.md, Memory).
    # Dreams every 16 updates: the dream function is traced too.
    before = len(registry())
    algo = tiny_config(jit_compile=False, dream_every_n_updates=16).build_algo()
    algo.train()
    algo.train()
    learner = algo.learner_group._learner
    traced = [learner._update_call, learner._dream_fn]
    traced += list(algo.env_runner.module._concrete_fns.values())
    assert len(traced) == 3  # update, dreams, the exploring policy
    graphs = [weakref.ref(fn.graph) for fn in traced]
    refs = [weakref.ref(algo), weakref.ref(learner)]
    del learner, traced
    algo.stop()
    del algo
    gc.collect()
    assert len(registry()) == before
    assert [ref() for ref in refs + graphs] == [None] * 5
