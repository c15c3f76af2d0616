"""backends/megatron/loss.py: log-probs from logits, response slicing, the RL loss and its metrics."""

from __future__ import annotations

import math
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from slime_lite import rollout_correction
from slime_lite.args import parser_defaults
from slime_lite.backends.megatron import loss as L
from slime_lite.config import LossConfig

torch.set_num_threads(1)


# ---------------------------------------------------------------- log-probs and entropy

def ref_logp_entropy(logits_row: list[float], token: int, temperature: float) -> tuple[float, float]:
    z = [x / temperature for x in logits_row]
    mx = max(z)
    lse = mx + math.log(sum(math.exp(x - mx) for x in z))
    p = [math.exp(x - lse) for x in z]
    return z[token] - lse, -sum(pi * (x - lse) for pi, x in zip(p, z))


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
def test_log_probs_and_entropy_use_temperature_scaled_distribution(temperature):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 11, generator=g, dtype=torch.float64) * 3
    tokens = torch.randint(0, 11, (6,), generator=g)
    logp, ent = L.token_log_probs_and_entropy(logits, tokens, temperature, with_entropy=True)
    assert logp.shape == ent.shape == (5,) and logp.dtype == torch.float32
    for t in range(5):
        want_lp, want_ent = ref_logp_entropy(logits[t].tolist(), int(tokens[t + 1]), temperature)
        assert logp[t].item() == pytest.approx(want_lp, abs=1e-5)
        assert ent[t].item() == pytest.approx(want_ent, abs=1e-5)
    direct = torch.log_softmax(logits[:-1] / temperature, -1).gather(-1, tokens[1:, None]).squeeze(-1)
    assert torch.allclose(logp.double(), direct, atol=1e-6)


def test_log_probs_batched_bf16_are_computed_in_fp32():
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(2, 5, 300, generator=g) * 8).bfloat16()
    tokens = torch.randint(0, 300, (2, 5), generator=g)
    logp, ent = L.token_log_probs_and_entropy(logits, tokens, 0.8)
    assert ent is None and logp.shape == (2, 4) and logp.dtype == torch.float32
    want = torch.log_softmax(logits.double() / 0.8, -1)[:, :-1].gather(-1, tokens[:, 1:, None]).squeeze(-1)
    assert torch.allclose(logp.double(), want, atol=1e-5)


def test_log_probs_and_entropy_are_differentiable():
    logits = torch.randn(4, 7, requires_grad=True)
    tokens = torch.tensor([1, 2, 3, 4])
    logp, ent = L.token_log_probs_and_entropy(logits, tokens, 1.0, with_entropy=True)
    (logp.sum() + ent.sum()).backward()
    assert logits.grad is not None and torch.isfinite(logits.grad).all()
    assert logits.grad[-1].abs().sum() == 0  # the last position predicts nothing


# ---------------------------------------------------------------- response slicing

def test_response_slices_packed_and_padded_pick_the_response_tokens():
    prompts, responses = [3, 1, 2], [2, 4, 1]
    seqs = [torch.arange(100 * i, 100 * i + p + r) for i, (p, r) in enumerate(zip(prompts, responses))]
    # per-predicting-position tensor: entry j holds the token it predicts (j+1)
    packed = torch.cat(seqs)
    got = L.response_slices(packed[1:], prompts, responses, packed=True)
    want = [s[p:] for s, p in zip(seqs, prompts)]
    assert [g.tolist() for g in got] == [w.tolist() for w in want]
    padded = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True)
    got = L.response_slices(padded[:, 1:], prompts, responses, packed=False)
    assert [g.tolist() for g in got] == [w.tolist() for w in want]


