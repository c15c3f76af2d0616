"""backends/megatron/logprobs.py: chunked (and TP vocab-parallel) log-probs and entropy equal the plain
full-vocabulary float32 computation, values and gradients, so no [tokens, vocab] float32 tensor is needed."""

from __future__ import annotations

import pytest
import torch

from slime_lite.backends.megatron.logprobs import token_log_probs
from slime_lite.backends.megatron.loss import token_log_probs_and_entropy
from slime_lite.io import free_port

VOCAB, PADDED, ROWS = 37, 38, 29  # padded to a multiple of TP=2, as Megatron does


def _data():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(ROWS + 1, PADDED, generator=g) * 2
    tokens = torch.randint(0, VOCAB, (ROWS + 1,), generator=g)
    return logits, tokens


def _reference(logits, tokens, temp):
    """The unchunked computation: full float32 [tokens, vocab] (loss.py's), real vocabulary only. Its entropy
    (lse - E[z]) loses digits to cancellation, so entropy and gradients are checked against float64."""
    lp, _ = token_log_probs_and_entropy(logits[:, :VOCAB], tokens, temp)
    x = logits[:, :VOCAB].double().requires_grad_(True)
    logp = torch.log_softmax(x[:-1] / temp, -1)
    ent = -(logp.exp() * logp).sum(-1)
    (logp.gather(-1, tokens[1:, None]).sum() + 0.3 * ent.sum()).backward()
    return lp, ent.float().detach(), torch.cat([x.grad.float(), torch.zeros(x.shape[0], PADDED - VOCAB)], -1)


@pytest.mark.parametrize("chunk", [1, 4, 1000])
def test_chunked_equals_full(chunk):
    logits, tokens = _data()
    ref_lp, ref_ent, ref_grad = _reference(logits, tokens, 0.7)
    x = logits.clone().requires_grad_(True)
    lp, ent = token_log_probs(x[:-1], tokens[1:], 0.7, True, vocab_limit=VOCAB, chunk_tokens=chunk)
    (lp.sum() + 0.3 * ent.sum()).backward()
    torch.testing.assert_close(lp, ref_lp, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad, ref_grad, rtol=1e-6, atol=1e-7)
    with torch.no_grad():  # forward-only gives the same values
        lp2, _ = token_log_probs(logits[:-1], tokens[1:], 0.7, False, vocab_limit=VOCAB, chunk_tokens=chunk)
    assert torch.equal(lp2, lp.detach())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_entropy", [False, True])
def test_gradient_of_the_log_probs_alone_and_in_the_logits_dtype(with_entropy, dtype):
    """Log-probs only (no entropy output; or entropy returned but left out of the loss), in float32 and bf16 logits:
    the gradient (written in the logits' dtype, one rounding) matches float64 autograd of the same values."""
    logits, tokens = _data()
    logits = logits.to(dtype)
    x = logits[:, :VOCAB].double().requires_grad_(True)
    torch.log_softmax(x[:-1] / 0.7, -1).gather(-1, tokens[1:, None]).sum().backward()
    ref = torch.cat([x.grad, torch.zeros(x.shape[0], PADDED - VOCAB, dtype=torch.float64)], -1)
    y = logits.clone().requires_grad_(True)
    lp, _ = token_log_probs(y[:-1], tokens[1:], 0.7, with_entropy, vocab_limit=VOCAB, chunk_tokens=4)
    lp.sum().backward()
    assert y.grad.dtype == dtype
    tol = {"rtol": 1e-6, "atol": 1e-7} if dtype == torch.float32 else {"rtol": 2 ** -8, "atol": 1e-6}
    torch.testing.assert_close(y.grad.double(), ref, **tol)


def _tp_rank(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    logits, tokens = _data()
    width = PADDED // 2
    x = logits[:, rank * width : (rank + 1) * width].clone().requires_grad_(True)
    lp, ent = token_log_probs(x[:-1], tokens[1:], 0.7, True, vocab_start=rank * width, vocab_limit=VOCAB,
                              tp_group=dist.group.WORLD, chunk_tokens=5)
    (lp.sum() + 0.3 * ent.sum()).backward()
    torch.save({"lp": lp.detach(), "ent": ent.detach(), "grad": x.grad}, f"{out}/{rank}.pt")
    dist.destroy_process_group()


def test_tp2_vocab_parallel_equals_full(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_tp_rank, args=(free_port(), str(tmp_path)), nprocs=2)
    logits, tokens = _data()
    ref_lp, ref_ent, ref_grad = _reference(logits, tokens, 0.7)
    parts = [torch.load(tmp_path / f"{r}.pt") for r in range(2)]
    for p in parts:  # every TP rank ends with the whole answer
        torch.testing.assert_close(p["lp"], ref_lp, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(p["ent"], ref_ent, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(torch.cat([p["grad"] for p in parts], -1), ref_grad, rtol=1e-6, atol=1e-7)


def test_a_tp_slice_of_padding_only_adds_nothing():
    """A TP rank whose vocabulary slice lies wholly past the real vocabulary (a tiny vocabulary split many ways)
    contributes nothing: no error, and a zero gradient."""
    x = torch.randn(3, 16, requires_grad=True)
    lp, ent = token_log_probs(x, torch.tensor([1, 2, 3]), 1.0, True, vocab_start=32, vocab_limit=20)
    assert lp.shape == ent.shape == (3,)
    (lp.sum() + ent.sum()).backward()
    assert torch.equal(x.grad, torch.zeros_like(x))
