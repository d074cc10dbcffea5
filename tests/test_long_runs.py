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


def _checkpoints(trial):
    """`[(env steps, episodes, replay steps stored, name)]` of the trial's complete checkpoints
    (those with a manifest), read from the files themselves."""
    found = []
    for path in trial.iterdir():
        if not (path.name.startswith("checkpoint_") and (path / "dreamer_manifest.json").exists()):
            continue
        with open(path / "algorithm_state.pkl", "rb") as f:
            stats = pickle.load(f)["metrics_logger"]["stats"]
        with open(path / "replay_buffer" / "state.pkl", "rb") as f:
            replay = pickle.load(f)
        found.append(
            (
                int(stats["env_runners--num_env_steps_sampled_lifetime"]["lifetime_sum"]),
                int(stats["env_runners--num_episodes_lifetime"]["lifetime_sum"]),
                replay["size"],
                path.name,
            )
        )
    return sorted(found)


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
        saved = _checkpoints(_trial_dir(storage)) if kill else []
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
        rounds.append({"kill": kill, "checkpoints": saved[-2:], "first": first, "last": seen[-1]})
        print(json.dumps(rounds[-1]), flush=True)
        for env_steps, episodes, stored, name in saved:
            # Nothing is evicted at this size: replay holds every sampled step plus each
            # finished episode's last observation, in every checkpoint.
            assert stored == env_steps + episodes, (name, env_steps, episodes, stored)
        if kill:
            # Tune resumed from the newest checkpoint, or (killed before Tune recorded it) the
            # one before: its first iteration adds one iteration's steps to that counter.
            restored = [c for c in saved if c[0] < first <= c[0] + 64]
            assert restored and restored[-1] in saved[-2:], rounds[-1]
            resumed = [
                r
                for r in _results(_trial_dir(storage))
                if r["env_runners"]["num_env_steps_sampled_lifetime"] == first
            ][-1]
            # ... and the replay buffer holds what that checkpoint held, plus that iteration's.
            stored = resumed["replay_buffer"]["num_steps_stored"]
            episodes = resumed["env_runners"]["num_episodes_lifetime"]
            assert stored == first + episodes, (stored, first, episodes)
        if kill == 5:
            assert proc.returncode == 0 and seen[-1] >= STOP, rounds
    print(json.dumps(rounds))


# --- an env that fails often and builds slowly, in a remote EnvRunner, on a loaded machine --
_FLAKY_RUN = r"""
import json, sys, time
import gymnasium as gym
import numpy as np
import ray
from helpers import tiny_config

class FlakySlowEnv(gym.Env):
    # Takes `build_s` to construct (every construction, as a restarted runner's env) and raises
    # at every `raise_every`-th step of its life.
    observation_space = gym.spaces.Box(-1e6, 1e6, (2,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, config):
        time.sleep(config["build_s"])
        self.every, self.count = config["raise_every"], 0

    def reset(self, *, seed=None, options=None):
        return np.zeros(2, np.float32), {}

    def step(self, action):
        self.count += 1
        if self.count % self.every == 0:
            raise RuntimeError(f"scripted env failure at step {self.count}")
        return np.array([self.count % 25, 0], np.float32), 1.0, False, self.count % 25 == 0, {}

stop, build_s, raise_every = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
ray.init(num_cpus=2, include_dashboard=False)
config = (
    tiny_config(FlakySlowEnv)
    .environment(FlakySlowEnv, env_config=dict(build_s=build_s, raise_every=raise_every))
    .env_runners(num_env_runners=1)
)  # RLlib's fault-tolerance defaults: restart_failed_env_runners, a 60 s restart delay
algo = config.build_algo()
sampled, start = [], time.monotonic()
while not sampled or sampled[-1] < stop:
    result = algo.train()
    sampled.append(int(result["env_runners"]["num_env_steps_sampled_lifetime"]))
restarts = algo.env_runner_group.num_remote_worker_restarts()
algo.stop()
print(json.dumps({"sampled": sampled, "restarts": restarts, "s": round(time.monotonic() - start)}))
"""


@pytest.mark.slow
def test_ten_runs_with_a_failing_slowly_built_env_all_finish(tmp_path):
    """10 runs, two at a time, each with a remote EnvRunner whose env takes 45 s to build and
    raises every 150 steps (two restarts a run, each after RLlib's 60 s delay): every run
    reaches its stop with a continuous env-step count. Prints one JSON line a run."""
    script = tmp_path / "flaky_run.py"
    script.write_text(_FLAKY_RUN)
    tests = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": tests}
    runs = []
    for _ in range(5):
        procs = [
            subprocess.Popen(
                [sys.executable, str(script), "400", "45", "150"],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env=env,
            )
            for _ in range(2)
        ]
        for proc in procs:
            out, _ = proc.communicate(timeout=1800)
            last = out.strip().splitlines()[-1] if out.strip() else ""
            assert proc.returncode == 0, out[-4000:]
            runs.append(json.loads(last))
            print(json.dumps({"run": len(runs), "load_1min": os.getloadavg()[0], **runs[-1]}))
    for run in runs:
        steps = run["sampled"]
        assert steps[-1] >= 400 and run["restarts"] >= 2, run
        assert all(b - a >= 16 for a, b in zip(steps, steps[1:])), run  # no step lost or reset
