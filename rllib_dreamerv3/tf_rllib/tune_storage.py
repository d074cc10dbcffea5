"""Saving a Tune trial's checkpoint in place, where Ray Tune would copy it.

Ray Tune saves a class trainable into a fresh temporary directory and then copies every file to
the trial's `checkpoint_NNNNNN` directory in the storage path. For an algorithm whose checkpoint
holds gigabytes that change little between saves (a replay buffer), that copy costs as much as
writing everything again, and the temporary directory may sit on another filesystem. With a
local storage path, :func:`save_in_place` has the trainable write its checkpoint directly at
the trial's checkpoint path instead (the trainable's own `save_checkpoint`, which can then
hard-link what an earlier checkpoint already holds), and reports it to Tune as Tune's own
`Trainable.save` does. It reads private attributes of Ray Tune 2.60 (guarded by the pinned
version; `tests/tf_rllib/test_tune_storage.py` fails when they change).
"""

import os

import ray

from rllib_dreamerv3.tf_rllib.compat import PINNED_RAY_VERSION


def local_storage(trainable):
    """The trainable's Tune `StorageContext` if it stores on this machine, else None."""
    storage = getattr(trainable, "_storage", None)
    if storage is None or ray.__version__ != PINNED_RAY_VERSION:
        return None
    if type(storage.storage_filesystem).__name__ != "LocalFileSystem":
        return None
    return storage


def save_in_place(trainable, checkpoint_dir=None):
    """Save `trainable` under Ray Tune straight into its next checkpoint directory; returns
    Tune's `_TrainingResult`, or None where Tune's own `save` applies (no local storage, an
    explicit `checkpoint_dir`, another Ray version)."""
    storage = local_storage(trainable)
    if checkpoint_dir is not None or storage is None:
        return None
    from ray.train._internal.session import _TrainingResult

    metrics = trainable._last_result.copy() if trainable._last_result else {}
    storage._update_checkpoint_index(metrics)
    path = storage.checkpoint_fs_path
    # Tune's contract: `save_checkpoint` is handed a directory that exists.
    os.makedirs(path, exist_ok=True)
    trainable.save_checkpoint(path)
    storage.persist_artifacts(force=storage.sync_config.sync_artifacts_on_checkpoint)
    checkpoint = ray.tune.Checkpoint(filesystem=storage.storage_filesystem, path=path)
    return _TrainingResult(checkpoint=checkpoint, metrics=metrics)
