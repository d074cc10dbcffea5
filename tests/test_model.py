"""Networks and one update on the plain path (`fast_kernels=False`): shapes for every size,
initial values, learning signal, compilation. (The fast path against this one:
tests/test_kernels.py.)"""

import math
from types import SimpleNamespace

import numpy as np
import pytest
import tensorflow as tf
from helpers import normal, reference_critic_loss

from rllib_dreamerv3 import losses, random_ops
from rllib_dreamerv3.actor_critic import Actor
from rllib_dreamerv3.config import HYPERPARAMETERS
from rllib_dreamerv3.model import DreamerV3Model
from rllib_dreamerv3.model_sizes import MODEL_SIZES, get_model_size
from rllib_dreamerv3.networks import set_matmul_dtype
from rllib_dreamerv3.tf_rllib import make_adam
from rllib_dreamerv3.update import batch_signature, make_update_fn

B, T = 4, 8


@pytest.fixture(autouse=True)
def _global_seed():
    """Models draw their initial weights from TF's global seed: reset it, so that every test
    sees the same weights in any test order (`build` sets its own)."""
    tf.random.set_seed(0)


def _perturb(variables, seed, scale):
    """Add N(0, scale²) noise from numpy to `variables` (non-trivial heads)."""
    rng = np.random.default_rng(seed)
    for variable in variables:
        variable.assign_add(rng.normal(size=variable.shape).astype(np.float32) * scale)


# Two code paths through the model (XLA vs eager, a loop vs single steps) sum in different
# orders: a layer's sums of n ≲ 300 terms round ~sqrt(n)·eps ≈ 1e-6 of its outputs' scale
# apart, over ≲ 30 layers along a recurrence: ≲ 3e-5 of an array's largest entry, which
# entries that cancel to near 0 need as atol. Rtols stay per test.
SCALE_RTOL = 1e-4


def _assert_same_first_adam_step(weights, reference, max_lr):
    """Weights after one Adam step from the same start agree within rounding, but for rare
    entries. A first Adam step moves a weight by lr·g / (|g| + eps), about ±lr for any gradient
    above eps (1e-8 for the world model): where a gradient sums to within its rounding error
    (~1e-6 of its variable's scale, machine-dependent) of 0, the two steps may differ by up to
    2·lr. With a density ~1/scale of gradients near 0 that is ~1e-5 of the entries, about none
    of a nano model's 2e4 weights (none seen): up to 1 in 1000 may differ, by at most 2·lr."""
    a, b = (np.concatenate([np.ravel(w) for w in ws]) for ws in (weights, reference))
    off = ~np.isclose(a, b, rtol=1e-3, atol=1e-5)
    assert off.sum() <= a.size // 1000, (off.sum(), a.size, np.abs(a - b).max())
    assert np.all(np.abs(a - b)[off] <= 2 * max_lr + 1e-5), np.abs(a - b).max()


def _assert_close_in_scale(actual, desired, rtol, scale_rtol, err_msg=""):
    """`actual` within `rtol` of each entry of `desired`, and within `scale_rtol` of its largest:
    a gradient entry summing many terms that cancel to near 0 has the rounding error of its
    terms, whose size is that of the array's large entries, not its own."""
    desired = np.asarray(desired)
    np.testing.assert_allclose(
        actual, desired, rtol=rtol, atol=scale_rtol * np.abs(desired).max(), err_msg=err_msg
    )


def hparams(**overrides):
    values = {name: default for name, (default, _) in HYPERPARAMETERS.items()}
    values.update(
        gamma=1 - 1 / 333, horizon_H=5, batch_size_B=B, batch_length_T=T, fast_kernels=False
    )
    values.update(overrides)
    return SimpleNamespace(**values)


