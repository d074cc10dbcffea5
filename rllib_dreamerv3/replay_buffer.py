"""DreamerV3's replay buffer, as in the paper: uniform over all stored sub-sequences of length T.

Steps arrive as per-env streams (one stream per sub-env of each EnvRunner). A stream is a
contiguous run of steps across episode boundaries (marked by `is_first`), so a sampled sequence
may span several episodes. Storage is one set of flat numpy arrays of `capacity` steps in arrival
order (FIFO eviction of the oldest step); `next_slot` links each step to the next step of its
stream, so a sequence is gathered with T vectorised hops and one fancy-index per field.

A step record is `(obs, action, reward, is_first, is_terminal)`: the observation, the action
taken after seeing it (zeros on an episode's last step), the reward received on arriving at
it, and the flags. Dict observations are a dict `{key: array}`; each entry is stored in its own
array (field `obs/<key>`), in its own dtype (images stay uint8). FIFO eviction only ever removes
the oldest step of a stream, so every stream's stored steps stay a contiguous suffix.

On disk (:meth:`ReplayBuffer.save_files`), the storage is cut into fixed chunks of slots. A chunk
whose slots have all been written since the cursor last entered it never changes again until
the cursor comes back: it is written once, under a name that says which writes it holds, and
later saves hard-link that file instead of writing it again. Only the chunk under the cursor is
written at every save. `next_slot` is not saved: it follows from each slot's stream and index.
"""

import io
import os
import pickle
import shutil

import numpy as np

FIELDS = ("obs", "actions", "rewards", "is_first", "is_terminal")
FILES_VERSION = 1
STATE_FILE = "state.pkl"
CHUNK_BYTES = 8 << 20  # target size of one chunk file


def obs_fields(obs_shape, obs_dtype):
    """`{field: (shape, dtype)}` of the stored observation arrays: `obs`, or for Dict
    observations (`obs_shape`, `obs_dtype` dicts `{key: ...}`) one `obs/<key>` per entry."""
    if isinstance(obs_shape, dict):
        return {f"obs/{k}": (tuple(obs_shape[k]), np.dtype(obs_dtype[k])) for k in obs_shape}
    return {"obs": (tuple(obs_shape), np.dtype(obs_dtype))}


def bytes_per_step(obs_shape, obs_dtype, action_dim):
    """Bytes one stored step takes: observation, action, reward, flags and bookkeeping."""
    fields = obs_fields(obs_shape, obs_dtype).values()
    obs = sum(int(np.prod(shape)) * dtype.itemsize for shape, dtype in fields)
    return obs + 4 * action_dim + 4 + 2 + 3 * 8  # + reward, 2 flags, 3 int64 index arrays


