"""The layer pieces of captured decode steps in fewer kernels (Triton, CUDA): norms, rotary and the gated MLP.

At small batches a decode step is a chain of small kernels, ~25 per layer in eager PyTorch (an H200 profile at
batch 8: 140 copies, 131 multiplies, 75 adds and 49 norms per step, 2-6 us each), and an RL rollout's tail runs
about a thousand such steps with a few rows each. Three kernels replace most of them:

- ``rms``: RMSNorm of a row, with the residual add before it when given (``h + o``, rounded to the model dtype as
  the eager add is, written out as the new residual); also GLM4's norms of the attention and MLP outputs. A layer's
  MLP output is added to the residual by the next layer's input norm (or the final norm), not by a kernel of its own.
  Where ``gemv`` serves a layer's products (at up to ``gemv.NORM_MAX_ROWS`` rows, 0 by default: measured slower),
  the residual adds and the norms can run inside the products' kernels instead (``gemv.linear``'s ``residual``,
  ``sums`` and ``norm``): two kernels fewer per layer;
- ``rope``: the rotary embedding of the q and k heads of one row (after each head's RMSNorm in models with QK-norm,
  Qwen3; in interleaved pairs and over part of the head for GLM4), with the v heads copied beside the k heads, or
  the k and v heads written straight into their rows of the KV cache (no separate cache write). Captured steps
  with ``decode_attention``'s kernels do this inside the attention kernel instead (its ``rope``);
- ``silu_mul`` (``slime_lite.swiglu``, shared with the trainer): ``silu(gate) * up`` of the fused gate/up projection.

Each computes in float32 and rounds to the model dtype where eager PyTorch does (after the norm, after each
product, after the add). In Triton's interpreter the rotary and the residual add then give eager's bits; compiled
(H200), about a fifth of the rotary's elements differ from eager's by one rounding step (the compiler may fuse a
product into the sum), and the norm's float32 sum runs in another order. The matrix products are cuBLAS's, or, at
a few rows on Hopper, ``gemv``'s (Triton kernels that read their weights while the kernel before them still runs);
there every kernel here is launched with programmatic dependent launch (``triton_build.pdl_args``).
``attention_inputs`` and ``mlp_output`` are a layer's pieces around attention built from them, used by captured
decode steps on CUDA with Triton (the MLP only where it is SiLU-gated and dense); elsewhere, and with
``ENABLED = False`` (benchmarks compare), the eager pieces (``model.layer_functions``) run.
``--enable-torch-compile`` replaces both with compiled eager pieces.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from slime_lite.swiglu import silu_and_mul  # noqa: F401  (also the tests' name for it here)
from slime_lite.engine import gemv
from slime_lite.triton_build import pdl_args, triton_kernels

ENABLED = True
# the products whose kernels ask the next product's weights into L2 as they start (``gemv.linear``'s ``ahead``, with
# PDL): q/k/v the o-projection's, o gate/up's, gate/up down's, down the next layer's q/k/v. On an H100 (0.5B shape,
# profile_decode.py --ahead, same process) the captured step took 0.806 / 0.761 / 0.741 ms at batch 32 / 8 / 1 with
# q/k/v, o and down, 0.841 / 0.777 / 0.756 with all four, 0.819 / 0.778 / 0.757 with o and down, 0.869 / 0.818 /
# 0.795 with none: gate/up's prefetch of down's weights competes with its own reads. Also tried and lost there: the
# attention kernel asking the layer's down weights (0.848 against 0.813 ms at batch 32, 0.748 against 0.754 at 8),
# the last down asking the output projection's first 25 MB (0.816 / 0.757 / 0.734 against 0.813 / 0.754 / 0.733)
AHEAD = ("qkv", "o", "down")
# each product's later weights by default; an ``AHEAD`` entry "product>target" asks another layer weight instead
# ("next": the next layer's q/k/v). A target is asked whichever kernel reads it (a gemv or cuBLAS's)
_TARGETS = {"qkv": "o", "o": "gate_up", "gate_up": "down", "down": "next"}


def _ahead(product: str, weights: dict | None) -> torch.Tensor | None:
    """The weights ``product``'s kernel asks into L2 (``AHEAD``), out of the layer's ``weights`` (by the names of
    ``_TARGETS``' values), or None."""
    for entry in AHEAD:
        asker, _, target = entry.partition(">")
        if asker == product and weights:
            return weights.get(target or _TARGETS[product])
    return None


@triton_kernels
def _kernels(triton, tl):
    @triton.jit
    def rms(x_ptr, res_ptr, w_ptr, h_ptr, y_ptr, n, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr,
            GDC: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        live = cols < n
        w = tl.load(w_ptr + cols, mask=live, other=0.0).to(tl.float32)  # a weight: read before the wait
        if GDC:  # launched with PDL: the previous kernel's output from here on (triton_build.pdl_args)
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        x = tl.load(x_ptr + row * n + cols, mask=live, other=0.0)
        if HAS_RES:  # the residual add, rounded as the eager add rounds, is the layer's new hidden state
            x = (x.to(tl.float32) + tl.load(res_ptr + row * n + cols, mask=live, other=0.0).to(tl.float32))
            x = x.to(h_ptr.dtype.element_ty)
            tl.store(h_ptr + row * n + cols, x, mask=live)
        xf = x.to(tl.float32)
        normed = (xf * tl.rsqrt(tl.sum(xf * xf, axis=0) / n + eps)).to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + row * n + cols, (w * normed.to(tl.float32)).to(y_ptr.dtype.element_ty), mask=live)

    @triton.jit
    def rope(qkv_ptr, cos_ptr, sin_ptr, norm_ptr, q_ptr, kv_ptr, idx_ptr, qkv_row, heads, kv_heads, eps,
             DH: tl.constexpr, D: tl.constexpr, HAS_NORM: tl.constexpr, INTERLEAVED: tl.constexpr,
             TO_CACHE: tl.constexpr, GDC: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        dims = tl.arange(0, D)  # D: the head size DH padded to a power of two
        live = dims < DH
        half: tl.constexpr = DH // 2
        if INTERLEAVED:  # rotary pairs (0, 1), (2, 3), ...
            pair = dims ^ 1
        else:  # pairs (d, d + DH / 2)
            pair = tl.where(dims < half, dims + half, dims - half)
        rotated = head < heads + kv_heads  # q and k heads; v heads are copied (they read cos/sin all the same)
        # before the wait: cos/sin (the step's rows of the table, taken before its first layer), the QK-norm weights
        c = tl.load(cos_ptr + row * DH + dims, mask=live, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + row * DH + dims, mask=live, other=0.0).to(tl.float32)
        w_ptr = norm_ptr + tl.where(head < heads, 0, DH)  # q_norm's weight for q heads, k_norm's after it for k heads
        if HAS_NORM:
            w = tl.load(w_ptr + dims, mask=live, other=0.0).to(tl.float32)
            wp = tl.load(w_ptr + pair, mask=live, other=0.0).to(tl.float32)
        if TO_CACHE:  # and the cache row of a K/V head (the index, also taken before the first layer)
            at = tl.load(idx_ptr + row * 2 * kv_heads + tl.maximum(head - heads, 0))
        if GDC:  # launched with PDL: the previous kernel's output from here on (triton_build.pdl_args)
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        src = qkv_ptr + row * qkv_row + head * DH
        x = tl.load(src + dims, mask=live, other=0.0)
        out = x
        if rotated:  # x * cos + partner(x) * sin (sin carries rotate_half's sign)
            partner = tl.load(src + pair, mask=live, other=0.0)
            if HAS_NORM:  # the head's RMSNorm first
                xf = x.to(tl.float32)
                r = tl.rsqrt(tl.sum(xf * xf, axis=0) / DH + eps)
                x = (w * (xf * r).to(x.dtype).to(tl.float32)).to(x.dtype)
                partner = (wp * (partner.to(tl.float32) * r).to(x.dtype).to(tl.float32)).to(x.dtype)
            a = (x.to(tl.float32) * c).to(x.dtype)
            b = (partner.to(tl.float32) * s).to(x.dtype)
            out = (a.to(tl.float32) + b.to(tl.float32)).to(x.dtype)
        if head < heads:
            tl.store(q_ptr + (row * heads + head) * DH + dims, out, mask=live)
        elif TO_CACHE:  # straight into the KV cache: the row of this (row, K/V head) in the layer's [-1, DH] view
            tl.store(kv_ptr + at * DH + dims, out, mask=live)
        else:
            tl.store(kv_ptr + (row * 2 * kv_heads + head - heads) * DH + dims, out, mask=live)

    return rms, rope


def usable(x: torch.Tensor) -> bool:
    """The kernels serve ``x``'s step: CUDA, Triton, a float dtype, and not switched off."""
    return (ENABLED and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and _kernels() is not None)


def _pow2(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """``weight * rmsnorm(x)`` over the last dimension; with ``residual``: ``(x + residual, weight *
    rmsnorm(x + residual))``. ``x`` (and ``residual``) contiguous, in the model dtype."""
    if not x.is_contiguous() or (residual is not None and not residual.is_contiguous()):
        raise ValueError("rms_norm: x and residual must be contiguous")
    n = x.shape[-1]
    rows = x.numel() // n
    y = torch.empty_like(x)
    h = torch.empty_like(x) if residual is not None else y
    with torch.cuda.device(x.device if x.is_cuda else -1):  # -1: the Triton interpreter (tests)
        _kernels()[0][(rows,)](x, residual if residual is not None else x, weight, h, y, n, float(eps),
                               # 4 warps: 1 made the 0.5B step at batch 32 0.02 ms slower on an H100, 2 the same
                               HAS_RES=residual is not None, BLOCK=_pow2(n), num_warps=4,
                               **pdl_args(x))
    return (h, y) if residual is not None else y


def rotary(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int, head_dim: int,
           qk_norm: torch.Tensor | None = None, eps: float = 1e-6, interleaved: bool = False,
           cache: torch.Tensor | None = None, index: torch.Tensor | None = None):
    """``qkv [R, (heads + 2 kv_heads) * head_dim]`` (rows contiguous), ``cos``/``sin`` ``[R, head_dim]`` (contiguous)
    -> roped q ``[R, heads, head_dim]`` and ``[R, 2 kv_heads, head_dim]``: roped k heads, then the v heads. With
    ``qk_norm`` (``[2 head_dim]``: q's weight, then k's) each q and k head is RMS-normed first; ``interleaved``: the
    rotary pairs are (0, 1), (2, 3), ... (``model.rotary_partner``). With ``cache`` (a layer's KV cache viewed as
    ``[-1, head_dim]``) and ``index`` (``[R * 2 kv_heads]`` rows of it, ``KVCache.flat_index`` of one position per
    row) the k and v heads are written there instead, and None is returned for them."""
    if head_dim % 2 or qkv.stride(-1) != 1 or not (cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError("rotary: an even head size, rows of qkv with a contiguous last dimension, contiguous cos/sin")
    if qk_norm is not None and (qk_norm.numel() != 2 * head_dim or not qk_norm.is_contiguous()):
        raise ValueError("rotary: qk_norm must be the contiguous [2 * head_dim] weights of q_norm then k_norm")
    rows = qkv.shape[0]
    if cache is not None and (index is None or index.shape != (rows * 2 * kv_heads,) or not index.is_contiguous()
                              or cache.shape[-1] != head_dim or not cache.is_contiguous() or cache.dtype != qkv.dtype):
        raise ValueError("rotary: cache must be a contiguous [-1, head_dim] view in qkv's dtype, with index of "
                         "[rows * 2 * kv_heads] rows into it (contiguous)")
    q = torch.empty(rows, heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    kv = cache if cache is not None else torch.empty(rows, 2 * kv_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    with torch.cuda.device(qkv.device if qkv.is_cuda else -1):  # -1: the Triton interpreter (tests)
        _kernels()[1][(rows, heads + 2 * kv_heads)](
            qkv, cos, sin, qk_norm if qk_norm is not None else cos, q, kv, index if cache is not None else cos,
            qkv.stride(0), heads, kv_heads, float(eps), DH=head_dim, D=_pow2(head_dim), HAS_NORM=qk_norm is not None,
            INTERLEAVED=interleaved, TO_CACHE=cache is not None, num_warps=1, **pdl_args(qkv))
    return q, (None if cache is not None else kv)


def attention_inputs(h: torch.Tensor, add: torch.Tensor | None, ln: torch.Tensor, qkv_w: torch.Tensor,
                     qkv_b: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, qk_norm: torch.Tensor | None,
                     heads: int, kv_heads: int, head_dim: int, eps: float, interleaved: bool = False,
                     cache: torch.Tensor | None = None, index: torch.Tensor | None = None,
                     sq: torch.Tensor | None = None, rotate: bool = True, ahead_w: dict | None = None):
    """A layer's input norm, q/k/v projection and rotary for hidden states ``h [B, T, hidden]`` (contiguous), as
    ``model.layer_functions``' ``qkv_rope``: returns ``(h, q [B, T, heads, D], kv [B, T, 2 kv_heads, D])``. ``add``:
    the previous layer's MLP output, not yet added to ``h``: the norm's kernel adds it (the returned ``h`` is the
    sum). ``sq``: the sums of squares of ``h``'s rows (``mlp_output``'s): the norm runs inside the q/k/v product's
    kernel. ``cache``/``index`` (``rotary``'s): K and V go straight into the cache, and ``kv`` is None. ``cos``,
    ``sin`` (``[B, T, ..., head_dim]``) and ``index``: contiguous (refused otherwise), made before the first layer,
    as the rotary's kernel reads them before its wait for the product before it. ``rotate=False``: no rotary here
    (``decode_attention`` with ``rope`` does it): returns ``(h, qkv [B * T, width], None)``, the product's rows.
    ``ahead_w``: the layer's weights by name (o, gate_up, down, next), for the q/k/v product to ask the ones
    ``AHEAD`` says into L2."""
    b, t, _ = h.shape
    ahead = _ahead("qkv", ahead_w)
    if add is None and sq is not None and gemv.usable(h, qkv_w, qkv_b):
        qkv = gemv.linear(h, qkv_w, qkv_b, norm=(ln, eps, sq), ahead=ahead)
    else:
        if add is None:
            x = rms_norm(h, ln, eps)
        else:
            h, x = rms_norm(add.contiguous(), ln, eps, residual=h)
        qkv = (gemv.linear(x, qkv_w, qkv_b, ahead=ahead) if gemv.usable(x, qkv_w, qkv_b)
               else F.linear(x, qkv_w, qkv_b))
    if not rotate:
        return h, qkv.view(b * t, -1), None
    q, kv = rotary(qkv.view(b * t, -1), cos.view(b * t, head_dim), sin.view(b * t, head_dim), heads, kv_heads,
                   head_dim, qk_norm, eps, interleaved, cache, index)
    return h, q.view(b, t, heads, head_dim), (None if kv is None else kv.view(b, t, 2 * kv_heads, head_dim))


def mlp_output(h, attn_out, o_w, o_b, ln2, gu_w, gu_b, down_w, down_b, post_attn, post_mlp, eps: float,
               ahead_w: dict | None = None):
    """The o-projection, residual add and gated SiLU MLP after attention, as ``model.layer_functions``'
    ``mlp_residual``: ``(h, m, sq)``. ``ahead_w``: the layer's weights by name (o, gate_up, down, next: the next
    layer's q/k/v), for the products to ask the ones ``AHEAD`` says into L2. Where ``gemv`` serves all three
    products at up to ``gemv.NORM_MAX_ROWS`` rows, ``h`` is the layer's output, ``m`` None and ``sq`` the sums of
    squares of its rows for the next layer's norm (``attention_inputs``): the residual adds and the norm run inside
    the products' kernels. Else the MLP output ``m`` is returned with the new ``h`` instead of added to it (and
    ``sq`` is None), for the next layer's ``attention_inputs`` (or the final norm) to add inside its norm kernel."""
    rows = h.numel() // h.shape[-1]
    o_ahead, gu_ahead, down_ahead = (_ahead(p, ahead_w) for p in ("o", "gate_up", "down"))
    if (post_attn is None and post_mlp is None and rows <= gemv.NORM_MAX_ROWS and attn_out.is_contiguous()
            and all(gemv.usable(h, w_, b_) for w_, b_ in ((o_w, o_b), (gu_w, gu_b), (down_w, down_b)))):
        h, sq = gemv.linear(attn_out, o_w, o_b, residual=h, sums=True, ahead=o_ahead)
        act = gemv.linear(h, gu_w, gu_b, swiglu=True, norm=(ln2, eps, sq), ahead=gu_ahead)
        h, sq = gemv.linear(act, down_w, down_b, residual=h, sums=True, ahead=down_ahead)
        return h, None, sq
    if gemv.usable(attn_out, o_w, o_b):  # the products by gemv where it serves them (PDL devices, a few rows)
        o = gemv.linear(attn_out, o_w, o_b, ahead=o_ahead)
    else:
        o = F.linear(attn_out, o_w, o_b).contiguous()
    if post_attn is not None:  # GLM4: the attention output is normed before the residual add
        o = rms_norm(o, post_attn, eps)
    h, normed = rms_norm(o, ln2, eps, residual=h)
    if gemv.usable(normed, gu_w, gu_b):  # with the SiLU
        act = gemv.linear(normed, gu_w, gu_b, swiglu=True, ahead=gu_ahead)
    else:
        gu, act = F.linear(normed, gu_w, gu_b), None
        if gemv.usable(gu, down_w, down_b, silu_in=True):  # the SiLU inside the down product's kernel
            m = gemv.linear(gu, down_w, down_b, silu_in=True)
        else:
            act = silu_and_mul(gu)
    if act is not None:
        m = (gemv.linear(act, down_w, down_b, ahead=down_ahead) if gemv.usable(act, down_w, down_b)
             else F.linear(act, down_w, down_b))
    if post_mlp is not None:  # GLM4: and the MLP output
        m = rms_norm(m.contiguous(), post_mlp, eps)
    return h, m, None
