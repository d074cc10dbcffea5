"""Every public way to restore a checkpoint checks it first; saves write only what is new.

The restore entry points: `Algorithm.from_checkpoint`, `Checkpointable.from_checkpoint`,
`DreamerV3.from_checkpoint`, `algo.restore_from_path`, Tune's `Trainable.restore` (which calls
`load_checkpoint`, i.e. `restore_from_path`) and `rllib evaluate` (`cli.load_checkpoint_config`).
"""

import os
import pathlib
import shutil
import types

import helpers
import numpy as np
import pytest
from ray.rllib.algorithms.algorithm import Algorithm
from ray.rllib.utils.checkpoints import Checkpointable

from rllib_dreamerv3 import DreamerV3, checkpoints, cli, replay_buffer
from rllib_dreamerv3.algorithm import NEXT_CHECKPOINT_S

pytestmark = pytest.mark.usefixtures("ray_session")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """`(algo, checkpoint path)`: a tiny algorithm after 3 iterations, saved twice (replay chunks
    of 10 steps, so the second save links some)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(replay_buffer, "CHUNK_BYTES", 10 * 60)
        algo = helpers.tiny_config(dream_every_n_updates=0).build_algo()
        algo.train()
        algo.train()
        first = algo.save_to_path(str(tmp_path_factory.mktemp("a") / "first"))
        algo.train()
        path = algo.save_to_path(str(tmp_path_factory.mktemp("b") / "ckpt"))
        yield algo, pathlib.Path(path), pathlib.Path(first)
        algo.stop()


def _copy(path, tmp_path):
    out = tmp_path / "ckpt"
    shutil.copytree(path, out)
    return out


def _weights_file(path):
    manifest = checkpoints.read_manifest(path)
    prefix = cli.MODULE_STATE_DIR.replace(os.sep, "/")
    return next(name for name in manifest["files"] if name.startswith(prefix))


def _flip_a_bit(path):
    name = _weights_file(path)
    data = bytearray((path / name).read_bytes())
    data[len(data) // 2] ^= 0x01
    (path / name).write_bytes(bytes(data))
    return name, "checksum"


def _truncate_ctor(path):
    name = "class_and_ctor_args.pkl"
    (path / name).write_bytes((path / name).read_bytes()[:50])
    return name, "bytes"


def _drop_manifest(path):
    (path / checkpoints.MANIFEST).unlink()
    return checkpoints.MANIFEST, checkpoints.ALLOW_UNVERIFIED


ENTRY_POINTS = {
    "Algorithm.from_checkpoint": lambda algo, path: Algorithm.from_checkpoint(path),
    "Checkpointable.from_checkpoint": lambda algo, path: Checkpointable.from_checkpoint(path),
    "DreamerV3.from_checkpoint": lambda algo, path: DreamerV3.from_checkpoint(path),
    "restore_from_path": lambda algo, path: algo.restore_from_path(path),
    "Trainable.restore (Tune)": lambda algo, path: algo.restore(path),
    "rllib evaluate": lambda algo, path: cli.load_checkpoint_config(path),
}


@pytest.mark.parametrize("damage", [_flip_a_bit, _truncate_ctor, _drop_manifest])
@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_every_entry_point_names_the_damaged_file_and_restores_nothing(
    trained, tmp_path, entry, damage
):
    algo, path, _ = trained
    path = _copy(path, tmp_path)
    name, why = damage(path)
    counters = dict(algo._counters)
    with pytest.raises((checkpoints.CheckpointError, cli.CliError), match=f"{name}.*{why}"):
        ENTRY_POINTS[entry](algo, str(path))
    assert dict(algo._counters) == counters


def test_without_a_manifest_the_documented_flag_restores_unverified(trained, tmp_path, monkeypatch):
    algo, path, _ = trained
    path = _copy(path, tmp_path)
    _drop_manifest(path)
    monkeypatch.setenv(checkpoints.ALLOW_UNVERIFIED, "1")
    assert isinstance(cli.load_checkpoint_config(str(path)), cli.DreamerV3Config)
    algo.restore_from_path(str(path))  # the replay files are then read unchecked


def test_algorithm_from_checkpoint_completes_a_save_killed_between_its_renames(trained, tmp_path):
    """A kill after the old checkpoint moved aside and before the new one moved in leaves no
    directory at the path; RLlib's own entry point finishes the save."""
    algo, path, _ = trained
    moved = tmp_path / f".ckpt{checkpoints._TMP}abc"
    shutil.copytree(path, moved)
    restored = Algorithm.from_checkpoint(str(tmp_path / "ckpt"))
    try:
        assert isinstance(restored, DreamerV3)
        assert (tmp_path / "ckpt").is_dir() and not moved.exists()
        assert restored._counters == algo._counters
        assert len(restored.replay_buffer) == len(algo.replay_buffer)
        batch, expected = restored.replay_buffer.sample(2), algo.replay_buffer.sample(2)
        np.testing.assert_array_equal(batch["obs"].shape, expected["obs"].shape)
        # Copies of a checkpoint restore on their own, and link their chunks at the next save.
        restored.train()
        again = pathlib.Path(restored.save_to_path(str(tmp_path / "next")))
        old, new = tmp_path / "ckpt" / "replay_buffer", again / "replay_buffer"
        kept = [name for name in os.listdir(new) if (old / name).exists()]
        linked = [name for name in kept if os.path.samefile(new / name, old / name)]
        assert "chunk_open.npz" not in linked and "state.pkl" not in linked
        assert linked
    finally:
        restored.stop()