def make_batch(seed=0, obs_dim=3, num_actions=2, discrete=True):
    rng = np.random.default_rng(seed)
    if discrete:
        actions = np.eye(num_actions, dtype=np.float32)[rng.integers(0, num_actions, (B, T))]
    else:
        actions = rng.uniform(-1, 1, (B, T, num_actions)).astype(np.float32)
    is_first = np.zeros((B, T), bool)
    is_first[:, 0] = True
    is_first[1, 5] = True
    is_terminal = np.zeros((B, T), bool)
    is_terminal[1, 4] = True
    return {
        "obs": rng.normal(size=(B, T, obs_dim)).astype(np.float32),
        "actions": actions,
        "rewards": rng.normal(size=(B, T)).astype(np.float32),
        "is_first": is_first,
        "is_terminal": is_terminal,
    }


def build(size="nano", discrete=True, seed=0, obs_dim=3, num_actions=2):
    tf.random.set_seed(seed)
    model = DreamerV3Model(obs_dim, num_actions, discrete, get_model_size(size))
    optimizers = {
        "world_model": make_adam(1e-3, 1e-8, model.world_model.trainable_variables),
        "actor": make_adam(3e-4, 1e-5, model.actor.trainable_variables),
        "critic": make_adam(3e-4, 1e-5, model.critic.trainable_variables),
    }
    return model, optimizers


@pytest.mark.parametrize("size", list(MODEL_SIZES))
def test_output_shapes_for_every_size(size):
    dims = get_model_size(size)
    model = DreamerV3Model(obs_shape=(5,), action_dim=3, discrete=True, size=dims)
    n = 2
    carry = model.initial_carry(n)
    action, (h, z, prev) = model.policy_step(
        carry, tf.zeros([n, 5]), tf.constant([True, False]), tf.constant([1, 2]), explore=True
    )
    stoch = dims.num_categoricals * dims.num_classes
    assert action.shape == (n, 3) and prev.shape == (n, 3)
    assert h.shape == (n, dims.gru_units) and z.shape == (n, stoch)
    # One-hot actions, and z one-hot per categorical: straight-through `sample + p - sg(p)`,
    # the one within an ulp of 1 (2**-23 above it: more than the default rtol), the rest 0.
    np.testing.assert_allclose(tf.reduce_sum(action, -1), 1.0, rtol=1e-6)
    np.testing.assert_allclose(
        tf.reduce_sum(tf.reshape(z, [n, dims.num_categoricals, -1]), -1), 1.0, rtol=1e-6
    )
    feat = tf.concat([h, z], -1)
    wm = model.world_model
    assert wm.decoder(feat).shape == (n, 5)
    assert wm.reward_head(feat).shape == (n, 255)  # one logit per bin
    assert model.critic.mlp(feat).shape == (n, 255)
    assert wm.continue_logit(feat).shape == (n,)
    assert model.critic(feat).shape == (n, 255)


def test_hidden_layers_follow_the_size_table():
    dims = get_model_size("S")
    model = DreamerV3Model(obs_shape=(4,), action_dim=2, discrete=True, size=dims)
    assert len(model.actor.mlp.blocks) == dims.mlp_layers == 2
    assert model.actor.mlp.blocks[0].dense.w.shape[1] == 512
    assert model.actor.mlp.blocks[0].dense.b is None  # hidden Dense layers have no bias
    assert model.actor.mlp.out.b is not None  # output layers do
    assert model.world_model.gru.dense.w.shape == (512 + 512, 3 * 512)


def test_reward_and_critic_start_at_zero():
    model, _ = build()
    feat = normal([7, model.world_model.feat_dim], seed=0)
    # Zero logits: sum(bins) / 255, 0 but for the float32 bins' asymmetry (-7e-8) and the
    # rounding of a sum of 255 bins |b| ≤ 20 in any order, 255·eps·20 / 255 ≈ 1.2e-6.
    np.testing.assert_allclose(model.world_model.reward(feat), np.zeros(7), atol=2e-6)
    np.testing.assert_allclose(model.critic.value(feat), np.zeros(7), atol=2e-6)


