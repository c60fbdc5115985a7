"""GRPO math against hand-computed values: advantages, aggregation modes, PPO-clip, KL estimators, entropy."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tlt_jax.rl import (
    ADVANTAGE_FNS,
    KL_ESTIMATORS,
    agg_loss,
    compute_advantages,
    entropy_from_logits,
    grpo_loss,
    kl_penalty,
    ppo_clip_loss,
    token_entropy,
)

# ----- advantages -----------------------------------------------------------------------------------------------

REWARDS = np.array([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 2.0]], np.float32)


def test_grpo_advantages_by_hand_and_numpy():
    adv = np.asarray(compute_advantages("grpo", REWARDS))
    # Group 0: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.57735 -> +-0.5 / 0.57735 = +-0.8660254.
    np.testing.assert_allclose(adv[0], [0.8660254, -0.8660254, -0.8660254, 0.8660254], rtol=1e-5)
    np.testing.assert_array_equal(adv[1], 0.0)  # all-equal group: no signal, and no NaN
    mean, std = REWARDS.mean(1, keepdims=True), REWARDS.std(1, ddof=1, keepdims=True)
    np.testing.assert_allclose(adv, (REWARDS - mean) / (std + 1e-6), rtol=1e-5)
    flat = compute_advantages("grpo", REWARDS.reshape(-1), group_size=4)
    assert flat.shape == (12,)
    np.testing.assert_allclose(flat, adv.reshape(-1), rtol=1e-6)


def test_drgrpo_and_rloo_by_hand():
    np.testing.assert_allclose(compute_advantages("drgrpo", REWARDS[0], 4), [0.5, -0.5, -0.5, 0.5], atol=1e-7)
    # RLOO: baseline for sample 0 is (0 + 0 + 1) / 3, for sample 1 it is (1 + 0 + 1) / 3.
    np.testing.assert_allclose(compute_advantages("rloo", REWARDS[0], 4), [2 / 3, -2 / 3, -2 / 3, 2 / 3], rtol=1e-6)
    np.testing.assert_allclose(compute_advantages("rloo", REWARDS[2], 4), [-2 / 3, -2 / 3, -2 / 3, 2.0], rtol=1e-6)
    # RLOO is the Dr. GRPO advantage scaled by n / (n - 1).
    np.testing.assert_allclose(
        compute_advantages("rloo", REWARDS), 4 / 3 * np.asarray(compute_advantages("drgrpo", REWARDS)), rtol=1e-6
    )


@pytest.mark.parametrize("name", sorted(ADVANTAGE_FNS))
def test_advantages_reject_bad_groups(name):
    with pytest.raises(ValueError, match="group_size >= 2"):
        compute_advantages(name, np.ones((3, 1)))
    with pytest.raises(ValueError, match="group_size >= 2"):
        compute_advantages(name, np.ones(3), group_size=1)
    with pytest.raises(ValueError, match="groups of 4"):
        compute_advantages(name, np.ones(6), group_size=4)
    with pytest.raises(ValueError, match="need group_size"):
        compute_advantages(name, np.ones(6))
    with pytest.raises(ValueError, match="unknown advantage"):
        compute_advantages("ppo", np.ones(6), 2)


def test_advantages_jit():
    fn = jax.jit(ADVANTAGE_FNS["grpo"], static_argnums=1)
    np.testing.assert_allclose(fn(REWARDS.reshape(-1), 4), compute_advantages("grpo", REWARDS).reshape(-1))


# ----- loss aggregation -----------------------------------------------------------------------------------------

LOSS = np.array([[1.0, 2.0, 3.0, 4.0], [10.0, 7.0, 7.0, 7.0], [5.0, 5.0, 5.0, 5.0]], np.float32)
MASK = np.array([[1, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0]], np.float32)  # lengths 4 and 1, plus a padding row


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", (1 + 2 + 3 + 4 + 10) / 5),  # 4.0: every token weighs the same
        ("seq-mean-token-sum", (10 + 10) / 2),  # 10.0: the padding row is not a sequence
        ("seq-mean-token-mean", (2.5 + 10) / 2),  # 6.25: every sequence weighs the same
        ("seq-mean-token-sum-norm", 20 / 4),  # 5.0: Dr. GRPO's constant normaliser (T = 4)
    ],
)
def test_agg_modes(mode, expected):
    assert float(agg_loss(LOSS, MASK, mode, norm_len=4)) == pytest.approx(expected)
    assert float(agg_loss(LOSS, np.zeros_like(MASK), mode, norm_len=4)) == 0.0  # all padding: zero, not NaN


def test_drgrpo_normaliser_is_the_given_constant_not_the_padded_length():
    """seq-mean-token-sum-norm divides by norm_len (a constant of the run): padding the batch to a longer bucket
    leaves it unchanged; without norm_len it is an error naming the fix."""
    padded_loss = np.concatenate([LOSS, np.full((3, 12), 9.0, np.float32)], axis=1)
    padded_mask = np.concatenate([MASK, np.zeros((3, 12), np.float32)], axis=1)
    a = float(agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", norm_len=16))
    b = float(agg_loss(padded_loss, padded_mask, "seq-mean-token-sum-norm", norm_len=16))
    assert a == b == pytest.approx(20 / 16)
    with pytest.raises(ValueError, match="needs norm_len >= 1, a constant of the run"):
        agg_loss(LOSS, MASK, "seq-mean-token-sum-norm")


def test_agg_modes_agree_on_equal_lengths_and_reject_unknown():
    mask = np.ones((2, 3), np.float32)
    loss = np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], np.float32)
    assert float(agg_loss(loss, mask, "token-mean")) == pytest.approx(
        float(agg_loss(loss, mask, "seq-mean-token-mean"))
    )
    assert float(agg_loss(loss, mask, "seq-mean-token-sum")) == pytest.approx(3 * 3.5)
    with pytest.raises(ValueError, match="loss aggregation mode"):
        agg_loss(loss, mask, "sum")


# ----- PPO clip -------------------------------------------------------------------------------------------------


def _ppo_numpy(ratio, adv, clip_low, clip_high):
    return np.maximum(-adv * ratio, -adv * np.clip(ratio, 1 - clip_low, 1 + clip_high))


def test_ppo_clip_values_by_hand():
    ratio = np.array([[1.1, 1.5, 0.5, 0.5, 1.5, 1.25]], np.float32)
    adv = np.array([[1.0, 1.0, 1.0, -1.0, -1.0, 1.0]], np.float32)
    mask = np.ones_like(ratio)
    old = np.full_like(ratio, -1.0)
    logp = old + np.log(ratio)
    # Per token: inside; clipped at 1.2; r < 1 - eps with A > 0 keeps the unclipped (pessimistic) term;
    # A < 0 clipped at 0.8; A < 0 with r > 1 + eps unclipped; 1.25 is clipped at 1.2.
    by_hand = [-1.1, -1.2, -0.5, 0.8, 1.5, -1.2]
    np.testing.assert_allclose(_ppo_numpy(ratio, adv, 0.2, 0.2)[0], by_hand, rtol=1e-6)
    loss, metrics = ppo_clip_loss(logp, old, adv, mask)
    assert float(loss) == pytest.approx(np.mean(by_hand), rel=1e-5)
    assert float(metrics["clip_frac"]) == pytest.approx(3 / 6)
    np.testing.assert_allclose(float(metrics["approx_kl"]), np.mean(ratio - np.log(ratio) - 1), rtol=1e-5)
    # Clip-higher (DAPO): with clip_high = 0.28 the ratio 1.25 is no longer clipped and 1.5 is clipped at 1.28.
    loss_hi, metrics_hi = ppo_clip_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    expected_hi = np.mean(_ppo_numpy(ratio, adv, 0.2, 0.28))
    assert float(loss_hi) == pytest.approx(expected_hi, rel=1e-5)
    assert float(loss_hi) == pytest.approx(np.mean([-1.1, -1.28, -0.5, 0.8, 1.5, -1.25]), rel=1e-5)
    assert float(metrics_hi["clip_frac"]) == pytest.approx(2 / 6)


def test_ppo_per_sample_advantages_broadcast_and_mask():
    old = np.zeros((2, 3), np.float32)
    logp = np.log(np.array([[1.1, 1.0, 9.0], [0.9, 1.0, 9.0]], np.float32))
    mask = np.array([[1, 1, 0], [1, 1, 0]], np.float32)  # the huge ratios sit on padding
    loss, metrics = ppo_clip_loss(logp, old, np.array([2.0, -1.0]), mask)
    # Tokens: -2 * 1.1, -2 * 1.0, +1 * 0.9, +1 * 1.0 -> mean -0.575.
    assert float(loss) == pytest.approx((-2.2 - 2.0 + 0.9 + 1.0) / 4, rel=1e-5)
    assert float(metrics["clip_frac"]) == 0.0


@pytest.mark.parametrize("adv, bound", [(1.0, 1.2), (-1.0, 0.8)])
def test_clipping_engages_exactly_at_the_boundary(adv, bound):
    delta = 1e-3
    # Just inside, then just outside [1 - 0.2, 1 + 0.2] on the side where the clip is active for this sign of A.
    inside, outside = (bound - delta, bound + delta) if adv > 0 else (bound + delta, bound - delta)
    logp = jnp.log(jnp.array([[inside, outside]], jnp.float32))
    old, mask, advs = jnp.zeros((1, 2)), jnp.ones((1, 2)), jnp.full((1,), adv)
    loss_fn = lambda lp: ppo_clip_loss(lp, old, advs, mask, agg_mode="seq-mean-token-sum")
    grad = jax.grad(lambda lp: loss_fn(lp)[0])(logp)
    np.testing.assert_allclose(grad[0, 0], -adv * inside, rtol=1e-5)  # d(-A r)/dlogp = -A r
    assert float(grad[0, 1]) == 0.0  # clipped: no gradient
    assert float(loss_fn(logp)[1]["clip_frac"]) == 0.5
    # The loss is continuous at the boundary: the clipped token's loss equals -A * bound.
    assert float(loss_fn(logp)[0]) == pytest.approx(-adv * inside - adv * bound, rel=1e-5)


def test_dual_clip_caps_negative_advantages():
    old = np.zeros((1, 3), np.float32)
    logp = np.log(np.array([[5.0, 2.0, 5.0]], np.float32))
    adv = np.array([[-1.0, -1.0, 1.0]], np.float32)
    mask = np.ones((1, 3), np.float32)
    plain, _ = ppo_clip_loss(logp, old, adv, mask, agg_mode="seq-mean-token-sum")
    dual, _ = ppo_clip_loss(logp, old, adv, mask, agg_mode="seq-mean-token-sum", dual_clip_c=3.0)
    assert float(plain) == pytest.approx(5.0 + 2.0 - 1.2, rel=1e-5)
    assert float(dual) == pytest.approx(3.0 + 2.0 - 1.2, rel=1e-5)  # only the A < 0, r = 5 token is capped
    with pytest.raises(ValueError, match="dual_clip_c"):
        ppo_clip_loss(logp, old, adv, mask, dual_clip_c=1.0)


# ----- KL -------------------------------------------------------------------------------------------------------


def test_kl_estimators_by_hand():
    logp, ref = np.array([-1.0, -2.0], np.float32), np.array([-1.5, -1.0], np.float32)
    np.testing.assert_allclose(kl_penalty(logp, ref, "k1"), [0.5, -1.0])
    np.testing.assert_allclose(kl_penalty(logp, ref, "abs"), [0.5, 1.0])
    np.testing.assert_allclose(kl_penalty(logp, ref, "k2"), [0.125, 0.5])
    # k3 with d = ref - logp = [-0.5, 1.0]: exp(d) - d - 1.
    np.testing.assert_allclose(kl_penalty(logp, ref, "k3"), [math.exp(-0.5) - 0.5, math.e - 2.0], rtol=1e-6)
    for alias, name in (("kl", "k1"), ("mse", "k2"), ("low_var_kl", "k3")):
        np.testing.assert_array_equal(kl_penalty(logp, ref, alias), kl_penalty(logp, ref, name))
    assert float(kl_penalty(np.float32(-40.0), np.float32(-1.0), "k3")) == 10.0  # VeRL's clamp
    with pytest.raises(ValueError, match="KL estimator"):
        kl_penalty(logp, ref, "k4")


def test_k1_k3_are_unbiased_for_kl_pi_ref():
    """Exact expectation under pi over a small vocabulary: E[k1] = E[k3] = KL(pi || ref), k3 >= 0 pointwise."""
    pi = np.array([0.5, 0.2, 0.2, 0.1])
    ref = np.array([0.25, 0.25, 0.4, 0.1])
    kl = float(np.sum(pi * np.log(pi / ref)))
    for kind in ("k1", "k3"):
        per_token = np.asarray(kl_penalty(np.log(pi), np.log(ref), kind), np.float64)
        assert float(np.sum(pi * per_token)) == pytest.approx(kl, rel=1e-5)
    assert np.all(np.asarray(kl_penalty(np.log(pi), np.log(ref), "k3")) >= 0)


# ----- combined loss and gradients ------------------------------------------------------------------------------


def test_grpo_loss_adds_kl_term_and_gradients_have_the_right_sign():
    old = jnp.log(jnp.array([[0.5, 0.4, 0.3], [0.5, 0.4, 0.3]]))
    ref = old - 0.1
    mask = jnp.array([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    adv = jnp.array([1.5, -0.5])
    kw = dict(ref_logp=ref, kl_coef=0.1, kl_kind="k3", agg_mode="token-mean")
    loss, metrics = grpo_loss(old, old, adv, mask, **kw)
    k3 = math.exp(-0.1) + 0.1 - 1.0  # every token has d = ref - logp = -0.1
    pg = (2 * -1.5 + 3 * 0.5) / 5  # ratio 1 everywhere
    assert float(metrics["pg_loss"]) == pytest.approx(pg, rel=1e-5)
    assert float(metrics["kl_loss"]) == pytest.approx(k3, rel=1e-4)
    assert float(loss) == pytest.approx(pg + 0.1 * k3, rel=1e-5)

    grad = jax.jit(jax.grad(lambda lp: grpo_loss(lp, old, adv, mask, **kw)[0]))(old)
    assert bool(jnp.all(jnp.isfinite(grad)))
    # d/dlogp at ratio 1: (-A + 0.1 * (1 - exp(ref - logp))) / 5 tokens.
    expected = (-adv[:, None] + 0.1 * (1 - math.exp(-0.1))) / 5 * mask
    np.testing.assert_allclose(grad, expected, rtol=1e-5, atol=1e-7)
    assert float(grad[0, 0]) < 0 < float(grad[1, 0])  # raise logp of A > 0 tokens, lower it for A < 0
    assert float(grad[0, 2]) == 0.0  # padding gets no gradient

    with pytest.raises(ValueError, match="ref_logp"):
        grpo_loss(old, old, adv, mask, kl_coef=0.1)
    with pytest.raises(ValueError, match="policy loss"):
        grpo_loss(old, old, adv, mask, policy_loss="gspo")
    no_kl, no_kl_metrics = grpo_loss(old, old, adv, mask)
    assert float(no_kl) == pytest.approx(pg, rel=1e-5) and "kl_loss" not in no_kl_metrics


def test_registered_kl_estimators_give_finite_gradients():
    logp = jnp.array([[-1.0, -2.0, -0.5]])
    ref = jnp.array([[-1.2, -1.0, -0.5]])
    for kind in KL_ESTIMATORS:
        g = jax.grad(lambda lp, kind=kind: agg_loss(kl_penalty(lp, ref, kind), jnp.ones((1, 3))))(logp)
        assert bool(jnp.all(jnp.isfinite(g))), kind
    # k3 pushes logp towards ref: gradient sign = sign(1 - exp(ref - logp)).
    g3 = jax.grad(lambda lp: jnp.sum(kl_penalty(lp, ref, "k3")))(logp)
    np.testing.assert_allclose(g3, 1 - jnp.exp(ref - logp), rtol=1e-6)


# ----- entropy --------------------------------------------------------------------------------------------------


def test_entropy_from_logits():
    logits = jnp.array(
        [
            [[0.0, 0.0, 0.0, 0.0], [0.0, math.log(3.0), -jnp.inf, -jnp.inf]],
            [[0.0, -jnp.inf, -jnp.inf, -jnp.inf], [5.0, 1.0, 2.0, 3.0]],
        ]
    )
    h_mixed = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))  # p = [1/4, 3/4]
    per_token = token_entropy(logits)
    np.testing.assert_allclose(per_token[0], [math.log(4.0), h_mixed], rtol=1e-6)
    assert float(per_token[1, 0]) == 0.0  # one-hot, no NaN from -inf logits
    mask = jnp.array([[1.0, 1.0], [1.0, 0.0]])
    expected = (math.log(4.0) + h_mixed + 0.0) / 3
    assert float(jax.jit(entropy_from_logits)(logits, mask)) == pytest.approx(expected, rel=1e-6)


def test_losses_jit_with_static_mode():
    fn = jax.jit(functools.partial(ppo_clip_loss, agg_mode="seq-mean-token-mean", clip_high=0.28))
    loss, metrics = fn(jnp.zeros((2, 3)), jnp.zeros((2, 3)), jnp.array([1.0, -1.0]), jnp.ones((2, 3)))
    assert float(loss) == pytest.approx(0.0) and set(metrics) == {"clip_frac", "approx_kl"}
