"""rl_math (loss, KL, advantages) and rollout correction against float64 references written as plain loops."""

from __future__ import annotations

import math

import pytest
import torch

from slime_lite import rl_math, rollout_correction

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
        assert clipfrac[i].item() == (1.0 if s2 > s1 else 0.0)
    assert 0 < clipfrac.sum() < 200


# ---------------------------------------------------------------- rollout correction and mismatch metrics

def ref_level_logs(d, m, level):
    """Per-token log ratio at `level` for one sample (plain floats)."""
    if level == "token":
        return list(d)
    s = sum(x for x, k in zip(d, m) if k)
    v = s if level == "sequence" else s / max(sum(m), 1)
    return [v] * len(d)


def ref_correction(train, rollout, ms, tis=False, tis_level="token", tis_mode="truncate", tis_low=None,
                   tis_high=2.0, rs=False, rs_level="token", rs_low=None, rs_high=2.0, rs_veto=None):
    weights, keeps, rejected, clipped = [], [], [], []
    for t, r, m in zip(tolist(train), tolist(rollout), tolist(ms)):
        d = [a - b for a, b in zip(t, r)]
        raw = [math.exp(min(max(x, -20.0), 20.0)) for x in ref_level_logs(d, m, tis_level)]
        keep = [k != 0 for k in m]
        w, ch = [1.0] * len(d), [False] * len(d)
        if tis:
            for j, x in enumerate(raw):
                if tis_mode == "truncate":
                    y = min(x, tis_high) if tis_low is None else min(max(x, tis_low), tis_high)
                    w[j], ch[j] = y, y != x
                else:
                    lo = tis_low if tis_low is not None else 1 / tis_high
                    inside = lo <= x <= tis_high
                    w[j], ch[j] = (x if inside else 0.0), not inside
                    keep[j] = keep[j] and inside
        if rs:
            lo = rs_low if rs_low is not None else 1 / rs_high
            for j, x in enumerate(ref_level_logs(d, m, rs_level)):
                keep[j] = keep[j] and lo <= math.exp(min(max(x, -20.0), 20.0)) <= rs_high
            if rs_veto is not None and any(x < math.log(rs_veto) and k for x, k in zip(d, m)):
                keep = [False] * len(d)
        weights.append(w)
        keeps.append([float(k) for k in keep])
        rejected.append([float(bool(k0) and not k) for k0, k in zip(m, keep)])
        clipped.append([float(c and bool(k0)) for c, k0 in zip(ch, m)])
    return weights, keeps, rejected, clipped


def _correction_batch():
    train = [x - 1.0 for x in ragged(11, 0.5)]
    rollout = [t + n for t, n in zip(train, ragged(12, 0.6))]
    return train, rollout, masks()


CORRECTIONS = [
    dict(tis=True),  # slime's --use-tis: token-level truncation
    dict(tis=True, tis_low=0.8),  # truncated from both sides (--tis-clip-low)
    dict(tis=True, tis_mode="mask"),  # MIS: tokens outside [1/2, 2] rejected
    dict(tis=True, tis_level="sequence", tis_high=1.5),
    dict(tis=True, tis_level="sequence", tis_mode="mask", tis_high=2.0),
    dict(tis=True, tis_level="geometric", tis_high=1.15),
    dict(tis=True, tis_level="geometric", tis_mode="mask", tis_high=1.15),
    dict(rs=True, rs_level="token"),  # pure rejection, no reweighting
    dict(tis=True, rs=True, rs_level="geometric", rs_high=1.15),  # token TIS + geometric rejection
    dict(rs=True, rs_level="sequence", rs_high=1e9, rs_veto=0.65),  # only the veto rejects (sample 0)
]


