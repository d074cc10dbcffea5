"""Tests of the TF2 layer for RLlib 2.60 (`rllib_dreamerv3.tf_rllib`) on a toy regression.

The toy: `ToyModule` predicts `y = net(x) + 0.5 * head(x)` with two linear `tf.Module`s (`head`
is excluded from inference-only state), `ToyLearner` trains `net` and `head` with one Adam each
on an MSE loss, and `ToyConfig` is the smallest `AlgorithmConfig` that builds them for "tf2".
"""

import os

os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"

import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402

import gymnasium as gym  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import ray  # noqa: E402
import tensorflow as tf  # noqa: E402  (before ray.rllib, which would switch TF to v1 mode)
from ray.rllib.algorithms.algorithm_config import AlgorithmConfig  # noqa: E402
from ray.rllib.core import DEFAULT_MODULE_ID  # noqa: E402
from ray.rllib.core.rl_module.rl_module import RLModuleSpec  # noqa: E402
from ray.rllib.policy.sample_batch import MultiAgentBatch, SampleBatch  # noqa: E402
from ray.rllib.utils.metrics import NUM_ENV_STEPS_SAMPLED_LIFETIME  # noqa: E402

from rllib_dreamerv3.tf_rllib import (  # noqa: E402
    PINNED_RAY_VERSION,
    TfLearner,
    TfRLModule,
    apply_ray_patches,
    make_adam,
    to_numpy,
    to_tensor,
)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OBS_DIM = 3
TRUE_W = np.array([1.0, -2.0, 0.5])
TRUE_B = 0.3
SPACES = {
    DEFAULT_MODULE_ID: (
        gym.spaces.Box(-10.0, 10.0, (OBS_DIM,), np.float32),
        gym.spaces.Box(-10.0, 10.0, (1,), np.float32),
    )
}
MID = DEFAULT_MODULE_ID
NET_OPT = f"{MID}_net"  # full registration names: module_id + "_" + optimizer_name
HEAD_OPT = f"{MID}_head"


# --- the toy ------------------------------------------------------------------------------------
class Linear(tf.Module):
    def __init__(self, n_in, rng):
        super().__init__()
        self.w = tf.Variable(rng.normal(size=(n_in, 1)).astype(np.float32))
        self.b = tf.Variable(rng.normal(size=(1,)).astype(np.float32))

    def __call__(self, x):
        return (tf.matmul(x, self.w) + self.b)[:, 0]


class ToyModule(TfRLModule):
    inference_only_excluded = ("head",)

    def setup(self):
        rng = np.random.default_rng((self.model_config or {}).get("seed"))
        self.net = Linear(self.observation_space.shape[0], rng)
        self.head = Linear(self.observation_space.shape[0], rng)

    def _forward_inference(self, batch, **kwargs):
        return {"pred": self.net(batch["obs"])}

    _forward_exploration = _forward_inference

    def _forward_train(self, batch, **kwargs):
        return {"pred": self.net(batch["obs"]) + 0.5 * self.head(batch["obs"])}


class ToyLearner(TfLearner):
    def configure_optimizers_for_module(self, module_id, config=None):
        module = self.module[module_id]
        for name in ("net", "head"):
            params = list(getattr(module, name).trainable_variables)
            self.register_optimizer(
                module_id=module_id,
                optimizer_name=name,
                optimizer=make_adam(config.lr, 1e-8, params),
                params=params,
                lr_or_lr_schedule=config.lr,
            )

    def compute_loss_for_module(self, *, module_id, config, batch, fwd_out):
        return tf.reduce_mean(tf.square(fwd_out["pred"] - batch["y"]))


class ToyConfig(AlgorithmConfig):
    def __init__(self, algo_class=None):
        super().__init__(algo_class=algo_class)
        self.framework_str = "tf2"

    def get_default_learner_class(self):
        return ToyLearner

    def get_default_rl_module_spec(self):
        return RLModuleSpec(module_class=ToyModule)


