"""Replay buffer: uniform sequences across episode boundaries, per-env streams, FIFO capacity."""

import numpy as np
import pytest

from rllib_dreamerv3.replay_buffer import ReplayBuffer


def _steps(start, n, is_first_at=(), obs_dim=1):
    """Steps whose observation is their global counter, so sequences can be checked."""
    obs = np.arange(start, start + n, dtype=np.float32)[:, None].repeat(obs_dim, 1)
    is_first = np.zeros(n, bool)
    is_first[list(is_first_at)] = True
    return {
        "obs": obs,
        "actions": np.zeros((n, 2), np.float32),
        "rewards": np.arange(start, start + n, dtype=np.float32),
        "is_first": is_first,
        "is_terminal": np.zeros(n, bool),
    }


def test_sequences_are_contiguous_and_cross_episode_boundaries():
    buf = ReplayBuffer(100, 5, (1,), np.float32, 2, seed=0)
    buf.add("env0", _steps(0, 7, is_first_at=[0, 3]))
    buf.add("env0", _steps(7, 5, is_first_at=[2]))
    batch = buf.sample(64)
    assert batch["obs"].shape == (64, 5, 1) and batch["actions"].shape == (64, 5, 2)
    starts = batch["rewards"][:, 0]
    np.testing.assert_array_equal(batch["rewards"], starts[:, None] + np.arange(5))
    # Every start 0..7 is possible (12 steps, T = 5), and the flags travel with the steps.
    assert set(starts.astype(int)) == set(range(8))
    np.testing.assert_array_equal(batch["is_first"], np.isin(batch["rewards"], [0, 3, 9]))


def test_streams_do_not_mix():
    buf = ReplayBuffer(1000, 4, (1,), np.float32, 2, seed=1)
    for chunk in range(10):  # interleaved arrival, as from two envs
        buf.add(("runner", 0), _steps(chunk * 3, 3))
        buf.add(("runner", 1), _steps(1000 + chunk * 3, 3))
    batch = buf.sample(256)
    diffs = np.diff(batch["rewards"], axis=1)
    np.testing.assert_array_equal(diffs, np.ones_like(diffs))


def test_uniform_over_all_subsequences():
    buf = ReplayBuffer(1000, 3, (1,), np.float32, 2, seed=2)
    buf.add("a", _steps(0, 10))  # 8 valid starts
    buf.add("b", _steps(100, 4))  # 2 valid starts
    starts = np.concatenate([buf.sample(500)["rewards"][:, 0] for _ in range(20)])
    counts = np.array([np.sum(starts == s) for s in [*range(8), 100, 101]])
    assert counts.sum() == 10000
    # Each of the 10 starts is drawn with probability 1/10: 1000 ± 5 sigma (sigma = 30).
    assert np.all(np.abs(counts - 1000) < 150), counts


def test_fifo_eviction_by_step_capacity():
    buf = ReplayBuffer(10, 3, (1,), np.float32, 2, seed=3)
    buf.add("a", _steps(0, 8))
    buf.add("a", _steps(8, 6))  # 14 steps added, the oldest 4 evicted
    assert len(buf) == 10 and buf.num_steps_added == 14
    rewards = buf.sample(200)["rewards"]
    assert rewards.min() == 4 and rewards.max() == 13
    np.testing.assert_array_equal(np.diff(rewards, axis=1), 1)


def test_eviction_with_two_streams_keeps_sequences_valid():
    buf = ReplayBuffer(12, 3, (1,), np.float32, 2, seed=4)
    for chunk in range(6):
        buf.add("a", _steps(chunk * 2, 2))
        buf.add("b", _steps(500 + chunk * 2, 2))
    rewards = buf.sample(500)["rewards"]
    np.testing.assert_array_equal(np.diff(rewards, axis=1), 1)
    assert rewards[rewards < 500].min() >= 6 and rewards[rewards >= 500].min() >= 506


def test_images_stay_uint8_and_nbytes():
    buf = ReplayBuffer(50, 4, (64, 64, 3), np.uint8, 2, seed=0)
    steps = _steps(0, 10)
    steps["obs"] = np.full((10, 64, 64, 3), 255, np.uint8)
    buf.add(0, steps)
    batch = buf.sample(2)
    assert batch["obs"].dtype == np.uint8 and batch["obs"].shape == (2, 4, 64, 64, 3)
    # 10 stored steps of 64*64*3 pixels + 2 actions * 4 + reward 4 + 2 flags + 3 * 8 index.
    assert buf.nbytes == 10 * (64 * 64 * 3 + 8 + 4 + 2 + 24)
    assert buf.capacity_nbytes == 50 * (64 * 64 * 3 + 8 + 4 + 2 + 24)