@pytest.mark.parametrize("cfg", CORRECTIONS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_rollout_correction_matches_reference(cfg):
    train, rollout, ms = _correction_batch()
    weights, keeps, stats = rollout_correction.rollout_correction(train, rollout, ms, **cfg)
    w_ref, k_ref, rej_ref, clip_ref = ref_correction(train, rollout, ms, **cfg)
    close(weights, w_ref)
    close(keeps, k_ref)
    assert stats["rejected"].tolist() == [x for r in rej_ref for x in r]
    assert stats["tis_clipfrac"].tolist() == [x for r in clip_ref for x in r]
    flat_m = [k for m in tolist(ms) for k in m]
    if cfg.get("tis"):  # the bounds did something and left something alone
        changed = [c for c, k in zip(stats["tis_clipfrac"].tolist(), flat_m) if k]
        assert 0 < sum(changed) < len(changed)
    if cfg.get("rs") or cfg.get("tis_mode") == "mask":
        rejected = [c for c, k in zip(stats["rejected"].tolist(), flat_m) if k]
        assert 0 < sum(rejected) < len(rejected)
    assert all(not w.requires_grad for w in weights)


def test_rollout_correction_is_identity_when_train_equals_rollout():
    """Step 1 (--ci-test): the engine sampled with the trainer's weights, so every ratio is 1: no weight changes,
    nothing is rejected, at every level and mode."""
    train, _, ms = _correction_batch()
    for cfg in CORRECTIONS:
        weights, keeps, stats = rollout_correction.rollout_correction(train, [t.clone() for t in train], ms, **cfg)
        assert all(torch.equal(w, torch.ones_like(w)) for w in weights), cfg
        assert all(torch.equal(k, m) for k, m in zip(keeps, ms)), cfg
        assert stats["rejected"].sum() == 0 and stats["tis_clipfrac"].sum() == 0, cfg


def test_rollout_correction_sequence_ratio_is_clamped_not_overflowing():
    t = [torch.zeros(400, dtype=torch.float64)]
    r = [torch.full((400,), -1.0, dtype=torch.float64)]  # sum of log ratios 400: exp would be inf
    w, _, stats = rollout_correction.rollout_correction(t, r, [torch.ones(400)], tis=True, tis_level="sequence", tis_high=5.0)
    assert w[0].tolist() == [5.0] * 400 and stats["tis"][0].item() == pytest.approx(math.exp(20.0))
    with pytest.raises(ValueError, match="level"):
        rollout_correction.rollout_correction(t, r, [torch.ones(400)], tis=True, tis_level="tokens")


def ref_mismatch(train, rollout, ms, bound):
    toks, seqs = [], []
    for i, (t, r, m) in enumerate(zip(tolist(train), tolist(rollout), tolist(ms))):
        d = [(i, j, a, b) for j, (a, b, k) in enumerate(zip(t, r, m)) if k]
        toks += d
        if d:
            seqs.append(math.exp(min(max(sum(a - b for _, _, a, b in d), -20.0), 20.0)))
    ratios = [math.exp(a - b) for _, _, a, b in toks]
    out = lambda xs: sum(1 for x in xs if x < 1 / bound or x > bound) / len(xs)  # noqa: E731
    scalars = {
        "token_ratio_mean": sum(ratios) / len(ratios), "token_ratio_max": max(ratios),
        "token_ratio_min": min(ratios), "token_ratio_outside_frac": out(ratios),
        "seq_ratio_mean": sum(seqs) / len(seqs), "seq_ratio_max": max(seqs), "seq_ratio_min": min(seqs),
        "seq_ratio_outside_frac": out(seqs),
        "k3_kl": sum(x - 1 - math.log(x) for x in ratios) / len(ratios),
        "kl": sum(b - a for _, _, a, b in toks) / len(toks),
    }
    worst = sorted(toks, key=lambda x: -abs(x[2] - x[3]))
    return scalars, worst


def test_mismatch_metrics_match_reference():
    train, rollout, ms = _correction_batch()
    got, worst = rollout_correction.mismatch_metrics([t.float() for t in train], rollout, ms, bound=2.0, top_k=4)
    want, want_worst = ref_mismatch([t.float().double() for t in train], rollout, ms, 2.0)
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-12, abs=1e-12), k
    assert 0 < got["token_ratio_outside_frac"] < 1 and got["k3_kl"] > 0
    assert [(i, j) for i, j, _, _ in worst] == [(i, j) for i, j, _, _ in want_worst[:4]]
    assert worst[0][2:] == pytest.approx(want_worst[0][2:])
    # masked tokens never count: the fully masked sample 3 and the masked position 1 of sample 0 are not listed
    _, every = rollout_correction.mismatch_metrics(train, rollout, ms, 2.0, top_k=100)
    assert len(every) == sum(int(m.sum()) for m in ms) and all(i != 3 and (i, j) != (0, 1) for i, j, _, _ in every)


def test_mismatch_metrics_at_step_one_are_exactly_on_policy():
    train, _, ms = _correction_batch()
    got, worst = rollout_correction.mismatch_metrics(train, train, ms, 2.0, top_k=2)
    assert got["token_ratio_max"] == got["token_ratio_min"] == got["seq_ratio_mean"] == 1.0
    assert got["k3_kl"] == 0.0 and got["token_ratio_outside_frac"] == 0.0 and worst[0][2] == worst[0][3]
    assert rollout_correction.mismatch_metrics([], [], [], 2.0) == ({}, [])


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