def make_module(seed=None, inference_only=False):
    obs_space, act_space = SPACES[MID]
    return ToyModule(
        observation_space=obs_space,
        action_space=act_space,
        inference_only=inference_only,
        model_config={"seed": seed},
    )


def make_config(lr=0.05, grad_clip=None, seed=0):
    return ToyConfig().training(lr=lr, grad_clip=grad_clip).rl_module(model_config={"seed": seed})


def make_learner(**kwargs):
    return make_config(**kwargs).build_learner(spaces=SPACES)


def make_data(n=32, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, OBS_DIM))  # float64 on purpose: the learner converts to float32
    return {"obs": x, "y": x @ TRUE_W + TRUE_B}


def as_batch(data):
    n = len(data["y"])
    return MultiAgentBatch({MID: SampleBatch(dict(data))}, env_steps=n)


def update(learner, data):
    return learner.update(batch=as_batch(data), timesteps={NUM_ENV_STEPS_SAMPLED_LIFETIME: 0})


def value(stat):
    """A float from a (reduced) metrics leaf: a Stats object or a plain number."""
    return float(stat.peek() if hasattr(stat, "peek") else stat)


def weights(learner):
    return learner.module[MID].get_state()


def mse_and_grads(state, data):
    """The toy's MSE and its gradients keyed by state path, by hand on copies of `state`."""
    v = {k: tf.Variable(val) for k, val in state.items()}
    x = tf.constant(data["obs"], tf.float32)
    y = tf.constant(data["y"], tf.float32)
    with tf.GradientTape() as tape:
        pred = ((x @ v["net/w"] + v["net/b"]) + 0.5 * (x @ v["head/w"] + v["head/b"]))[:, 0]
        loss = tf.reduce_mean(tf.square(pred - y))
    grads = dict(zip(v, tape.gradient(loss, list(v.values()))))
    return float(loss), {k: g.numpy() for k, g in grads.items()}


# --- 1. TfRLModule ------------------------------------------------------------------------------
def test_module_get_state_is_numpy_keyed_by_attribute_path():
    module = make_module(seed=0)
    state = module.get_state()
    assert sorted(state) == ["head/b", "head/w", "net/b", "net/w"]
    for name, array in state.items():
        assert isinstance(array, np.ndarray) and array.dtype == np.float32, name
    np.testing.assert_array_equal(state["net/w"], module.net.w.numpy())
    np.testing.assert_array_equal(state["head/b"], module.head.b.numpy())
    assert state["net/w"].shape == (OBS_DIM, 1)
    # The state is a copy: mutating it does not write through to the variables.
    state["net/w"][:] = 123.0
    assert not np.any(module.net.w.numpy() == 123.0)
    # Every trainable variable of the tf.Module attributes, in the same sorted order.
    assert [v.ref() for v in module.trainable_variables] == [
        v.ref() for v in (module.head.b, module.head.w, module.net.b, module.net.w)
    ]


def test_module_inference_only_state_omits_excluded_prefix():
    module = make_module(seed=0)
    full = module.get_state()
    inference = module.get_state(inference_only=True)
    assert sorted(inference) == ["net/b", "net/w"]
    for name in inference:
        np.testing.assert_array_equal(inference[name], full[name])
    # An inference-only state is a valid partial state for a full module (EnvRunner sync).
    other = make_module(seed=1)
    other.set_state(inference)
    np.testing.assert_array_equal(other.get_state()["net/w"], full["net/w"])
    assert not np.array_equal(other.get_state()["head/w"], full["head/w"])


def test_module_set_state_round_trip_makes_modules_equal():
    a, b = make_module(seed=1), make_module(seed=2)
    x = {"obs": tf.constant(make_data(8)["obs"], tf.float32)}
    assert not np.allclose(a.forward_train(x)["pred"], b.forward_train(x)["pred"])
    b.set_state(a.get_state())
    for name, array in a.get_state().items():
        np.testing.assert_array_equal(b.get_state()[name], array, err_msg=name)
    np.testing.assert_array_equal(a.forward_train(x)["pred"], b.forward_train(x)["pred"])


