"""backends/megatron/fused_ops.py: the trainer's SwiGLU and RoPE kernels against the eager ops they replace (Megatron's
unfused glu and ``_apply_rotary_pos_emb_bshd``), forward and backward. On the CPU in Triton's interpreter
(tests/triton_interpreter.py: float32 and float16); on a GPU (skipped without CUDA) compiled, in bf16, and a whole
train step of the tiny model with the kernels against the same step without them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F


def _eager_swiglu(x):
    gate, up = torch.chunk(x, 2, dim=-1)
    return F.silu(gate) * (up + 0.0)  # Megatron's unfused glu (glu_linear_offset 0.0)


def _eager_rope(t, freqs, interleaved):
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    return _apply_rotary_pos_emb_bshd(t.unsqueeze(1), freqs[:, None, None, :], rotary_interleaved=interleaved)[:, 0]


def _freqs(tokens, rot, device, interleaved, g):
    """float32 angles laid out as Megatron's rotary embedding lays them (each frequency twice)."""
    angle = torch.rand(tokens, rot // 2, generator=g) * 6.3
    return (angle.repeat_interleave(2, -1) if interleaved else torch.cat((angle, angle), -1)).to(device)


def check(device: str, dtype: torch.dtype, exact: bool) -> None:
    """Forward and backward of both kernels against the eager ops. RoPE: bit for bit (``exact``: the interpreter) or
    within one rounding step of ``dtype`` (compiled: the compiler may fuse a product into a sum). SwiGLU: within a
    few float32 rounding steps before the final rounding (torch's ``exp`` and ``silu`` are not Triton's)."""
    from slime_lite.backends.megatron import fused_ops

    g = torch.Generator().manual_seed(0)
    step = torch.finfo(dtype).eps

    def same(got, want, scale, exact=exact):
        if exact:
            assert torch.equal(got, want), (got - want).abs().max()
        else:
            torch.testing.assert_close(got, want, rtol=step, atol=step * scale)

    x = (torch.randn(5, 2 * 1100, generator=g) * 3).to(dtype).to(device)  # gate/up wider than one block
    dy = torch.randn(5, 1100, generator=g).to(dtype).to(device)
    got_x, want_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    got, want = fused_ops.swiglu(got_x), _eager_swiglu(want_x)
    tol = max(step, 4 * torch.finfo(torch.float32).eps)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item())
    got.backward(dy)
    want.backward(dy)
    torch.testing.assert_close(got_x.grad, want_x.grad, rtol=tol, atol=tol * want_x.grad.abs().max().item())
    for d, rot, interleaved in ((32, 32, False), (40, 20, True), (24, 24, True)):  # GLM4: half the head, in pairs
        base = (torch.randn(6, 5, d, generator=g) * 2).to(dtype).to(device)
        freqs = _freqs(6, rot, device, interleaved, g)
        cos, sin = torch.cos(freqs).to(dtype), torch.sin(freqs).to(dtype)  # as Megatron rounds them
        gout = torch.randn(6, 3, d, generator=g).to(dtype).to(device)
        got_t, want_t = base.clone().requires_grad_(), base.clone().requires_grad_()
        got = fused_ops.rope(got_t[:, 1:4], cos, sin, interleaved)  # a strided view: 3 of 5 heads
        want = _eager_rope(want_t[:, 1:4], freqs, interleaved)
        assert got.shape == want.shape and got.is_contiguous()
        same(got, want, 4 * base.abs().max().item())
        got.backward(gout)
        want.backward(gout)
        same(got_t.grad, want_t.grad, 4 * gout.abs().max().item())
        if rot < d:
            assert torch.equal(got[..., rot:], base[:, 1:4, rot:])  # past the rotary dims: as it was


def _kernels_on_cpu() -> None:
    """Run by ``test_the_kernels_in_the_triton_interpreter`` with TRITON_INTERPRET=1 (CPU tensors count as CUDA)."""
    from slime_lite.backends.megatron import fused_ops

    fused_ops.available = lambda x: True
    check("cpu", torch.float32, exact=True)
    check("cpu", torch.float16, exact=True)


def test_the_kernels_in_the_triton_interpreter():
    from tests.triton_interpreter import run_interpreted

    run_interpreted("tests.backends.test_fused_ops:_kernels_on_cpu")


