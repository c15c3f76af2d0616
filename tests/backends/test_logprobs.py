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


def _float64_reference(logits, targets, temp, vocab, g_ent):
    """log p, entropy and d(sum log p + g_ent * sum H)/d logits in float64 over the real vocabulary."""
    x = logits.double().requires_grad_(True)
    logp = torch.log_softmax(x[:, :vocab] / temp, -1)
    ent = -(logp.exp() * logp).sum(-1)
    lp = logp.gather(-1, targets[:, None]).squeeze(-1)
    (lp.sum() + g_ent * ent.sum()).backward()
    return lp.detach(), ent.detach(), x.grad


@pytest.mark.parametrize(
    "dtype,vocab,columns,temp,with_entropy",
    [(torch.bfloat16, 151936, 151936, 1.0, True),    # Qwen2.5's vocabulary: 38 blocks of 4,096 per row
     (torch.bfloat16, 151900, 151936, 0.7, False),   # padding columns, a temperature, log-probs only
     (torch.float32, 5000, 5003, 0.7, True),         # float32 logits, a short last block
     (torch.float16, 37, 38, 1.3, True)],            # one block narrower than the row
)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_kernels_match_float64_and_the_torch_path(dtype, vocab, columns, temp, with_entropy):
    pytest.importorskip("triton")
    from slime_lite.backends.megatron import logprobs_fused

    g = torch.Generator(device="cuda").manual_seed(1)
    logits = (torch.randn(67, columns, generator=g, device="cuda") * 3).to(dtype)
    targets = torch.randint(0, vocab, (67,), generator=g, device="cuda")
    assert logprobs_fused.available(logits)
    ref_lp, ref_ent, ref_grad = _float64_reference(logits, targets, temp, vocab, 0.3 if with_entropy else 0.0)
    out = {}
    for fused in (True, False):
        x = logits.clone().requires_grad_(True)
        lp, ent = token_log_probs(x, targets, temp, with_entropy, vocab_limit=vocab, fused=fused)
        (lp.sum() + (0.3 * ent.sum() if with_entropy else 0)).backward()
        assert x.grad.dtype == dtype
        out[fused] = (lp.detach(), ent, x.grad)
        torch.testing.assert_close(lp.double(), ref_lp, rtol=1e-5, atol=2e-5)
        if with_entropy:
            torch.testing.assert_close(ent.detach().double(), ref_ent, rtol=1e-5, atol=2e-5)
        tol = {"rtol": 1e-5, "atol": 1e-7} if dtype == torch.float32 else {"rtol": 2 ** -7, "atol": 1e-6}
        torch.testing.assert_close(x.grad.double(), ref_grad, **tol)
    assert torch.equal(out[True][2][:, vocab:], torch.zeros_like(out[True][2][:, vocab:]))  # padding: no gradient
    with torch.no_grad():  # the log-prob pass (no grad) gives the train pass's values, bit for bit
        lp_nograd, _ = token_log_probs(logits, targets, temp, False, vocab_limit=vocab)
    assert torch.equal(lp_nograd, out[True][0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_rows_kernel_result_does_not_depend_on_its_batch():
    """Each row is reduced on its own: the same row alone, at another place or in a larger batch gives the same bits
    (log-probs, entropy, gradient), as the log-prob and train passes need when their micro-batches differ."""
    pytest.importorskip("triton")
    g = torch.Generator(device="cuda").manual_seed(2)
    logits = (torch.randn(300, 151936, generator=g, device="cuda") * 3).to(torch.bfloat16)
    targets = torch.randint(0, 151936, (300,), generator=g, device="cuda")

    def run(rows):
        x = logits[rows].clone().requires_grad_(True)
        lp, ent = token_log_probs(x, targets[rows], 1.0, True, vocab_limit=151936)
        (lp.sum() + 0.3 * ent.sum()).backward()
        return lp.detach(), ent.detach(), x.grad

    whole = run(torch.arange(300, device="cuda"))
    for rows in (torch.arange(7, 9, device="cuda"), torch.tensor([299, 5, 42], device="cuda")):
        for a, b in zip(run(rows), whole):
            assert torch.equal(a, b[rows])


def _tp_rank_cuda(rank: int, port: int, out: str) -> None:
    """A TP=2 rank on the one GPU (gloo all-reduces CUDA tensors through the host): the kernels on its vocabulary
    slice, combined over the group."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    g = torch.Generator(device="cuda").manual_seed(3)
    logits = (torch.randn(41, 2 * 8192, generator=g, device="cuda") * 3).to(torch.bfloat16)
    targets = torch.randint(0, 16000, (41,), generator=g, device="cuda")
    x = logits[:, rank * 8192: (rank + 1) * 8192].clone().requires_grad_(True)
    lp, ent = token_log_probs(x, targets, 0.7, True, vocab_start=rank * 8192, vocab_limit=16000,
                              tp_group=dist.group.WORLD, fused=True)
    (lp.sum() + 0.3 * ent.sum()).backward()
    torch.save({"lp": lp.detach().cpu(), "ent": ent.detach().cpu(), "grad": x.grad.cpu(), "logits": logits.cpu(),
                "targets": targets.cpu()}, f"{out}/{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_kernels_over_two_tp_vocabulary_slices(tmp_path):
    """TP=2 vocab-parallel with the kernels (two processes on one GPU, the second slice partly padding) equals the
    float64 computation over the whole vocabulary on every rank, and the slices' gradients join into the whole one."""
    pytest.importorskip("triton")
    import torch.multiprocessing as mp

    mp.spawn(_tp_rank_cuda, args=(free_port(), str(tmp_path)), nprocs=2)
    parts = [torch.load(tmp_path / f"{r}.pt") for r in range(2)]
    ref_lp, ref_ent, ref_grad = _float64_reference(parts[0]["logits"], parts[0]["targets"], 0.7, 16000, 0.3)
    for p in parts:
        torch.testing.assert_close(p["lp"].double(), ref_lp, rtol=1e-5, atol=2e-5)
        torch.testing.assert_close(p["ent"].double(), ref_ent, rtol=1e-5, atol=2e-5)
    grad = torch.cat([p["grad"] for p in parts], -1).double()
    torch.testing.assert_close(grad, ref_grad, rtol=2 ** -7, atol=1e-6)


def _kernels_on_cpu() -> None:
    """Run by ``test_the_kernels_in_the_triton_interpreter`` in a process with TRITON_INTERPRET=1: the kernels on CPU
    tensors (float32 and float16 logits; several blocks per row, padding columns, a temperature) against float64
    and against the torch path, values and gradients; a row alone gives the bits it gives in its batch."""
    from slime_lite.backends.megatron import logprobs_fused

    for dtype, vocab, columns, temp, with_entropy in [(torch.float32, 9000, 9003, 0.7, True),
                                                        (torch.float16, 37, 38, 1.0, False)]:
        g = torch.Generator().manual_seed(4)
        logits = (torch.randn(6, columns, generator=g) * 3).to(dtype)
        targets = torch.randint(0, vocab, (6,), generator=g)
        ref_lp, ref_ent, ref_grad = _float64_reference(logits, targets, temp, vocab, 0.3 if with_entropy else 0.0)
        grads = {}
        for fused in (True, False):
            x = logits.clone().requires_grad_(True)
            if fused:
                lp, ent = logprobs_fused.token_log_probs(x, targets, temp, with_entropy, 0, vocab, None)
            else:
                lp, ent = token_log_probs(x, targets, temp, with_entropy, vocab_limit=vocab, fused=False)
            (lp.sum() + (0.3 * ent.sum() if with_entropy else 0)).backward()
            torch.testing.assert_close(lp.double(), ref_lp, rtol=1e-5, atol=2e-5)
            if with_entropy:
                torch.testing.assert_close(ent.detach().double(), ref_ent, rtol=1e-5, atol=2e-5)
            tol = 1e-5 if dtype == torch.float32 else 2e-3
            torch.testing.assert_close(x.grad.double(), ref_grad, rtol=tol, atol=1e-7)
            grads[fused] = x.grad
        assert torch.equal(grads[True][:, vocab:], torch.zeros_like(grads[True][:, vocab:]))
        alone, _ = logprobs_fused.token_log_probs(logits[3:4], targets[3:4], temp, False, 0, vocab, None)
        batch, _ = logprobs_fused.token_log_probs(logits, targets, temp, False, 0, vocab, None)
        assert torch.equal(alone, batch[3:4])


def test_the_kernels_in_the_triton_interpreter():
    """The Triton kernels' logic runs in CI too (on the CPU, in Triton's interpreter); the GPU tests above add bf16,
    the real compiler and TP over a process group."""
    from tests.triton_interpreter import run_interpreted

    run_interpreted("tests.backends.test_logprobs:_kernels_on_cpu")
