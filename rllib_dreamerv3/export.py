"""Export a trained DreamerV3 policy as a TensorFlow SavedModel that runs without Ray.

The SavedModel holds the acting part of the agent (encoder, RSSM posterior step, actor) and
three serving signatures, batched over envs:

- `initial_state(batch_size)` -> `{h, z, prev_action}`: the learned initial state;
- `step(obs, h, z, prev_action, is_first)` -> `{action, h, z, prev_action}`: greedy (the
  posterior's and the actor's modes), as `rllib evaluate` acts;
- `step_sample(obs, h, z, prev_action, is_first, seed)` -> the same with sampled latents and
  actions, reproducible from the `[2]` int32 `seed` (use a new one per step).

`action` is in the env's action space (discrete: the index; continuous: rescaled to the Box
bounds); `prev_action` is the model's encoding of it, to pass back with `h` and `z`. `is_first`
(`[B]` bool) marks envs that were just reset: their state restarts from the initial one, so
`initial_state` is only needed for the first call. Image observations go in as uint8
`[B, 64, 64, C]`, vector observations as float32 `[B, n]`, Dict observations as a dict of
these keyed by entry (nested keys as `"a/b"`, Discrete entries one-hot); a policy of Dict
observations is called from Python only (`policy.step(obs={...}, ...)`): it has no serving
signatures, which take flat tensors (TF Serving, TFLite).

Loading needs only TensorFlow::

    policy = tf.saved_model.load("exported/")
    state = policy.initial_state(tf.constant(1))
    out = policy.step(obs=obs[None], is_first=tf.constant([True]), **state)
    action, state = out.pop("action"), out
"""

import json
import os

import numpy as np
import tensorflow as tf
from ray.rllib.core import (
    COMPONENT_LEARNER,
    COMPONENT_LEARNER_GROUP,
    COMPONENT_RL_MODULE,
    DEFAULT_MODULE_ID,
)

from rllib_dreamerv3.spaces import ObsFormat, env_action

METADATA_FILE = "rllib_dreamerv3.json"  # beside saved_model.pb: the env it was trained on
MODULE_PATH = os.path.join(
    COMPONENT_LEARNER_GROUP, COMPONENT_LEARNER, COMPONENT_RL_MODULE, DEFAULT_MODULE_ID
)


class ServedPolicy(tf.Module):
    """The acting policy of a `DreamerV3RLModule` as a `tf.Module` with serving functions.

    It tracks only the networks acting reads (encoder, RSSM, actor), so the SavedModel holds
    what acting needs.
    """

    def __init__(self, module, jit_compile=None):
        super().__init__(name="dreamerv3_policy")
        model = module.model
        wm = model.world_model
        # What acting reads, and nothing else (not the decoder, reward and continue heads or the
        # critics): the SavedModel stores the variables of the tracked modules.
        self.acting = [
            wm.encoder,
            wm.gru_input,
            wm.gru,
            wm.prior_net,
            wm.posterior_net,
            wm.h0_raw,
            model.actor,
        ]
        space = module.action_space
        if jit_compile is None:
            jit_compile = bool(module.model_config.get("jit_compile", True))
        obs_format = module.obs_format
        self.dict_obs = obs_format.is_dict
        if self.dict_obs:  # a dict of `[batch, ...]` tensors, keyed as `obs_format`'s entries
            obs = {
                key: tf.TensorSpec([None, *shape], obs_format.dtype()[key])
                for key, shape in obs_format.shape().items()
            }
        else:
            obs = tf.TensorSpec([None, *obs_format.shape()], obs_format.dtype(), "obs")
        state = [
            tf.TensorSpec([None, wm.size.gru_units], tf.float32, "h"),
            tf.TensorSpec([None, wm.stoch_dim], tf.float32, "z"),
            tf.TensorSpec([None, model.action_dim], tf.float32, "prev_action"),
        ]
        is_first = tf.TensorSpec([None], tf.bool, "is_first")
        seed = tf.TensorSpec([2], tf.int32, "seed")

        def act(obs, h, z, prev_action, is_first, seed, explore):
            action, (h, z, _) = model.policy_step((h, z, prev_action), obs, is_first, seed, explore)
            return {"action": env_action(action, space), "h": h, "z": z, "prev_action": action}

        def step(obs, h, z, prev_action, is_first):
            return act(obs, h, z, prev_action, is_first, tf.zeros([2], tf.int32), False)

        def step_sample(obs, h, z, prev_action, is_first, seed):
            return act(obs, h, z, prev_action, is_first, seed, True)

        def initial_state(batch_size):
            h, z, prev_action = model.initial_carry(batch_size)
            return {"h": h, "z": z, "prev_action": prev_action}

        self.step = tf.function(
            step, input_signature=[obs, *state, is_first], jit_compile=jit_compile
        )
        self.step_sample = tf.function(
            step_sample, input_signature=[obs, *state, is_first, seed], jit_compile=jit_compile
        )
        self.initial_state = tf.function(
            initial_state, input_signature=[tf.TensorSpec([], tf.int32, "batch_size")]
        )

    def signatures(self):
        """The serving signatures, by name (None for Dict observations: a signature takes flat
        tensors, so TF Serving and TFLite need Box or Discrete observations)."""
        if self.dict_obs:
            return None
        return {
            "serving_default": self.step.get_concrete_function(),
            "step": self.step.get_concrete_function(),
            "step_sample": self.step_sample.get_concrete_function(),
            "initial_state": self.initial_state.get_concrete_function(),
        }


