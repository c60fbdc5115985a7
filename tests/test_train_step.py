"""GRPO train step: sharded == single device, micro-batch invariance, NaN/inf skip, schedules, recomputed log-probs."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from tlt_jax.config import OptimConfig
from tlt_jax.distributed import LogicalRules, MeshConfig, init_sharded, make_mesh, state_shardings
from tlt_jax.models import CausalLM, tiny_config
from tlt_jax.rl.logprobs import batch_logprobs, make_logprob_fn, split_rows, unsplit_rows
from tlt_jax.rl.train_step import LossConfig, init_train_state, lr_schedule, make_optimizer, make_train_step

B, T = 8, 16


def _model(cfg, mesh=None):
    make = lambda: CausalLM(cfg, rngs=nnx.Rngs(0))
    return make() if mesh is None else init_sharded(make, mesh)


def _batch(cfg, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(2, cfg.vocab_size, (B, T)).astype(np.int32)
    lens = rng.integers(T // 2, T + 1, B)
    prompt = rng.integers(2, T // 2, B)
    pos = np.arange(T)[None]
    attn = (pos < lens[:, None]).astype(np.int32)
    resp = ((pos >= prompt[:, None]) & (pos < lens[:, None])).astype(np.float32)
    old = (rng.normal(size=(B, T)) * 0.1 - 5.0).astype(np.float32) * resp
    return {
        "input_ids": ids,
        "attention_mask": attn,
        "response_mask": resp,
        "advantages": rng.normal(size=(B,)).astype(np.float32),
        "old_logp": old,
        "ref_logp": old - 0.05 * resp,
        "loss_scale": np.float32(1.0),
    }


def _run(model, batch, micro, *, mesh=None, optim=OptimConfig(lr=1e-2, warmup_steps=0), kl=0.1, steps=1):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = make_optimizer(optim, total_updates=10)
    state = init_train_state(params, tx)
    loss_cfg = LossConfig(micro_batch_size=micro, temperature=0.9, kl_coef=kl, clip_low=0.2, clip_high=0.28)
    step = make_train_step(graphdef, tx, loss_cfg, state, mesh=mesh)
    for _ in range(steps):
        state, metrics = step(state, rest, {k: jnp.asarray(v) for k, v in batch.items()})
    return state, jax.device_get(metrics)


def _flat(state):
    return {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(state.params)}


def _flat_init(cfg):
    params = nnx.state(_model(cfg), nnx.Param)
    return {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(params)}


def test_sharded_step_equals_single_device():
    cfg = tiny_config(num_heads=8, num_kv_heads=4)
    batch = _batch(cfg)
    # Adam's first steps are ~lr * sign(g): with a tiny eps, fp32 noise in near-zero gradients flips signs. A larger
    # eps keeps the update linear in small gradients, so the comparison tests the gradients themselves.
    optim = OptimConfig(lr=1e-2, eps=1e-3)
    single, m1 = _run(_model(cfg), batch, micro=4, optim=optim, steps=2)
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    sharded, m2 = _run(_model(cfg, mesh), batch, micro=4, mesh=mesh, optim=optim, steps=2)
    # Parameters really are split over fsdp and tensor (not replicated).
    specs = {str(x.sharding.spec) for x in jax.tree.leaves(sharded.params)}
    assert any("fsdp" in s for s in specs) and any("tensor" in s for s in specs), specs
    a, b = _flat(single), _flat(sharded)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_allclose(a[k], b[k], atol=1e-5, rtol=0, err_msg=k)
    np.testing.assert_allclose(m1["loss"], m2["loss"], atol=1e-5)
    np.testing.assert_allclose(m1["grad_norm"], m2["grad_norm"], rtol=1e-5)
    moved = max(np.abs(a[k] - _flat_init(cfg)[k]).max() for k in a)
    assert moved > 1e-3  # the step did change the parameters
    assert float(m2["finite"]) == 1.0 and int(sharded.skipped) == 0


def test_sharded_rematerialised_step_equals_single_device():
    """A rematerialised model on a data x fsdp x tensor mesh (gradients accumulated in place, the LM head's through
    its vocabulary-parallel split) takes the plain single-device model's steps."""
    cfg = tiny_config(num_heads=8, num_kv_heads=4)
    batch = _batch(cfg)
    optim = OptimConfig(lr=1e-2, eps=1e-3)
    single, m1 = _run(_model(cfg), batch, micro=4, optim=optim, steps=2)
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    model = _model(cfg, mesh)
    model.remat = True
    sharded, m2 = _run(model, batch, micro=4, mesh=mesh, optim=optim, steps=2)
    a, b = _flat(single), _flat(sharded)
    for k in a:
        np.testing.assert_allclose(a[k], b[k], atol=1e-5, rtol=0, err_msg=k)
    np.testing.assert_allclose(m1["grad_norm"], m2["grad_norm"], rtol=1e-5)
    assert max(np.abs(a[k] - _flat_init(cfg)[k]).max() for k in a) > 1e-3


