"""Packed micro-batches (--use-dynamic-batch-size): the plan (batch.py) and the model's packed forward
(attention.py): a sample's logits are those of the sample alone, whatever it is packed with."""

from __future__ import annotations

import pytest
import torch

from slime_lite.backends.megatron import batch as B
from slime_lite.io import free_port

torch.set_num_threads(1)


def _steps(n: int, g: int) -> list[list[int]]:  # unsplit samples: step k is samples [k*g, (k+1)*g)
    return [list(range(k, k + g)) for k in range(0, n, g)]


@pytest.mark.parametrize("dp", [1, 2, 4])
@pytest.mark.parametrize("max_tokens", [7, 30, 1000])
def test_dynamic_plan_covers_each_sample_once_within_the_budget(dp, max_tokens):
    g = torch.Generator().manual_seed(dp * 1000 + max_tokens)
    lengths = torch.randint(2, 20, (32,), generator=g).tolist()
    plans = [B.dynamic_step_shards(lengths, _steps(32, 16), r, dp, max_tokens) for r in range(dp)]
    for step in range(2):
        counts = {len(p[step]) for p in plans}
        assert len(counts) == 1  # every DP rank runs the same number of micro-batches
        seen = sorted(i for p in plans for mb in p[step] for i in mb)
        assert seen == list(range(step * 16, step * 16 + 16))
        for p in plans:
            for mb in p[step]:
                assert len(mb) == 1 or sum(lengths[i] for i in mb) <= max_tokens
    if max_tokens == 1000:  # everything fits: one micro-batch per rank, tokens balanced within the longest sample
        loads = [sum(lengths[i] for i in p[0][0]) for p in plans]
        assert all(len(p[0]) == 1 for p in plans) and max(loads) - min(loads) <= max(lengths)


