"""The engine's sampler: draws follow the tempered, truncated distribution; log-probs ignore the truncation."""

from __future__ import annotations

import torch

from slime_lite.engine.sampling import SamplingParams, sample

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
N = 4000


def draw(**params) -> tuple[torch.Tensor, torch.Tensor]:
    p = SamplingParams(**params)
    return sample(LOGITS.repeat(N, 1), [p] * N, list(range(N)), [0] * N)


def test_draw_frequencies_match_the_tempered_distribution():
    tokens, logprobs = draw(temperature=0.7)
    expected = torch.softmax(LOGITS / 0.7, -1)
    freq = torch.bincount(tokens, minlength=5).float() / N
    assert (freq - expected).abs().max() < 0.03
    assert torch.allclose(logprobs, torch.log_softmax(LOGITS / 0.7, -1)[tokens])


def test_top_k_top_p_min_p_restrict_support_but_not_logprobs():
    tokens, logprobs = draw(top_k=2)
    assert set(tokens.tolist()) == {0, 1}
    assert torch.allclose(logprobs, torch.log_softmax(LOGITS, -1)[tokens])
    probs = torch.softmax(LOGITS, -1)  # 0.57, 0.21, 0.13, ...: top_p 0.7 keeps the first two
    assert set(draw(top_p=0.7)[0].tolist()) == {0, 1}
    assert set(draw(min_p=0.3)[0].tolist()) == {0, 1} and probs[1] / probs[0] > 0.3 > probs[2] / probs[0]


def test_same_seed_and_step_give_the_same_token_in_any_batch():
    p = SamplingParams()
    alone = sample(LOGITS[None], [p], [42], [7])[0]
    mixed = sample(torch.stack([LOGITS.flip(0), LOGITS]), [p, p], [1, 42], [3, 7])[0]
    assert alone.item() == mixed[1].item()


def test_greedy_rows_take_the_argmax_and_bans_apply():
    tokens, _ = sample(LOGITS.repeat(2, 1), [SamplingParams(temperature=0.0)] * 2, [0, 1], [0, 0], [[], [0]])
    assert tokens.tolist() == [0, 1]