def test_micro_batch_size_does_not_change_the_update():
    cfg = tiny_config()
    batch = _batch(cfg, seed=1)
    for mode in ("token-mean", "seq-mean-token-mean"):
        results = []
        for micro in (2, 8):
            graphdef, params, rest = nnx.split(_model(cfg), nnx.Param, ...)
            tx = make_optimizer(OptimConfig(lr=1e-2, eps=1e-3), 10)  # eps: see the sharded test
            state = init_train_state(params, tx)
            step = make_train_step(graphdef, tx, LossConfig(micro, agg_mode=mode, kl_coef=0.01), state)
            state, m = step(state, rest, {k: jnp.asarray(v) for k, v in batch.items()})
            results.append((_flat(state), float(m["loss"])))
        (a, la), (b, lb) = results
        assert abs(la - lb) < 1e-5, mode
        for k in a:
            np.testing.assert_allclose(a[k], b[k], atol=1e-6, err_msg=f"{mode} {k}")


def _pad_to(batch, t):
    """The same batch right-padded to length ``t`` (a longer length bucket)."""
    pad = lambda v: np.pad(v, [(0, 0), (0, t - v.shape[1])]) if np.ndim(v) == 2 else v
    return {k: pad(v) for k, v in batch.items()}


@pytest.mark.parametrize("mode", ["seq-mean-token-sum-norm", "token-mean"])
def test_loss_does_not_depend_on_the_length_bucket(mode):
    """Dr. GRPO's normaliser is a constant of the run (LossConfig.norm_len = rollout.max_new_tokens), so the same
    batch padded to a longer bucket gives the same loss and update."""
    cfg = tiny_config()
    batch = _batch(cfg, seed=2)
    results = []
    for b in (batch, _pad_to(batch, 2 * T)):
        graphdef, params, rest = nnx.split(_model(cfg), nnx.Param, ...)
        tx = make_optimizer(OptimConfig(lr=1e-2, eps=1e-3), 10)
        state = init_train_state(params, tx)
        loss_cfg = LossConfig(4, agg_mode=mode, norm_len=T, kl_coef=0.01)
        step = make_train_step(graphdef, tx, loss_cfg, state)
        state, m = step(state, rest, {k: jnp.asarray(v) for k, v in b.items()})
        results.append((_flat(state), float(m["loss"])))
    (a, la), (b, lb) = results
    assert la != 0.0 and abs(la - lb) < 1e-6, (mode, la, lb)
    for k in a:
        np.testing.assert_allclose(a[k], b[k], atol=1e-6, err_msg=f"{mode} {k}")


def test_nonfinite_loss_skips_update_and_counts():
    cfg = tiny_config()
    batch = dict(_batch(cfg), loss_scale=np.float32(np.nan))
    model = _model(cfg)
    before = {
        jax.tree_util.keystr(k): np.array(v)
        for k, v in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param))
    }
    state, m = _run(model, batch, micro=4)
    assert float(m["finite"]) == 0.0 and int(state.skipped) == 1 and int(state.step) == 1
    after = _flat(state)
    for k in before:
        np.testing.assert_array_equal(before[k], after[k])
    # Adam moments and the schedule count did not move either.
    assert all(np.all(np.asarray(x) == 0) for x in jax.tree.leaves(state.opt_state[1][0].mu))
    assert int(state.opt_state[1][0].count) == 0


