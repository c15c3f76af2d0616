"""rl_math (loss, KL, advantages) against float64 references written as plain loops (rollout correction:
test_rollout_correction.py)."""

from __future__ import annotations

import math

import pytest
import torch

from slime_lite import rl_math

torch.set_num_threads(1)


# ---------------------------------------------------------------- references (plain Python, float64)

def ref_kl(lp: float, rf: float, kind: str) -> float:
    d = lp - rf
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d * d
    k3 = math.exp(-d) - 1.0 + d
    return min(max(k3, -10.0), 10.0) if kind == "low_var_kl" else k3


def ref_pg(lp, old, a, eps_lo, eps_hi, c=None):
    r = math.exp(lp - old)
    l1 = -a * r
    l2 = -a * min(max(r, 1 - eps_lo), 1 + eps_hi)
    loss = max(l1, l2)
    if c is not None and a < 0:
        loss = min(loss, -c * a)
    return loss, 1.0 if l2 > l1 else 0.0, old - lp


def ref_sample_mean(xs, ms):
    """Per-sample masked token means, averaged over samples."""
    total = 0.0
    for x, m in zip(xs, ms):
        num = sum(xi * mi for xi, mi in zip(x, m))
        den = max(sum(m), 1)
        total += num / den
    return total / len(xs)


def ref_whiten(xs, ms, eps=1e-8):
    vals = [x for xs_i, ms_i in zip(xs, ms) for x, m in zip(xs_i, ms_i) if m]
    n = len(vals)
    mean = sum(vals) / n
    var = sum((v - mean) ** 2 for v in vals) / max(n - 1, 1)
    return [[(x - mean) / math.sqrt(var + eps) for x in xs_i] for xs_i in xs]


def ref_group_adv(rewards, g, std_norm, eps=1e-6):
    out = []
    for s in range(0, len(rewards), g):
        grp = rewards[s : s + g]
        mean = sum(grp) / g
        std = math.sqrt(sum((x - mean) ** 2 for x in grp) / (g - 1)) if g > 1 else 0.0
        out += [(x - mean) / (std + eps) if std_norm else x - mean for x in grp]
    return out


def ref_gae(rews, vals, gamma, lambd):
    T = len(rews)
    adv = [0.0] * T
    last = 0.0
    for t in reversed(range(T)):
        nv = vals[t + 1] if t + 1 < T else 0.0
        delta = rews[t] + gamma * nv - vals[t]
        last = delta + gamma * lambd * last
        adv[t] = last
    return adv, [a + v for a, v in zip(adv, vals)]


def ref_discounted(rews, gamma):
    out, run = [0.0] * len(rews), 0.0
    for t in reversed(range(len(rews))):
        run = rews[t] + gamma * run
        out[t] = run
    return out


# ---------------------------------------------------------------- fixtures

LENGTHS = [5, 1, 7, 3, 4, 6]  # ragged; groups of 2 or 3


def ragged(seed: int, scale: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g, dtype=torch.float64) * scale for n in LENGTHS]


def masks():
    ms = [torch.ones(n, dtype=torch.float64) for n in LENGTHS]
    ms[0][1] = 0  # a tool-output token in the middle
    ms[2][5:] = 0  # trailing untrained tokens
    ms[3][:] = 0  # a fully masked sample
    return ms


def tolist(xs):
    return [x.tolist() for x in xs]


def close(got, want, tol=1e-10):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        g = g.tolist() if isinstance(g, torch.Tensor) else g
        if isinstance(w, list):
            close(g, w, tol)
        else:
            assert g == pytest.approx(w, abs=tol, rel=tol), (g, w)


# ---------------------------------------------------------------- KL

@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "low_var_kl"])
def test_kl_matches_reference(kind):
    lp = torch.tensor([-1.0, -0.5, -3.0, -0.1, -20.0, -0.2], dtype=torch.float64)
    rf = torch.tensor([-1.0, -1.5, -0.2, -4.0, -0.1, -30.0], dtype=torch.float64)
    got = rl_math.compute_kl(lp, rf, kind)
    close(got, [ref_kl(a, b, kind) for a, b in zip(lp.tolist(), rf.tolist())], tol=1e-9)
    assert got[0] == 0.0  # identical policies: zero KL for every estimator


def test_low_var_kl_is_k3_clamped_at_10():
    lp = torch.tensor([-20.0, -0.3], dtype=torch.float64)
    rf = torch.tensor([-0.1, -0.2], dtype=torch.float64)
    k3 = rl_math.compute_kl(lp, rf, "k3")
    low = rl_math.compute_kl(lp, rf, "low_var_kl")
    assert k3[0] > 1e8 and low[0] == 10.0
    assert low[1] == k3[1]


