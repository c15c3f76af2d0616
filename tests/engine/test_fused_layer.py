"""engine/fused_layer.py: the fused norm, rotary and gated-MLP kernels of captured decode steps, against the eager
layer pieces (engine/model.py ``layer_functions``). On the CPU in Triton's interpreter (tests/triton_interpreter.py:
float32 and float16); on a GPU (skipped without CUDA) compiled, in bf16 too, and inside the engine's graphs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

HEADS, KV_HEADS, EPS = 4, 2, 1e-6  # 2 KV heads: a KV-head index that is off shows
FAMILIES = ("llama", "qwen3", "glm4")  # qwen3: QK-norm; glm4: partial interleaved rotary and post-norms


def _pieces(head_dim: int, inter: int, family: str = "llama"):
    """The eager pieces, and the fused ones in the same form: ``qkv_rope`` (q, kv) and ``mlp_residual`` (h + m)."""
    from slime_lite.engine import fused_layer
    from slime_lite.engine.model import layer_functions

    interleaved = family == "glm4"
    eager = layer_functions(EPS, HEADS, KV_HEADS, head_dim, inter, F.silu, interleaved)

    def qkv_rope(h, ln, qkv_w, qkv_b, cos, sin, qk_norm=None):
        return fused_layer.attention_inputs(h, None, ln, qkv_w, qkv_b, cos, sin, qk_norm, HEADS, KV_HEADS, head_dim,
                                            EPS, interleaved)[1:]

    def mlp_residual(*args):
        h, m, _ = fused_layer.mlp_output(*args, EPS)
        return h if m is None else h + m

    return eager, (qkv_rope, mlp_residual)


def _inputs(rows: int, head_dim: int, inter: int, dtype: torch.dtype, device: str = "cpu", seed: int = 0,
            family: str = "llama"):
    from slime_lite.engine.model import rotary_table

    g = torch.Generator().manual_seed(seed)
    hidden = HEADS * head_dim
    width = (HEADS + 2 * KV_HEADS) * head_dim

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)

    rot = head_dim // 2 if family == "glm4" else head_dim  # GLM4 turns half of each head
    angle = torch.rand(rows, rot // 2, generator=g) * 6.3
    angle = torch.cat((angle, angle), dim=-1)  # as HF's rotary modules give them: the frequencies twice
    cos, sin = rotary_table(torch.cos(angle).to(dtype), torch.sin(angle).to(dtype), head_dim, family == "glm4")
    qk_norm = r(2 * head_dim, scale=0.5) + 1 if family == "qwen3" else None
    qkv_args = (r(rows, 1, hidden, scale=3.0), r(hidden, scale=0.5) + 1, r(width, hidden, scale=0.1), r(width),
                cos.to(device)[:, None, None, :], sin.to(device)[:, None, None, :], qk_norm)
    post = (r(hidden, scale=0.5) + 1, r(hidden, scale=0.5) + 1) if family == "glm4" else (None, None)
    mlp_args = (qkv_args[0], r(rows, 1, hidden), r(hidden, hidden, scale=0.1), None, r(hidden, scale=0.5) + 1,
                r(2 * inter, hidden, scale=0.1), None, r(hidden, inter, scale=0.1), None, *post)
    return qkv_args, mlp_args


def _mlp_in_float64(h, attn, o_w, o_b, ln2, gu_w, gu_b, down_w, down_b, post_attn=None, post_mlp=None):
    """``mlp_residual``'s h + m in float64 (no rounding between the steps), from the same inputs."""
    def rms(x, w):
        return w.double() * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)

    o = F.linear(attn.double(), o_w.double(), None if o_b is None else o_b.double())
    h2 = h.double() + (o if post_attn is None else rms(o, post_attn))
    gate, up = F.linear(rms(h2, ln2), gu_w.double(), None if gu_b is None else gu_b.double()).chunk(2, dim=-1)
    m = F.linear(F.silu(gate) * up, down_w.double(), None if down_b is None else down_b.double())
    return h2 + (m if post_mlp is None else rms(m, post_mlp))