def test_module_set_state_unknown_key_raises_naming_it():
    module = make_module(seed=0)
    with pytest.raises(ValueError, match="net/unknown"):
        module.set_state({"net/unknown": np.zeros((1,), np.float32)})


def test_module_set_state_wrong_shape_raises_naming_it():
    module = make_module(seed=0)
    before = module.get_state()
    with pytest.raises(ValueError, match="net/w"):
        module.set_state({"net/w": np.zeros((OBS_DIM + 1, 1), np.float32)})
    np.testing.assert_array_equal(module.net.w.numpy(), before["net/w"])


# --- 2. TfLearner -------------------------------------------------------------------------------
def test_learner_updates_lower_the_loss_and_report_total_loss():
    learner = make_learner(lr=0.1)
    data = make_data()
    expected_first, _ = mse_and_grads(weights(learner), data)
    losses = []
    for _ in range(60):
        results = update(learner, data)
        losses.append(value(results[MID]["total_loss"]))
    # The reported loss is the one of the forward pass before the step.
    np.testing.assert_allclose(losses[0], expected_first, rtol=1e-5)
    assert np.all(np.isfinite(losses))
    assert losses[-1] < 0.5 * losses[0], losses
    # And the weights really moved towards the solution: fresh loss on the trained weights.
    final, _ = mse_and_grads(weights(learner), data)
    assert final < 0.5 * expected_first


def test_learner_grad_clip_logs_and_applies_per_optimizer_global_norm():
    clip = 0.5
    learner = make_learner(grad_clip=clip)
    data = make_data()
    _, grads = mse_and_grads(weights(learner), data)
    expected = {
        "net": float(np.sqrt(sum(np.sum(grads[k] ** 2) for k in ("net/b", "net/w")))),
        "head": float(np.sqrt(sum(np.sum(grads[k] ** 2) for k in ("head/b", "head/w")))),
    }
    assert min(expected.values()) > clip  # so that clipping is active for both optimizers

    results = update(learner, data)
    for name in ("net", "head"):
        key = f"gradients_{name}_global_norm"
        assert key in results[MID], sorted(results[MID])
        np.testing.assert_allclose(value(results[MID][key]), expected[name], rtol=1e-5)

    # The clipped gradients are what Adam saw: after one step its first moment is
    # (1 - beta_1) * g * clip / ||g||.  (`_momentums` is in the order of the registered params.)
    paths = {v.ref(): path for path, v in learner.module[MID].tf_variables().items()}
    for name, opt_name in (("net", NET_OPT), ("head", HEAD_OPT)):
        optimizer = learner._named_optimizers[opt_name]
        params = [learner._params[ref] for ref in learner._optimizer_parameters[optimizer]]
        assert sorted(paths[p.ref()] for p in params) == [f"{name}/b", f"{name}/w"]
        for param, m in zip(params, optimizer._momentums):
            g = grads[paths[param.ref()]]
            np.testing.assert_allclose(
                m.numpy(),
                (1 - optimizer.beta_1) * g * clip / expected[name],
                rtol=1e-4,
                atol=1e-7,
                err_msg=paths[param.ref()],
            )


def test_learner_without_grad_clip_logs_no_norm():
    results = update(make_learner(grad_clip=None), make_data())
    assert not any("global_norm" in k for k in results[MID]), sorted(results[MID])