def test_kl_is_differentiable_and_rejects_unknown_type():
    lp = torch.tensor([-1.0, -2.0], requires_grad=True)
    rl_math.compute_kl(lp, torch.tensor([-1.5, -1.0]), "k3").sum().backward()
    # d k3 / d logp = 1 - exp(-d)
    assert lp.grad.tolist() == pytest.approx([1 - math.exp(-0.5), 1 - math.exp(1.0)], rel=1e-6)
    with pytest.raises(ValueError, match="k4"):
        rl_math.compute_kl(lp, lp, "k4")


# ---------------------------------------------------------------- policy loss

def _pg_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    n = 400
    old = -torch.rand(n, generator=g, dtype=torch.float64) * 3
    lp = old + torch.randn(n, generator=g, dtype=torch.float64) * 0.4
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    mask = (torch.rand(n, generator=g) > 0.2).double()
    return lp, old, adv, mask


@pytest.mark.parametrize("eps_hi,c", [(None, None), (0.28, None), (0.28, 3.0)])
def test_policy_loss_matches_reference(eps_hi, c):
    lp, old, adv, mask = _pg_inputs()
    loss, clipfrac, kl = rl_math.policy_loss(lp, old, adv, mask, 0.2, eps_hi, c)
    hi = 0.2 if eps_hi is None else eps_hi
    for i in range(lp.numel()):
        want = ref_pg(lp[i].item(), old[i].item(), adv[i].item(), 0.2, hi, c)
        if mask[i] == 0:
            want = (0.0, 0.0, 0.0)
        assert (loss[i].item(), clipfrac[i].item(), kl[i].item()) == pytest.approx(want, abs=1e-12)
    assert 0 < clipfrac.sum() < mask.sum()  # some tokens clipped, not all


def test_dual_clip_caps_only_negative_advantages():
    # ratio far above 1 with A<0: plain PPO loss -A*ratio grows without bound; dual clip caps it at -c*A
    lp = torch.tensor([2.0, 2.0, -2.0], dtype=torch.float64)
    old = torch.zeros(3, dtype=torch.float64)
    adv = torch.tensor([-1.0, 1.0, 1.0], dtype=torch.float64)
    plain, _, _ = rl_math.policy_loss(lp, old, adv, None, 0.2, 0.2)
    dual, _, _ = rl_math.policy_loss(lp, old, adv, None, 0.2, 0.2, eps_clip_c=3.0)
    assert plain[0].item() == pytest.approx(math.exp(2.0))
    assert dual[0].item() == pytest.approx(3.0)
    assert dual[1:].tolist() == plain[1:].tolist()  # A > 0 untouched
    with pytest.raises(ValueError, match="eps_clip_c"):
        rl_math.policy_loss(lp, old, adv, None, 0.2, 0.2, eps_clip_c=1.0)


def test_pg_clipfrac_counts_tokens_where_clipped_term_wins():
    old = torch.zeros(6, dtype=torch.float64)
    # ratios: 1.5 (A>0: clipped), 1.5 (A<0: unclipped wins), 0.5 (A<0: clipped), 0.5 (A>0: unclipped), 1.0, 1.1
    lp = torch.log(torch.tensor([1.5, 1.5, 0.5, 0.5, 1.0, 1.1], dtype=torch.float64))
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0, 1.0, 1.0], dtype=torch.float64)
    _, clipfrac, _ = rl_math.policy_loss(lp, old, adv, None, 0.2, 0.2)
    assert clipfrac.tolist() == [1.0, 0.0, 1.0, 0.0, 0.0, 0.0]


def test_policy_loss_gradient_is_zero_where_clipped():
    lp, old, adv, _ = _pg_inputs(1)
    lp = lp.clone().requires_grad_(True)
    loss, clipfrac, _ = rl_math.policy_loss(lp, old, adv, None, 0.2, 0.2, eps_clip_c=3.0)
    loss.sum().backward()
    ratio = torch.exp(lp.detach() - old)
    dual = (adv < 0) & (-adv * ratio > -3.0 * adv)
    zero = clipfrac.bool() | dual
    assert zero.any() and (~zero).any()
    assert torch.all(lp.grad[zero] == 0)
    # elsewhere d(-A*r)/dlogp = -A*r
    assert torch.allclose(lp.grad[~zero], (-adv * ratio)[~zero])