def test_block_inverse_cdf_equals_a_full_cumsum_search():
    from slime_lite.engine.sampling import _inverse_cdf

    gen = torch.Generator().manual_seed(0)
    for vocab in (5, 1000, 1024, 3001):  # under, at and over one block; a partial last block
        probs = torch.softmax(torch.randn(64, vocab, generator=gen) * 3, -1)
        probs[:, ::7] = 0  # zero-probability tokens (banned, truncated) are never drawn
        u = torch.rand(64, dtype=torch.float64, generator=gen)
        cdf = probs.double().cumsum(-1)
        want = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0].clamp(max=vocab - 1)
        got = _inverse_cdf(probs, u)
        assert torch.equal(got, want)
        assert (got % 7 != 0).all()
        probs[:, vocab // 2 :] = 0  # a truncated tail: u at the very top must not land in it
        top = _inverse_cdf(probs, torch.full((64,), 1 - 2**-53, dtype=torch.float64))
        assert (probs.gather(1, top[:, None]) > 0).all() and (top < vocab // 2).all()


def test_vectorized_uniforms_and_tensor_sampler_equal_the_scalar_ones():
    from slime_lite.engine.sampling import sample_rows, uniform, uniforms

    seeds, steps = [0, 1, 2**63 - 1, 123456789] * 8, list(range(32))
    assert uniforms(seeds, steps) == [uniform(a, b) for a, b in zip(seeds, steps)]
    logits = torch.randn(32, 50, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=[1.0, 0.7, 0.0, 1.3][i % 4]) for i in range(32)]
    want = sample(logits, params, seeds, steps)
    temps = torch.tensor([1.0 if p.greedy else p.temperature for p in params])
    got = sample_rows(logits, temps, torch.tensor(uniforms(seeds, steps), dtype=torch.float64),
                      torch.tensor([p.greedy for p in params]))
    assert torch.equal(got[0], want[0])
    assert torch.allclose(got[1], want[1], atol=1e-6)


def check_triton_sample(device: str, dtypes) -> None:
    """The sampler's two Triton kernels (``block_stats.triton_sample``) draw the tokens the eager ``sample_rows``
    draws on the CPU, with the same log-probs: plain and greedy rows, temperatures, uniforms at both ends, ties (the
    first index, as torch.argmax), a block of -inf logits, a partial last block and whole blocks."""
    from slime_lite.engine import block_stats
    from slime_lite.engine.sampling import BLOCK, sample_rows

    gen = torch.Generator().manual_seed(0)
    rows = 24
    temps = torch.tensor([1.0, 0.7, 1.0, 0.5, 1.0, 2.0, 1.3, 1.0] * 3)
    greedy = torch.tensor([False, False, True, False, False, True, False, False] * 3)
    u = torch.rand(rows, dtype=torch.float64, generator=gen)
    u[0], u[1] = 0.0, 1 - 2**-53
    for dtype in dtypes:
        for vocab in (5000, 3072):  # a partial last block; whole blocks
            logits = (torch.randn(rows, vocab, generator=gen) * 3).to(dtype)
            logits[2, 1500] = logits[2, 2600] = 50  # a tie across blocks: the first index, as torch.argmax
            logits[5, 10] = logits[5, 20] = 60  # and a tie inside one block
            logits[4, :BLOCK] = float("-inf")  # a block of -inf logits weighs 0, not NaN
            want_tok, want_lp = sample_rows(logits, temps, u, greedy)  # CPU: the eager passes
            dev = torch.device(device)
            tok, lp = block_stats.triton_sample(logits.to(dev), temps.to(dev), u.to(dev), greedy.to(dev), BLOCK)
            assert tok[2].item() == 1500 and tok[5].item() == 10
            assert torch.equal(tok.cpu(), want_tok), (dtype, vocab, tok.cpu() - want_tok)
            assert not lp.isnan().any() and torch.allclose(lp.cpu(), want_lp, atol=2e-5, rtol=0)
            assert (tok[4].item() >= BLOCK or greedy[4]) and lp.dtype == torch.float32
            # as a captured step calls them: float64 rows of temperatures and greedy flags, the draws written
            # straight into the columns of a float64 buffer wider than the batch
            out = torch.full((2, rows + 3), -7.0, dtype=torch.float64, device=dev)
            as_f64 = [t.to(dev, torch.float64) for t in (temps, greedy)]
            block_stats.triton_sample(logits.to(dev), as_f64[0], u.to(dev), as_f64[1], BLOCK, out=out)
            assert torch.equal(out[0, :rows].cpu(), want_tok.double()), (dtype, vocab)
            assert torch.equal(out[1, :rows].cpu(), lp.double().cpu())  # the same bits as the float32 log-probs
            assert (out[:, rows:] == -7).all()  # the columns past the batch are left alone


def _triton_sample_on_cpu() -> None:
    """Run by ``test_the_sampler_kernels_in_the_triton_interpreter`` with TRITON_INTERPRET=1, in float32 and float16
    (the interpreter keeps bf16 as raw integers; the GPU test adds bf16)."""
    check_triton_sample("cpu", (torch.float32, torch.float16))


def test_the_sampler_kernels_in_the_triton_interpreter():
    from tests.triton_interpreter import run_interpreted

    run_interpreted("tests.engine.test_sampling:_triton_sample_on_cpu")


def test_top_p_shares_out_the_mass_the_min_new_tokens_ban_leaves():
    """SGLang bans stop tokens in the logits, before the softmax: top-p keeps its share of the tokens left, even
    when a banned token held most of the mass; the log-prob stays that of the unbanned distribution."""
    logits = torch.tensor([5.0, 2.0, 1.9, 0.0, 0.0, 0.0, 0.0, 0.0])  # token 0 (banned) holds 0.89 of the mass
    n = 400
    tokens, logprobs = sample(logits.repeat(n, 1), [SamplingParams(top_p=0.5)] * n, list(range(n)), [0] * n,
                              [[0]] * n)
    assert set(tokens.tolist()) == {1, 2}  # 0.39 and 0.35 of what is left
    assert torch.allclose(logprobs, torch.log_softmax(logits, -1)[tokens])


def test_a_row_keeps_its_whole_support_next_to_a_row_asking_top_p():
    """top_p = 1 truncates nothing, whatever the other rows of the batch ask (float32 cumsums pass 1.0 in a large
    vocabulary's tail: a batch-wide top-p pass dropped those tokens from rows that did not ask for it)."""
    from slime_lite.engine.sampling import _truncate

    logp = torch.log_softmax(torch.randn(8, 32000, generator=torch.Generator().manual_seed(0)) * 3, -1)
    plain, top_p = SamplingParams(top_k=32000), SamplingParams(top_p=0.5)
    alone = _truncate(logp, logp, [plain] * 8, True, False)
    both = torch.cat([logp, logp[:1]])
    mixed = _truncate(both, both, [plain] * 8 + [top_p], True, True)
    assert torch.isfinite(alone).all()  # top_k = the vocabulary keeps every token
    assert torch.equal(mixed[:8], alone)