def test_continuous_actor_bounds_and_std():
    model = DreamerV3Model(3, 2, False, get_model_size("nano"))
    feat = normal([100, model.world_model.feat_dim], seed=0, scale=10.0)
    dist = model.actor.dist(feat)
    mean, std = dist.mean(), dist.stddev()
    assert np.all(np.abs(mean) <= 1.0)
    assert np.all((std >= 0.1) & (std <= 1.0))
    action = model.actor.sample(dist, tf.constant([0, 1]))
    assert np.all(np.abs(action) <= 1.0)


def test_actor_distributions_against_hand_computed_values():
    size = get_model_size("nano")
    # Continuous: tanh(0) = 0 mean, std (1 - 0.1) * sigmoid(-2 + 2) + 0.1 = 0.55 per dimension.
    actor = Actor(4, 2, False, size)
    dist = actor.dist_from_output(tf.constant([[0.0, 0.0, -2.0, -2.0]]))
    per_dim = -0.5 * (0.5 / 0.55) ** 2 - math.log(0.55) - 0.5 * math.log(2 * math.pi)
    np.testing.assert_allclose(dist.log_prob([[0.5, -0.5]]), [2 * per_dim], rtol=1e-6)
    entropy = 0.5 + 0.5 * math.log(2 * math.pi) + math.log(0.55)
    np.testing.assert_allclose(dist.entropy(), [2 * entropy], rtol=1e-6)
    np.testing.assert_allclose(dist.mode(), [[0.0, 0.0]])
    # Discrete: softmax [1/4, 3/4] mixed with 1% uniform: [0.2525, 0.7475].
    actor = Actor(4, 2, True, size)
    dist = actor.dist_from_output(tf.constant([[0.0, math.log(3.0)]]))
    probs = np.array([0.2525, 0.7475])
    np.testing.assert_allclose(dist.log_prob([[0.0, 1.0]]), [math.log(0.7475)], rtol=1e-6)
    np.testing.assert_allclose(dist.entropy(), [-np.sum(probs * np.log(probs))], rtol=1e-6)
    np.testing.assert_array_equal(dist.mode(), [[0.0, 1.0]])
    action = actor.sample(dist, tf.constant([0, 1]))  # one-hot, with the probs' gradient
    np.testing.assert_allclose(tf.reduce_sum(action, -1), [1.0], rtol=1e-6)


def test_reset_on_is_first_restores_initial_state():
    model, _ = build()
    h0, z0 = model.world_model.initial_state(2)
    h, z = normal(h0.shape, seed=0), normal(z0.shape, seed=1)
    prev = tf.ones([2, 2])
    h_r, z_r, a_r = model.world_model.reset(h, z, prev, tf.constant([True, False]))
    np.testing.assert_allclose(h_r[0], h0[0])
    np.testing.assert_allclose(z_r[0], z0[0])
    np.testing.assert_allclose(h_r[1], h[1])
    np.testing.assert_allclose(a_r, [[0, 0], [1, 1]])


def test_observe_matches_a_loop_of_observe_steps():
    """`observe` (a `tf.scan` of the posterior steps, the prior on all states after it) gives
    the same states and logits as the one-step path the policy uses, with resets
    mid-sequence."""
    model, _ = build("micro")
    wm = model.world_model
    batch = make_batch(3)
    embed = wm.encoder(losses.time_major(batch["obs"]))
    actions = losses.time_major(batch["actions"])
    prev_actions = tf.concat([tf.zeros_like(actions[:1]), actions[:-1]], 0)
    is_first = losses.time_major(batch["is_first"])
    seeds = random_ops.split(tf.constant([5, 6]), T)
    h, z, post, prior = wm.observe(embed, prev_actions, is_first, seeds)
    assert h.shape == (T, B, 32) and z.shape == (T, B, 64) and post.shape == (T, B, 8, 8)
    h_t, z_t = wm.initial_state(B)
    for t in range(T):
        h_t, z_t, post_t = wm.observe_step(
            h_t, z_t, prev_actions[t], embed[t], is_first[t], seeds[t]
        )
        prior_t = wm.prior_logits(h_t)
        for ours, ref in [(h[t], h_t), (z[t], z_t), (post[t], post_t), (prior[t], prior_t)]:
            _assert_close_in_scale(ours, ref, 1e-4, SCALE_RTOL)


