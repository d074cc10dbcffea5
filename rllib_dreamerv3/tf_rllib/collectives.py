"""TensorFlow's collective ops among the processes of one Learner group.

Ray Train's `TensorflowConfig` backend (which `compat.apply_ray_patches` makes RLlib use for TF
Learners) writes `TF_CONFIG` on each Learner actor: the addresses of all of them and this one's
index. :func:`connect` turns that into a TF cluster in this process (`enable_collective_ops`),
and a :class:`Collective` then all-reduces and all-gathers tensors with TF's own collective
kernels (ring over gRPC on CPUs, NCCL on GPUs), eagerly or inside a `tf.function`.

Every process must issue the same collectives in the same order: a call's instance key is
drawn from a per-process counter, so the n-th collective of one process meets the n-th of the
others. A `tf.function` draws its keys once, when it is traced, and reuses them on each call.

A collective whose peer is gone would wait forever. TF can bound each collective's wait
(`timeout`), but it does so with one sleeping thread per collective call, which a training loop
of many calls a second turns into thousands of threads. Instead, :meth:`Collective.watch_peers`
starts one thread that asks the peers' TF servers whether they are alive (TF's
`check_collective_ops_peer_health`, as `MultiWorkerMirroredStrategy` does) and, when one does
not answer, aborts this process's collectives: the pending and all later ones raise
`tf.errors.UnavailableError`, so the group must be rebuilt.

XLA cannot compile collectives for CPUs: functions that contain them are graph functions.
"""

import contextlib
import json
import os
import threading
import time

import tensorflow as tf
from tensorflow.core.protobuf import tensorflow_server_pb2
from tensorflow.python.eager import context
from tensorflow.python.framework import errors as tf_errors
from tensorflow.python.ops import collective_ops

_GROUP_KEY = 1
_JOB = "worker"
_current = threading.local()


@contextlib.contextmanager
def in_group(collective):
    """Make `collective` (a :class:`Collective` or None) the group of :func:`gather_in_group`
    for the code inside, e.g. while a `tf.function` traces."""
    previous = getattr(_current, "value", None)
    _current.value = collective
    try:
        yield
    finally:
        _current.value = previous


def gather_in_group(tensor):
    """`tensor` of every process of the current :func:`in_group` group, concatenated along
    axis 0 in rank order; `tensor` itself outside a group (one process)."""
    collective = getattr(_current, "value", None)
    return tensor if collective is None else collective.all_gather(tensor)


def cluster_from_env(environ=None):
    """`(addresses, index)` from `TF_CONFIG` in `environ` (default `os.environ`), or `None`
    when it is unset or names a single worker."""
    raw = (os.environ if environ is None else environ).get("TF_CONFIG")
    if not raw:
        return None
    config = json.loads(raw)
    addresses = list(config.get("cluster", {}).get(_JOB, []))
    task = config.get("task", {})
    if len(addresses) < 2:
        return None
    if task.get("type") != _JOB or not 0 <= int(task.get("index", -1)) < len(addresses):
        raise ValueError(
            f"TF_CONFIG's task {task!r} is not one of its {len(addresses)} "
            f"{_JOB!r} addresses {addresses}."
        )
    return addresses, int(task["index"])


def connect(addresses, index):
    """Join this process to the TF cluster of `addresses` as worker `index`.

    Must run before this process creates any `tf.Variable` (variables created earlier stay on
    the pre-cluster device name, which collectives cannot use). Returns a :class:`Collective`.
    """
    if tf.config.list_logical_devices("GPU"):
        device = "GPU:0"
    else:
        device = "CPU:0"
    cluster = tf.train.ClusterSpec({_JOB: list(addresses)})
    # The session config travels with the server: it names the worker that resolves groups
    # (TF's `configure_collective_ops` would, but only before TF's first op in this process).
    session_config = tf.compat.v1.ConfigProto()
    session_config.experimental.collective_group_leader = f"/job:{_JOB}/replica:0/task:0"
    session_config.experimental.collective_nccl = device.startswith("GPU")
    session_config.device_filters.append(f"/job:{_JOB}/task:{index}")
    context.context().enable_collective_ops(
        tensorflow_server_pb2.ServerDef(
            cluster=cluster.as_cluster_def(),
            job_name=_JOB,
            task_index=index,
            protocol="grpc",
            default_session_config=session_config,
        )
    )
    return Collective(len(addresses), index, f"/job:{_JOB}/replica:0/task:{index}/{device}")