@pytest.mark.parametrize("dynamic", [False, True], ids=["micro-batch-size", "dynamic"])
def test_balance_data_deals_equal_counts_and_shrinks_the_per_rank_flops_spread(dynamic):
    """--balance-data: each rank gets as many samples (micro-batches) as in-order dealing gives it, every sample
    once, and the spread of per-rank estimated FLOPs (linear plus quadratic in length) shrinks: with
    --micro-batch-size against in-order dealing (the long samples first in the rollout, as a sorted or grouped
    rollout has them, all land on rank 0: a 4x smaller spread at least), with packed micro-batches against their
    dealing by tokens (which leaves the quadratic part unbalanced)."""
    dp, g = 4, 32
    lengths = sorted(torch.randint(8, 400, (2 * g,), generator=torch.Generator().manual_seed(1)).tolist(),
                     reverse=True)
    costs = B.sample_flops(lengths, hidden_size=64)
    assert costs[0] == lengths[0] * (1 + lengths[0] / 384)

    def plans(balanced):
        c = costs if balanced else None
        if dynamic:
            return [B.dynamic_step_shards(lengths, _steps(2 * g, g), r, dp, 1000, c) for r in range(dp)]
        return [B.step_shards(_steps(2 * g, g), r, dp, 2, c) for r in range(dp)]

    spread = {}
    for balanced in (False, True):
        ranks = plans(balanced)
        for step in range(2):
            assert len({len(p[step]) for p in ranks}) == 1  # equal micro-batch counts
            assert sorted(i for p in ranks for mb in p[step] for i in mb) == list(range(step * g, step * g + g))
        if not dynamic:
            assert {len([i for mb in p[0] for i in mb]) for p in ranks} == {g // dp}  # equal sample counts
        flops = [sum(costs[i] for mb in p[0] for i in mb) for p in ranks]
        spread[balanced] = (max(flops) - min(flops)) / (sum(flops) / dp)
    assert spread[True] < spread[False] / (1.2 if dynamic else 4), spread


def _sample(tokens, response_length):
    from slime_lite.types import Sample

    return Sample(tokens=list(tokens), response_length=response_length)


def test_packed_micro_batch_restarts_positions():
    s = [_sample([5, 6, 7], 1), _sample([8, 9], 1)]
    mb = B.make_packed_micro_batch(s, [0, 1])
    assert mb.tokens.tolist() == [[5, 6, 7, 8, 9]] and mb.position_ids.tolist() == [[0, 1, 2, 0, 1]]
    assert mb.cu_seqlens.tolist() == [0, 3, 5] and mb.max_seqlen == 3 and mb.packed


@pytest.fixture(scope="module")
def tiny_gpt(tiny_model_dir):
    from transformers import AutoConfig

    from slime_lite.backends.megatron import parallel
    from slime_lite.backends.megatron.convert import load_hf_weights
    from slime_lite.backends.megatron.model import build_gpt_model

    parallel.init_distributed(1, 1, 0, 1, "127.0.0.1", free_port(), seed=3)
    hf = AutoConfig.from_pretrained(tiny_model_dir)
    model = build_gpt_model(hf)
    load_hf_weights(model, str(tiny_model_dir), hf)
    yield model.eval()
    parallel.destroy()


def _packed_logits(model, seqs):
    from slime_lite.backends.megatron.model import packed_seq_params

    mb = B.make_packed_micro_batch([_sample(s, 1) for s in seqs], list(range(len(seqs))))
    with torch.no_grad():
        out = model(mb.tokens, mb.position_ids, None, packed_seq_params=packed_seq_params(mb.cu_seqlens, mb.max_seqlen))
    return torch.split(out[0], [len(s) for s in seqs])


@pytest.mark.parametrize("backend", ["auto", "bucketed"])
def test_packed_forward_equals_each_sample_alone_and_is_batch_invariant(tiny_gpt, backend, monkeypatch):
    from slime_lite.backends.megatron.model import forward_logits

    monkeypatch.setenv("SLIME_LITE_PACKED_ATTENTION", backend)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 60, (n,), generator=g).tolist() for n in (9, 23, 5, 16)]
    packed = _packed_logits(tiny_gpt, seqs)
    vocab = tiny_gpt.hf_vocab_size
    for s, got in zip(seqs, packed):
        with torch.no_grad():
            alone = forward_logits(tiny_gpt, torch.tensor([s]))[0]
        torch.testing.assert_close(got[:, :vocab], alone, rtol=1e-5, atol=1e-5)
    # the same sample packed with other neighbours at another offset: bitwise the same logits
    again = _packed_logits(tiny_gpt, [seqs[3], seqs[1][:7], seqs[0]])
    assert torch.equal(again[0], packed[3]) and torch.equal(again[2], packed[0])