def test_a_second_save_links_the_unchanged_replay_chunks(trained):
    _, path, first = trained
    chunks = sorted(p.name for p in (path / "replay_buffer").glob("chunk_0*.npz"))
    shared = [c for c in chunks if (first / "replay_buffer" / c).exists()]
    assert shared and all(
        os.path.samefile(path / "replay_buffer" / c, first / "replay_buffer" / c) for c in shared
    )
    # The manifest lists the linked chunks with the first save's checksums.
    one, two = checkpoints.read_manifest(first), checkpoints.read_manifest(path)
    for c in shared:
        assert two["files"][f"replay_buffer/{c}"] == one["files"][f"replay_buffer/{c}"]
    checkpoints.verify(path)  # and they are right


def test_a_damaged_replay_chunk_is_named_when_it_is_read(trained, tmp_path):
    algo, path, _ = trained
    path = _copy(path, tmp_path)
    chunk = next((path / "replay_buffer").glob("chunk_0*.npz"))
    data = bytearray(chunk.read_bytes())
    data[-20] ^= 0x10
    chunk.write_bytes(bytes(data))
    counters = dict(algo._counters)
    with pytest.raises(checkpoints.CheckpointError, match=f"{chunk.name}.*checksum"):
        algo.restore_from_path(str(path))
    assert dict(algo._counters) == counters


def test_a_foreign_checkpoint_without_a_manifest_is_left_to_rllib(tmp_path):
    (tmp_path / "class_and_ctor_args.pkl").write_bytes(b"not ours")
    checkpoints.check_before_restore(str(tmp_path))  # no error: not this package's


def test_checkpoints_on_the_clock_only_under_tune():
    clock = types.SimpleNamespace(
        config=types.SimpleNamespace(checkpoint_interval_s=60.0),
        _under_tune=True,
        _last_checkpoint_time=0.0,
    )
    results = {}
    clock._last_checkpoint_time = __import__("time").monotonic() - 30.0
    DreamerV3._checkpoint_on_the_clock(clock, results)
    assert "should_checkpoint" not in results and 29.0 < results[NEXT_CHECKPOINT_S] <= 30.0
    clock._last_checkpoint_time -= 31.0
    DreamerV3._checkpoint_on_the_clock(clock, results)
    assert results["should_checkpoint"] is True and results[NEXT_CHECKPOINT_S] == 0.0
    outside = {}
    clock._under_tune = False
    DreamerV3._checkpoint_on_the_clock(clock, outside)
    assert outside == {}