def test_policy_loss_does_not_modify_inputs_and_keeps_dtype():
    lp, old, adv, mask = (t.float() for t in _pg_inputs(2))
    before = [t.clone() for t in (lp, old, adv, mask)]
    outs = rl_math.policy_loss(lp, old, adv, mask, 0.2, 0.3, 3.0)
    assert all(o.dtype == torch.float32 for o in outs)
    assert all(torch.equal(a, b) for a, b in zip(before, (lp, old, adv, mask)))


# ---------------------------------------------------------------- value loss, TIS

def test_value_loss_matches_reference():
    g = torch.Generator().manual_seed(3)
    v, v_old, ret = (torch.randn(200, generator=g, dtype=torch.float64) for _ in range(3))
    loss, clipfrac = rl_math.value_loss(v, v_old, ret, 0.2)
    for i in range(200):
        vc = v_old[i].item() + min(max(v[i].item() - v_old[i].item(), -0.2), 0.2)
        s1, s2 = (v[i].item() - ret[i].item()) ** 2, (vc - ret[i].item()) ** 2
        assert loss[i].item() == pytest.approx(max(s1, s2), abs=1e-12)  # no 0.5 factor
        assert clipfrac[i].item() == (1.0 if abs(v[i].item() - v_old[i].item()) > 0.2 else 0.0)  # as slime
    assert 0 < clipfrac.sum() < 200
    # a value moved far toward its return is clipped (counted) though the clipped term is not the larger one
    loss, clipfrac = rl_math.value_loss(torch.tensor([0.5, 0.5, 0.1]), torch.zeros(3), torch.tensor([1.0, 0, 0]), 0.2)
    assert clipfrac.tolist() == [1.0, 1.0, 0.0] and loss.mean().item() == pytest.approx(0.3)


# ---------------------------------------------------------------- aggregation

def test_masked_mean_and_aggregate_loss():
    xs, ms = ragged(4), masks()
    assert rl_math.masked_mean(xs[3], ms[3]).item() == 0.0  # empty mask -> 0, not NaN
    want = ref_sample_mean(tolist(xs), tolist(ms))
    assert rl_math.aggregate_loss(xs, ms).item() == pytest.approx(want, abs=1e-12)
    assert rl_math.aggregate_loss(torch.cat(xs), ms).item() == pytest.approx(want, abs=1e-12)
    # with a global normalizer the parts add up to the whole
    parts = rl_math.aggregate_loss(xs[:2], ms[:2], 6) + rl_math.aggregate_loss(xs[2:], ms[2:], 6)
    assert parts.item() == pytest.approx(want, abs=1e-12)


def test_a_split_trajectory_is_one_token_mean_over_its_samples():
    """A trajectory trained as two samples (batch.trajectory_denominators: each divides its masked sum by the
    trajectory's loss tokens) weighs as the trajectory unsplit, in one micro-batch or two; unsplit samples keep their
    own means, and a per-token normalizer ignores the denominators."""
    from slime_lite.backends.megatron import batch as B
    from slime_lite.types import Sample

    whole, other = torch.tensor([1.0, 2.0, 3.0, 10.0, 20.0]), torch.tensor([4.0, 8.0])
    mask_w, mask_o = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0]), torch.tensor([1.0, 1.0])
    want = rl_math.aggregate_loss([whole, other], [mask_w, mask_o]).item()  # (33 / 4 + 6) / 2
    samples = [Sample(index=0, rollout_id=7, response_length=3), Sample(index=1, rollout_id=7, response_length=2),
               Sample(index=2, response_length=2)]
    xs, ms = [whole[:3], whole[3:], other], [mask_w[:3], mask_w[3:], mask_o]
    den = B.trajectory_denominators(samples, ms)
    assert den == [4.0, 4.0, 2.0] and want == pytest.approx(7.125)
    assert rl_math.aggregate_loss(xs, ms, 2, den).item() == pytest.approx(want, abs=1e-12)
    parts = rl_math.aggregate_loss(xs[:1], ms[:1], 2, den[:1]) + rl_math.aggregate_loss(xs[1:], ms[1:], 2, den[1:])
    assert parts.item() == pytest.approx(want, abs=1e-12)
    assert rl_math.aggregate_loss(xs, ms, 2).item() == pytest.approx((1.5 + 15 + 6) / 2)  # each sample weighs one
    per_token = rl_math.PerTokenNormalizer(6.0)
    assert rl_math.aggregate_loss(xs, ms, per_token, den).item() == rl_math.aggregate_loss(xs, ms, per_token).item()
    assert B.trajectory_denominators(samples[2:], ms[2:]) is None  # nothing split