def test_response_slices_with_real_log_probs_and_errors():
    g = torch.Generator().manual_seed(2)
    prompts, responses = [2, 3], [3, 2]
    seqs = [torch.randint(0, 9, (p + r,), generator=g) for p, r in zip(prompts, responses)]
    logits = [torch.randn(s.numel(), 9, generator=g) for s in seqs]
    packed_lp, _ = L.token_log_probs_and_entropy(torch.cat(logits), torch.cat(seqs))
    got = L.response_slices(packed_lp, prompts, responses)
    for s, lg, p, out in zip(seqs, logits, prompts, got):
        want = [torch.log_softmax(lg[t - 1], -1)[s[t]].item() for t in range(p, s.numel())]
        assert out.tolist() == pytest.approx(want, abs=1e-6)
    with pytest.raises(ValueError, match="too short"):
        L.response_slices(packed_lp, prompts, [3, 5])
    with pytest.raises(ValueError, match="prompt length"):
        L.response_slices(packed_lp, [0, 3], responses)


# ---------------------------------------------------------------- rl_loss

LENGTHS = [4, 1, 6, 3, 5, 2]


def batch(seed=3, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)

    def r(scale=1.0, shift=0.0):
        return [torch.randn(n, generator=g, dtype=dtype) * scale + shift for n in LENGTHS]

    old = r(0.5, -1.5)
    logp = [o + torch.randn(o.shape, generator=g, dtype=dtype) * 0.3 for o in old]
    ref = [o + torch.randn(o.shape, generator=g, dtype=dtype) * 0.2 for o in old]
    rollout = [o + torch.randn(o.shape, generator=g, dtype=dtype) * 0.4 for o in old]
    adv = r()
    ent = [x.abs() for x in r(1.0, 1.0)]
    ms = [torch.ones(n, dtype=dtype) for n in LENGTHS]
    ms[0][2] = 0
    ms[4][:] = 0
    return dict(logp=logp, old=old, ref=ref, rollout=rollout, adv=adv, ent=ent, masks=ms)


ARGS = LossConfig(
    loss_type="policy_loss", eps_clip=0.2, eps_clip_high=0.28, eps_clip_c=3.0, entropy_coef=0.01, use_kl_loss=True, kl_loss_coef=0.1,
    kl_loss_type="low_var_kl", use_tis=True, tis_clip=1.5, tis_clip_low=None, tis_level="token", tis_mode="truncate",
    use_rs=False, rs_level="token", rs_lower_bound=None, rs_upper_bound=None, rs_veto_threshold=None,
)


def ref_rl_loss(b, a):
    """Float64 loops: per-sample token means averaged over samples, every term."""
    sums = dict(pg=0.0, clip=0.0, ppo_kl=0.0, kl=0.0, ent=0.0, diff=0.0, tis=0.0, tis_abs=0.0, tis_clip=0.0)
    n = len(LENGTHS)
    for i in range(n):
        den = max(sum(b["masks"][i].tolist()), 1)
        acc = dict.fromkeys(sums, 0.0)
        for t in range(LENGTHS[i]):
            if b["masks"][i][t] == 0:
                continue
            lp, old, rf, ro = (b[k][i][t].item() for k in ("logp", "old", "ref", "rollout"))
            A = b["adv"][i][t].item()
            ratio = math.exp(lp - old)
            l1, l2 = -A * ratio, -A * min(max(ratio, 1 - a.eps_clip), 1 + a.eps_clip_high)
            pg = max(l1, l2)
            if A < 0:
                pg = min(pg, -a.eps_clip_c * A)
            pg *= min(math.exp(old - ro), a.tis_clip)
            acc["tis"] += math.exp(old - ro)
            acc["tis_abs"] += abs(math.exp(old - ro) - 1)
            acc["tis_clip"] += 1.0 if math.exp(old - ro) > a.tis_clip else 0.0
            d = lp - rf
            acc["pg"] += pg
            acc["clip"] += 1.0 if l2 > l1 else 0.0
            acc["ppo_kl"] += old - lp
            acc["kl"] += min(max(math.exp(-d) - 1 + d, -10), 10)
            acc["ent"] += b["ent"][i][t].item()
            acc["diff"] += abs(old - ro)
        for k in sums:
            sums[k] += acc[k] / den / n
    loss = sums["pg"] - a.entropy_coef * sums["ent"] + a.kl_loss_coef * sums["kl"]
    return dict(
        pg_loss=sums["pg"], pg_clipfrac=sums["clip"], ppo_kl=sums["ppo_kl"], kl_loss=sums["kl"],
        entropy_loss=sums["ent"], train_rollout_logprob_abs_diff=sums["diff"], loss=loss,
        tis=sums["tis"], tis_abs=sums["tis_abs"], tis_clipfrac=sums["tis_clip"],
    )