@pytest.mark.parametrize("discrete", [True, False])
def test_critic_loss_and_returns_match_a_direct_evaluation(discrete):
    """The critic loss and the returns (heads run on the imagined states only) equal the
    paper's terms computed one by one on all states: values, and the critic loss's gradient
    w.r.t. the critic's variables."""
    model, _ = build("nano", discrete=discrete)
    wm, critic = model.world_model, model.critic
    _perturb(
        [
            wm.reward_head.out.w,
            *wm.continue_head.variables,
            critic.mlp.out.w,
            *model.critic_ema.variables,
        ],
        seed=7,
        scale=0.3,
    )  # non-trivial heads
    n, hp = 6, hparams()
    h = normal([n, wm.size.gru_units], seed=8)
    z = wm.sample_z(normal([n, *wm.stoch_shape], seed=9), tf.constant([1, 2]))
    imagined = losses.imagine(
        model, h, z, hp.horizon_H, random_ops.split(tf.constant([3, 4]), 2 * hp.horizon_H)
    )
    start_cont = tf.constant([1.0, 1.0, 0.0, 1.0, 1.0, 1.0])
    with tf.GradientTape(persistent=True) as tape:
        _, critic_loss, _, metrics = losses.actor_critic_losses(model, imagined, start_cont, hp)
        assert imagined.feat.shape == (hp.horizon_H + 1, 6, wm.size.gru_units + wm.stoch_dim)
        reference, returns = reference_critic_loss(model, imagined, start_cont, hp)
    assert abs(float(tf.reduce_mean(returns))) > 1e-3  # the reward head is not zero
    # Rewards and values: two-hot means over 255 bins, on batches of other sizes (other sum
    # orders): ~sqrt(255)·eps·20·p_max ≲ 1e-6 apart in symlog space, over ≤ 5 steps.
    np.testing.assert_allclose(
        metrics["imagined_return_mean"], tf.reduce_mean(returns), rtol=1e-5, atol=2e-6
    )
    # Cross-entropies ≈ 5.5: the same log-softmaxes on batches of other sizes, ≤ 2·255·eps ≈
    # 3e-5 apart.
    np.testing.assert_allclose(critic_loss, reference, rtol=1e-5)
    ours = tape.gradient(critic_loss, critic.trainable_variables)
    theirs = tape.gradient(reference, critic.trainable_variables)
    assert max(float(tf.reduce_max(tf.abs(g))) for g in theirs) > 1e-3
    for a, b, variable in zip(ours, theirs, critic.trainable_variables):
        # The softmaxes differ by the log-normalisers' 3e-5, so do the gradients' terms.
        _assert_close_in_scale(a, b, 1e-4, SCALE_RTOL, err_msg=variable.name)


def test_the_actor_acts_on_imagined_states_without_their_gradient():
    """DreamerV3's `policy(sg(state))`: with continuous actions the actor's output at a step
    depends on its variables directly only, not through the earlier actions that led to the
    state; the states themselves still carry the actions' gradient (returns backpropagate
    through the dynamics)."""
    model, _ = build("nano", discrete=False)
    wm, actor = model.world_model, model.actor
    h = normal([4, wm.size.gru_units], seed=8)
    z = wm.sample_z(normal([4, *wm.stoch_shape], seed=9), tf.constant([1, 2]))
    with tf.GradientTape(persistent=True) as tape:
        imagined = losses.imagine(model, h, z, 3, random_ops.split(tf.constant([3, 4]), 6))
        mean_at_2 = imagined.dist.mean()[2]
        feat_2 = tf.stop_gradient(tf.concat([imagined.h[2], imagined.z[2]], -1))
        direct = actor.dist(feat_2).mean()
        state_2 = tf.reduce_sum(tf.sin(imagined.h[2]))
    # The same layers on the same values (batched differently): a few roundings of outputs
    # ≲ 1 apart.
    np.testing.assert_allclose(mean_at_2, direct, rtol=1e-5, atol=1e-6)
    for a, b in zip(
        tape.gradient(mean_at_2, actor.trainable_variables),
        tape.gradient(direct, actor.trainable_variables),
    ):
        _assert_close_in_scale(a, b, 1e-4, SCALE_RTOL)
    through_dynamics = tape.gradient(state_2, actor.trainable_variables)
    assert max(float(tf.reduce_max(tf.abs(g))) for g in through_dynamics) > 1e-6


