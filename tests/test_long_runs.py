"""A long run survives kills: `rllib train file` killed with SIGKILL and resumed with --resume.

Opt-in (`python -m pytest -m slow tests/test_long_runs.py -s`): each of the 5 rounds starts Ray
and compiles the update again. Prints, per kill, the env steps reached before the kill, those of
the newest checkpoint and those the resumed run starts from.
"""

import json
import os
import pickle
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import yaml

SETTINGS = {
    "model_size": "nano",
    "batch_size_B": 2,
    "batch_length_T": 8,
    "horizon_H": 3,
    "training_ratio": 32,
    "num_steps_sampled_before_learning_starts": 32,
    "min_sample_timesteps_per_iteration": 16,
    "dream_every_n_updates": 0,
    "checkpoint_interval_s": 5,
    "seed": 0,
}
STOP = 900


def _env_steps(line):
    return int(line.split("| env steps ")[1].split(" ")[0])


def _trial_dir(storage):
    experiment = storage / "kill-loop"
    return next(p for p in experiment.iterdir() if p.is_dir() and p.name.startswith("DreamerV3"))


def _newest_checkpoint(trial):
    found = sorted(p for p in trial.iterdir() if p.name.startswith("checkpoint_"))
    if not found:
        return None
    with open(found[-1] / "replay_buffer" / "state.pkl", "rb") as f:
        state = pickle.load(f)
    return found[-1].name, state["added"], state["size"]


def _results(trial):
    with open(trial / "result.json") as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.mark.slow
def test_killed_five_times_and_resumed_the_run_reaches_its_stop(tmp_path):
    (tmp_path / "run.yaml").write_text(
        yaml.safe_dump(
            {
                "kill-loop": {
                    "env": "CartPole-v1",
                    "run": "DreamerV3",
                    "stop": {"num_env_steps_sampled_lifetime": STOP},
                    "config": SETTINGS,
                }
            }
        )
    )
    storage = tmp_path / "runs"
    command = [sys.executable, "-m", "rllib_dreamerv3", "train", "file", "run.yaml"]
    command += ["--storage-path", str(storage), "--num-cpus", "2"]
    rng = np.random.default_rng(0)
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    rounds = []
    for kill in range(6):
        proc = subprocess.Popen(
            command + (["--resume"] if kill else []),
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            env=env,
        )
        checkpoint = _newest_checkpoint(_trial_dir(storage)) if kill else None
        seen, first, deadline = [], None, None
        for line in proc.stdout:
            if " iter " in line and "| env steps " in line:
                seen.append(_env_steps(line))
                if first is None:
                    first = seen[-1]
                    deadline = time.monotonic() + float(rng.uniform(5.0, 25.0))
            if kill < 5 and deadline is not None and time.monotonic() > deadline:
                os.killpg(proc.pid, signal.SIGKILL)
                break
        proc.wait()
        rounds.append({"kill": kill, "checkpoint": checkpoint, "first": first, "last": seen[-1]})
        if kill:
            name, added, size = checkpoint
            # The resumed run continues from the newest checkpoint: its first iteration adds one
            # iteration's steps to the checkpoint's, and the replay buffer holds what it held.
            assert added < first <= added + 64, rounds[-1]
            resumed = [
                r
                for r in _results(_trial_dir(storage))
                if r["env_runners"]["num_env_steps_sampled_lifetime"] == first
            ][-1]
            stored = resumed["replay_buffer"]["num_steps_stored"]
            assert stored == size + (first - added), (stored, size, first, added)
        if kill == 5:
            assert proc.returncode == 0 and seen[-1] >= STOP, rounds
    print(json.dumps(rounds))
