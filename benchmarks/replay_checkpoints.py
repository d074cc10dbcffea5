"""Replay buffer checkpoints and disk storage: the figures of docs/performance.md, "Replay".

Usage: python benchmarks/replay_checkpoints.py [--steps 10000 100000 1000000] [--storage disk]
       [--keep 3] [--old-format-up-to 100000] [--sample-steps 200000] [--dir benchmarks/out/replay]

A synthetic Atari buffer (64x64x3 uint8 frames, 6 actions, 16 env streams) is filled through
`ReplayBuffer.add` to each size, then saved as a checkpoint is (chunk files, a manifest, a
rename): the first save, a save after 1,000 new steps (once the previous save has reached the
disk), and more such saves keeping the last `--keep` (disk use counts hard-linked files
once). Restore reads every file once, checking it against the manifest. Up to
`--old-format-up-to` steps, the former format (the whole buffer pickled into the state file,
then hashed) is timed too. `--sample-steps` compares sampling
[B=16, T=64] batches from RAM and from memory-mapped storage (warm page cache, alternating
rounds) and the growth of the process's anonymous and file-backed resident memory per fill.
One JSON line per measurement.
"""

import argparse
import json
import os
import pickle
import shutil
import time

import numpy as np

from rllib_dreamerv3 import checkpoints
from rllib_dreamerv3.replay_buffer import ReplayBuffer

SHAPE, ACTIONS, STREAMS, PIECE = (64, 64, 3), 6, 16, 1000