def test_learner_learning_rate_get_set_round_trip_and_effect():
    learner = make_learner(lr=0.05)
    head_opt = learner._named_optimizers[HEAD_OPT]
    net_opt = learner._named_optimizers[NET_OPT]
    assert learner._get_optimizer_lr(head_opt) == pytest.approx(0.05)
    learner._set_optimizer_lr(head_opt, 0.0125)
    assert learner._get_optimizer_lr(head_opt) == pytest.approx(0.0125)
    assert learner._get_optimizer_lr(net_opt) == pytest.approx(0.05)

    # After the update function is traced, a new lr must still take effect (it is a variable).
    data = make_data()
    update(learner, data)
    learner._set_optimizer_lr(head_opt, 0.0)
    before = weights(learner)
    update(learner, data)
    after = weights(learner)
    for name in ("head/b", "head/w"):
        np.testing.assert_array_equal(after[name], before[name], err_msg=name)
    assert not np.allclose(after["net/w"], before["net/w"])
    # RLlib's fixed-lr scheduler sets the configured lr again after each update.
    assert learner._get_optimizer_lr(head_opt) == pytest.approx(0.05)


def test_learner_state_round_trip_restores_optimizer_moments():
    data = make_data()
    other_data = make_data(seed=7)
    a = make_learner(lr=0.05, seed=0)
    for _ in range(5):
        update(a, other_data)
    state = a.get_state()
    assert set(state["optimizer"]) == {NET_OPT, HEAD_OPT}
    assert all(
        isinstance(v, (np.ndarray, np.generic))  # numpy only: pickles into checkpoints
        for entry in state["optimizer"].values()
        for v in entry["variables"]
    )

    b = make_learner(lr=0.05, seed=3)
    b.set_state(state)
    for name, array in weights(a).items():
        np.testing.assert_array_equal(weights(b)[name], array, err_msg=name)
    assert int(b._named_optimizers[NET_OPT].iterations) == 5

    # Negative control: same weights, fresh Adam moments.
    c = make_learner(lr=0.05, seed=3)
    c.set_state({k: v for k, v in state.items() if k != "optimizer"})

    for learner in (a, b, c):
        update(learner, data)
    for name, array in weights(a).items():
        np.testing.assert_allclose(weights(b)[name], array, rtol=1e-6, atol=1e-7, err_msg=name)
    assert any(
        not np.allclose(weights(c)[name], array, rtol=1e-4, atol=1e-5)
        for name, array in weights(a).items()
    ), "control: moments should matter"


def test_learner_set_optimizer_state_rejects_mismatched_state():
    learner = make_learner()
    state = learner._get_optimizer_state()
    bad = {name: dict(entry) for name, entry in state.items()}
    bad[NET_OPT]["variables"] = bad[NET_OPT]["variables"][:-1]
    with pytest.raises(ValueError, match=NET_OPT):
        learner._set_optimizer_state(bad)
    with pytest.raises(ValueError, match="no_such_optimizer"):
        learner._set_optimizer_state({"no_such_optimizer": state[NET_OPT]})


# --- 3. tracing ---------------------------------------------------------------------------------
def test_compiled_update_traces_once_for_same_shapes():
    learner = make_learner()
    assert learner._compiled_update is None
    for seed in range(4):  # same shapes and dtypes, different values
        update(learner, make_data(seed=seed))
    assert learner._compiled_update.experimental_get_tracing_count() == 1