def host(metrics):
    """The metrics as floats (the losses report 0-dim float64 tensors; the trainer sums a step's on the host)."""
    assert all(torch.is_tensor(v) and v.dim() == 0 and v.dtype == torch.float64 for v in metrics.values()), metrics
    return {k: float(v) for k, v in metrics.items()}


def run(b, args, sl=slice(None), normalizer=None):
    loss, m = L.rl_loss(
        b["logp"][sl], b["old"][sl], b["ref"][sl], b["rollout"][sl], b["adv"][sl], b["masks"][sl], b["ent"][sl],
        args, normalizer=normalizer,
    )
    return loss, host(m)


def test_rl_loss_and_metrics_match_reference():
    b = batch()
    loss, metrics = run(b, ARGS)
    want = ref_rl_loss(b, ARGS)
    assert set(metrics) == set(want)
    for k, v in want.items():
        assert metrics[k] == pytest.approx(v, abs=1e-12), k
    assert loss.item() == pytest.approx(want["loss"], abs=1e-12)
    assert 0 < metrics["pg_clipfrac"] < 1


def test_tis_and_kl_switches_change_the_loss():
    b = batch()
    base = replace(ARGS, use_tis=False, use_kl_loss=False)
    _, m0 = run(b, base)
    _, m_tis = run(b, replace(base, use_tis=True))
    _, m_kl = run(b, replace(base, use_kl_loss=True))
    assert m_tis["pg_loss"] != pytest.approx(m0["pg_loss"])
    assert m0["loss"] == pytest.approx(m0["pg_loss"] - base.entropy_coef * m0["entropy_loss"])
    assert m_kl["loss"] == pytest.approx(m0["loss"] + base.kl_loss_coef * m0["kl_loss"])


CORRECTIONS = [  # every rollout-correction variant, as LossConfig fields
    dict(use_tis=True),
    dict(use_tis=True, tis_clip_low=0.8),
    dict(use_tis=True, tis_mode="mask"),
    dict(use_tis=True, tis_level="sequence", tis_clip=3.0),
    dict(use_tis=True, tis_level="sequence", tis_mode="mask", tis_clip=3.0),
    dict(use_tis=True, tis_level="geometric", tis_clip=1.1),
    dict(use_tis=True, tis_level="geometric", tis_mode="mask", tis_clip=1.1),
    dict(use_rs=True, tis_clip=1.5),
    dict(use_tis=True, use_rs=True, rs_level="geometric", rs_upper_bound=1.1),
    dict(use_rs=True, rs_level="sequence", rs_upper_bound=1e9, rs_veto_threshold=0.5),
]


