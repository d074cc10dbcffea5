"""`rllib evaluate` and `rllib export`: a checkpoint's policy, restored alone (no Learner, no
replay buffer), run on its env in this process or written as a TensorFlow SavedModel.

    rllib evaluate ~/ray_results/EXPERIMENT/TRIAL/checkpoint_000000 --episodes 10
    rllib export ~/ray_results/EXPERIMENT/TRIAL/checkpoint_000000 exported/
"""

import importlib.util
import json
import os
import pickle
import sys
import time

import numpy as np
from ray.rllib.algorithms.algorithm_config import AlgorithmConfig
from ray.rllib.utils.checkpoints import Checkpointable
from tqdm import tqdm

from rllib_dreamerv3 import checkpoints
from rllib_dreamerv3.algorithm import DreamerV3
from rllib_dreamerv3.config import DreamerV3Config
from rllib_dreamerv3.env_runner import DreamerV3EnvRunner, make_env
from rllib_dreamerv3.export import MODULE_PATH as MODULE_STATE_DIR
from rllib_dreamerv3.export import (
    export_policy,
    export_tflite,
    read_metadata,
    run_saved_model,
    saved_model_bytes,
)
from rllib_dreamerv3.progress import format_number as fmt

CTOR_FILE = Checkpointable.CLASS_AND_CTOR_ARGS_FILE_NAME


class CliError(Exception):
    """A user error of the `rllib` command: printed as one paragraph (no traceback), exit code 2."""


def _checkpoint_candidates(path):
    found = []
    for root, dirs, files in os.walk(path):
        if "rllib_checkpoint.json" in files:
            found.append(root)
            dirs.clear()
    return sorted(found)


def load_checkpoint_config(path):
    """The `DreamerV3Config` saved in an Algorithm checkpoint, or a `CliError` that says why not.

    It is the first constructor argument that RLlib's `Checkpointable.save_to_path` stores in
    `CTOR_FILE`; `Algorithm.from_checkpoint` would read it the same way, but would also build
    the Learner and restore the replay buffer, which evaluation does not need.
    """
    if not os.path.exists(path):
        raise CliError(
            f"{path}: no such checkpoint directory. Give the checkpoint_NNNNNN "
            "directory printed at the end of `rllib train`, or the path of "
            "`algo.save_to_path()`."
        )
    if not os.path.isdir(path):
        raise CliError(f"{path}: is a file; a checkpoint is a directory (checkpoint_NNNNNN).")
    ctor_file = os.path.join(path, CTOR_FILE)
    checkpoints.recover_interrupted_save(path)
    if not os.path.isfile(ctor_file) or not os.path.isdir(os.path.join(path, MODULE_STATE_DIR)):
        candidates = _checkpoint_candidates(path)
        hint = (
            f" Checkpoints below it: {', '.join(candidates[-3:])}."
            if candidates
            else " Nothing below it looks like one either; was the run checkpointed "
            "(--checkpoint-freq, checkpoint_at_end)?"
        )
        raise CliError(
            f"{path}: not an RLlib Algorithm checkpoint (no {CTOR_FILE}"
            f" and {MODULE_STATE_DIR}).{hint}"
        )
    try:  # the files evaluation reads: the config and the policy's weights
        checkpoints.verify(path, prefixes=(CTOR_FILE, MODULE_STATE_DIR.replace(os.sep, "/")))
    except checkpoints.CheckpointError as err:
        raise CliError(str(err)) from None
    try:
        with open(ctor_file, "rb") as f:
            saved = pickle.load(f)
        algo_class = saved["class"]
        config = AlgorithmConfig.from_state(saved["ctor_args_and_kwargs"][0][0])
    except Exception as err:  # a truncated or foreign pickle fails in many ways
        raise CliError(
            f"{path}: the checkpoint is corrupt or from an incompatible version "
            f"({ctor_file}: {type(err).__name__}: {err}). Use another checkpoint of "
            "the run, or re-save it with this version."
        ) from None
    if not (isinstance(algo_class, type) and issubclass(algo_class, DreamerV3)):
        raise CliError(
            f"{path}: a checkpoint of {getattr(algo_class, '__name__', algo_class)},"
            " not DreamerV3; `rllib evaluate` evaluates DreamerV3 checkpoints."
        )
    return config