def test_bucketed_attention_equals_per_sample_attention_forward_and_backward():
    """The opt-in ``bucketed`` backend (samples of similar length padded into one SDPA call per bucket) gives each
    sample what per-sample SDPA gives it, values and gradients, GQA included, over several buckets."""
    from slime_lite.backends.megatron.attention import packed_causal_attention

    g = torch.Generator().manual_seed(1)
    lengths = [37, 5, 40, 1, 12, 33, 11, 64, 38]  # padded to 40, 5, 40, 1, 12, 40, 12, 64, 40
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    t = sum(lengths)
    base = [torch.randn(t, h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2)]
    outs, grads = [], []
    for backend in ("sdpa", "bucketed"):
        q, k, v = (x.clone().requires_grad_() for x in base)
        o = packed_causal_attention(q, k, v, cu, max(lengths), 0.3, backend)
        (o * torch.linspace(-1, 1, o.numel(), dtype=o.dtype).view_as(o)).sum().backward()
        outs.append(o.detach())
        grads.append([x.grad for x in (q, k, v)])
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-12, atol=1e-12)
    for a, b in zip(grads[1], grads[0]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    # a sample's rows are bitwise the same alone and next to another sample of its padded length (float32)
    x = [torch.randn(50, h, 16, generator=g) for h in (4, 2, 2)]
    y = [torch.randn(51, h, 16, generator=g) for h in (4, 2, 2)]
    alone = packed_causal_attention(*x, torch.tensor([0, 50]), 50, 0.25, "bucketed")
    both = packed_causal_attention(*(torch.cat([b, a]) for a, b in zip(x, y)), torch.tensor([0, 51, 101]), 51, 0.25,
                                   "bucketed")
    assert torch.equal(both[51:], alone)


def test_packed_rope_equals_megatrons_per_sample_rope():
    """attention.py's RoPE for packed rows (frequencies gathered once per micro-batch by position) gives bitwise
    what Megatron's own thd RoPE gives (one split per sample); rows not tagged with positions go to Megatron's."""
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer import attention as megatron_attention

    from slime_lite.backends.megatron.attention import (
        install_packed_rope,
        mark_packed_positions,
    )

    install_packed_rope()
    rope = megatron_attention.apply_rotary_pos_emb
    assert rope.slime_lite
    g = torch.Generator().manual_seed(2)
    bounds = [0, 7, 8, 30, 41]
    t = torch.randn(41, 3, 16, generator=g)
    freqs = torch.randn(30, 1, 1, 16, generator=g)
    config = type("C", (), {"apply_rope_fusion": False, "context_parallel_size": 1, "rotary_interleaved": False,
                                "multi_latent_attention": False})()
    group = type("G", (), {"size": lambda self: 1, "rank": lambda self: 0})()
    cu = torch.tensor(bounds, dtype=torch.int32)
    want = rope_utils._apply_rotary_pos_emb_thd(t, cu, freqs, cp_group=group)
    assert torch.equal(rope(t, freqs, config, cu_seqlens=cu, cp_group=group), want)  # untagged: Megatron's
    mark_packed_positions(cu, bounds)
    got = rope(t, freqs, config, cu_seqlens=cu, cp_group=group)
    assert torch.equal(got, want) and len(cu.slime_freqs) == 1
    assert torch.equal(rope(t, freqs, config, cu_seqlens=cu, cp_group=group), want)  # from the cache


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_packed_attention_backends_agree_on_cuda_in_bf16():
    """On CUDA in bf16 every packed backend this torch has (varlen, bucketed) gives per-sample SDPA's outputs and
    gradients within bf16 rounding, GQA included; prints each backend's largest difference."""
    from slime_lite.backends.megatron.attention import _varlen, packed_causal_attention

    g = torch.Generator(device="cuda").manual_seed(3)
    lengths = [300, 17, 1025, 64, 511, 2048, 5]
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
    base = [torch.randn(sum(lengths), h, 64, generator=g, device="cuda", dtype=torch.bfloat16) for h in (14, 2, 2)]
    weight = torch.randn(sum(lengths), 14, 64, generator=g, device="cuda", dtype=torch.bfloat16)
    res = {}
    for backend in ["sdpa", "bucketed"] + (["varlen"] if _varlen() is not None else []):
        q, k, v = (x.clone().requires_grad_() for x in base)
        o = packed_causal_attention(q, k, v, cu, max(lengths), 0.125, backend)
        (o.float() * weight.float()).sum().backward()
        res[backend] = [o.detach().float()] + [x.grad.float() for x in (q, k, v)]
    if _varlen() is not None:
        print("varlen: GQA heads passed without repeated k/v:", _varlen().native_gqa)
    for backend, got in res.items():
        diffs = [float((a - b).abs().max() / b.abs().max()) for a, b in zip(got, res["sdpa"])]
        print(f"{backend}: max |diff| / max |sdpa| of out, dq, dk, dv: {diffs}")
        assert max(diffs) < 2e-2, (backend, diffs)


# ------------------------------------------------------------------------- bad input, refused before Ray starts
@pytest.fixture()
def base(tmp_path):
    import json

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "1+1=", "label": "2"}\n')
    return ["--hf-checkpoint", str(model), "--prompt-data", str(data), "--rm-type", "addition"]