# --- 4. tensors ---------------------------------------------------------------------------------
def test_to_tensor_and_to_numpy():
    tree = {
        "f64": np.array([[1.5, -2.0]], np.float64),
        "nested": {
            "i64": np.array([1, 2, 3], np.int64),
            "list": [np.array([1], np.int32), np.array([0.5], np.float32)],
            "bool": np.array([True, False]),
        },
        "python": 3,
    }
    tensors = to_tensor(tree)
    assert isinstance(tensors["f64"], tf.Tensor) and tensors["f64"].dtype == tf.float32
    assert tensors["nested"]["i64"].dtype == tf.int64
    assert tensors["nested"]["list"][0].dtype == tf.int32
    assert tensors["nested"]["list"][1].dtype == tf.float32
    assert tensors["nested"]["bool"].dtype == tf.bool
    assert tensors["python"] == 3 and isinstance(tensors["python"], int)
    assert isinstance(tensors["nested"]["list"], list)

    arrays = to_numpy(tensors)
    assert isinstance(arrays["f64"], np.ndarray) and arrays["f64"].dtype == np.float32
    np.testing.assert_array_equal(arrays["f64"], tree["f64"])
    assert arrays["nested"]["i64"].dtype == np.int64
    np.testing.assert_array_equal(arrays["nested"]["i64"], tree["nested"]["i64"])
    np.testing.assert_array_equal(arrays["nested"]["list"][0], [1])
    np.testing.assert_array_equal(arrays["nested"]["bool"], [True, False])
    assert arrays["python"] == 3
    np.testing.assert_array_equal(to_numpy({"v": tf.Variable([2.0])})["v"], [2.0])


# --- 5. compat ----------------------------------------------------------------------------------
def _original_get_backend_config(patched):
    originals = [
        c.cell_contents
        for c in (patched.__closure__ or ())
        if callable(c.cell_contents)
        and getattr(c.cell_contents, "__name__", "") == "_get_backend_config"
    ]
    assert len(originals) == 1, "the patch no longer wraps Ray's `_get_backend_config`"
    return originals[0]


class _Tf2Learner:
    framework = "tf2"


def test_ray_is_the_pinned_version():
    assert ray.__version__ == PINNED_RAY_VERSION


def test_apply_ray_patches_makes_tf2_backend_config():
    from ray.rllib.core.learner import learner_group
    from ray.train.tensorflow import TensorflowConfig

    applied = [
        "learner_group._get_backend_config",
        "from_checkpoint restore checks",
        "experiment state saved after every trial checkpoint",
        "silenced notices",
    ]
    assert apply_ray_patches() == applied
    assert apply_ray_patches() == applied  # idempotent
    patched = learner_group._get_backend_config
    assert getattr(patched, "_rllib_dreamerv3_patch", False)
    # Ray Train's TF backend writes TF_CONFIG, from which several Learners form a TF cluster.
    assert type(patched(_Tf2Learner)) is TensorflowConfig
    assert type(patched(ToyLearner)) is TensorflowConfig
    # Applying it twice did not wrap the wrapper.
    assert not getattr(_original_get_backend_config(patched), "_rllib_dreamerv3_patch", False)


def test_patch_is_still_needed_ray_original_rejects_tf2():
    """Fails once Ray itself accepts TF learners (then the patch should go) or it stops applying."""
    from ray.rllib.core.learner import learner_group

    apply_ray_patches()
    original = _original_get_backend_config(learner_group._get_backend_config)
    assert original.__module__ == "ray.rllib.core.learner.learner_group"
    with pytest.raises(ValueError, match="must be 'torch'"):
        original(_Tf2Learner)


def test_apply_ray_patches_is_a_noop_on_other_ray_versions(monkeypatch):
    monkeypatch.setattr(ray, "__version__", "0.0.0")
    assert apply_ray_patches() == []


def test_ensure_tf2_behavior_undoes_disable_v2_behavior():
    script = textwrap.dedent("""
        import json
        import tensorflow as tf
        from tensorflow.python import tf2
        from rllib_dreamerv3.tf_rllib import ensure_tf2_behavior

        def probe():
            eq = tf.constant([1]) == tf.constant([1])
            return {"tf2": tf2.enabled(), "eager": tf.executing_eagerly(),
                    "eq_is_bool": isinstance(eq, bool), "eq_is_tensor": tf.is_tensor(eq)}

        tf.compat.v1.disable_v2_behavior()
        tf.compat.v1.enable_eager_execution()  # what RLlib does: eager, but TF1 semantics
        out = {"before": probe()}
        ensure_tf2_behavior()
        out["after"] = probe()
        ensure_tf2_behavior()  # idempotent
        out["again"] = probe()
        print("RESULT" + json.dumps(out))
    """)
    env = dict(
        os.environ,
        TF_CPP_MIN_LOG_LEVEL="2",
        PYTHONPATH=os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH")) if p),
    )
    proc = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT"))
    out = json.loads(line[len("RESULT") :])
    # Without the call, `==` is Python identity (TF1 semantics): the test is meaningful.
    assert out["before"] == {"tf2": False, "eager": True, "eq_is_bool": True, "eq_is_tensor": False}
    expected = {"tf2": True, "eager": True, "eq_is_bool": False, "eq_is_tensor": True}
    assert out["after"] == expected
    assert out["again"] == expected