def evaluate_checkpoint(path, episodes, env=None, explore=False, seed=None, video_dir=None):
    """Run `episodes` episodes of a checkpoint's policy on one env in this process.

    Only the policy is restored (not the learner or the replay buffer), so this is quick even
    for large runs. Returns `{"episodes", "return_mean", "return_min", "return_max",
    "length_mean", "env"}`.
    """
    from gymnasium.error import DependencyNotInstalled

    if episodes < 1:
        raise CliError(f"--episodes {episodes}: give at least 1.")
    if video_dir is not None and importlib.util.find_spec("moviepy") is None:
        raise CliError(
            "--video-dir needs moviepy, which is not installed: pip install moviepy "
            "(or pip install -e '.[video]')."
        )
    config = load_checkpoint_config(path).copy(copy_frozen=False)
    if env is not None:
        config.environment(env)
    if video_dir is not None:
        config.environment(env_config={**config.env_config, "render_mode": "rgb_array"})
    config.env_runners(num_env_runners=0, num_envs_per_env_runner=1, explore=explore)
    config.reporting(metrics_num_episodes_for_smoothing=episodes)
    if seed is not None:
        config.debugging(seed=seed)
    try:
        runner = DreamerV3EnvRunner(config=config, worker_index=0)
    except ValueError as err:
        raise CliError(f"{path}: could not create the env {config.env!r}: {err}") from None
    try:
        if video_dir is not None:
            runner.envs = [_record_video(runner.envs[0], video_dir, episodes)]
        try:
            runner.module.restore_from_path(os.path.abspath(os.path.join(path, MODULE_STATE_DIR)))
        except (ValueError, OSError, EOFError, pickle.UnpicklingError) as err:
            raise CliError(
                f"{path}: could not load the policy weights ({type(err).__name__}: "
                f"{err}). The checkpoint is corrupt, or --env has other spaces than "
                "the env it was trained on."
            ) from None
        bar = tqdm(total=episodes, desc="evaluating", unit="episode", leave=False, disable=None)
        try:
            with bar:
                runner.sample(num_episodes=episodes, progress=lambda n: bar.update(n - bar.n))
        except DependencyNotInstalled as err:  # e.g. the renderer for --video-dir
            raise CliError(f"{config.env}: {err}") from None
        metrics = runner.get_metrics()
    finally:
        runner.stop()
    return {
        "env": str(config.env),
        "episodes": episodes,
        "return_mean": float(metrics["episode_return_mean"]),
        "return_min": float(metrics["episode_return_min"]),
        "return_max": float(metrics["episode_return_max"]),
        "length_mean": float(metrics["episode_len_mean"]),
    }


def _record_video(env, video_dir, episodes):
    import gymnasium as gym

    try:  # not the episode the env resets into after the last one
        return gym.wrappers.RecordVideo(
            env,
            os.path.abspath(video_dir),
            episode_trigger=lambda episode: episode < episodes,
            disable_logger=True,
        )
    except gym.error.Error as err:
        raise CliError(f"--video-dir: the env cannot render frames ({err}).") from None


def add_commands(commands):
    """The `evaluate` and `export` subcommands of the `rllib` parser's `commands`."""
    evaluate = commands.add_parser(
        "evaluate",
        help="report the return of N episodes of a checkpoint's policy",
        description="Restore a checkpoint's policy and report the mean/min/max return of N "
        "episodes (greedy actions unless --explore).",
    )
    evaluate.add_argument(
        "checkpoint", nargs="?", help="a checkpoint directory (checkpoint_NNNNNN)"
    )
    evaluate.add_argument(
        "--saved-model",
        metavar="DIR",
        help="evaluate a policy exported by `rllib export` instead of a checkpoint",
    )
    evaluate.add_argument("--episodes", type=int, default=10, help="episodes (default 10)")
    evaluate.add_argument("--env", help="evaluate on this env instead of the trained one")
    evaluate.add_argument(
        "--explore",
        action="store_true",
        help="sample actions as in training instead of greedy ones",
    )
    evaluate.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the env resets and the policy (default 0: a checkpoint and its exported "
        "policy play the same episodes)",
    )
    evaluate.add_argument(
        "--video-dir", metavar="DIR", help="write a video of every episode here (needs moviepy)"
    )
    evaluate.add_argument("--json", action="store_true", help="print the results as one JSON line")

    export = commands.add_parser(
        "export",
        help="write a checkpoint's policy as a TensorFlow SavedModel (runs without Ray)",
        description="Write the acting policy of a checkpoint (encoder, RSSM posterior step, "
        "actor) as a TensorFlow SavedModel with the signatures initial_state, step (greedy) "
        "and step_sample; loading it needs only TensorFlow.",
    )
    export.add_argument("checkpoint", help="a checkpoint directory (checkpoint_NNNNNN)")
    export.add_argument("out_dir", help="the SavedModel directory to write")
    export.add_argument(
        "--no-jit",
        action="store_true",
        help="plain TensorFlow steps instead of XLA-compiled ones (the default follows the "
        "training config; XLA gives exactly the actions of `rllib evaluate`)",
    )
    export.add_argument(
        "--tflite",
        action="store_true",
        help="also write OUT_DIR/policy.tflite of the greedy step where TFLite's ops allow "
        "(implies --no-jit)",
    )


