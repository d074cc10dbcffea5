"""Replay buffer files: chunked saves that write only what changed, and exact restores."""

import os
import shutil

import numpy as np
import pytest

from rllib_dreamerv3 import replay_buffer
from rllib_dreamerv3.replay_buffer import STATE_FILE, ReplayBuffer


def _steps(start, n, obs_dim=3):
    obs = np.arange(start, start + n, dtype=np.float32)[:, None].repeat(obs_dim, 1)
    return {
        "obs": obs,
        "actions": np.full((n, 2), start, np.float32),
        "rewards": np.arange(start, start + n, dtype=np.float32),
        "is_first": np.arange(start, start + n) % 5 == 0,
        "is_terminal": np.arange(start, start + n) % 7 == 0,
    }


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 10 steps (a step here is 3*4 + 2*4 + 4 + 2 + 24 = 50 bytes)."""
    monkeypatch.setattr(replay_buffer, "CHUNK_BYTES", 500)


def _buffer(capacity=95):
    return ReplayBuffer(capacity, 4, (3,), np.float32, 2, seed=0)


def _load(directory, capacity=95):
    buf = _buffer(capacity)
    buf.load_files(lambda name: open(os.path.join(directory, name), "rb").read())
    return buf


def _assert_same(a, b):
    sa, sb = a.get_state(), b.get_state()
    for key in sa["data"]:
        np.testing.assert_array_equal(sa["data"][key], sb["data"][key], err_msg=key)
    for key in ("stream", "index", "length", "first", "last_slot"):
        np.testing.assert_array_equal(sa[key], sb[key], err_msg=key)
    assert (a._cursor, len(a), a.num_steps_added) == (b._cursor, len(b), b.num_steps_added)
    for _ in range(3):  # the same RNG state and links: the same batches
        x, y = a.sample(8), b.sample(8)
        for key in x:
            np.testing.assert_array_equal(x[key], y[key], err_msg=key)


def test_files_restore_the_buffer_exactly_before_and_after_it_wraps(tmp_path, small_chunks):
    buf = _buffer()
    for i in range(40):  # three streams of uneven pieces; 40 * 7 steps wrap 95 slots twice
        buf.add(("runner", i % 3), _steps(100 * (i % 3) + 7 * i, 7))
        if i % 6 == 5:
            directory = tmp_path / f"save{i}"
            buf.save_files(directory)
            _assert_same(buf, _load(directory))


def test_a_second_save_links_the_full_chunks_and_writes_only_the_open_one(tmp_path, small_chunks):
    buf = _buffer()
    buf.add("a", _steps(0, 47))
    first = buf.save_files(tmp_path / "one")
    assert buf.chunk_steps == 10
    # Four full chunks (slots 0-39) are written, and the open chunk of slots 40-46.
    assert sorted(first) == sorted(
        [f"chunk_{10 * k:014d}.npz" for k in range(4)] + ["chunk_open.npz", STATE_FILE]
    )
    assert all(data is not None for _, data in first.values())
    buf.add("a", _steps(47, 8))  # slots 47-54: chunk 40-49 fills, chunk 50-59 opens
    second = buf.save_files(tmp_path / "two", reuse={n: p for n, (p, _) in first.items()})
    linked = {name for name, (_, data) in second.items() if data is None}
    assert linked == {f"chunk_{10 * k:014d}.npz" for k in range(4)}
    for name in linked:  # the same file on disk, not a copy
        assert os.path.samefile(tmp_path / "one" / name, tmp_path / "two" / name)
    written = {name for name, (_, data) in second.items() if data is not None}
    assert written == {"chunk_00000000000040.npz", "chunk_open.npz", STATE_FILE}
    _assert_same(buf, _load(tmp_path / "two"))


def test_after_the_buffer_wraps_a_rewritten_chunk_gets_a_new_name(tmp_path, small_chunks):
    buf = _buffer(capacity=30)
    buf.add("a", _steps(0, 30))
    first = buf.save_files(tmp_path / "one")
    buf.add("a", _steps(30, 10))  # overwrites slots 0-9: a new generation of that chunk
    second = buf.save_files(tmp_path / "two", reuse={n: p for n, (p, _) in first.items()})
    assert "chunk_00000000000030.npz" in second and "chunk_00000000000000.npz" not in second
    assert second["chunk_00000000000030.npz"][1] is not None  # written, not linked
    assert second["chunk_00000000000010.npz"][1] is None
    _assert_same(buf, _load(tmp_path / "two", capacity=30))


def test_a_saved_directory_restores_on_its_own_after_the_first_is_gone(tmp_path, small_chunks):
    buf = _buffer()
    buf.add("a", _steps(0, 60))
    first = buf.save_files(tmp_path / "one")
    buf.add("a", _steps(60, 3))
    buf.save_files(tmp_path / "two", reuse={n: p for n, (p, _) in first.items()})
    shutil.rmtree(tmp_path / "one")
    shutil.copytree(tmp_path / "two", tmp_path / "elsewhere")  # as to another machine
    shutil.rmtree(tmp_path / "two")
    _assert_same(buf, _load(tmp_path / "elsewhere"))


def test_a_linked_file_that_is_gone_is_written_again(tmp_path, small_chunks):
    buf = _buffer()
    buf.add("a", _steps(0, 25))
    first = buf.save_files(tmp_path / "one")
    shutil.rmtree(tmp_path / "one")
    second = buf.save_files(tmp_path / "two", reuse={n: p for n, (p, _) in first.items()})
    assert all(data is not None for _, data in second.values())
    _assert_same(buf, _load(tmp_path / "two"))


def test_files_of_another_buffer_or_a_wrong_chunk_are_refused(tmp_path, small_chunks):
    buf = _buffer()
    buf.add("a", _steps(0, 25))
    buf.save_files(tmp_path / "one")
    with pytest.raises(ValueError, match="restore with the same replay_capacity"):
        _load(tmp_path / "one", capacity=50)
    other = _buffer()
    other.add("a", _steps(0, 17))  # its open chunk holds 7 steps, not 5
    other.save_files(tmp_path / "other")
    shutil.copyfile(tmp_path / "other" / "chunk_open.npz", tmp_path / "one" / "chunk_open.npz")
    with pytest.raises(ValueError, match="chunk_open.npz.*expects"):
        _load(tmp_path / "one")


def test_dict_observations_round_trip(tmp_path, small_chunks):
    shapes = {"image": (4, 4, 1), "vec": (2,)}
    dtypes = {"image": np.uint8, "vec": np.float32}
    buf = ReplayBuffer(40, 3, shapes, dtypes, 1, seed=1)
    rng = np.random.default_rng(0)
    for _ in range(6):
        n = 9
        buf.add(
            "a",
            {
                "obs": {
                    "image": rng.integers(0, 255, (n, 4, 4, 1), dtype=np.uint8),
                    "vec": rng.normal(size=(n, 2)).astype(np.float32),
                },
                "actions": np.zeros((n, 1), np.float32),
                "rewards": rng.normal(size=n).astype(np.float32),
                "is_first": np.zeros(n, bool),
                "is_terminal": np.zeros(n, bool),
            },
        )
    buf.save_files(tmp_path / "d")
    restored = ReplayBuffer(40, 3, shapes, dtypes, 1, seed=1)
    restored.load_files(lambda name: open(tmp_path / "d" / name, "rb").read())
    x, y = buf.sample(5), restored.sample(5)
    for key in ("image", "vec"):
        np.testing.assert_array_equal(x["obs"][key], y["obs"][key])


def test_a_disk_buffer_samples_what_a_ram_buffer_samples_and_deletes_its_files(tmp_path):
    ram = _buffer(capacity=50)
    disk = ReplayBuffer(50, 4, (3,), np.float32, 2, seed=0, directory=str(tmp_path / "steps"))
    for i in range(12):  # wraps the 50 slots
        for buf in (ram, disk):
            buf.add(("r", i % 2), _steps(7 * i, 7))
    assert isinstance(disk._data["obs"], np.memmap)
    assert sorted(os.listdir(tmp_path / "steps")) == sorted(
        f"{name}.npy" for name in ("obs", "actions", "rewards", "is_first", "is_terminal")
    )
    _assert_same(ram, disk)
    disk.save_files(tmp_path / "saved")
    _assert_same(ram, _load(tmp_path / "saved", capacity=50))
    disk.close()
    assert not (tmp_path / "steps").exists()
