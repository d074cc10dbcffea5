"""Run the DreamerV3 author's code and ours side by side, with one settings set, on DeepMind
Control proprio tasks; bin the training returns the author's way.

Backs docs/author_comparison.md (its settings table, speed table and return table).

The author's code is danijar/dreamerv3 at commit 423291a (May 2023, JAX), checked out outside this
repo with its own virtualenv (see the doc for the commands and the patches it needs). `SETTINGS`
below is the one settings set; `our_config` and `author_flags` map it to each implementation.

Usage:
    python benchmarks/author_comparison.py run --impl ours --task walker-walk --seed 0 \
        --out benchmarks/out/author_comparison/ours_walker-walk_s0.jsonl
    python benchmarks/author_comparison.py run --impl author --task walker-walk --seed 0 \
        --out benchmarks/out/author_comparison/author_walker-walk_s0.jsonl \
        --author-checkout /work/author/dreamerv3 --author-python /work/author/venv/bin/python
    python benchmarks/author_comparison.py summary benchmarks/out/author_comparison/*.jsonl

`run` writes JSON lines to `--out` as the run goes:
- `{"kind": "episode", ...}` per finished training episode: `agent_step` (agent steps taken,
  the episode's own included), `frames` (env frames: agent steps × action repeat), `return`,
  `length` (agent steps), `wall_s` (seconds since the run started, build and compile included);
- `{"kind": "progress", ...}`: `agent_step`, `updates` (training updates so far), `wall_s`, and
  for the author's code its own timer's `update_s` (seconds per update in that log window);
- `{"kind": "done", ...}` at the end (or `{"kind": "failed", ...}`).
`summary` prints one JSON object: per implementation, task and seed the mean return of the
episodes ending in each 10k-frame bin ((0, 10k], (10k, 20k], ...; the author's plot.py binning),
their mean, min and max over seeds, and the speeds (env steps/s and wall seconds per update
after warm-up, from the progress lines).
"""

import argparse
import collections
import json
import math
import os
import re
import shutil
import subprocess
import sys
import threading
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# The one settings set both implementations run with (model: our size "mini").
SETTINGS = {
    "deter": 64,  # GRU / deterministic state units
    "hidden": 64,  # units of every MLP hidden layer (RSSM, encoder, decoder, heads, actor, critic)
    "mlp_layers": 1,  # hidden layers of encoder, decoder, reward/continue heads, actor, critic
    "stoch": 16,  # categorical latents ...
    "classes": 16,  # ... of this many classes each
    "world_model_lr": 1e-3,
    "actor_lr": 3e-4,
    "critic_lr": 3e-4,
    "world_model_adam_eps": 1e-8,
    "actor_adam_eps": 1e-5,
    "critic_adam_eps": 1e-5,
    "world_model_grad_clip": 1000.0,
    "actor_grad_clip": 100.0,
    "critic_grad_clip": 100.0,
    "training_ratio": 512,  # replayed steps per agent step: 512 / (16 * 64) = 0.5 updates/step
    "batch_size": 16,
    "batch_length": 64,
    "horizon": 15,
    "free_bits": 1.0,
    "num_envs": 1,
    "action_repeat": 2,
    # Random-action steps before the first update. The author's code fills its replay until it
    # holds batch_size * batch_length sequences of batch_length steps, in 100-step rounds:
    # 1,024 + 63 -> 1,100 agent steps; ours is set to the same.
    "warmup_steps": 1100,
    "agent_steps": 25_000,  # 50k env frames
    "threads": 1,  # compute threads per run (two runs share the 2 cores)
}
# Named settings sets. "mini" is the first choice (the size of our published CPU results); the
# author's compiled update takes seconds there on this CPU, so its 12,450 updates per run take
# hours. "nano-r64" is the set whose runs end within a session on 2 cores: our smallest size and
# training ratio 64 (one update per 16 agent steps, 1,556 per run), everything else as "mini".
PRESETS = {
    "mini": SETTINGS,
    "nano-r64": {
        **SETTINGS,
        "deter": 16,
        "hidden": 16,
        "stoch": 4,
        "classes": 4,
        "training_ratio": 64,
    },
}
EPISODE_FRAMES = 1000  # dm_control's time limit: 500 agent steps at action repeat 2
BIN_FRAMES = 10_000
TASKS = ("walker-walk", "cartpole-balance", "cup-catch", "reacher-easy", "cheetah-run")