def test_per_token_normalizer_below_one_gives_the_global_token_mean_over_dp_ranks():
    """--calculate-per-token-loss under DP: each rank divides by the step's loss tokens per rank (the worker's
    normalizer) and DDP averages the ranks. A step with fewer loss tokens than ranks has a normalizer below 1,
    which must not be raised to 1 (that would shrink the loss and its gradient by the rank count)."""
    dp = 4
    ranks = [([torch.tensor([3.0, 5.0])], [torch.tensor([0.0, 1.0])])]  # the step's one loss token
    ranks += [([torch.tensor([7.0])], [torch.tensor([0.0])])] * (dp - 1)  # fully masked samples
    tokens = sum(float(m.sum()) for _, ms in ranks for m in ms)
    per_rank = [rl_math.aggregate_loss(xs, ms, rl_math.PerTokenNormalizer(tokens / dp)) for xs, ms in ranks]
    assert (sum(per_rank) / dp).item() == pytest.approx(5.0)
    # a step without a loss token: 0, not NaN
    assert rl_math.aggregate_loss(*ranks[1], rl_math.PerTokenNormalizer(0.0)).item() == 0.0


def test_whiten_uses_masked_unbiased_statistics():
    xs, ms = ragged(5, scale=3.0), masks()
    got = rl_math.whiten(xs, ms)
    close(got, ref_whiten(tolist(xs), tolist(ms)), tol=1e-9)
    flat, m = torch.cat(got), torch.cat(ms).bool()
    assert abs(flat[m].mean().item()) < 1e-12 and flat[m].std().item() == pytest.approx(1.0, abs=1e-6)
    with pytest.raises(ValueError, match="masked"):
        rl_math.whiten(xs, [torch.zeros_like(x) for x in xs])


# ---------------------------------------------------------------- advantage estimators

@pytest.mark.parametrize("std_norm", [True, False])
def test_grpo_advantages(std_norm):
    rewards = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.5, -2.0, 3.0]
    got = rl_math.grpo_advantages(torch.tensor(rewards, dtype=torch.float64), 3, std_norm)
    close(got, ref_group_adv(rewards, 3, std_norm), tol=1e-9)
    assert got[3:6].tolist() == [0.0, 0.0, 0.0]  # a group with equal rewards learns nothing


def test_grpo_group_size_checks():
    assert rl_math.grpo_advantages(torch.tensor([1.0, 2.0]), 1).tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="groups of 4"):
        rl_math.grpo_advantages(torch.zeros(6), 4)


@pytest.mark.parametrize("std_norm", [True, False])
def test_group_normalized_rewards_are_what_each_group_estimator_takes_as_given(std_norm):
    """The rewards the manager normalises for split trajectories, taken as given (rewards_normalized), give the
    same advantages as the estimator's own group normalisation of the raw rewards: GRPO's (std by the flag) and
    REINFORCE++-baseline's (centred only)."""
    rewards = torch.tensor([1.0, 0.0, 0.5, 3.0, -1.0, 2.0], dtype=torch.float64)
    logp, masks = ragged(0), [torch.ones(n, dtype=torch.float64) for n in LENGTHS]
    for name in ("grpo", "reinforce_plus_plus_baseline"):
        own = rl_math.compute_advantages_and_returns(name, rewards, logp, None, None, masks, group_size=3,
                                                     std_normalization=std_norm)
        given = rl_math.group_normalized(name, rewards, 3, std_norm)
        taken = rl_math.compute_advantages_and_returns(name, given, logp, None, None, masks, group_size=3,
                                                       std_normalization=std_norm, rewards_normalized=True)
        for a, b in zip(own[0] + own[1], taken[0] + taken[1]):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-9)
    centred = torch.tensor([0.5, -0.5, 0.0, 5 / 3, -7 / 3, 2 / 3], dtype=torch.float64)  # means 0.5 and 4/3
    torch.testing.assert_close(rl_math.group_normalized("reinforce_plus_plus_baseline", rewards, 3), centred)
    with pytest.raises(ValueError, match="does not normalise groups"):
        rl_math.group_normalized("reinforce_plus_plus", rewards, 3)


