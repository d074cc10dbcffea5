"""Unpin traced graphs from TF's gradient registry.

Inside a `tf.function` trace, every call of a `tf.custom_gradient` function (TF's own
`tf.nn.silu` is one) registers its gradient function under a new name, `CustomGradient-<uid>`,
in TF's process-wide gradient registry, and nothing ever unregisters it
(tensorflow/tensorflow#27492, #97697). The registered closure holds tensors of the traced
graph, so the graph, its ops, its nested `cond`/`while` graphs and their function
definitions live as long as the process, after the function and its owner are gone: about
50 MB for each DreamerV3 algorithm built, trained and stopped (nano model; see
`benchmarks/memory.py`).

A gradient registered so is looked up while the trace builds its gradients (`tape.gradient`
inside the function), never when the traced function runs. :func:`release_custom_gradients`
therefore unregisters those of a finished trace: the functions that own a trace call it
right after tracing, and the graph is then freed with them. Only a gradient taken later
*through* the traced function from outside would need the entries (it then raises
`LookupError: No gradient defined for operation ... (op type: CustomGradient-...)`), and a
SavedModel of it would be saved without its custom gradients.
"""

from tensorflow.python.framework import ops

_PREFIX = "CustomGradient-"


def _graphs_within(graph):
    """`graph` and the graphs of the functions it holds (cond branches, loop bodies, their
    gradients), recursively."""
    graphs, stack, seen = [], [graph], set()
    while stack:
        g = stack.pop()
        if id(g) in seen:
            continue
        seen.add(id(g))
        graphs.append(g)
        functions = getattr(g, "_functions", {})  # TF's own SavedModel export reads it too
        stack.extend(f.graph for f in functions.values() if hasattr(f, "graph"))
    return graphs


def custom_gradient_names(graph):
    """The gradient-registry names that the ops of `graph` (and of the graphs nested in it)
    refer to: a `tf.custom_gradient` call is an `IdentityN` op whose gradient override
    `_gradient_op_type` names its registered gradient."""
    names = set()
    for g in _graphs_within(graph):
        for op in g.get_operations():
            if op.type != "IdentityN":
                continue
            try:
                name = op.get_attr("_gradient_op_type")
            except ValueError:  # a plain IdentityN
                continue
            name = name.decode() if isinstance(name, bytes) else name
            if name.startswith(_PREFIX):
                names.add(name)
    return names


def release_custom_gradients(*graphs):
    """Unregister the `tf.custom_gradient` gradients that tracing `graphs` (FuncGraphs, e.g.
    a `ConcreteFunction`'s `.graph`) registered; call once their traces are complete. Only
    these graphs' own entries go: other functions' traces, finished or not, keep theirs.
    Returns the number of entries removed (0 where TF's registry is not the dict it is in
    TF 2.21: the graphs then stay, as without this)."""
    registry = getattr(ops.gradient_registry, "_registry", None)
    if not isinstance(registry, dict):
        return 0
    removed = 0
    for graph in graphs:
        for name in custom_gradient_names(graph):
            removed += registry.pop(name, None) is not None
    return removed
