"""`save_in_place`: a Tune trial's checkpoint written at its final path, not copied there; and the
`from_checkpoint` restore hook. Both read Ray internals: these tests fail when those change."""

import os
import sys

import pytest
import ray
from ray import tune
from ray.rllib.algorithms.algorithm import Algorithm
from ray.rllib.utils.checkpoints import Checkpointable

from rllib_dreamerv3.tf_rllib import compat
from rllib_dreamerv3.tf_rllib.tune_storage import save_in_place

# Ray's workers cannot import this test module (tests/ is not a package on their path): its
# classes travel by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class Toy(tune.Trainable):
    """Counts; each checkpoint records where it was written."""

    def setup(self, config):
        self.count = 0

    def step(self):
        self.count += 1
        return {"count": self.count}

    def save_checkpoint(self, checkpoint_dir):
        with open(os.path.join(checkpoint_dir, "state.txt"), "w") as f:
            f.write(f"{self.count} {checkpoint_dir}")

    def load_checkpoint(self, checkpoint_dir):
        with open(os.path.join(checkpoint_dir, "state.txt")) as f:
            self.count = int(f.read().split()[0])

    def save(self, checkpoint_dir=None):
        saved = save_in_place(self, checkpoint_dir)
        return saved if saved is not None else super().save(checkpoint_dir)


@pytest.mark.usefixtures("ray_session")
def test_checkpoints_are_written_where_tune_keeps_them(tmp_path):
    analysis = tune.run(
        Toy,
        stop={"training_iteration": 3},
        checkpoint_config=tune.CheckpointConfig(checkpoint_frequency=1, num_to_keep=2),
        storage_path=str(tmp_path),
        name="toy",
        verbose=0,
    )
    trial = analysis.trials[0]
    kept = sorted(p for p in os.listdir(trial.path) if p.startswith("checkpoint_"))
    assert kept == ["checkpoint_000001", "checkpoint_000002"]  # Tune deleted the oldest
    for name in kept:
        with open(os.path.join(trial.path, name, "state.txt")) as f:
            count, written_at = f.read().split()
        assert written_at == os.path.join(trial.path, name)  # in place, no temporary copy
    assert trial.checkpoint.path == os.path.join(trial.path, "checkpoint_000002")
    restored = Toy()
    restored.restore(trial.checkpoint.path)
    assert restored.count == 3


def test_outside_tune_or_with_a_directory_tunes_own_save_applies(tmp_path):
    toy = Toy()
    assert save_in_place(toy) is None  # no Tune storage
    assert save_in_place(toy, str(tmp_path)) is None


def test_from_checkpoint_hook_wraps_rays_classmethods():
    compat.apply_ray_patches()
    for owner in (Algorithm, Checkpointable):
        func = owner.__dict__["from_checkpoint"].__func__
        assert getattr(func, "_rllib_dreamerv3_patch", False), owner
        original = func._original.__func__
        assert not getattr(original, "_rllib_dreamerv3_patch", False)
        assert original.__qualname__.endswith("from_checkpoint")
    seen = []
    compat.register_restore_check(seen.append)
    try:
        with pytest.raises((ValueError, FileNotFoundError), match="not found"):
            Algorithm.from_checkpoint("/nonexistent/checkpoint_000000")
        assert seen == ["/nonexistent/checkpoint_000000"]
    finally:
        compat._RESTORE_CHECKS.remove(seen.append)
    assert ray.__version__ == compat.PINNED_RAY_VERSION


def test_tune_saves_its_experiment_state_after_every_trial_checkpoint():
    from ray.tune.execution.experiment_state import _ExperimentCheckpointManager

    compat.apply_ray_patches()
    patched = _ExperimentCheckpointManager.on_trial_checkpoint
    assert getattr(patched, "_rllib_dreamerv3_patch", False)
    assert patched._original.__qualname__ == "_ExperimentCheckpointManager.on_trial_checkpoint"
    # Tune's own rule (num_to_keep=3): a forced save only at every third trial checkpoint.
    for patch in (False, True):
        method = patched if patch else patched._original
        manager = _ExperimentCheckpointManager(
            storage=None, checkpoint_period="auto", sync_every_n_trial_checkpoints=3
        )
        forced = []
        for _ in range(3):
            method(manager, "trial")
            forced.append(manager._should_force_sync_up)
            manager._should_force_sync_up = False
        assert forced == ([True, True, True] if patch else [False, False, True])
