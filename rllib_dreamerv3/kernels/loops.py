"""Loops and buffers shaped for XLA: a scan whose gradient does not copy its outputs, and
identities that XLA computes into a buffer of their own (so that it does not fuse a copy of a
long chain of operations into every consumer)."""

import tensorflow as tf
from tensorflow.python.ops import list_ops  # TensorList ops (no public API; TF is pinned)


def scan(fn, elems, initializer):
    """`tf.scan(fn, elems, initializer)` for loops whose per-step outputs are the new carries,
    with those outputs gathered in a way that XLA differentiates without copies.

    `tf.scan` writes each step's output into a list with `TensorListSetItem`, whose gradient
    reads the item and writes zeros over it in the same buffer: XLA then copies the whole
    `[T, ...]` gradient buffer twice per step.
    Here outputs are pushed (`TensorListPushBack`, the gradient pops them), as TF's own loop
    gradients do with the tensors they keep. `elems` and `initializer` are nests of tensors with
    static shapes; `elems` are unstacked along their first axis (the number of steps).
    """
    flat_elems = tf.nest.flatten(elems)
    steps = flat_elems[0].shape[0]
    arrays = [
        tf.TensorArray(e.dtype, size=steps, element_shape=e.shape[1:]).unstack(e)
        for e in flat_elems
    ]
    flat_init = [tf.convert_to_tensor(x) for x in tf.nest.flatten(initializer)]
    lists = [
        list_ops.empty_tensor_list(x.shape, x.dtype, max_num_elements=steps) for x in flat_init
    ]

    def body(t, carry, lists):
        inputs = tf.nest.pack_sequence_as(elems, [array.read(t) for array in arrays])
        new = tf.nest.flatten(fn(tf.nest.pack_sequence_as(initializer, carry), inputs))
        return t + 1, new, [list_ops.tensor_list_push_back(out, x) for out, x in zip(lists, new)]

    _, _, lists = tf.while_loop(
        lambda t, *_: t < steps, body, (tf.constant(0), flat_init, lists), maximum_iterations=steps
    )
    return tf.nest.pack_sequence_as(
        initializer,
        [
            list_ops.tensor_list_stack(out, x.dtype, num_elements=steps, element_shape=x.shape)
            for out, x in zip(lists, flat_init)
        ],
    )


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
    of buffers each time. Here the gradient
    passes through a `tf.cond` whose two branches are the same identity, so it is exact for any
    predicate, and XLA does not fuse across a conditional. (`optimization_barrier` would say
    this directly, but XLA:CPU drops it before fusion.) The predicate reads `x`, computed in
    the forward pass, not the gradient, so that the predicate does not wait for it.
    """
    return tf.identity(x), lambda dy: _through_cond(dy, decider=x)