def test_world_model_loss_terms_at_init():
    model, _ = build()
    _, metrics, (h, z) = losses.world_model_loss(
        model, make_batch(), random_ops.split(tf.constant([0, 0]), T), hparams()
    )
    # Zero-initialised reward head: uniform over 255 bins (a sum of 255 ones is exact; log and
    # the mean over the batch round a few times).
    np.testing.assert_allclose(metrics["L_reward"], np.log(255.0), rtol=1e-5)
    # Free bits: both KL losses are at least 1 nat.
    assert metrics["L_dyn"] >= 1.0 and metrics["L_rep"] >= 1.0
    assert h.shape == (T, B, 16) and z.shape == (T, B, 16)


def test_other_bin_counts_give_heads_of_that_many_bins():
    """41 bins: the heads have 41 logits; the zero-initialised reward head is uniform over them
    (log 41), and one compiled update runs."""
    model = DreamerV3Model(3, 2, True, get_model_size("nano"), num_bins=41)
    feat = normal([5, model.world_model.feat_dim], seed=0)
    assert model.critic(feat).shape == (5, 41) and model.critic.mlp(feat).shape == (5, 41)
    assert model.world_model.reward_head(feat).shape == (5, 41)
    _, metrics, _ = losses.world_model_loss(
        model, make_batch(), random_ops.split(tf.constant([0, 0]), T), hparams()
    )
    np.testing.assert_allclose(metrics["L_reward"], np.log(41.0), rtol=1e-5)
    optimizers = {
        name: make_adam(1e-3, 1e-8, part.trainable_variables)
        for name, part in [
            ("world_model", model.world_model),
            ("actor", model.actor),
            ("critic", model.critic),
        ]
    }
    update = make_update_fn(
        model, optimizers, hparams(), batch_signature((3,), tf.float32, 2, B, T)
    )
    metrics = update(make_batch(), tf.constant([0, 1]))
    assert all(np.isfinite(value.numpy()).all() for value in metrics.values())


def test_updates_on_a_fixed_batch_lower_the_world_model_loss():
    model, optimizers = build()
    sig = batch_signature((3,), tf.float32, 2, B, T)
    update = make_update_fn(model, optimizers, hparams(), sig)
    batch = make_batch()
    first = float(update(batch, tf.constant([0, 0]))["L_world_model"])
    for i in range(60):
        last = float(update(batch, tf.constant([0, i]))["L_world_model"])
    assert last < 0.8 * first, (first, last)
    assert update.experimental_get_tracing_count() == 1


@pytest.mark.parametrize("discrete", [True, False])
def test_compiled_update_matches_eager(discrete):
    """One XLA-compiled update equals the same update run eagerly, weights included."""
    results = []
    for jit in (True, None):
        model, optimizers = build(discrete=discrete, seed=3)
        sig = batch_signature((3,), tf.float32, 2, B, T)
        fn = make_update_fn(model, optimizers, hparams(), sig, jit_compile=bool(jit))
        update = fn if jit else fn.python_function
        metrics = update(make_batch(discrete=discrete), tf.constant([5, 7]))
        results.append((metrics, [v.numpy() for v in model.variables]))
    (m_jit, w_jit), (m_eager, w_eager) = results
    for key in m_jit:  # losses and statistics: ~1e-6 relative apart, well inside
        np.testing.assert_allclose(m_jit[key], m_eager[key], rtol=2e-3, atol=2e-4, err_msg=key)
    _assert_same_first_adam_step(w_jit, w_eager, max_lr=1e-3)