def test_cannot_sample_before_t_steps():
    buf = ReplayBuffer(50, 8, (1,), np.float32, 2)
    buf.add(0, _steps(0, 5))
    buf.add(1, _steps(0, 5))
    assert not buf.can_sample()
    with pytest.raises(RuntimeError, match="batch_length_T=8"):
        buf.sample(4)


def test_state_round_trip_samples_identically():
    buf = ReplayBuffer(30, 4, (1,), np.float32, 2, seed=5)
    buf.add("a", _steps(0, 25))
    buf.add("b", _steps(100, 12))
    restored = ReplayBuffer(30, 4, (1,), np.float32, 2, seed=99)
    restored.set_state(buf.get_state())
    a, b = buf.sample(16), restored.sample(16)
    for key in a:
        np.testing.assert_array_equal(a[key], b[key])
    buf.add("a", _steps(25, 3))
    restored.add("a", _steps(25, 3))
    np.testing.assert_array_equal(buf.sample(16)["rewards"], restored.sample(16)["rewards"])


def test_bad_input():
    with pytest.raises(ValueError, match="capacity=3"):
        ReplayBuffer(3, 8, (1,), np.float32, 2)
    buf = ReplayBuffer(30, 4, (1,), np.float32, 2)
    steps = _steps(0, 5)
    steps["rewards"] = steps["rewards"][:4]
    with pytest.raises(ValueError, match="steps\\['obs'\\] has 5 entries, expected 4"):
        buf.add(0, steps)


def test_state_is_sized_by_what_is_stored():
    buf = ReplayBuffer(1000, 4, (3,), np.float32, 2, seed=5)
    buf.add("a", _steps(0, 25))
    state = buf.get_state()
    assert state["capacity"] == 1000
    for key in ("stream", "index", "next_slot"):
        assert len(state[key]) == 25, key
    assert all(len(v) == 25 for v in state["data"].values())
    full = ReplayBuffer(20, 4, (3,), np.float32, 2)
    full.add("a", _steps(0, 25))  # wrapped around: every slot is in use
    assert len(full.get_state()["stream"]) == 20


def _capacity_sized(state, capacity):
    """`state` as buffers wrote it before states were sized by content: bookkeeping for every
    slot (initial values past the stored steps) and no `capacity` entry."""
    old = dict(state)
    del old["capacity"]
    for key, fill in (("stream", -1), ("index", 0), ("next_slot", 0)):
        old[key] = np.concatenate([state[key], np.full(capacity - len(state[key]), fill)])
    return old


@pytest.mark.parametrize("steps", [25, 47])  # part full; wrapped around
def test_content_sized_and_capacity_sized_states_restore_the_same(steps):
    buf = ReplayBuffer(30, 4, (1,), np.float32, 2, seed=5)
    buf.add("a", _steps(0, steps))
    buf.add("b", _steps(100, 12))
    state = buf.get_state()
    for restored_state in (state, _capacity_sized(state, 30)):
        restored = ReplayBuffer(30, 4, (1,), np.float32, 2, seed=99)
        restored.set_state(restored_state)
        copy = ReplayBuffer(30, 4, (1,), np.float32, 2, seed=5)
        copy.set_state(state)
        for other in (copy, restored):
            other.add("a", _steps(steps, 3))
        a, b = copy.sample(16), restored.sample(16)
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])


def test_damaged_or_mismatched_states_are_named():
    buf = ReplayBuffer(30, 4, (1,), np.float32, 2)
    buf.add("a", _steps(0, 10))
    state = buf.get_state()
    with pytest.raises(ValueError, match="capacity 30, this buffer 40"):
        ReplayBuffer(40, 4, (1,), np.float32, 2).check_state(state)
    state["next_slot"] = state["next_slot"][:5]
    with pytest.raises(ValueError, match="'next_slot' has 5 entries for 10 stored steps"):
        ReplayBuffer(30, 4, (1,), np.float32, 2).check_state(state)