def test_infinite_learning_rate_is_skipped():
    cfg = tiny_config()
    state, m = _run(_model(cfg), _batch(cfg), micro=8, optim=OptimConfig(lr=float("inf")), steps=2)
    assert int(state.skipped) == 2 and float(m["finite"]) == 0.0
    assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(state.params))


def test_update_moves_towards_positive_advantage():
    """On-policy (old = current log-probs): a step raises the log-prob of the positively rewarded sequences."""
    cfg = tiny_config()
    model = _model(cfg)
    batch = _batch(cfg, seed=3)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    lp = make_logprob_fn(graphdef, chunk_size=4, temperature=1.0)
    ids, attn = jnp.asarray(batch["input_ids"]), jnp.asarray(batch["attention_mask"])
    old = np.asarray(lp(params, rest, ids, attn))
    adv = np.where(np.arange(B) % 2 == 0, 1.0, -1.0).astype(np.float32)
    batch = dict(batch, old_logp=old, ref_logp=old, advantages=adv)
    tx = make_optimizer(OptimConfig(lr=3e-3, max_grad_norm=0.0), 10)
    state = init_train_state(params, tx)
    step = make_train_step(graphdef, tx, LossConfig(4, temperature=1.0, kl_coef=0.001), state)
    state, m = step(state, rest, {k: jnp.asarray(v) for k, v in batch.items()})
    assert abs(float(m["approx_kl"])) < 1e-6 and abs(float(m["clip_frac"])) < 1e-6
    assert abs(float(m["kl_loss"])) < 1e-6  # reference == policy before the update
    new = np.asarray(lp(state.params, rest, ids, attn))
    delta = ((new - old) * batch["response_mask"]).sum(1)
    assert np.all(delta[adv > 0] > 0) and np.all(delta[adv < 0] < 0), delta


def test_logprobs_match_unpadded_forward_and_chunking():
    cfg = tiny_config()
    model = _model(cfg)
    batch = _batch(cfg, seed=4)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    got = np.asarray(
        batch_logprobs(
            graphdef,
            params,
            rest,
            jnp.asarray(batch["input_ids"]),
            jnp.asarray(batch["attention_mask"]),
            chunk_size=2,
            temperature=0.7,
        )
    )
    # Causal attention: a row's right padding cannot change earlier positions, so one unmasked forward is the oracle.
    logits = model(jnp.asarray(batch["input_ids"])).logits / 0.7
    ref = np.asarray(jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1], -1), batch["input_ids"][:, 1:, None], -1))
    for b in range(B):
        n = int(batch["attention_mask"][b].sum())
        np.testing.assert_allclose(got[b, 1:n], ref[b, : n - 1, 0], atol=2e-5)
        assert got[b, 0] == 0 and np.all(got[b, n:] == 0)
    x = jnp.arange(24).reshape(8, 3)
    np.testing.assert_array_equal(unsplit_rows(split_rows(x, 4)), x)
    assert split_rows(x, 4)[0, :, 0].tolist() == [0, 6, 12, 18]  # strided chunks


@pytest.mark.parametrize(
    "sched,expect",
    [
        ("constant", [0.0, 0.5, 1.0, 1.0, 1.0]),
        ("linear", [0.0, 0.5, 1.0, 0.6, 0.2]),
        ("cosine", [0.0, 0.5, 1.0, 0.6, 0.2]),
    ],
)
def test_lr_schedules(sched, expect):
    cfg = OptimConfig(lr=1.0, warmup_steps=2, schedule=sched, final_lr_ratio=0.2)
    fn = lr_schedule(cfg, total_updates=4)
    got = [float(fn(i)) for i in range(5)]
    if sched == "cosine":
        mid = 0.2 + 0.8 * 0.5 * (1 + np.cos(np.pi * 0.5))
        expect = [0.0, 0.5, 1.0, mid, 0.2]
    np.testing.assert_allclose(got, expect, atol=1e-6)