def load_module(algo_or_path):
    """The `DreamerV3RLModule` of an Algorithm, or of an Algorithm checkpoint directory (only
    the module is restored, through RLlib's `Checkpointable.from_checkpoint`)."""
    if not isinstance(algo_or_path, str | os.PathLike):
        return algo_or_path.get_module()
    from rllib_dreamerv3.rl_module import DreamerV3RLModule

    path = os.fspath(algo_or_path)
    module_path = os.path.join(path, MODULE_PATH)
    if not os.path.isdir(module_path):
        raise FileNotFoundError(
            f"{path}: not a DreamerV3 Algorithm checkpoint (no {MODULE_PATH}). Give the "
            "checkpoint_NNNNNN directory of a run, or the path of `algo.save_to_path()`."
        )
    return DreamerV3RLModule.from_checkpoint(os.path.abspath(module_path))


def export_policy(algo_or_path, out_dir, jit_compile=None, env=None, env_config=None):
    """Write the acting policy of `algo_or_path` (a `DreamerV3` Algorithm, or the path of one
    of its checkpoints) to `out_dir` as a SavedModel (see the module doc). `jit_compile`:
    compile the step with XLA (default: as the module was trained; XLA gives the same actions
    as the EnvRunners' compiled policy, plain TF runs everywhere, e.g. for TFLite).

    `METADATA_FILE` beside the model records the env (`env`, `env_config`; an Algorithm's own
    by default) for `rllib evaluate --saved-model`. Returns `out_dir`.
    """
    module = load_module(algo_or_path)
    config = getattr(algo_or_path, "config", None)
    if env is None and config is not None:
        env, env_config = config.env, config.env_config
    policy = ServedPolicy(module, jit_compile=jit_compile)
    out_dir = os.fspath(out_dir)
    tf.saved_model.save(policy, out_dir, signatures=policy.signatures())
    metadata = {
        "env": env if isinstance(env, str) else None,
        "env_config": _json_safe(dict(env_config or {})),
        "observation_space": repr(module.observation_space),
        "action_space": repr(module.action_space),
    }
    with open(os.path.join(out_dir, METADATA_FILE), "w") as f:
        json.dump(metadata, f, indent=1)
    return out_dir


def saved_model_bytes(saved_model_dir):
    """The size of an exported policy on disk, in bytes."""
    return sum(
        os.path.getsize(os.path.join(root, name))
        for root, _, names in os.walk(os.fspath(saved_model_dir))
        for name in names
    )


def _json_safe(mapping):
    return {k: v for k, v in mapping.items() if isinstance(v, str | int | float | bool | None)}


def read_metadata(saved_model_dir):
    """The `METADATA_FILE` of an exported policy (`{}` if there is none)."""
    path = os.path.join(os.fspath(saved_model_dir), METADATA_FILE)
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def export_tflite(saved_model_dir, out_file):
    """Convert the exported `step` signature to a TFLite model at `out_file`; returns
    `(out_file, None)`, or `(None, reason)` when the converter cannot (the ops it names)."""
    if read_metadata(saved_model_dir).get("observation_space", "").startswith("Dict("):
        return None, "the policy takes Dict observations; TFLite models take flat tensors"
    converter = tf.lite.TFLiteConverter.from_saved_model(
        os.fspath(saved_model_dir), signature_keys=["step"]
    )
    try:
        model = converter.convert()
    except Exception as err:  # noqa: BLE001 - the converter raises many kinds; report them
        return None, " ".join(str(err).split())[:1000]
    with open(out_file, "wb") as f:
        f.write(model)
    return out_file, None


def run_saved_model(saved_model_dir, env, episodes, greedy=True, seed=None):
    """Play `episodes` episodes of `env` (a gymnasium env) with an exported policy; returns
    the episode returns and lengths (one env, batch 1)."""
    policy = tf.saved_model.load(os.fspath(saved_model_dir))
    obs_format = ObsFormat(env.observation_space)  # e.g. Discrete observations as one-hot
    rng = np.random.default_rng(seed)
    returns, lengths = [], []
    state = dict(policy.initial_state(tf.constant(1)))
    for _ in range(episodes):
        obs, _ = env.reset(seed=None if seed is None else int(rng.integers(2**31)))
        is_first, done, total, length = True, False, 0.0, 0
        while not done:
            obs = obs_format.map(lambda x: tf.convert_to_tensor(x[None]), obs_format.convert(obs))
            inputs = {"obs": obs, **state}
            inputs["is_first"] = tf.constant([is_first])
            if greedy:
                out = policy.step(**inputs)
            else:
                seed_pair = rng.integers(2**31, size=2).astype(np.int32)
                out = policy.step_sample(**inputs, seed=tf.constant(seed_pair))
            action = out.pop("action").numpy()[0]
            state, is_first = out, False
            obs, reward, terminated, truncated, _ = env.step(action)
            total, length = total + float(reward), length + 1
            done = terminated or truncated
        returns.append(total)
        lengths.append(length)
    return returns, lengths