def author_flags(task, seed, logdir, settings=SETTINGS):
    """Command-line flags of the author's train.py (its configs.yaml keys) for `settings`."""
    s = settings
    episodes = math.ceil(s["agent_steps"] / (EPISODE_FRAMES // s["action_repeat"]))
    hidden = str(s["hidden"])
    layers = str(s["mlp_layers"])
    flags = {
        "--configs": "dmc_proprio",
        "--task": "dmc_" + task.replace("-", "_"),
        "--logdir": logdir,
        "--seed": str(seed),
        "--jax.platform": "cpu",
        "--jax.precision": "float32",
        "--jax.prealloc": "False",
        "--envs.amount": str(s["num_envs"]),
        "--envs.parallel": "none",
        "--env.dmc.repeat": str(s["action_repeat"]),
        "--env.dmc.render": "False",  # added by our patch: proprio runs read no image
        # Its step counter also counts each episode's reset step (501 per 500-step episode).
        "--run.steps": str(s["agent_steps"] + episodes),
        "--run.train_ratio": str(s["training_ratio"]),
        "--run.log_every": "120",
        "--batch_size": str(s["batch_size"]),
        "--batch_length": str(s["batch_length"]),
        "--imag_horizon": str(s["horizon"]),
        "--rssm.deter": str(s["deter"]),
        "--rssm.units": hidden,
        "--rssm.stoch": str(s["stoch"]),
        "--rssm.classes": str(s["classes"]),
        # dmc_proprio's `.*\.units` / `.*\.layers` miss the encoder's and decoder's mlp_* keys.
        "--encoder.mlp_units": hidden,
        "--encoder.mlp_layers": layers,
        "--decoder.mlp_units": hidden,
        "--decoder.mlp_layers": layers,
        "--reward_head.units": hidden,
        "--reward_head.layers": layers,
        "--cont_head.units": hidden,
        "--cont_head.layers": layers,
        "--actor.units": hidden,
        "--actor.layers": layers,
        "--critic.units": hidden,
        "--critic.layers": layers,
        "--model_opt.lr": str(s["world_model_lr"]),
        "--actor_opt.lr": str(s["actor_lr"]),
        "--critic_opt.lr": str(s["critic_lr"]),
        "--model_opt.eps": str(s["world_model_adam_eps"]),
        "--actor_opt.eps": str(s["actor_adam_eps"]),
        "--critic_opt.eps": str(s["critic_adam_eps"]),
        "--model_opt.clip": str(s["world_model_grad_clip"]),
        "--actor_opt.clip": str(s["actor_grad_clip"]),
        "--critic_opt.clip": str(s["critic_grad_clip"]),
        "--dyn_loss.free": str(s["free_bits"]),
        "--rep_loss.free": str(s["free_bits"]),
    }
    return [item for pair in flags.items() for item in pair]


def author_env(settings=SETTINGS):
    """Environment of the author's process: one compute thread, no OpenGL, unbuffered output."""
    env = dict(os.environ)
    threads = settings["threads"]
    env.update(
        PYTHONUNBUFFERED="1",
        MUJOCO_GL="disable",
        XLA_FLAGS=(
            f"--xla_cpu_multi_thread_eigen={'true' if threads > 1 else 'false'} "
            f"intra_op_parallelism_threads={threads}"
        ),
        TF_CPP_MIN_LOG_LEVEL="2",
    )
    return env


def our_model_size(settings=SETTINGS):
    """The name of our model size with the settings' dims (a ValueError if none has them)."""
    from rllib_dreamerv3.model_sizes import MODEL_SIZES

    want = (
        settings["deter"],
        settings["hidden"],
        settings["mlp_layers"],
        settings["stoch"],
        settings["classes"],
    )
    for name, size in MODEL_SIZES.items():
        dims = (
            size.gru_units,
            size.dense_units,
            size.mlp_layers,
            size.num_categoricals,
            size.num_classes,
        )
        if dims == want:
            return name
    raise ValueError(f"No model size of ours has (deter, hidden, layers, stoch, classes)={want}.")


def our_config(env_id, seed, settings=SETTINGS):
    """Our `DreamerV3Config` for `settings` on the registered env `env_id`."""
    from rllib_dreamerv3 import DreamerV3Config

    s = settings
    return (
        DreamerV3Config()
        .environment(env_id)
        .env_runners(num_env_runners=0, num_envs_per_env_runner=s["num_envs"])
        .training(
            model_size=our_model_size(s),
            training_ratio=s["training_ratio"],
            batch_size_B=s["batch_size"],
            batch_length_T=s["batch_length"],
            horizon_H=s["horizon"],
            world_model_lr=s["world_model_lr"],
            actor_lr=s["actor_lr"],
            critic_lr=s["critic_lr"],
            world_model_adam_eps=s["world_model_adam_eps"],
            actor_adam_eps=s["actor_adam_eps"],
            critic_adam_eps=s["critic_adam_eps"],
            world_model_grad_clip=s["world_model_grad_clip"],
            actor_grad_clip=s["actor_grad_clip"],
            critic_grad_clip=s["critic_grad_clip"],
            free_bits=s["free_bits"],
            num_steps_sampled_before_learning_starts=s["warmup_steps"],
            dream_every_n_updates=0,
            tf_num_threads=s["threads"],
            log_progress=False,
        )
        .reporting(min_sample_timesteps_per_iteration=1000)
        .debugging(seed=seed)
    )


class Recorder:
    """Appends JSON lines to the output file, each with the run's identity. Thread-safe, and
    picklable (the env creator that RLlib's registry pickles holds one)."""

    def __init__(self, path, impl, task, seed, preset="mini"):
        self.path = os.path.abspath(path)
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        open(self.path, "w").close()  # a rerun starts the file anew
        self._lock = threading.Lock()
        self._ident = {"impl": impl, "task": task, "seed": seed, "preset": preset}
        self.start = time.time()

    def __getstate__(self):
        return {key: value for key, value in self.__dict__.items() if key != "_lock"}

    def __setstate__(self, state):
        self.__dict__.update(state, _lock=threading.Lock())

    def wall(self):
        return round(time.time() - self.start, 2)

    def write(self, kind, **fields):
        line = json.dumps({"kind": kind, **self._ident, **fields, "wall_s": self.wall()})
        with self._lock, open(self.path, "a") as f:
            f.write(line + "\n")
        print(line, flush=True)


def tuned_example_config(path, env_id, seed, settings=SETTINGS):
    """Our config from a tuned example's YAML (its one experiment's `config`), on `env_id`, with
    `settings`' compute threads (two runs share the cores); its stop criteria are not applied:
    a run takes `settings["agent_steps"]`."""
    import yaml

    from rllib_dreamerv3 import DreamerV3Config

    with open(path) as f:
        (experiment,) = yaml.safe_load(f).values()
    config = DreamerV3Config().update_from_dict(experiment.get("config", {}))
    config.environment(env_id).debugging(seed=seed)
    return config.training(tf_num_threads=settings["threads"], log_progress=False)


def run_ours(task, seed, recorder, settings=SETTINGS, tuned_example=None):
    import gymnasium as gym
    from ray.tune.registry import register_env

    from rllib_dreamerv3.envs.dmc import make_dmc_env

    class EpisodeRecorder(gym.Wrapper):
        """Writes an episode line whenever an episode ends (random warm-up ones included)."""

        agent_step = 0
        episodes = 0

        def reset(self, **kwargs):
            self._return, self._length = 0.0, 0
            return self.env.reset(**kwargs)

        def step(self, action):
            obs, reward, terminated, truncated, info = self.env.step(action)
            self._return += float(reward)
            self._length += 1
            EpisodeRecorder.agent_step += 1
            if terminated or truncated:
                EpisodeRecorder.episodes += 1
                recorder.write(
                    "episode",
                    episode=EpisodeRecorder.episodes,
                    agent_step=EpisodeRecorder.agent_step,
                    frames=EpisodeRecorder.agent_step * settings["action_repeat"],
                    **{"return": round(self._return, 3)},
                    length=self._length,
                )
            return obs, reward, terminated, truncated, info

    env_id = f"author-comparison/{task}"
    env_config = {"action_repeat": settings["action_repeat"]}
    register_env(env_id, lambda _: EpisodeRecorder(make_dmc_env(f"DMC/{task}", env_config)))
    if tuned_example:
        algo = tuned_example_config(tuned_example, env_id, seed, settings).build_algo()
    else:
        algo = our_config(env_id, seed, settings).build_algo()
    recorder.write("progress", agent_step=0, updates=0, phase="built")
    steps = 0
    while steps < settings["agent_steps"]:
        result = algo.train()
        steps = result["env_runners"]["num_env_steps_sampled_lifetime"]
        recorder.write("progress", agent_step=steps, updates=result.get("num_updates_lifetime"))
    algo.stop()
    return {"agent_step": steps}


EPISODE_LINE = re.compile(r"Episode has (\d+) steps and return (-?[\d.]+|nan|inf)\.")


def run_author(task, seed, recorder, checkout, python, logdir, settings=SETTINGS):
    """Launch the author's train.py and turn its output into our JSON lines as it goes."""
    if os.path.exists(logdir):
        shutil.rmtree(logdir)  # its train.py resumes from a checkpoint in the logdir
    script = os.path.join(checkout, "dreamerv3", "train.py")
    command = [python, script, *author_flags(task, seed, logdir, settings)]
    recorder.write("progress", agent_step=0, updates=0, phase="launch", command=command)
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=author_env(settings),
        cwd=checkout,
    )
    stop = threading.Event()
    watcher = threading.Thread(
        target=_follow_author_metrics, args=(logdir, recorder, stop, settings), daemon=True
    )
    watcher.start()
    agent_step = episodes = 0
    for line in process.stdout:
        sys.stdout.write(line)
        match = EPISODE_LINE.search(line)
        if match:
            length, episode_return = int(match[1]), float(match[2])
            agent_step += length
            episodes += 1
            recorder.write(
                "episode",
                episode=episodes,
                agent_step=agent_step,
                frames=agent_step * settings["action_repeat"],
                **{"return": episode_return},
                length=length,
                author_step=agent_step + episodes,  # its counter: the reset steps too
            )
    code = process.wait()
    time.sleep(6)  # the watcher's last poll
    stop.set()
    watcher.join()
    if code != 0:
        raise RuntimeError(f"the author's train.py exited with {code}")
    return {"agent_step": agent_step}


def _follow_author_metrics(logdir, recorder, stop, settings):
    """Poll the author's metrics.jsonl; one progress line per timer log (updates so far)."""
    path = os.path.join(logdir, "metrics.jsonl")
    offset, updates = 0, 0
    while not stop.is_set():
        if os.path.exists(path):
            with open(path) as f:
                f.seek(offset)
                chunk = f.read()
            complete = chunk[: chunk.rfind("\n") + 1]
            offset += len(complete.encode())
            for line in complete.splitlines():
                metrics = json.loads(line)
                if "timer/agent.train_count" not in metrics:
                    continue
                updates += int(metrics["timer/agent.train_count"])
                recorder.write(
                    "progress",
                    # Its logged step is its step counter times the action repeat.
                    author_step=int(metrics["step"]) // settings["action_repeat"],
                    updates=updates,
                    update_s=metrics.get("timer/agent.train_avg"),
                    fps=metrics.get("fps"),
                )
        stop.wait(5)


def cmd_run(args):
    settings = PRESETS[args.preset]
    preset = args.preset
    if args.tuned_example:
        if args.impl != "ours":
            raise SystemExit("--tuned-example runs our implementation only (--impl ours).")
        preset = os.path.splitext(os.path.basename(args.tuned_example))[0]
    recorder = Recorder(args.out, args.impl, args.task, args.seed, preset)
    recorder.write("start", settings=settings, argv=sys.argv)
    try:
        if args.impl == "ours":
            end = run_ours(args.task, args.seed, recorder, settings, args.tuned_example)
        else:
            logdir = args.author_logdir or os.path.splitext(args.out)[0] + "_logdir"
            end = run_author(
                args.task,
                args.seed,
                recorder,
                os.path.abspath(args.author_checkout),
                args.author_python,
                os.path.abspath(logdir),
                settings,
            )
    except BaseException as error:
        recorder.write("failed", error=f"{type(error).__name__}: {error}")
        raise
    recorder.write("done", **end)


# --- summary ------------------------------------------------------------------------------------
def read_runs(paths):
    """`{(preset, impl, task, seed): [records]}` of the given JSON-lines files."""
    runs = collections.defaultdict(list)
    for path in paths:
        with open(path) as f:
            for line in f:
                line = line.strip()
                if not line.startswith("{"):
                    continue
                record = json.loads(line)
                key = (record.get("preset", "mini"), record["impl"], record["task"])
                runs[(*key, record["seed"])].append(record)
    return runs


def bin_returns(episodes, bin_frames=BIN_FRAMES, max_frames=None):
    """Mean return of the episodes ending in each bin (start, stop]: `{stop: mean}`; None for
    a bin without episodes (the author's plot.py `binning` with fill='nan')."""
    if not episodes:
        return {}
    last = max(e["frames"] for e in episodes)
    last = min(last, max_frames) if max_frames else last
    bins = {}
    for stop in range(bin_frames, int(math.ceil(last / bin_frames)) * bin_frames + 1, bin_frames):
        values = [e["return"] for e in episodes if stop - bin_frames < e["frames"] <= stop]
        bins[stop] = round(sum(values) / len(values), 1) if values else None
    return bins


def speeds(records):
    """Env steps/s and wall seconds per update after warm-up, from the progress lines."""
    progress = [
        r
        for r in records
        if r["kind"] == "progress"
        and r.get("updates")
        and r.get("agent_step", r.get("author_step"))
    ]
    if len(progress) < 2:
        return {}
    first, last = progress[0], progress[-1]

    def step(r):
        return r.get("agent_step", r.get("author_step"))

    wall = last["wall_s"] - first["wall_s"]
    updates = last["updates"] - first["updates"]
    out = {
        "window_wall_s": round(wall, 1),
        "agent_steps_per_s": round((step(last) - step(first)) / wall, 3) if wall > 0 else None,
        "wall_s_per_update": round(wall / updates, 3) if updates > 0 else None,
        "updates": last["updates"],
    }
    timed = [r["update_s"] for r in progress if r.get("update_s")]
    if timed:
        out["author_timer_update_s_median"] = round(sorted(timed)[len(timed) // 2], 3)
    done = [r for r in records if r["kind"] == "done"]
    if done:
        out["total_wall_s"] = done[-1]["wall_s"]
    return out


def cmd_summary(args):
    runs = read_runs(args.files)
    max_frames = args.max_frames
    out = {"bin_frames": BIN_FRAMES, "runs": [], "over_seeds": []}
    grouped = collections.defaultdict(dict)
    for (preset, impl, task, seed), records in sorted(runs.items(), key=str):
        episodes = [r for r in records if r["kind"] == "episode"]
        bins = bin_returns(episodes, max_frames=max_frames)
        status = next(
            (r["kind"] for r in reversed(records) if r["kind"] in ("done", "failed")), "running"
        )
        out["runs"].append(
            {
                "preset": preset,
                "impl": impl,
                "task": task,
                "seed": seed,
                "status": status,
                "episodes": len(episodes),
                "frames": max((e["frames"] for e in episodes), default=0),
                "returns_by_bin": bins,
                "speed": speeds(records),
            }
        )
        grouped[(preset, impl, task)][seed] = bins
    for (preset, impl, task), by_seed in sorted(grouped.items()):
        stops = sorted({stop for bins in by_seed.values() for stop in bins})
        table = {}
        for stop in stops:
            values = [b[stop] for b in by_seed.values() if b.get(stop) is not None]
            if values:
                table[stop] = {
                    "mean": round(sum(values) / len(values), 1),
                    "min": min(values),
                    "max": max(values),
                    "seeds": len(values),
                }
        out["over_seeds"].append(
            {"preset": preset, "impl": impl, "task": task, "returns_by_bin": table}
        )
    print(json.dumps(out, indent=1))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="train one implementation on one task and seed")
    run.add_argument("--impl", choices=("author", "ours"), required=True)
    run.add_argument("--task", default="walker-walk", help=f"a DMC task, e.g. {', '.join(TASKS)}")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--preset", choices=sorted(PRESETS), default="mini", help="settings set")
    run.add_argument(
        "--tuned-example",
        metavar="YAML",
        help="ours only: the config of this tuned example (e.g. dmc_proprio_cpu.yaml) instead of "
        "the preset's settings (its steps, action repeat and threads still apply)",
    )
    run.add_argument("--out", required=True, help="JSON-lines file (rewritten)")
    run.add_argument("--author-checkout", default="/work/author/dreamerv3")
    run.add_argument("--author-python", default="/work/author/venv/bin/python")
    run.add_argument("--author-logdir", help="the author's logdir (default: next to --out)")
    summary = commands.add_parser("summary", help="bin the returns of finished or running runs")
    summary.add_argument("files", nargs="+")
    summary.add_argument("--max-frames", type=int, default=2 * SETTINGS["agent_steps"])
    args = parser.parse_args()
    {"run": cmd_run, "summary": cmd_summary}[args.command](args)


if __name__ == "__main__":
    main()