def test_optimizer_clips_global_norm():
    tx = make_optimizer(OptimConfig(lr=1.0, max_grad_norm=0.5, weight_decay=0.0, b1=0.0, b2=0.0, eps=1e-12), 10)
    params = {"w": jnp.zeros(4)}
    upd, _ = tx.update({"w": jnp.array([3.0, 4.0, 0.0, 0.0])}, tx.init(params), params)
    # b1 = b2 = 0 makes Adam a sign step of the (clipped) gradient: the direction survives, clipping only scales.
    np.testing.assert_allclose(np.asarray(upd["w"]), [-1.0, -1.0, 0.0, 0.0], atol=1e-6)
    clip = optax.clip_by_global_norm(0.5)
    g, _ = clip.update({"w": jnp.array([3.0, 4.0])}, clip.init(None))
    assert abs(float(optax.tree.norm(g)) - 0.5) < 1e-6


def test_state_shardings_cover_optimizer_state():
    cfg = tiny_config(num_heads=8, num_kv_heads=4)
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    model = _model(cfg, mesh)
    _, params, _ = nnx.split(model, nnx.Param, ...)
    state = init_train_state(params, make_optimizer(OptimConfig(), 10))
    want = state_shardings(nnx.state(model, nnx.Param), mesh, LogicalRules())
    mu = state.opt_state[1][0].mu
    for a, s in zip(jax.tree.leaves(mu), jax.tree.leaves(want), strict=True):
        assert a.sharding.is_equivalent_to(s, a.ndim)
    assert dataclasses.is_dataclass(state)


def test_on_policy_update_equals_the_update_with_recomputed_old_logprobs():
    """One update per step: taking the old log-probs from the update's own forward (no separate pass, the batch's
    old_logp unread) gives the update computed from separately recomputed old log-probs."""
    cfg = tiny_config()
    batch = _batch(cfg, seed=5)
    graphdef, params, rest = nnx.split(_model(cfg), nnx.Param, ...)
    lp = make_logprob_fn(graphdef, chunk_size=4, temperature=0.9)
    old = np.asarray(lp(params, rest, jnp.asarray(batch["input_ids"]), jnp.asarray(batch["attention_mask"])))
    tx = make_optimizer(OptimConfig(lr=1e-2, eps=1e-3), 10)
    out = {}
    for on_policy, old_logp in ((False, old), (True, np.full_like(old, np.nan))):  # on-policy never reads old_logp
        state = init_train_state(jax.tree.map(jnp.copy, params), tx)
        loss_cfg = LossConfig(4, temperature=0.9, kl_coef=0.1, on_policy=on_policy)
        step = make_train_step(graphdef, tx, loss_cfg, state)
        b = {k: jnp.asarray(v) for k, v in dict(batch, old_logp=old_logp, ref_logp=old - 0.05).items()}
        out[on_policy] = step(state, rest, b)
    (s0, m0), (s1, m1) = out[False], out[True]
    assert float(m1["finite"]) == 1.0 and float(m1["approx_kl"]) == 0.0
    np.testing.assert_allclose(float(m1["loss"]), float(m0["loss"]), rtol=1e-5, atol=1e-7)
    for a, b in zip(jax.tree.leaves(s0.params), jax.tree.leaves(s1.params), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-6)


def test_the_optimizer_update_is_computed_once():
    """The compiled step holds one Adam update per parameter (one sqrt of each second moment, plus the gradient norm
    and the clipping's norm), not a second copy of the update to check it is finite."""
    import re

    cfg = tiny_config()
    graphdef, params, rest = nnx.split(_model(cfg), nnx.Param, ...)
    tx = make_optimizer(OptimConfig(lr=1e-2), 10)
    state = init_train_state(params, tx)
    step = make_train_step(graphdef, tx, LossConfig(4, kl_coef=0.1), state)
    hlo = step.lower(state, rest, {k: jnp.asarray(v) for k, v in _batch(cfg).items()}).compile().as_text()
    sqrts = len(re.findall(r" sqrt\(", hlo))
    leaves = len(jax.tree.leaves(params))
    assert leaves <= sqrts <= leaves + 2, (sqrts, leaves)