@pytest.mark.parametrize("extra,named", [
    (["--max-tokens-per-gpu", "64"], ["--max-tokens-per-gpu", "--use-dynamic-batch-size"]),
    (["--use-dynamic-batch-size"], ["--use-dynamic-batch-size", "--max-tokens-per-gpu"]),
    (["--use-dynamic-batch-size", "--max-tokens-per-gpu", "16", "--rollout-max-response-len", "32"],
     ["--max-tokens-per-gpu 16", "--rollout-max-response-len 32"]),
    (["--use-dynamic-batch-size", "--max-tokens-per-gpu", "64", "--log-probs-max-tokens-per-gpu", "8"],
     ["--log-probs-max-tokens-per-gpu 8", "--rollout-max-response-len"]),
    (["--use-dynamic-batch-size", "--max-tokens-per-gpu", "64", "--actor-num-gpus-per-node", "2",
      "--pipeline-model-parallel-size", "2"], ["--use-dynamic-batch-size", "--pipeline-model-parallel-size 2"]),
])
def test_bad_token_budgets_are_refused_naming_both_flags(base, extra, named):
    from slime_lite.args import parse_args
    from slime_lite.errors import SlimeLiteError

    with pytest.raises(SlimeLiteError) as info:
        parse_args(base + extra)
    assert all(n in str(info.value) for n in named), str(info.value)


def test_log_probs_budget_defaults_to_the_train_budget(base):
    from slime_lite.args import parse_args

    from slime_lite.config import TokenBudget

    args = parse_args(base + ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "64"])
    assert TokenBudget.from_args(args).tokens(log_probs=True) == 64
    assert args.log_probs_max_tokens_per_gpu is None  # the flag as given: the default is the budget's rule


def test_a_sample_longer_than_the_budget_is_a_micro_batch_of_its_own_in_runs_and_replays(caplog):
    """One rule (config.TokenBudget): the planner packs an over-budget sample alone, and the replay preflight
    accepts the same sample (logging it), so a run's own dumps replay with the same flags."""
    import logging
    from types import SimpleNamespace

    from slime_lite.config import TokenBudget
    from slime_lite.preflight import check_token_budget

    args = SimpleNamespace(use_dynamic_batch_size=True, max_tokens_per_gpu=10, log_probs_max_tokens_per_gpu=40)
    budget = TokenBudget.from_args(args)
    lengths = [8, 12, 3, 9]
    assert budget.alone(lengths) == [1] and budget.alone(lengths, log_probs=True) == []
    plan = B.dynamic_step_shards(lengths, _steps(len(lengths), 4), 0, 1, budget.tokens())
    assert [1] in plan[0] and all(sum(lengths[i] for i in mb) <= 10 for mb in plan[0] if mb != [1])
    with caplog.at_level(logging.INFO, logger="slime_lite.preflight"):
        check_token_budget(args, [_sample(range(8), 2), _sample(range(12), 4)], "d/0.pt")
    assert "d/0.pt: 1 sample(s) longer than --max-tokens-per-gpu 10 (e.g. sample 1, 12 tokens)" in caplog.text


def test_sample_tensors_pickle_as_one_buffer_and_come_back_equal():
    import pickle

    g = torch.Generator().manual_seed(0)
    d = B.SampleTensors((i, torch.randn(int(n), generator=g)) for i, n in enumerate(torch.randint(1, 40, (512,))))
    d[600] = torch.randn(2, 5, generator=g)  # [log-prob; entropy] rows keep their shape
    d[7] = torch.empty(0)  # a sample with no response token
    back = pickle.loads(pickle.dumps(d))
    assert isinstance(back, B.SampleTensors) and list(back) == list(d)
    for k in d:
        assert back[k].shape == d[k].shape and back[k].dtype == d[k].dtype and torch.equal(back[k], d[k])
    # one flat tensor, not 512 pickled tensors (each carries ~200 bytes of its own)
    assert len(pickle.dumps(d)) < len(pickle.dumps(dict(d))) / 2
    mixed = B.SampleTensors({0: torch.ones(2), 1: torch.ones(3, dtype=torch.float64)})
    back = pickle.loads(pickle.dumps(mixed))
    assert isinstance(back, B.SampleTensors) and back[1].dtype == torch.float64 and torch.equal(back[0], mixed[0])
    assert pickle.loads(pickle.dumps(B.SampleTensors())) == {}
    odd = B.SampleTensors({0: torch.ones(2, requires_grad=True), 1: None})  # kept as they are, not flattened
    back = pickle.loads(pickle.dumps(odd))
    assert back[0].requires_grad and back[1] is None