def fill(buffer, steps, rng):
    """Add `steps` random steps in pieces of `PIECE`, round-robin over `STREAMS` streams."""
    for start in range(0, steps, PIECE):
        n = min(PIECE, steps - start)
        buffer.add(
            (start // PIECE) % STREAMS,
            {
                "obs": rng.integers(0, 256, (n, *SHAPE), dtype=np.uint8),
                "actions": np.eye(ACTIONS, dtype=np.float32)[rng.integers(0, ACTIONS, n)],
                "rewards": rng.normal(size=n).astype(np.float32),
                "is_first": np.zeros(n, bool),
                "is_terminal": np.zeros(n, bool),
            },
        )


def make_buffer(capacity, storage_dir=None):
    return ReplayBuffer(capacity, 64, SHAPE, np.uint8, ACTIONS, seed=0, directory=storage_dir)


def save(buffer, path, previous):
    """Save as `DreamerV3.save_to_path` does; returns (seconds, bytes written, files)."""
    written = {}

    def write(tmp):
        reuse = {name: file for name, (file, _) in previous.items()}
        for name, (target, data) in buffer.save_files(tmp, reuse=reuse).items():
            entry = checkpoints.entry(data) if data is not None else previous[name][1]
            written[name] = (target, entry, data is not None)
        return {name: entry for name, (_, entry, _) in written.items()}

    start = time.perf_counter()
    checkpoints.save_atomically(path, write)
    seconds = time.perf_counter() - start
    new_bytes = sum(e["size"] for _, e, fresh in written.values() if fresh)
    files = {name: (os.path.join(path, name), entry) for name, (_, entry, _) in written.items()}
    return seconds, new_bytes, files


def restore(path, capacity):
    buffer = make_buffer(capacity)
    manifest = checkpoints.read_manifest(path)
    start = time.perf_counter()
    buffer.load_files(lambda name: checkpoints.read_verified(path, name, manifest))
    return time.perf_counter() - start, buffer


def disk_use(paths):
    """Bytes of the files below `paths`, each inode counted once."""
    seen, total = set(), 0
    for path in paths:
        for root, _, files in os.walk(path):
            for name in files:
                stat = os.stat(os.path.join(root, name))
                if stat.st_ino not in seen:
                    seen.add(stat.st_ino)
                    total += stat.st_size
    return total


def old_format(buffer, directory):
    """The former checkpoint: the buffer's state pickled into one file, hashed for the
    manifest; restore reads it, checks it and unpickles it."""
    file = os.path.join(directory, "state.pkl")
    start = time.perf_counter()
    data = pickle.dumps(buffer.get_state(), protocol=pickle.HIGHEST_PROTOCOL)
    with open(file, "wb") as f:
        f.write(data)
    checkpoints.entry(data)
    saved = time.perf_counter() - start
    size = len(data)
    del data
    start = time.perf_counter()
    with open(file, "rb") as f:
        data = f.read()
    checkpoints.entry(data)
    restored = make_buffer(buffer.capacity)
    restored.set_state(pickle.loads(data))
    return saved, size, time.perf_counter() - start


def checkpoint_figures(steps, args, rng):
    root = os.path.join(args.dir, f"ckpt_{steps}")
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    storage = os.path.join(root, "storage") if args.storage == "disk" else None
    buffer = make_buffer(steps, storage)
    fill(buffer, steps, rng)
    row = {"steps": steps, "storage": args.storage, "bytes_stored": buffer.nbytes}
    paths, files = [], {}
    for i in range(args.keep + 2):
        if i:
            fill(buffer, 1000, rng)
            # Minutes pass between two checkpoints of a run, time enough for the OS to write the
            # last one back; timed at once, a save would wait behind that writeback instead.
            os.sync()
        path = os.path.join(root, f"checkpoint_{i:06d}")
        seconds, written, files = save(buffer, path, files)
        paths.append(path)
        if len(paths) > args.keep:
            shutil.rmtree(paths.pop(0))
        key = "first_save" if i == 0 else f"save_{i}_after_1000_new_steps"
        row[key] = {"s": round(seconds, 3), "bytes_written": written}
    row["disk_use_of_kept_checkpoints"] = {"kept": len(paths), "bytes": disk_use(paths)}
    buffer.close()
    del buffer
    os.sync()
    seconds, restored = restore(paths[-1], steps)
    row["restore_s"] = round(seconds, 3)
    row["restore_bytes_read"] = disk_use(paths[-1:])
    del restored
    if steps <= args.old_format_up_to:
        buffer = make_buffer(steps)
        fill(buffer, steps, rng)
        saved, size, restored_s = old_format(buffer, root)
        row["old_format"] = {
            "save_s": round(saved, 3),
            "bytes": size,
            "restore_s": round(restored_s, 3),
        }
        del buffer
    shutil.rmtree(root, ignore_errors=True)
    return row


def sampling_figures(steps, args, rng, rounds=5, seconds=4.0):
    """RAM and disk buffers of `steps` steps each, sampled in alternating rounds (so that the
    machine's load changes both alike); median batches per second, and memory growth per fill."""
    buffers, rows = {}, {}
    for storage in ("memory", "disk"):
        root = os.path.join(args.dir, "sample_disk")
        shutil.rmtree(root, ignore_errors=True)
        before = _memory()
        buffers[storage] = make_buffer(steps, root if storage == "disk" else None)
        fill(buffers[storage], steps, rng)
        buffers[storage].sample(16)
        after = _memory()
        rows[storage] = {f"{key}_growth_bytes": after[key] - before[key] for key in after}
        rows[storage]["rates"] = []
    for _ in range(rounds):
        for storage, buffer in buffers.items():
            start, n = time.perf_counter(), 0
            while time.perf_counter() - start < seconds:
                buffer.sample(16)
                n += 1
            rows[storage]["rates"].append(n / (time.perf_counter() - start))
    buffers["disk"].close()
    return [
        {
            "sampling": storage,
            "steps": steps,
            "batches_per_s": round(float(np.median(row.pop("rates"))), 1),
            **row,
        }
        for storage, row in rows.items()
    ]


def _memory():
    """The process's resident memory: anonymous (its own) and file-backed (mapped files, which
    the OS can drop and read back), in bytes."""
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return {key: int(fields[key].split()[0]) * 1024 for key in ("RssAnon", "RssFile")}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, nargs="*", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--storage", choices=("memory", "disk"), default="disk")
    parser.add_argument("--keep", type=int, default=3)
    parser.add_argument("--old-format-up-to", type=int, default=100_000)
    parser.add_argument("--sample-steps", type=int, default=200_000)
    parser.add_argument("--dir", default=os.path.join("benchmarks", "out", "replay"))
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    if args.sample_steps:
        for row in sampling_figures(args.sample_steps, args, rng):
            print(json.dumps(row), flush=True)
    for steps in args.steps:
        print(json.dumps(checkpoint_figures(steps, args, rng)), flush=True)


if __name__ == "__main__":
    main()