def test_without_the_kernels_the_mlp_computes_megatrons_unfused_glu():
    """CPU (and ``ENABLED = False``): the dense MLP's ``bias_activation_fusion`` path is the eager glu, bit for bit."""
    from slime_lite.backends.megatron import fused_ops

    x = torch.randn(7, 2 * 48, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(2 * 48, generator=torch.Generator().manual_seed(2))
    assert not fused_ops.available(x)
    assert torch.equal(fused_ops._swiglu_impl(x, None, False, False), _eager_swiglu(x))
    assert torch.equal(fused_ops._swiglu_impl(x, bias, False, False), _eager_swiglu(x + bias))


def test_a_linear_with_a_bias_is_one_f_linear_where_the_kernels_run(monkeypatch):
    """ColumnParallelLinear with a bias (Qwen2's q/k/v): where ``available`` (here forced on the CPU), one
    ``F.linear`` and not Megatron's autograd function; the same output and gradients to float32 rounding. Without
    (the CPU, ``ENABLED = False``) or without a bias, Megatron's function as before."""
    from megatron.core import ModelParallelConfig
    from megatron.core.tensor_parallel import layers

    from slime_lite.backends.megatron import fused_ops, parallel
    from slime_lite.io import free_port

    parallel.init_distributed(1, 1, 0, 1, "127.0.0.1", free_port(), seed=3)
    try:
        fused_ops.install_swiglu()
        fused_ops.install_swiglu()  # idempotent: one wrapper, not two
        assert layers.ColumnParallelLinear._forward_impl.slime_lite
        calls = []
        real = layers.LinearWithGradAccumulationAndAsyncCommunication.apply
        monkeypatch.setattr(layers.LinearWithGradAccumulationAndAsyncCommunication, "apply",
                            lambda *a: calls.append(1) or real(*a))
        torch.manual_seed(0)
        x = torch.randn(5, 2, 16)
        runs = {}
        for name, bias, forced in (("megatron", True, False), ("f.linear", True, True), ("no bias", False, True)):
            monkeypatch.setattr(fused_ops, "available", lambda t, forced=forced: forced)
            torch.manual_seed(1)
            lin = layers.ColumnParallelLinear(16, 24, config=ModelParallelConfig(), init_method=torch.nn.init.normal_,
                                              bias=bias, gather_output=False, skip_bias_add=False)
            if bias:
                torch.nn.init.normal_(lin.bias)
            xi = x.clone().requires_grad_()
            before = len(calls)
            out, _ = lin(xi)
            out.square().sum().backward()
            runs[name] = (len(calls) - before, out, xi.grad, lin.weight.grad, lin.bias.grad if bias else None)
        assert [runs[n][0] for n in ("megatron", "f.linear", "no bias")] == [1, 0, 1]
        for a, b in zip(runs["megatron"][1:], runs["f.linear"][1:]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    finally:
        parallel.destroy()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_kernels_compiled_on_a_gpu(dtype):
    check("cuda", dtype, exact=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_train_step_with_the_kernels_gives_the_loss_and_gradients_without_them(tiny_model_dir, monkeypatch):
    """The tiny model in bf16 on packed rows, forward + backward with the kernels and with Megatron's ops: the same
    loss and gradient norm within bf16 rounding."""
    from transformers import AutoConfig

    from slime_lite.backends.megatron import batch as B
    from slime_lite.backends.megatron import fused_ops, parallel
    from slime_lite.backends.megatron.convert import load_hf_weights
    from slime_lite.backends.megatron.model import build_gpt_model, packed_seq_params
    from slime_lite.io import free_port

    parallel.init_distributed(1, 1, 0, 1, "127.0.0.1", free_port(), seed=3)
    try:
        hf = AutoConfig.from_pretrained(tiny_model_dir)
        model = build_gpt_model(hf, params_dtype=torch.bfloat16)
        load_hf_weights(model, str(tiny_model_dir), hf)
        g = torch.Generator().manual_seed(0)
        seqs = [torch.randint(0, 60, (n,), generator=g).tolist() for n in (90, 230, 50, 160)]
        samples = [type("S", (), {"tokens": s, "response_length": 1})() for s in seqs]
        mb = B.make_packed_micro_batch(samples, list(range(len(seqs))))
        tokens, positions = mb.tokens.cuda(), mb.position_ids.cuda()
        runs = []
        for enabled in (True, False):
            monkeypatch.setattr(fused_ops, "ENABLED", enabled)
            model.zero_grad(set_to_none=True)
            params = packed_seq_params(mb.cu_seqlens.cuda(), mb.max_seqlen)
            out = model(tokens, positions, None, packed_seq_params=params)
            loss = out.float().logsumexp(-1).mean()
            loss.backward()
            norm = torch.sqrt(sum((p.grad.float() ** 2).sum() for p in model.parameters() if p.grad is not None))
            runs.append((loss.item(), norm.item()))
        print("loss, grad norm with / without the kernels:", runs)
        (loss_on, norm_on), (loss_off, norm_off) = runs
        assert abs(loss_on - loss_off) <= 1e-2 * abs(loss_off) and abs(norm_on - norm_off) <= 2e-2 * norm_off
    finally:
        parallel.destroy()