def _check(dtype: torch.dtype, head_dim: int, inter: int, device: str, tol: float, family: str = "llama") -> None:
    """The fused pieces against the eager ones: the rotary and the residual add bit for bit on the same input (no
    sum in them); the norms and what follows them within ``tol`` (the norm's float32 sum runs in another order)."""
    from slime_lite.engine import fused_layer, gemv
    from slime_lite.engine.model import _rms, rotary_partner

    eager, fused = _pieces(head_dim, inter, family)
    interleaved = family == "glm4"
    qkv_args, mlp_args = _inputs(5, head_dim, inter, dtype, device, family=family)
    h, ln, qkv_w, qkv_b, cos, sin, qk_norm = qkv_args
    q, kv = fused[0](*qkv_args)
    q_want, kv_want = eager[0](*qkv_args)
    assert q.shape == q_want.shape and kv.shape == kv_want.shape
    torch.testing.assert_close(q, q_want, rtol=tol, atol=tol)
    torch.testing.assert_close(kv, kv_want, rtol=tol, atol=tol)
    # The rotary alone on any rows: bit for bit in the interpreter; compiled, within one rounding step of the dtype
    # (on an H200 some bf16/fp16 elements differ from eager by a rounding, the float32 ones by the compiler's fused
    # multiply-add)
    width = (HEADS + 2 * KV_HEADS) * head_dim
    rows = torch.randn(5, width, generator=torch.Generator().manual_seed(1)).to(dtype).to(device)
    got_q, got_kv = fused_layer.rotary(rows, cos.reshape(5, -1), sin.reshape(5, -1), HEADS, KV_HEADS, head_dim,
                                       interleaved=interleaved)
    heads = rows.view(5, 1, -1, head_dim)
    qk = heads[:, :, : HEADS + KV_HEADS]
    roped = qk * cos + rotary_partner(qk, interleaved) * sin
    want_kv = torch.cat((roped[:, 0, HEADS:], heads[:, 0, HEADS + KV_HEADS:]), dim=1)
    one_step = torch.finfo(dtype).eps  # relative size of one rounding step
    for got, want in ((got_q, roped[:, 0, :HEADS]), (got_kv, want_kv)):
        if device == "cpu":
            assert torch.equal(got, want)
        else:
            differ = (got != want).float().mean().item()
            print(f"rotary {dtype}: {differ:.4%} of elements differ from eager")
            # a rounding of a product at the inputs' largest magnitude (the sum can be far smaller than its terms)
            torch.testing.assert_close(got, want, rtol=one_step, atol=one_step * rows.abs().max().item())
    if family == "glm4":  # the rotary leaves the second half of each q/k head as it is, and turns the first half
        assert torch.equal(got_q[..., head_dim // 2:], heads[:, 0, :HEADS, head_dim // 2:])
        assert not torch.equal(got_q[..., : head_dim // 2], heads[:, 0, :HEADS, : head_dim // 2])
    if qk_norm is not None:  # QK-norm: each q and k head RMS-normed with its own weight, then the rotary
        got_q, got_kv = fused_layer.rotary(rows, cos.reshape(5, -1), sin.reshape(5, -1), HEADS, KV_HEADS, head_dim,
                                           qk_norm=qk_norm, eps=EPS)
        normed = torch.cat((_rms(qk[:, :, :HEADS], qk_norm[:head_dim], EPS),
                            _rms(qk[:, :, HEADS:], qk_norm[head_dim:], EPS)), dim=2)
        roped = normed * cos + rotary_partner(normed, False) * sin
        torch.testing.assert_close(got_q, roped[:, 0, :HEADS], rtol=tol, atol=tol)
        torch.testing.assert_close(got_kv[:, :KV_HEADS], roped[:, 0, HEADS:], rtol=tol, atol=tol)
        assert torch.equal(got_kv[:, KV_HEADS:], heads[:, 0, HEADS + KV_HEADS:])  # v heads: not normed
    out, want = fused[1](*mlp_args), eager[1](*mlp_args)
    # h + m as close to the exact layer as eager's is: the products sum in another order (gemv's kernels against
    # cuBLAS), so an element of the activation may round the other way and down adds that to m; where h + m cancels
    # the difference stays (in float16 with head size 128: 0.0059 at an element of 0.11, from activations of ~50).
    # In float32 the error is the products' sums, not the output's rounding: on an H200 gemv's (fused multiply-adds in
    # K order) were off by up to 2.5x cuBLAS's in norm (~2e-4 against 1.0e-4; at most 1.7e-5 against 9.5e-6 at outputs
    # of up to ~46), so the norm may be 3x there; a 0.1% error in the activation is off by over 1,000x
    exact = _mlp_in_float64(*mlp_args)
    off, eager_off = (out.double() - exact).abs(), (want.double() - exact).abs()
    ratio = 3.0 if dtype == torch.float32 and device == "cuda" else 1.5
    assert off.max() <= 2 * eager_off.max() + tol and off.norm() <= ratio * eager_off.norm() + tol, (
        f"fused MLP off the float64 layer by {off.max().item():.3g}, {off.norm().item():.3g} in norm (eager: "
        f"{eager_off.max().item():.3g}, {eager_off.norm().item():.3g})")
    x, res = mlp_args[0], mlp_args[1]
    summed, normed = fused_layer.rms_norm(x, mlp_args[4], EPS, residual=res)
    assert torch.equal(summed, x + res)
    torch.testing.assert_close(normed, mlp_args[4] * F.rms_norm(summed.float(), (x.shape[-1],), None, EPS).to(dtype),
                               rtol=tol, atol=tol)
    gu = torch.randn(5, 1, 2 * inter, generator=torch.Generator().manual_seed(2)).to(dtype).to(device) * 4
    torch.testing.assert_close(fused_layer.silu_and_mul(gu), F.silu(gu[..., :inter]) * gu[..., inter:], rtol=tol,
                               atol=tol)
    small = x * 1e-3  # where eps matters
    torch.testing.assert_close(fused_layer.rms_norm(small, mlp_args[4], 1e-2), _rms(small, mlp_args[4], 1e-2),
                               rtol=tol, atol=tol)
    # the MLP output added by the next layer's norm, and K/V written straight into cache rows: as the plain pieces
    add = mlp_args[1] * 2
    cache = torch.full((40 * 2 * KV_HEADS, head_dim), 7.0, dtype=dtype, device=device)
    index = torch.randperm(40 * 2 * KV_HEADS, generator=torch.Generator().manual_seed(3))[: 5 * 2 * KV_HEADS]
    h2, q2, none = fused_layer.attention_inputs(h, add, ln, qkv_w, qkv_b, cos, sin, qk_norm, HEADS, KV_HEADS,
                                                head_dim, EPS, interleaved, cache, index.to(device))
    assert none is None and torch.equal(h2, h + add)
    q_plain, kv_plain = fused[0](h + add, *qkv_args[1:])
    assert torch.equal(q2, q_plain)
    assert torch.equal(cache[index.to(device)], kv_plain.reshape(-1, head_dim))
    untouched = torch.ones(cache.shape[0], dtype=torch.bool)
    untouched[index] = False
    assert (cache[untouched.to(device)] == 7).all()
    # the layer's output with its rows' sums of squares (the adds in the products' kernels): the next layer's norm
    # inside the q/k/v product gives the norm kernel's q and kv within tol
    h_out, none, sq = fused_layer.mlp_output(*mlp_args, EPS)
    if gemv.NORM_MAX_ROWS and family != "glm4":  # GLM4's post-norms keep the kernels of their own
        assert none is None and sq is not None
        _, q3, kv3 = fused_layer.attention_inputs(h_out, None, ln, qkv_w, qkv_b, cos, sin, qk_norm, HEADS, KV_HEADS,
                                                  head_dim, EPS, interleaved, sq=sq)
        q4, kv4 = fused[0](h_out, *qkv_args[1:])
        torch.testing.assert_close(q3, q4, rtol=tol, atol=tol)
        torch.testing.assert_close(kv3, kv4, rtol=tol, atol=tol)
    else:
        assert sq is None and none is not None


def test_the_family_features_change_what_the_pieces_compute():
    """Guards for the checks above: dropping QK-norm, the interleaving or the post-norms changes the output."""
    for family in ("qwen3", "glm4"):
        eager, _ = _pieces(32, 80, family)
        qkv_args, mlp_args = _inputs(4, 32, 80, torch.float32, family=family)
        if family == "qwen3":
            assert not torch.allclose(eager[0](*qkv_args)[0], eager[0](*qkv_args[:-1])[0], atol=1e-2)
        else:
            plain, _ = _pieces(32, 80, "llama")
            assert not torch.allclose(eager[0](*qkv_args)[0], plain[0](*qkv_args)[0], atol=1e-2)
            assert not torch.allclose(eager[1](*mlp_args), eager[1](*mlp_args[:-2]), atol=1e-2)


def _kernels_on_cpu() -> None:
    """Run by ``test_the_kernels_in_the_triton_interpreter`` with TRITON_INTERPRET=1 (CPU tensors count as usable;
    the products by gemv's kernels, as on a device with programmatic dependent launch)."""
    from slime_lite.engine import fused_layer, gemv

    fused_layer.usable = lambda x: True
    gemv.usable = lambda x, *weights, **kw: True
    for gemv.NORM_MAX_ROWS in (16, 0):  # the norms inside the products' kernels, then kernels of their own
        _check(torch.float32, 32, 1100, "cpu", 1e-5)  # gate/up wider than one block of silu_mul
        _check(torch.float16, 24, 40, "cpu", 2e-3)  # a head size that is not a power of two
        for family in ("qwen3", "glm4"):
            _check(torch.float32, 48, 64, "cpu", 1e-5, family)  # 48: a head size that is not a power of two
            _check(torch.float16, 40, 64, "cpu", 2e-3, family)
        for arch, shape in (("qwen2", {}), ("qwen3", {"head_dim": 48}), ("glm4", {}), ("qwen2_moe", {})):
            _decode_on_cpu(arch, rotary_kernel=bool(gemv.NORM_MAX_ROWS), **shape)
    # rows where gate/up is cuBLAS's and down is gemv's with the SiLU inside (gemv.SILU_IN_MAX_ROWS)
    gemv.usable = lambda x, w, b=None, silu_in=False: silu_in
    linear, calls = gemv.linear, []
    gemv.linear = lambda *a, **kw: calls.append(kw.get("silu_in")) or linear(*a, **kw)
    _check(torch.float32, 32, 1100, "cpu", 1e-5)
    _check(torch.float16, 40, 64, "cpu", 2e-3, "glm4")
    assert calls and all(calls), calls  # every product by gemv was the down product with the SiLU inside


def _decode_on_cpu(arch: str, rotary_kernel: bool, **shape) -> None:
    """Run by ``test_the_kernels_in_the_triton_interpreter``: padded decode steps of a tiny model of each family
    through the fused pieces and the own-length attention kernels (K/V written by the attention kernel, which
    rotates q and k, or by the rotary kernel; each MLP output added by the next norm, or the residual adds and norms
    inside the products; GLM4's post-norms and MoE layers in between) against the eager pieces with SDPA: the same
    hidden states and the same KV cache, step after step."""
    import tempfile

    from slime_lite.engine import decode_attention, fused_layer
    from slime_lite.engine.model import CausalLM, load_hf_model
    from slime_lite.tiny_model import make_tiny_model

    with tempfile.TemporaryDirectory() as d:
        make_tiny_model(d, arch=arch, warm_start_steps=0, num_layers=3, **shape)
        lm = CausalLM(load_hf_model(d, "float32", torch.device("cpu")), max_len=64)
    slots, prompts = torch.tensor([2, 0, 3]), torch.randint(1, 40, (3, 6), generator=torch.Generator().manual_seed(0))
    # the eager pieces with SDPA (the reference); the fused pieces with the own-length attention kernels (as on
    # CUDA), the rotary inside the attention kernel; and (``rotary_kernel``) with the rotary's kernel before it
    ways = [(False, False, True), (True, True, True)] + [(True, True, False)] * rotary_kernel
    caches = [lm.new_cache(4, 64) for _ in ways]
    for c in caches:
        c.ensure(4, 64)
    with torch.inference_mode():
        for c in caches:
            lm.prefill(prompts, slots, c)
        pos = torch.tensor([6, 4, 5])  # rows at different lengths (shorter prompts' padding is overwritten)
        tokens = prompts[:, 0]
        for _ in range(3):
            outs = []
            for cache, (fused, own_length, rope) in zip(caches, ways):
                fused_layer.usable = lambda x, on=fused: on
                decode_attention.available = lambda *a, on=own_length: on
                decode_attention.ROPE_MAX_ROWS = 32 if rope else 0
                outs.append(lm.decode(tokens, pos, slots, cache, int(pos.max()) + 1, graphed=True))
            for got, cache in zip(outs[1:], caches[1:]):
                torch.testing.assert_close(got, outs[0], rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(cache.kv, caches[0].kv, rtol=1e-5, atol=1e-5)
            tokens, pos = lm.logits(outs[0]).argmax(-1), pos + 1


def test_the_kernels_in_the_triton_interpreter():
    from tests.triton_interpreter import run_interpreted

    run_interpreted("tests.engine.test_fused_layer:_kernels_on_cpu")


def test_the_kernels_serve_cuda_only_and_can_be_switched_off(monkeypatch):
    from slime_lite.engine import fused_layer

    assert not fused_layer.usable(torch.zeros(3))  # CPU: captured steps keep the eager pieces
    monkeypatch.setattr(fused_layer, "ENABLED", False)
    assert not fused_layer.usable(torch.zeros(3, device="meta"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype,head_dim,tol", [(torch.bfloat16, 64, 2e-2), (torch.float16, 128, 2e-3),
                                                (torch.float32, 80, 1e-5)])
def test_the_kernels_compiled_on_a_gpu(dtype, head_dim, tol, family):
    from slime_lite.engine import fused_layer

    assert fused_layer.usable(torch.zeros(1, device="cuda", dtype=dtype))
    _check(dtype, head_dim, 4864 // 4, "cuda", tol, family)


def test_the_products_ask_the_weights_ahead_says(monkeypatch):
    from slime_lite.engine import fused_layer

    later = {"o": torch.zeros(1), "gate_up": torch.zeros(2), "down": torch.zeros(3), "next": torch.zeros(4)}
    monkeypatch.setattr(fused_layer, "AHEAD", ("qkv", "o", "down"))  # each its next product's (down: next layer's)
    names = {id(w): n for n, w in later.items()}

    def asked():
        return [names.get(id(fused_layer._ahead(p, later))) for p in ("qkv", "o", "gate_up", "down")]

    assert asked() == ["o", "gate_up", None, "next"]
    monkeypatch.setattr(fused_layer, "AHEAD", ("qkv>gate_up", "o>down", "down"))  # benchmarks: other targets
    assert asked() == ["gate_up", "down", None, "next"]
    assert fused_layer._ahead("down", {**later, "next": None}) is None  # the last layer
    assert fused_layer._ahead("qkv", None) is None