def test_critic_ema_moves_towards_the_critic():
    model, _ = build()
    for var in model.critic.variables:
        var.assign(var + 1.0)
    before = [v.numpy() for v in model.critic_ema.variables]
    model.update_critic_ema(0.02)
    for b, slow, fast in zip(before, model.critic_ema.variables, model.critic.variables):
        # 3 roundings of values ≲ 2; entries near 0 (0.98·b ≈ -0.02·(b + 1)) need the atol.
        np.testing.assert_allclose(slow, 0.98 * b + 0.02 * fast.numpy(), rtol=1e-6, atol=1e-6)


def test_actor_loss_only_updates_actor_and_critic_only_critic():
    model, optimizers = build()
    sig = batch_signature((3,), tf.float32, 2, B, T)
    update = make_update_fn(model, optimizers, hparams(world_model_lr=0.0), sig)
    actor_before = [v.numpy() for v in model.actor.variables]
    critic_before = [v.numpy() for v in model.critic.variables]
    metrics = update(make_batch(), tf.constant([1, 1]))
    assert np.isfinite(float(metrics["L_actor"])) and np.isfinite(float(metrics["L_critic"]))
    assert any(not np.allclose(a, v) for a, v in zip(actor_before, model.actor.variables))
    assert any(not np.allclose(c, v) for c, v in zip(critic_before, model.critic.variables))


def image_batch(seed=0, num_actions=2):
    batch = make_batch(seed, num_actions=num_actions)
    rng = np.random.default_rng(seed)
    batch["obs"] = rng.integers(0, 256, (B, T, 16, 16, 3), dtype=np.uint8)
    return batch


def test_compiled_update_matches_eager_on_images():
    """The CNN path too: one compiled update equals the eager one (16x16 frames keep it fast)."""
    results = []
    for jit in (True, False):
        tf.random.set_seed(4)
        model = DreamerV3Model((16, 16, 3), 2, True, get_model_size("nano"))
        optimizers = {
            name: make_adam(3e-4, 1e-5, getattr(model, name).trainable_variables)
            for name in ("world_model", "actor", "critic")
        }
        sig = batch_signature((16, 16, 3), tf.uint8, 2, B, T)
        fn = make_update_fn(model, optimizers, hparams(), sig, jit_compile=jit)
        update = fn if jit else fn.python_function
        metrics = update(image_batch(), tf.constant([5, 7]))
        results.append((metrics, [v.numpy() for v in model.variables]))
    (m_jit, w_jit), (m_eager, w_eager) = results
    assert float(m_jit["L_decoder"]) > 0
    for key in m_jit:  # losses and statistics: ~1e-6 relative apart, well inside
        np.testing.assert_allclose(m_jit[key], m_eager[key], rtol=2e-3, atol=2e-4, err_msg=key)
    _assert_same_first_adam_step(w_jit, w_eager, max_lr=1e-3)


def test_bfloat16_matmuls_stay_close_to_float32():
    losses_by_dtype = {}
    for dtype in (tf.float32, tf.bfloat16):
        model, _ = build(seed=5)
        set_matmul_dtype(model, dtype)
        loss, metrics, (h, _) = losses.world_model_loss(
            model, make_batch(), random_ops.split(tf.constant([0, 0]), T), hparams()
        )
        assert h.dtype == tf.float32  # states, norms and losses stay float32
        losses_by_dtype[dtype] = float(metrics["L_decoder"])
    f32, bf16 = losses_by_dtype[tf.float32], losses_by_dtype[tf.bfloat16]
    assert f32 != bf16  # the matmuls really ran in bfloat16 ...
    assert bf16 == pytest.approx(f32, rel=0.05)  # ... with bfloat16's ~3 significant digits