# --- 6. a remote learner ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ray_cluster():
    # Ray workers cannot import this test module under pytest's module name (its rootdir is not
    # on their sys.path), so the toy classes travel by value; the package comes from REPO_ROOT.
    this_module = sys.modules[__name__]
    ray.cloudpickle.register_pickle_by_value(this_module)
    started = not ray.is_initialized()
    if started:
        pythonpath = os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH")) if p)
        ray.init(
            num_cpus=2,
            include_dashboard=False,
            log_to_driver=False,
            runtime_env={"env_vars": {"PYTHONPATH": pythonpath, "TF_CPP_MIN_LOG_LEVEL": "2"}},
        )
    try:
        yield
    finally:
        if started:
            ray.shutdown()
        ray.cloudpickle.unregister_pickle_by_value(this_module)


def test_remote_learner_group_updates(ray_cluster):
    from tensorflow.python import tf2

    assert "learner_group._get_backend_config" in apply_ray_patches()
    config = make_config(lr=0.05).learners(num_learners=1)
    data = make_data()
    local = config.copy().learners(num_learners=0).build_learner(spaces=SPACES)
    expected, _ = mse_and_grads(weights(local), data)  # same seed -> same initial weights

    group = config.build_learner_group(spaces=SPACES)
    try:
        assert group.is_remote
        results = group.update(batch=as_batch(data), timesteps={NUM_ENV_STEPS_SAMPLED_LIFETIME: 0})
        assert isinstance(results, list) and len(results) == 1
        loss = value(results[0][MID]["total_loss"])
        assert np.isfinite(loss)
        np.testing.assert_allclose(loss, expected, rtol=1e-5)
        # The actor runs TF with TF2 semantics, and its weights moved.
        remote = [
            r.get()
            for r in group.foreach_learner(
                lambda learner: (tf2.enabled(), learner.module[MID].get_state())
            )
        ]
        assert len(remote) == 1
        enabled, remote_weights = remote[0]
        assert enabled
        assert not np.allclose(remote_weights["net/w"], weights(local)["net/w"])
    finally:
        group.shutdown()


def test_module_set_state_with_a_bad_entry_changes_nothing():
    module = make_module(seed=1)
    before = module.get_state()
    bad = {"net/w": before["net/w"] + 1.0, "no/such/variable": np.zeros(1)}
    with pytest.raises(ValueError, match="no/such/variable"):
        module.set_state(bad)
    np.testing.assert_array_equal(module.get_state()["net/w"], before["net/w"])


def test_inference_only_exclusion_matches_whole_path_segments():
    module = make_module(seed=1)
    module.inference_only_excluded = ("ne",)  # a prefix of "net", but not a path segment
    assert "net/w" in module.get_state(inference_only=True)