def test_gae_matches_hand_loop():
    rews, vals = ragged(6), ragged(7)
    adv, ret = rl_math.gae(rews, vals, 0.97, 0.9)
    for i in range(len(LENGTHS)):
        want_a, want_r = ref_gae(rews[i].tolist(), vals[i].tolist(), 0.97, 0.9)
        close(adv[i], want_a)
        close(ret[i], want_r)


def test_gae_with_gamma_lambda_one_is_reward_to_go_minus_value():
    rews, vals = [torch.tensor([0.0, 0.0, 1.0])], [torch.tensor([0.2, 0.4, 0.6])]
    adv, ret = rl_math.gae(rews, vals, 1.0, 1.0)
    assert ret[0].tolist() == pytest.approx([1.0, 1.0, 1.0])
    assert adv[0].tolist() == pytest.approx([0.8, 0.6, 0.4])


def test_estimators_take_a_batch_of_empty_responses():
    """Zero-length responses everywhere (e.g. every sample aborted before its first token): empty advantages and
    returns, not an IndexError in the discounted scan."""
    empty = [torch.zeros(0, dtype=torch.float64) for _ in range(2)]
    adv, ret = rl_math.gae(empty, empty, 0.9, 0.95)
    assert [a.numel() for a in adv] == [0, 0] and [r.numel() for r in ret] == [0, 0]
    rets = rl_math.reinforce_plus_plus_returns(torch.tensor([1.0, 0.0], dtype=torch.float64), empty, empty, 0.1, 1.0)
    assert [r.numel() for r in rets] == [0, 0]
    adv, ret = rl_math.compute_advantages_and_returns("ppo", [1.0, 0.0], empty, empty, empty, empty, group_size=2,
                                                      kl_coef=0.1)
    assert [a.numel() for a in adv] == [0, 0] and [r.numel() for r in ret] == [0, 0]


def _common():
    logp, ref = ragged(8, 0.5), ragged(9, 0.5)
    logp = [x - 1.0 for x in logp]
    ref = [x - 1.0 for x in ref]
    rewards = [1.0, 0.0, 0.5, 2.0, -1.0, 0.25]
    return logp, ref, rewards, masks()


def test_reinforce_plus_plus_matches_reference():
    logp, ref, rewards, ms = _common()
    kl = [rl_math.compute_kl(a, b, "k3") for a, b in zip(logp, ref)]
    rets = rl_math.reinforce_plus_plus_returns(torch.tensor(rewards, dtype=torch.float64), kl, ms, 0.1, 0.95)
    want = []
    for i in range(len(LENGTHS)):
        m = ms[i].tolist()
        tok = [-0.1 * ref_kl(a, b, "k3") * mi for a, b, mi in zip(logp[i].tolist(), ref[i].tolist(), m)]
        last = max((t for t, mi in enumerate(m) if mi), default=None)
        if last is not None:
            tok[last] += rewards[i]
        want.append(ref_discounted(tok, 0.95))
    close(rets, want)
    adv, ret = rl_math.compute_advantages_and_returns(
        "reinforce_plus_plus", rewards, logp, ref, None, ms, group_size=2, kl_coef=0.1, kl_type="k3", gamma=0.95
    )
    close(ret, want)
    close(adv, ref_whiten(want, tolist(ms)), tol=1e-9)


def test_reinforce_plus_plus_baseline_matches_reference():
    logp, ref, rewards, ms = _common()
    adv, ret = rl_math.compute_advantages_and_returns(
        "reinforce_plus_plus_baseline", rewards, logp, ref, None, ms, group_size=3, kl_coef=0.05, kl_type="k1"
    )
    centered = ref_group_adv(rewards, 3, std_norm=False)
    want = [
        [centered[i] - 0.05 * ref_kl(a, b, "k1") * mi for a, b, mi in zip(logp[i].tolist(), ref[i].tolist(), ms[i].tolist())]
        for i in range(len(LENGTHS))
    ]
    close(ret, want)
    close(adv, ref_whiten(want, tolist(ms)), tol=1e-9)


def test_grpo_entry_point_broadcasts_and_ignores_kl_coef():
    logp, ref, rewards, ms = _common()
    kw = dict(group_size=3, kl_type="k3")
    a0, r0 = rl_math.compute_advantages_and_returns("grpo", rewards, logp, ref, None, ms, kl_coef=0.0, **kw)
    a1, _ = rl_math.compute_advantages_and_returns("grpo", rewards, logp, ref, None, ms, kl_coef=0.5, **kw)
    per = ref_group_adv(rewards, 3, True)
    close(a0, [[per[i]] * n for i, n in enumerate(LENGTHS)], tol=1e-9)
    close(r0, tolist(a0))
    close(a1, tolist(a0))
    an, _ = rl_math.compute_advantages_and_returns(
        "grpo", rewards, logp, ref, None, ms, kl_coef=0.0, normalize_advantages=True, **kw
    )
    close(an, ref_whiten([[per[i]] * n for i, n in enumerate(LENGTHS)], tolist(ms)), tol=1e-9)