def export_command(args):
    config = load_checkpoint_config(args.checkpoint)
    jit = False if (args.no_jit or args.tflite) else None
    try:
        out = export_policy(
            args.checkpoint,
            args.out_dir,
            jit_compile=jit,
            env=config.env,
            env_config=config.env_config,
        )
    except ValueError as err:  # e.g. a policy of Dict observations
        raise CliError(f"rllib export {args.checkpoint}: {err}") from None
    size = saved_model_bytes(out)
    print(
        f"{out}: SavedModel of the {config.env} policy ({size / 1e6:.2f} MB). Load it with "
        f"tf.saved_model.load({out!r}); run it with rllib evaluate --saved-model {out}"
    )
    if args.tflite:
        path, reason = export_tflite(out, os.path.join(out, "policy.tflite"))
        if path is None:
            print(f"TFLite: the converter could not convert the step: {reason}", file=sys.stderr)
            return 1
        print(f"TFLite: {path} ({os.path.getsize(path) / 1e6:.2f} MB)")
    return 0


def evaluate_saved_model(path, episodes, env=None, explore=False, seed=None):
    """Run `episodes` episodes with a policy exported by `rllib export` (same result keys as
    :func:`evaluate_checkpoint`; with `seed`, the same env resets)."""
    if episodes < 1:
        raise CliError(f"--episodes {episodes}: give at least 1.")
    if not os.path.isfile(os.path.join(path, "saved_model.pb")):
        raise CliError(f"--saved-model {path}: no saved_model.pb; give a `rllib export` directory.")
    metadata = read_metadata(path)
    env = env or metadata.get("env")
    if env is None:
        raise CliError(f"--saved-model {path}: it records no env; give --env ENV.")
    config = DreamerV3Config().environment(env, env_config=metadata.get("env_config", {}))
    try:
        environment = make_env(config)
    except ValueError as err:
        raise CliError(f"--saved-model {path}: could not create the env {env!r}: {err}") from None
    try:
        returns, lengths = run_saved_model(
            path, environment, episodes, greedy=not explore, seed=seed
        )
    finally:
        environment.close()
    return {
        "env": str(env),
        "episodes": episodes,
        "return_mean": float(np.mean(returns)),
        "return_min": float(np.min(returns)),
        "return_max": float(np.max(returns)),
        "length_mean": float(np.mean(lengths)),
    }


def evaluate_command(args):
    start = time.time()
    if args.saved_model:
        if args.checkpoint or args.video_dir:
            raise CliError(
                "--saved-model evaluates an exported policy: give no checkpoint and no --video-dir."
            )
        result = evaluate_saved_model(
            args.saved_model, args.episodes, env=args.env, explore=args.explore, seed=args.seed
        )
    elif args.checkpoint is None:
        raise CliError("rllib evaluate needs a checkpoint directory (or --saved-model DIR).")
    else:
        result = evaluate_checkpoint(
            args.checkpoint,
            args.episodes,
            env=args.env,
            explore=args.explore,
            seed=args.seed,
            video_dir=args.video_dir,
        )
    if args.json:
        print(json.dumps(result))
    else:
        mode = "sampled" if args.explore else "greedy"
        print(
            f"{result['episodes']} {mode} episodes of {result['env']} (seed {args.seed}): "
            "return mean "
            f"{fmt(result['return_mean'])}, min {fmt(result['return_min'])}, max "
            f"{fmt(result['return_max'])}; length mean {fmt(result['length_mean'])} "
            f"({time.time() - start:.0f} s)"
        )
    if args.video_dir:
        print(f"videos in {os.path.abspath(args.video_dir)}")
    return 0