class ReplayBuffer:
    """FIFO, step-capacity replay of per-env streams with uniform `[B, T]` sequence sampling.

    Args:
        capacity: maximum number of stored env steps.
        batch_length: T, the length of sampled sequences.
        obs_shape, obs_dtype: one observation (images stay uint8); dicts `{key: ...}` for Dict
            observations.
        action_dim: width of the stored action vectors (one-hot for discrete actions).
        seed: seed of the sampling RNG.
        directory: None to store the steps in RAM; else a directory for one memory-mapped
            `.npy` file per field (created, and deleted by :meth:`close`): only the bookkeeping
            (three integers a step) stays in RAM, the OS pages the steps in and out.
    """

    def __init__(
        self, capacity, batch_length, obs_shape, obs_dtype, action_dim, seed=None, directory=None
    ):
        if capacity < batch_length:
            raise ValueError(
                f"replay capacity={capacity} is smaller than batch_length_T={batch_length}; "
                "use a capacity of at least T steps."
            )
        self.capacity = int(capacity)
        self.batch_length = int(batch_length)
        self._dict_obs = isinstance(obs_shape, dict)
        self.directory = directory
        fields = {
            **obs_fields(obs_shape, obs_dtype),
            "actions": ((action_dim,), np.dtype(np.float32)),
            "rewards": ((), np.dtype(np.float32)),
            "is_first": ((), np.dtype(bool)),
            "is_terminal": ((), np.dtype(bool)),
        }
        if directory is not None:
            os.makedirs(directory, exist_ok=True)
        self._data = {
            field: self._allocate(field, (self.capacity, *shape), dtype)
            for field, (shape, dtype) in fields.items()
        }
        self.bytes_per_step = bytes_per_step(obs_shape, obs_dtype, action_dim)
        self._stream = np.full(self.capacity, -1, np.int64)  # stream id per slot, -1 = empty
        self._index = np.zeros(self.capacity, np.int64)  # position of the step in its stream
        self._next_slot = np.zeros(self.capacity, np.int64)
        self._stream_ids = {}  # stream key -> stream id
        self._length = np.zeros(0, np.int64)  # per stream id: steps added so far
        self._first = np.zeros(0, np.int64)  # per stream id: position of its oldest stored step
        self._last_slot = np.zeros(0, np.int64)  # per stream id: slot of its newest step
        self._cursor = 0  # next slot to write
        self._size = 0
        self._added = 0
        self._writes = 0  # slots written over the lifetime (cursor = writes % capacity)
        self._rng = np.random.default_rng(seed)

    def _allocate(self, field, shape, dtype):
        """Zeros in RAM, or a memory-mapped file in `directory` (sparse: it takes disk space
        only where steps were written)."""
        if self.directory is None:
            return np.zeros(shape, dtype)
        file = os.path.join(self.directory, field.replace("/", "__") + ".npy")
        return np.lib.format.open_memmap(file, mode="w+", dtype=dtype, shape=shape)

    def close(self):
        """Delete the memory-mapped files of a disk buffer (nothing for a RAM buffer). The
        buffer is unusable afterwards."""
        if self.directory is None:
            return
        self._data = {}
        shutil.rmtree(self.directory, ignore_errors=True)

    def __len__(self):
        return self._size

    @property
    def num_steps_added(self):
        """Env steps added over the buffer's lifetime (evicted ones included)."""
        return self._added

    @property
    def nbytes(self):
        """Bytes of the stored steps (all fields). The arrays are allocated for `capacity` steps
        up front, but the OS only commits the pages that steps were written to."""
        return self._size * self.bytes_per_step

    @property
    def capacity_nbytes(self):
        """Bytes the buffer holds when full."""
        return self.capacity * self.bytes_per_step

    def _fields(self, steps):
        """`steps` keyed by the stored fields (a Dict observation's entries as `obs/<key>`)."""
        fields = {key: value for key, value in steps.items() if key != "obs"}
        if self._dict_obs:
            obs = steps["obs"]
            if not isinstance(obs, dict):
                raise ValueError(f"steps['obs'] is a {type(obs).__name__}, expected a dict.")
            fields.update({f"obs/{key}": value for key, value in obs.items()})
        else:
            fields["obs"] = steps["obs"]
        return fields

    def _nested(self, fields):
        """The inverse of :meth:`_fields`: a Dict observation's `obs/<key>` fields as one dict."""
        if not self._dict_obs:
            return dict(fields)
        out = {key: value for key, value in fields.items() if not key.startswith("obs/")}
        out["obs"] = {key[len("obs/") :]: v for key, v in fields.items() if key.startswith("obs/")}
        return out

    def add(self, stream_key, steps):
        """Append `steps` (dict of arrays `[N, ...]` with the keys of `FIELDS`) to a stream.

        `stream_key` is any hashable naming the env the steps come from, e.g. `(runner, env)`.
        """
        n = len(steps["rewards"])
        steps = self._fields(steps)
        for key in self._data:
            if key not in steps:
                raise ValueError(f"steps lack {key!r}; they need {sorted(self._data)}.")
            if len(steps[key]) != n:
                raise ValueError(f"steps[{key!r}] has {len(steps[key])} entries, expected {n}.")
        if stream_key not in self._stream_ids:
            self._stream_ids[stream_key] = len(self._stream_ids)
            self._length = np.append(self._length, 0)
            self._first = np.append(self._first, 0)
            self._last_slot = np.append(self._last_slot, -1)
        sid = self._stream_ids[stream_key]
        keep = min(n, self.capacity)  # more than `capacity` new steps: only the newest fit
        index = self._length[sid] + np.arange(n - keep, n)
        slots = (self._cursor + np.arange(keep)) % self.capacity

        evicted = self._stream[slots]
        stored = evicted >= 0
        np.maximum.at(self._first, evicted[stored], self._index[slots][stored] + 1)
        for key in self._data:
            self._data[key][slots] = steps[key][n - keep :]
        self._stream[slots] = sid
        self._index[slots] = index
        last = self._last_slot[sid]
        if last >= 0 and self._stream[last] == sid and self._index[last] == index[0] - 1:
            self._next_slot[last] = slots[0]
        self._next_slot[slots[:-1]] = slots[1:]
        self._length[sid] += n
        self._first[sid] = max(self._first[sid], self._length[sid] - self.capacity)
        self._last_slot[sid] = slots[-1]
        self._cursor = int((self._cursor + keep) % self.capacity)
        self._size = min(self._size + keep, self.capacity)
        self._added += n
        self._writes += keep

    def _valid(self, slots):
        """Whether a full T-step sequence of the same stream starts at each of `slots`."""
        ids = self._stream[slots]
        remaining = self._length[np.maximum(ids, 0)] - self._index[slots]
        return (ids >= 0) & (remaining >= self.batch_length)

    def can_sample(self):
        """True once some stream holds at least T consecutive stored steps."""
        return bool(np.any(self._length - self._first >= self.batch_length))

    def sample(self, batch_size):
        """`batch_size` sequences, uniform over all stored length-T sub-sequences: `[B, T, ...]`."""
        if not self.can_sample():
            raise RuntimeError(
                f"The replay buffer holds no sequence of batch_length_T={self.batch_length} steps "
                f"yet ({self._size} steps stored); collect more steps before sampling."
            )
        # Rejection sampling over slots is exact and O(B); invalid starts (the last T-1 steps of
        # each stream) are rare, but fall back to enumerating the valid ones if they are not.
        candidates = self._rng.integers(0, self._size, 8 * batch_size)
        starts = candidates[self._valid(candidates)]
        if len(starts) < batch_size:
            starts = self._rng.choice(
                np.flatnonzero(self._valid(np.arange(self._size))), batch_size
            )
        slots = np.empty((batch_size, self.batch_length), np.int64)
        slots[:, 0] = starts[:batch_size]
        for t in range(1, self.batch_length):
            slots[:, t] = self._next_slot[slots[:, t - 1]]
        return self._nested({key: value[slots] for key, value in self._data.items()})

    def get_state(self):
        """Everything needed to restore the buffer, as numpy arrays and plain Python values.

        Sized by what is stored, not by the capacity: until the buffer is full, slots are
        written in order from 0, so only the first `size` slots hold anything (data or
        bookkeeping); the rest are in their initial state and are not saved.
        """
        stored = slice(0, self._size)
        return {
            "capacity": self.capacity,
            "data": {k: v[stored] for k, v in self._data.items()},
            "stream": self._stream[stored],
            "index": self._index[stored],
            "next_slot": self._next_slot[stored],
            "stream_ids": dict(self._stream_ids),
            "length": self._length,
            "first": self._first,
            "last_slot": self._last_slot,
            "cursor": self._cursor,
            "size": self._size,
            "added": self._added,
            "rng": self._rng.bit_generator.state,
        }

    @property
    def spec(self):
        """`{capacity, obs_shape, obs_dtype, action_dim}`: what a restored state must match."""
        obs = self._nested(self._data)["obs"]
        if self._dict_obs:
            obs_shape = {key: list(value.shape[1:]) for key, value in obs.items()}
            obs_dtype = {key: value.dtype.name for key, value in obs.items()}
        else:
            obs_shape, obs_dtype = list(obs.shape[1:]), obs.dtype.name
        return {
            "capacity": self.capacity,
            "obs_shape": obs_shape,
            "obs_dtype": obs_dtype,
            "action_dim": int(self._data["actions"].shape[1]),
        }

    def check_state(self, state):
        """Raise a ValueError if :meth:`set_state` could not take `state` (changes nothing)."""
        # States written before they were sized by content hold all `capacity` slots.
        capacity = state.get("capacity", len(state["stream"]))
        if capacity != self.capacity:
            raise ValueError(
                f"Replay state has capacity {capacity}, this buffer {self.capacity}; "
                "restore with the same replay_capacity."
            )
        size = state["size"]
        for key in ("stream", "index", "next_slot"):
            if not size <= len(state[key]) <= self.capacity:
                raise ValueError(
                    f"Replay state's {key!r} has {len(state[key])} entries for {size} stored "
                    f"steps and capacity {self.capacity}: the state is damaged."
                )
        if set(state["data"]) != set(self._data):
            raise ValueError(
                f"Replay state holds {sorted(state['data'])}, this buffer {sorted(self._data)}: "
                "the state comes from another observation space."
            )
        for key, own in self._data.items():
            stored = np.asarray(state["data"][key])
            if stored.shape[1:] != own.shape[1:] or stored.dtype != own.dtype:
                raise ValueError(
                    f"Replay state's {key!r} are {stored.dtype}{list(stored.shape[1:])}, this "
                    f"buffer's {own.dtype}{list(own.shape[1:])}: the state comes from another "
                    "env or action space."
                )

    def set_state(self, state):
        """Restore from :meth:`get_state` (capacities must match)."""
        self.check_state(state)
        size = state["size"]
        for key in self._data:
            self._data[key][:size] = state["data"][key][:size]
        self._stream[:] = -1
        self._index[:] = 0
        self._next_slot[:] = 0
        for own, key in (
            (self._stream, "stream"),
            (self._index, "index"),
            (self._next_slot, "next_slot"),
        ):
            own[: len(state[key])] = state[key]
        self._stream_ids = dict(state["stream_ids"])
        self._length = np.array(state["length"])
        self._first = np.array(state["first"])
        self._last_slot = np.array(state["last_slot"])
        self._cursor, self._size, self._added = state["cursor"], size, state["added"]
        # States of older versions lack the write count: any value congruent to the cursor
        # names the chunks consistently from here on.
        self._writes = state.get("writes", size if size < self.capacity else size + self._cursor)
        self._rng.bit_generator.state = state["rng"]

    # --- files: chunked, each full chunk written once ------------------------------------------
    @property
    def chunk_steps(self):
        """Slots per chunk file: about `CHUNK_BYTES` of stored steps, at most the capacity."""
        return int(min(self.capacity, max(1, CHUNK_BYTES // self.bytes_per_step)))

    def _chunks(self):
        """`[(name, slots)]` of the chunks that hold stored steps. A chunk's name is the write
        count at which its first slot was last written, so a name stands for fixed contents
        once the chunk is full; the chunk under the cursor is named `open` (it still changes)."""
        size, step, writes = self._size, self.chunk_steps, self._writes
        chunks = []
        for begin in range(0, size, step):
            end = min(begin + step, self.capacity)
            if end > size or (begin < self._cursor < end and size == self.capacity):
                chunks.append(("open", slice(begin, min(end, size))))
                continue
            # The last write of slot `begin`: the largest write count w < writes with
            # w % capacity == begin.
            first_write = begin + (writes - 1 - begin) // self.capacity * self.capacity
            chunks.append((f"{first_write:014d}", slice(begin, end)))
        return chunks

    def save_files(self, directory, reuse=None):
        """Write the buffer into `directory` (created): `state.pkl` and one `.npz` per chunk.

        `reuse` maps file names to files of an earlier save (`{name: path}`): a full chunk whose
        name is there is hard-linked from it (copied across filesystems) instead of written.
        Returns `{name: (path, bytes or None)}` of the files now in `directory`: bytes for
        the files written (for checksums), None for linked ones.
        """
        os.makedirs(directory, exist_ok=True)
        reuse = reuse or {}
        written, chunk_names = {}, []
        for name, slots in self._chunks():
            file = f"chunk_{name}.npz"
            chunk_names.append((file, slots.start, slots.stop))
            target = os.path.join(directory, file)
            if name != "open" and file in reuse and _link(reuse[file], target):
                written[file] = (target, None)
                continue
            arrays = {key: value[slots] for key, value in self._data.items()}
            arrays.update(stream=self._stream[slots], index=self._index[slots])
            written[file] = (target, _write(target, _npz_bytes(arrays)))
        state = {
            "version": FILES_VERSION,
            "spec": self.spec,
            "chunks": chunk_names,
            "stream_ids": dict(self._stream_ids),
            "length": self._length,
            "first": self._first,
            "last_slot": self._last_slot,
            "cursor": self._cursor,
            "size": self._size,
            "added": self._added,
            "writes": self._writes,
            "rng": self._rng.bit_generator.state,
        }
        target = os.path.join(directory, STATE_FILE)
        written[STATE_FILE] = (target, _write(target, pickle.dumps(state)))
        return written

    def load_files(self, read):
        """Fill this new buffer from the files of :meth:`save_files`; `read(name)` returns the
        bytes of a file (checked by the caller). Every file is read once, straight into the
        buffer's arrays. A ValueError names a file that does not fit; the buffer is then partly
        filled and must be discarded (restore into a new buffer, keep the old one until done).
        """
        state = pickle.loads(read(STATE_FILE))
        if state.get("version") != FILES_VERSION:
            raise ValueError(
                f"Replay files of version {state.get('version')!r}; this version reads "
                f"{FILES_VERSION}."
            )
        if state["spec"] != self.spec:
            raise ValueError(
                f"Replay files hold a buffer {state['spec']}, this buffer is {self.spec}: "
                "restore with the same replay_capacity, env and action space."
            )
        own = {**self._data, "stream": self._stream, "index": self._index}
        for file, begin, end in state["chunks"]:
            with np.load(io.BytesIO(read(file))) as arrays:
                for key, out in own.items():
                    if arrays[key].shape != (end - begin, *out.shape[1:]):
                        raise ValueError(
                            f"{file}: {key!r} has shape {arrays[key].shape}, the buffer's state "
                            f"expects {(end - begin, *out.shape[1:])}: the replay files do not "
                            "fit together."
                        )
                    out[begin:end] = arrays[key]
        size = state["size"]
        self._next_slot[:size] = _next_slots(self._stream[:size], self._index[:size])
        self._stream_ids = dict(state["stream_ids"])
        self._length = np.array(state["length"])
        self._first = np.array(state["first"])
        self._last_slot = np.array(state["last_slot"])
        self._cursor, self._size, self._added = state["cursor"], size, state["added"]
        self._writes = state["writes"]
        self._rng.bit_generator.state = state["rng"]


def _next_slots(stream, index):
    """For each slot, the slot holding the next step of its stream (0 where none is stored)."""
    order = np.lexsort((index, stream))
    nxt = np.zeros(len(stream), np.int64)
    follows = (np.diff(stream[order]) == 0) & (np.diff(index[order]) == 1)
    nxt[order[:-1][follows]] = order[1:][follows]
    return nxt


def _npz_bytes(arrays):
    out = io.BytesIO()
    np.savez(out, **arrays)
    return out.getvalue()


def _write(path, data):
    with open(path, "wb") as f:
        f.write(data)
    return data


def _link(source, target):
    """Hard-link `source` as `target`, or copy it across filesystems; False if it is gone."""
    try:
        os.link(source, target)
    except FileNotFoundError:
        return False
    except OSError:  # another filesystem, or links not supported
        try:
            shutil.copyfile(source, target)
        except FileNotFoundError:
            return False
    return True