def test_the_train_rollout_comparison_leaves_out_tokens_of_older_weights():
    """A sample continued by --partial-rollout holds tokens of versions 2 and 3: only the version-3 ones (the
    newest in the batch) are compared with the trainer's log-probs; samples without per-token versions keep their
    loss masks."""
    import torch

    from slime_lite.backends.megatron.batch import newest_weight_masks
    from slime_lite.types import Sample

    continued = Sample(response_length=4, metadata={"token_weight_versions": [2, 2, 3, 3]})
    fresh = Sample(response_length=2, metadata={"token_weight_versions": [3, 3]})
    masks = [torch.tensor([1.0, 0.0, 1.0, 0.0]), torch.ones(2), torch.ones(3)]
    out = newest_weight_masks([continued, fresh, Sample(response_length=3)], masks)
    assert [m.tolist() for m in out] == [[0.0, 0.0, 1.0, 0.0], [1.0, 1.0], [1.0, 1.0, 1.0]]


@pytest.mark.parametrize("dp,micro", [(1, 1), (2, 1), (2, 2), (4, 2), (2, 3)])
@pytest.mark.parametrize("dynamic", [False, True], ids=["micro-batch-size", "dynamic"])
@pytest.mark.parametrize("balanced", [False, True], ids=["in-order", "balance-data"])
def test_steps_of_split_trajectories_keep_equal_micro_batch_counts(dp, micro, dynamic, balanced):
    """A step of G trajectories some of which were split holds any number of samples from G up: every rank still
    runs the same number of micro-batches, none empty, each sample once in its trajectory's step, micro-batches of at
    most --micro-batch-size samples (two where it is 1 and the count does not divide by the DP size: a rank cannot
    run an empty one), and within the token budget unless the samples are too few for that."""
    from slime_lite.types import Sample

    g = 4 * dp * micro
    gen = torch.Generator().manual_seed(dp * 10 + micro)
    parts = (1 + (torch.rand(3 * g, generator=gen) < 0.3).long() * torch.randint(1, 4, (3 * g,), generator=gen)).tolist()
    samples = [Sample(group_index=t, index=len(parts) * 10 + k, rollout_id=t if n > 1 else None, tokens=[1] * 5,
                      response_length=1) for t, n in enumerate(parts) for k in range(n)]
    for i, s in enumerate(samples):
        s.index = i
    steps = B.trajectory_steps(samples, g)
    assert len(steps) == 3 and sorted(i for st in steps for i in st) == list(range(len(samples)))
    for k, st in enumerate(steps):  # trajectories [k*g, (k+1)*g), all their samples
        assert {samples[i].group_index for i in st} == set(range(k * g, (k + 1) * g))
    lengths = torch.randint(2, 30, (len(samples),), generator=gen).tolist()
    costs = B.sample_flops(lengths, 64) if balanced else None
    plans = [B.dynamic_step_shards(lengths, steps, r, dp, 40, costs) if dynamic
             else B.step_shards(steps, r, dp, micro, costs) for r in range(dp)]
    for k, st in enumerate(steps):
        assert len({len(p[k]) for p in plans}) == 1
        assert sorted(i for p in plans for mb in p[k] for i in mb) == sorted(st)
        for p in plans:
            for mb in p[k]:
                assert mb
                if not dynamic:
                    assert len(mb) <= max(micro, 2 if len(st) % dp else 1)
                elif dp * len(p[k]) < len(st) // dp * dp:  # fewer micro-batches than the most: the budget held
                    assert len(mb) == 1 or sum(lengths[i] for i in mb) <= 40
    with pytest.raises(ValueError, match="trajectories do not split into steps of"):
        B.trajectory_steps(samples[:-parts[-1]], g)


def test_an_odd_step_over_two_ranks_with_one_sample_micro_batches_pairs_two_samples():
    assert [B.step_shards([[0, 1, 2, 3, 4]], r, 2, 1) for r in range(2)] == [[[[0, 1], [2]]], [[[3], [4]]]]
    assert [B.dynamic_step_shards([50, 50, 50], [[0, 1, 2]], r, 2, 10) for r in range(2)] == [[[[0, 2]]], [[[1]]]]