def test_ppo_entry_point_matches_reference():
    logp, ref, rewards, ms = _common()
    vals = ragged(10, 0.3)
    adv, ret = rl_math.compute_advantages_and_returns(
        "ppo", rewards, logp, ref, vals, ms, group_size=1, kl_coef=0.2, kl_type="k2", gamma=0.99, lambd=0.95
    )
    for i in range(len(LENGTHS)):
        tok = [-0.2 * ref_kl(a, b, "k2") * mi for a, b, mi in zip(logp[i].tolist(), ref[i].tolist(), ms[i].tolist())]
        tok[-1] += rewards[i]  # on the last response token, even when it is masked out
        want_a, want_r = ref_gae(tok, vals[i].tolist(), 0.99, 0.95)
        close(adv[i], want_a)
        close(ret[i], want_r)
    with pytest.raises(ValueError, match="critic values"):
        rl_math.compute_advantages_and_returns("ppo", rewards, logp, ref, None, ms, group_size=1)


def test_entry_point_rejects_unknown_estimator_and_bad_counts():
    logp, ref, rewards, ms = _common()
    with pytest.raises(ValueError, match="gspo"):
        rl_math.compute_advantages_and_returns("gspo", rewards, logp, ref, None, ms, group_size=3)
    with pytest.raises(ValueError, match="rewards"):
        rl_math.compute_advantages_and_returns("grpo", rewards[:-1], logp, ref, None, ms, group_size=3)


def test_estimators_work_in_float32_without_touching_inputs():
    logp, ref, rewards, ms = _common()
    logp32, ref32 = [x.float() for x in logp], [x.float() for x in ref]
    snapshot = [x.clone() for x in logp32]
    for est in ("grpo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo"):
        adv, ret = rl_math.compute_advantages_and_returns(
            est, rewards, logp32, ref32, [torch.zeros_like(x) for x in logp32], ms, group_size=3, kl_coef=0.1
        )
        assert all(a.dtype == torch.float32 for a in adv + ret)
        assert [a.numel() for a in adv] == LENGTHS
    assert all(torch.equal(a, b) for a, b in zip(snapshot, logp32))


def test_the_per_token_normalizer_counts_a_sample_without_loss_tokens_as_one_token_as_slime():
    """slime's num_tokens is the sum of clamp_min(loss_mask.sum(), 1): a sample with an empty mask (removed, or a
    multi-turn sample of inserted turns only) still counts 1 (it was 0 here: a larger loss than slime's)."""
    from types import SimpleNamespace

    from slime_lite.backends.megatron.worker import TrainWorker

    samples = [SimpleNamespace(loss_mask=m, response_length=len(m), trajectory=i)
               for i, m in enumerate(([1, 1, 1], [1, 1], [0, 0]))]
    fake = SimpleNamespace(args=SimpleNamespace(global_batch_size=3, calculate_per_token_loss=True), dp_size=1)
    assert float(TrainWorker._normalizer(fake, samples, 0)) == 6.0  # 3 + 2 + 1
    # a trajectory split in two, one part without loss tokens: counted as the whole one (it counted one more)
    samples.insert(1, SimpleNamespace(loss_mask=[0], response_length=1, trajectory=0))
    assert float(TrainWorker._normalizer(fake, samples, 0)) == 6.0


def test_the_trainer_scores_at_the_temperature_the_engine_sampled_at_even_at_the_greedy_edge():
    """At the edge (1e-6) the engine samples at that temperature (greedy only below it, as SGLang): the trainer's
    log-probs must divide by it too, else they are of other logits than the engine's."""
    from slime_lite.engine.sampling import SamplingParams
    from slime_lite.rl_math import GREEDY_EPS, scoring_temperature

    for t in (0.0, GREEDY_EPS / 2, GREEDY_EPS, 2 * GREEDY_EPS, 0.7):
        greedy = SamplingParams(temperature=t).greedy
        assert scoring_temperature(t) == (1.0 if greedy else t), t
    assert not SamplingParams(temperature=GREEDY_EPS).greedy and scoring_temperature(GREEDY_EPS) == GREEDY_EPS