@pytest.mark.parametrize("fields", CORRECTIONS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_corrections_weight_and_reject_tokens_in_every_term(fields):
    """The policy loss of a token is multiplied by its IS weight; a rejected token leaves the numerator of every
    term (pg, entropy, KL, metrics) while each sample's denominator stays its loss-mask count."""
    b = batch()
    cfg = replace(replace(ARGS, use_tis=False), **fields)
    loss, m = run(b, cfg)
    rs_high = cfg.rs_upper_bound if cfg.rs_upper_bound is not None else cfg.tis_clip
    weights, keeps, _ = rollout_correction.rollout_correction(
        b["old"], b["rollout"], b["masks"], tis=cfg.use_tis, tis_level=cfg.tis_level, tis_mode=cfg.tis_mode,
        tis_low=cfg.tis_clip_low, tis_high=cfg.tis_clip, rs=cfg.use_rs, rs_level=cfg.rs_level,
        rs_low=cfg.rs_lower_bound, rs_high=rs_high, rs_veto=cfg.rs_veto_threshold)
    rejecting = cfg.use_rs or cfg.tis_mode == "mask"
    pg = ent = kl = rejected = 0.0
    for i in range(len(LENGTHS)):
        den = max(sum(b["masks"][i].tolist()), 1)
        for t in range(LENGTHS[i]):
            if b["masks"][i][t] == 0:
                continue
            keep = keeps[i][t].item() if rejecting else 1.0
            rejected += (1.0 - keep) / den / len(LENGTHS)
            lp, old = b["logp"][i][t].item(), b["old"][i][t].item()
            A = b["adv"][i][t].item()
            ratio = math.exp(lp - old)
            l1, l2 = -A * ratio, -A * min(max(ratio, 1 - cfg.eps_clip), 1 + cfg.eps_clip_high)
            tok = min(max(l1, l2), -cfg.eps_clip_c * A) if A < 0 else max(l1, l2)
            d = lp - b["ref"][i][t].item()
            pg += keep * tok * weights[i][t].item() / den / len(LENGTHS)
            ent += keep * b["ent"][i][t].item() / den / len(LENGTHS)
            kl += keep * min(max(math.exp(-d) - 1 + d, -10), 10) / den / len(LENGTHS)
    assert m["pg_loss"] == pytest.approx(pg, abs=1e-12)
    assert m["entropy_loss"] == pytest.approx(ent, abs=1e-12) and m["kl_loss"] == pytest.approx(kl, abs=1e-12)
    assert loss.item() == pytest.approx(pg - cfg.entropy_coef * ent + cfg.kl_loss_coef * kl, abs=1e-12)
    assert ("rejected_frac" in m) == rejecting and ("tis" in m) == cfg.use_tis
    if rejecting:
        assert m["rejected_frac"] == pytest.approx(rejected, abs=1e-12) and 0 < rejected < 1
    _, plain = run(b, replace(ARGS, use_tis=False))
    assert m["pg_loss"] != pytest.approx(plain["pg_loss"])  # each variant changes this batch's loss


def test_corrections_at_step_one_change_nothing():
    """--ci-test step 1: the engine sampled with the trainer's weights (rollout == old log-probs), so every
    correction leaves the loss, its gradient and the first-step ppo_kl (0 on-policy) as they are without it."""
    b = batch()
    b["old"] = [x.detach().clone() for x in b["logp"]]  # the first step: old log-probs are this forward's
    b["rollout"] = [o.clone() for o in b["old"]]
    base = replace(ARGS, use_tis=False)

    def loss_and_grad(cfg):
        leaves = [x.detach().clone().requires_grad_(True) for x in b["logp"]]
        loss, m = run({**b, "logp": leaves}, cfg)
        return loss, torch.autograd.grad(loss, leaves), m

    want, want_g, want_m = loss_and_grad(base)
    for fields in CORRECTIONS:
        loss, grads, m = loss_and_grad(replace(base, **fields))
        assert loss.item() == want.item(), fields
        assert all(torch.equal(g, w) for g, w in zip(grads, want_g)), fields
        assert m["ppo_kl"] == 0.0 and m.get("tis_clipfrac", 0.0) == 0.0 and m.get("rejected_frac", 0.0) == 0.0


def test_rl_loss_on_policy_defaults_and_missing_inputs():
    b = batch()
    defaults = LossConfig.from_args(parser_defaults())
    loss, m = L.rl_loss(b["logp"], None, None, None, b["adv"], b["masks"], None, defaults)
    m = host(m)
    # on-policy: ratio 1 everywhere, nothing clipped, loss = -mean(A)
    assert m["pg_clipfrac"] == 0.0 and m["ppo_kl"] == 0.0
    want = -sum(
        sum(a * mk for a, mk in zip(adv.tolist(), ms.tolist())) / max(ms.sum().item(), 1)
        for adv, ms in zip(b["adv"], b["masks"])
    ) / len(LENGTHS)
    assert loss.item() == pytest.approx(want, abs=1e-12)
    assert "kl_loss" not in m and "train_rollout_logprob_abs_diff" not in m
    with pytest.raises(ValueError, match="use-kl-loss"):
        L.rl_loss(b["logp"], None, None, None, b["adv"], b["masks"], None, replace(defaults, use_kl_loss=True))
    with pytest.raises(ValueError, match="use-tis"):
        L.rl_loss(b["logp"], None, None, None, b["adv"], b["masks"], None, replace(defaults, use_tis=True))


def test_micro_batches_with_global_normalizer_equal_one_batch():
    b = batch()
    leaves = [x.clone().requires_grad_(True) for x in b["logp"]]
    b["logp"] = leaves
    whole, whole_m = run(b, ARGS)
    g_whole = torch.autograd.grad(whole, leaves)
    total, summed = 0.0, dict.fromkeys(whole_m, 0.0)
    for sl in (slice(0, 2), slice(2, 3), slice(3, 6)):
        part, part_m = run(b, ARGS, sl, normalizer=len(LENGTHS))
        part.backward()
        total += part.item()
        for k in summed:
            summed[k] += part_m[k]
    assert total == pytest.approx(whole.item(), abs=1e-12)
    for k in summed:
        assert summed[k] == pytest.approx(whole_m[k], abs=1e-12), k
    for x, c in zip(leaves, g_whole):
        a = x.grad
        assert torch.allclose(a, c, atol=1e-14)
    # without the normalizer, each micro-batch is its own mean and the sum is not the global mean
    unnormalised = sum(run(b, ARGS, sl)[0].item() for sl in (slice(0, 2), slice(2, 3), slice(3, 6)))
    assert unnormalised != pytest.approx(whole.item())


def test_value_rl_loss_matches_reference_and_splits():
    b = batch(4)
    vals, old, ret, ms = b["logp"], b["old"], b["ref"], b["masks"]
    loss, m = L.value_rl_loss(vals, old, ret, ms, 0.1)
    m = host(m)
    want_l = want_c = 0.0
    for i in range(len(LENGTHS)):
        den, sl, sc = max(ms[i].sum().item(), 1), 0.0, 0.0
        for t in range(LENGTHS[i]):
            if ms[i][t]:
                v, vo, g = vals[i][t].item(), old[i][t].item(), ret[i][t].item()
                vc = vo + min(max(v - vo, -0.1), 0.1)
                sl += max((v - g) ** 2, (vc - g) ** 2)
                sc += 1.0 if abs(v - vo) > 0.1 else 0.0  # slime's: the value moved past the clip
        want_l += sl / den / len(LENGTHS)
        want_c += sc / den / len(LENGTHS)
    assert loss.item() == pytest.approx(want_l, abs=1e-12) and m["value_loss"] == pytest.approx(want_l, abs=1e-12)
    assert m["value_clipfrac"] == pytest.approx(want_c, abs=1e-12) and 0 < want_c
    parts = sum(L.value_rl_loss(vals[s], old[s], ret[s], ms[s], 0.1, normalizer=6)[0].item()
                for s in (slice(0, 3), slice(3, 6)))
    assert parts == pytest.approx(want_l, abs=1e-12)


def test_loss_module_does_not_import_megatron():
    code = "import sys, slime_lite.backends.megatron.loss; assert 'megatron' not in sys.modules, 'megatron imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
