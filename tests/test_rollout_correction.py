"""Rollout correction (TIS / MIS / rejection) and the train-rollout mismatch metrics against float64 references
written as plain loops (the ragged samples and masks of test_rl_math)."""

from __future__ import annotations

import math

import pytest
import torch

from slime_lite import rollout_correction
from tests.test_rl_math import close, masks, ragged, tolist

torch.set_num_threads(1)


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


def test_mismatch_metrics_without_rollout_log_probs_are_left_out_with_a_warning(caplog):
    """--get-mismatch-metrics (which the doctor always asks for) over samples a generate hook gave no rollout
    log-probs: no mismatch/* metrics and a warning, not a crash of the train step."""
    from types import SimpleNamespace

    from slime_lite.backends.megatron.actor import TrainActor

    stub = SimpleNamespace(args=SimpleNamespace())
    assert TrainActor._mismatch(stub, 0, [], [], None, []) == {}
    assert TrainActor._mismatch(stub, 1, [], [], None, []) == {}
    assert caplog.text.count("no rollout log-probs") == 1  # once