class Collective:
    """All-reduce and all-gather among `group_size` processes; this one is `rank`.

    Args:
        group_size: the number of processes.
        rank: this process's index in `[0, group_size)`.
        device: the local device that takes part (its full name in the cluster).
    """

    def __init__(self, group_size, rank, device):
        self.group_size = group_size
        self.rank = rank
        self.device = device
        self._next_instance_key = 1
        self._watchdog = None
        self.failed_peer = None  # set by the watchdog: the task that stopped answering

    def _instance_key(self):
        key = self._next_instance_key
        self._next_instance_key += 1
        return key

    def watch_peers(self, timeout_s, interval_s=None):
        """Start a daemon thread that checks every `interval_s` (default `timeout_s / 3`)
        that each peer's TF server answers within `timeout_s`, and aborts this process's
        collectives when one does not (see the module doc). Call it once all peers are up,
        e.g. after a first collective."""
        if self._watchdog is not None:
            return
        interval_s = timeout_s / 3 if interval_s is None else interval_s
        peers = [f"/job:{_JOB}/replica:0/task:{i}" for i in range(self.group_size)]
        peers.remove(f"/job:{_JOB}/replica:0/task:{self.rank}")

        def watch():
            ctx = context.context()
            while True:
                time.sleep(interval_s)
                for peer in peers:
                    try:
                        ctx.check_collective_ops_peer_health(peer, int(timeout_s * 1000))
                    except Exception as error:  # unreachable, restarted or timed out
                        self.failed_peer = peer
                        ctx.abort_collective_ops(
                            tf_errors.UNAVAILABLE,
                            f"Learner {peer} did not answer a health check within "
                            f"{timeout_s} s ({type(error).__name__}); collectives aborted.",
                        )
                        return

        self._watchdog = threading.Thread(target=watch, name="collective-watchdog", daemon=True)
        self._watchdog.start()

    def all_reduce_mean(self, tensors):
        """The element-wise mean over the processes of each float32 tensor in `tensors`, in one
        collective over their concatenation. Returns a list like `tensors`."""
        tensors = [tf.convert_to_tensor(t, tf.float32) for t in tensors]
        flat = tf.concat([tf.reshape(t, [-1]) for t in tensors], 0)
        with tf.device(self.device):
            mean = collective_ops.all_reduce_v2(
                flat,
                self.group_size,
                _GROUP_KEY,
                self._instance_key(),
                merge_op="Add",
                final_op="Div",
            )
        parts = tf.split(mean, [t.shape.num_elements() for t in tensors])
        return [tf.reshape(p, t.shape) for p, t in zip(parts, tensors)]

    def all_gather(self, tensor):
        """The processes' `tensor`s (equal shapes) concatenated along axis 0, in rank order."""
        with tf.device(self.device):
            return collective_ops.all_gather_v2(
                tensor, self.group_size, _GROUP_KEY, self._instance_key()
            )

    def broadcast(self, tensors):
        """Rank 0's `tensors` (numbers of magnitude below 2**53), in every process (eagerly)."""
        tensors = [tf.convert_to_tensor(t) for t in tensors]
        # A sum in float64 to which only rank 0 contributes: exact for float32 values and for
        # integers below 2**53.
        flat = tf.concat([tf.reshape(tf.cast(t, tf.float64), [-1]) for t in tensors], 0)
        if self.rank != 0:
            flat = tf.zeros_like(flat)
        with tf.device(self.device):
            total = collective_ops.all_reduce_v2(
                flat, self.group_size, _GROUP_KEY, self._instance_key()
            )
        parts = tf.split(total, [t.shape.num_elements() for t in tensors])
        return [tf.cast(tf.reshape(p, t.shape), t.dtype) for p, t in zip(parts, tensors)]

    def broadcast_variables(self, variables):
        """Assign rank 0's values to `variables` in every process (eagerly)."""
        variables = list(variables)
        if variables:
            for var, value in zip(variables, self.broadcast([v.read_value() for v in variables])):
                var.assign(value)
