"""`tf_rllib.collectives`: TF_CONFIG parsing and a real two-process cluster."""

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

from rllib_dreamerv3.tf_rllib.collectives import cluster_from_env


def _tf_config(addresses, index, task_type="worker"):
    return {
        "TF_CONFIG": json.dumps(
            {"cluster": {"worker": addresses}, "task": {"type": task_type, "index": index}}
        )
    }


def test_cluster_from_env():
    assert cluster_from_env({}) is None
    assert cluster_from_env(_tf_config(["a:1"], 0)) is None  # one worker: no cluster
    assert cluster_from_env(_tf_config(["a:1", "b:2"], 1)) == (["a:1", "b:2"], 1)
    with pytest.raises(ValueError, match="task .* is not one of its 2 'worker' addresses"):
        cluster_from_env(_tf_config(["a:1", "b:2"], 2))
    with pytest.raises(ValueError, match="'chief'"):
        cluster_from_env(_tf_config(["a:1", "b:2"], 0, task_type="chief"))


_WORKER = textwrap.dedent("""
    import json, sys
    import tensorflow as tf
    tf.constant(0.0) + 1.0  # TF is already running, as in a Ray actor
    from rllib_dreamerv3.tf_rllib.collectives import cluster_from_env, connect
    group = connect(*cluster_from_env())
    var = tf.Variable([1.0, 2.0] if group.rank == 0 else [7.0, 7.0])
    group.broadcast_variables([var])

    @tf.function(autograph=False)
    def step(x):
        mean, total = group.all_reduce_mean([x, tf.reduce_sum(x)])
        return mean, total, group.all_gather(x[None])

    out = [step(tf.constant([1.0, 3.0]) * (group.rank + 1)) for _ in range(2)]
    print(json.dumps({
        "rank": group.rank,
        "var": var.numpy().tolist(),
        "mean": out[1][0].numpy().tolist(),
        "total": float(out[1][1]),
        "gathered": out[1][2].numpy().tolist(),
    }))
""")


def _free_ports(n):
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def test_two_processes_all_reduce_gather_and_broadcast():
    addresses = [f"127.0.0.1:{port}" for port in _free_ports(2)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _WORKER],
            env={**os.environ, **_tf_config(addresses, i), "TF_CPP_MIN_LOG_LEVEL": "3"},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    outs = [proc.communicate(timeout=120) for proc in procs]
    results = []
    for proc, (stdout, stderr) in zip(procs, outs):
        assert proc.returncode == 0, stderr[-2000:]
        results.append(json.loads(stdout.strip().splitlines()[-1]))
    for rank, result in enumerate(results):
        assert result["rank"] == rank
        assert result["var"] == [1.0, 2.0]  # rank 0's
        assert result["mean"] == [1.5, 4.5]  # of [1, 3] and [2, 6]
        assert result["total"] == 6.0  # mean of 4 and 8
        assert result["gathered"] == [[1.0, 3.0], [2.0, 6.0]]