def test_silenced_notices_match_what_ray_logs():
    """Fails when Ray renames the notices' `log_once` keys or messages (then the silencing stops
    applying): each key is the one RLlib 2.60's code passes, and is used up in this process."""
    import inspect
    import logging

    from ray.rllib.algorithms.algorithm_config import AlgorithmConfig
    from ray.rllib.core.rl_module import rl_module
    from ray.tune.utils import util as tune_util
    from ray.util import log_once

    from rllib_dreamerv3.tf_rllib.compat import RAY_NOTICES, RLLIB_NOTICE_KEYS

    apply_ray_patches()
    banner_key, deprecation_key = RLLIB_NOTICE_KEYS
    assert 'log_once(f"{self.algo_class.__name__}_on_new_api_stack")' in inspect.getsource(
        AlgorithmConfig._validate_new_api_stack_settings
    )
    assert banner_key == "DreamerV3_on_new_api_stack"
    assert f'old="{deprecation_key}"' in inspect.getsource(rl_module)
    for key in RLLIB_NOTICE_KEYS:
        assert not log_once(key), key  # already logged: RLlib stays quiet
    assert 'logger.warning("Install gputil for GPU system monitoring.")' in inspect.getsource(
        tune_util
    )
    from ray._private.authentication import authentication_token_setup

    assert authentication_token_setup.logger.name in RAY_NOTICES
    assert '"Token authentication is enabled for this Ray cluster. Set "' in inspect.getsource(
        authentication_token_setup
    )
    assert tune_util.logger.name in RAY_NOTICES
    from ray.tune.execution import tune_controller
    from ray.tune.trainable import trainable

    # Tune's slow-result warnings go through `warn_if_slow`, which logs on tune_util's logger.
    assert '"Processing trial results took {duration:.3f} s, "' in inspect.getsource(
        tune_controller
    )
    assert 'with warn_if_slow("process_trial_result")' in inspect.getsource(tune_controller)
    assert '"The `{name}` operation took {duration:.3f} s, "' in inspect.getsource(tune_util)
    assert '"Trainable.setup took {:.3f} seconds. If your "' in inspect.getsource(trainable)
    assert trainable.logger.name in RAY_NOTICES
    from ray.tune.execution import experiment_state

    assert experiment_state.logger.name in RAY_NOTICES
    assert '"Experiment state snapshotting has been triggered multiple "' in inspect.getsource(
        experiment_state
    )
    for name, prefixes in RAY_NOTICES.items():
        logger = logging.getLogger(name)
        for prefix in prefixes:
            record = logging.LogRecord(name, logging.WARNING, "", 0, prefix + " ...", None, None)
            assert not logger.filter(record), prefix
        other = logging.LogRecord(name, logging.WARNING, "", 0, "other", None, None)
        assert logger.filter(other)


def test_adam_adds_epsilon_to_the_bias_corrected_root_second_moment():
    # Kingma & Ba's Algorithm 1 (and optax): x -= lr * m̂ / (√v̂ + ε), m̂ = m / (1 − β₁ᵗ),
    # v̂ = v / (1 − β₂ᵗ). Gradients near ε (as the actor's and critic's often are) make the
    # difference to Keras' default, an ε added to the uncorrected √v, about 1e-4 per step here.
    lr, eps, beta_1, beta_2 = 1e-3, 1e-5, 0.9, 0.999
    start = np.array([0.5, -1.0])
    var = tf.Variable(start, dtype=tf.float32)
    optimizer = make_adam(lr, eps, [var])
    grads = np.array([[1e-6, -2e-6], [3e-6, 1e-6], [-2e-6, 5e-6], [4e-5, -1e-5]])
    x, m, v = start.copy(), np.zeros(2), np.zeros(2)
    for t, g in enumerate(grads, 1):
        optimizer.apply_gradients([(tf.constant(g, tf.float32), var)])
        m = beta_1 * m + (1 - beta_1) * g
        v = beta_2 * v + (1 - beta_2) * g**2
        m_hat, v_hat = m / (1 - beta_1**t), v / (1 - beta_2**t)
        x -= lr * m_hat / (np.sqrt(v_hat) + eps)
        # float32 rounding of values near 1: a few 1e-8 per step
        np.testing.assert_allclose(var.numpy(), x, rtol=0, atol=2e-7)
    assert np.abs(x - start).min() > 1e-4  # the steps are far larger than the tolerance
