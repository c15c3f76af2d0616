"""The engine's forward pass: the Hugging Face model's own modules, driven with a KV cache the engine owns.

Only attention and the cache are ours; embeddings, RMSNorm, rotary frequencies, q/k/v/o projections (with their
biases when the checkpoint has them), the SwiGLU MLP and the LM head (tied or not) are the HF model's modules, so
weights updated in the HF model are used at once and a prefill gives the same logits as ``model(input_ids)``.

Supported: the families of slime_lite/model_families.py with full attention: Llama, Qwen2, Qwen3 (per-head RMSNorm
of q and k before the rotary embedding, ``head_dim`` from config.json) and GLM4 (rotary over the first
``partial_rotary_factor`` of each head in interleaved pairs, norms of the attention and MLP outputs before their
residual adds, one gate/up projection), and the Mixture-of-Experts Qwen3-MoE and Qwen2-MoE, whose MLPs are
engine/moe.py's (HF's router and experts; fixed shapes in captured CUDA-graph steps).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AutoConfig, AutoModelForCausalLM

from slime_lite.engine import decode_attention, fused_layer, gemv, moe
from slime_lite.engine.kv_cache import KVCache
from slime_lite.errors import SlimeLiteError
from slime_lite.model_families import Family, check_family, check_servable

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str, config: Any, device: torch.device) -> torch.dtype:
    """``auto``: float32 on CPU (exact log-probs); the checkpoint's dtype on CUDA (bf16 when it says nothing)."""
    if dtype != "auto":
        if dtype not in _DTYPES:
            raise SlimeLiteError(f"--dtype {dtype!r}: expected auto, float32, bfloat16 or float16.")
        return _DTYPES[dtype]
    if device.type == "cpu":
        return torch.float32
    name = str(getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "bfloat16")
    return _DTYPES.get(name.removeprefix("torch."), torch.bfloat16)


def load_hf_model(model_path: str, dtype: str, device: torch.device):
    """Load an HF causal LM for the engine; a clear error for architectures the engine cannot run."""

    try:
        config = AutoConfig.from_pretrained(model_path)
    except (OSError, ValueError) as exc:
        raise SlimeLiteError(f"--model-path {model_path}: not a Hugging Face model folder ({exc}).") from None
    check_config(config, f"--model-path {model_path}")
    torch_dtype = resolve_dtype(dtype, config, device)
    model, info = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype, output_loading_info=True)
    tied = getattr(config, "tie_word_embeddings", False)  # lm_head is the embedding: no lm_head.weight on disk
    missing = sorted(k for k in info["missing_keys"] if not (tied and k == "lm_head.weight"))
    if missing:  # from_pretrained would run with them randomly initialised
        raise SlimeLiteError(f"--model-path {model_path}: the checkpoint lacks {len(missing)} weight(s) of the "
                             f"model its config.json describes: {', '.join(missing[:8])}"
                             f"{' ...' if len(missing) > 8 else ''}. Give a complete checkpoint.")
    return model.to(device=device, dtype=torch_dtype).eval()  # .to(dtype): older transformers ignore dtype=


def check_config(config: Any, where: str) -> Family:
    """The model's family when the embedded engine can serve it (an HF config or the config.json dict), else a
    SlimeLiteError naming what it cannot serve and the way out."""
    fix = "use --rollout-backend sglang"
    family = check_family(config, where, "the embedded engine cannot serve it; " + fix)
    check_servable(config, where, fix)
    return family


def _sdpa_without_plans(device: torch.device):
    """On CUDA, keep SDPA to kernels that need no per-shape plan (cuDNN's costs ~40 ms for each new shape)."""
    if device.type != "cuda":
        return contextlib.nullcontext()

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


@dataclass
class _Layer:
    """One decoder layer's tensors; q/k/v, gate/up and the q/k norms are fused (the HF parameters are views into
    them; GLM4's gate_up_proj is fused already)."""

    ln1: torch.Tensor
    ln2: torch.Tensor
    qkv_w: torch.Tensor
    qkv_b: torch.Tensor | None
    o_w: torch.Tensor
    o_b: torch.Tensor | None
    gu_w: torch.Tensor | None  # None in MoE layers (``moe``)
    gu_b: torch.Tensor | None
    down_w: torch.Tensor | None
    down_b: torch.Tensor | None
    qk_norm: torch.Tensor | None = None  # [2 * head_dim]: q_norm's weight, then k_norm's (Qwen3)
    post_attn: torch.Tensor | None = None  # post_self_attn_layernorm (GLM4)
    post_mlp: torch.Tensor | None = None  # post_mlp_layernorm (GLM4)
    moe: Any = None  # the HF sparse-MoE block (Qwen3-MoE, Qwen2-MoE): engine/moe.py runs it
    moe_index: int = -1  # an MoE layer's number from 0 among all layers: its row in the route store


def _fuse(params: list[Any]) -> torch.Tensor | None:
    """Concatenate parameters along dim 0 into one tensor and make each parameter a view of its slice."""
    if any(p is None for p in params):
        return None
    fused = torch.cat([p.data for p in params], dim=0)
    offset = 0
    for p in params:
        p.data = fused[offset : offset + p.shape[0]]
        offset += p.shape[0]
    return fused


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as HF computes it: normalize in float32, cast back, then scale."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)


def rotary_partner(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """The element each rotary element pairs with, over the last dimension: ``d + D/2`` (mod D), or in interleaved
    pairs ``d ^ 1``. The rotary is ``x * cos + rotary_partner(x) * sin`` with rotate_half's sign folded into sin
    (and cos 1, sin 0 where a partial rotary leaves the head as it is)."""
    if interleaved:
        return x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    return x.roll(x.shape[-1] // 2, dims=-1)


def layer_functions(eps: float, heads: int, kv_heads: int, head_dim: int, inter: int, act: Any,
                    interleaved: bool = False):
    """The two tensor-only pieces of a decoder layer around attention, with the model's constants bound, so that
    one ``torch.compile`` of each serves every layer. ``qk_norm`` (Qwen3), ``post_attn`` and ``post_mlp`` (GLM4)
    are None in families without them."""

    def qkv_rope(h, ln, qkv_w, qkv_b, cos, sin, qk_norm=None):
        b, t, _ = h.shape
        qkv = F.linear(_rms(h, ln, eps), qkv_w, qkv_b).view(b, t, -1, head_dim)
        qk = qkv[:, :, : heads + kv_heads]
        if qk_norm is not None:  # per-head RMSNorm of q and of k, before the rotary
            qk = torch.cat((_rms(qk[:, :, :heads], qk_norm[:head_dim], eps),
                            _rms(qk[:, :, heads:], qk_norm[head_dim:], eps)), dim=2)
        qk = qk * cos + rotary_partner(qk, interleaved) * sin
        return qk[:, :, :heads], torch.cat((qk[:, :, heads:], qkv[:, :, heads + kv_heads :]), dim=2)

    def mlp_residual(h, attn_out, o_w, o_b, ln2, gu_w, gu_b, down_w, down_b, post_attn=None, post_mlp=None):
        o = F.linear(attn_out, o_w, o_b)
        h = h + (o if post_attn is None else _rms(o, post_attn, eps))
        gate, up = F.linear(_rms(h, ln2, eps), gu_w, gu_b).split(inter, dim=-1)
        m = F.linear(act(gate) * up, down_w, down_b)
        return h + (m if post_mlp is None else _rms(m, post_mlp, eps))

    return qkv_rope, mlp_residual


def rotary_table(cos: torch.Tensor, sin: torch.Tensor, head_dim: int, interleaved: bool):
    """HF's rotary ``cos``/``sin`` ``[L, rotary dims]`` -> ``[L, head_dim]`` tables for ``x * cos +
    rotary_partner(x) * sin``: rotate_half's sign folded into sin; interleaved (GLM4), each frequency on a pair of
    dims, as HF repeats it; past the rotary dims (a partial rotary) cos 1 and sin 0, which leave the element as it
    is."""
    rot, half = cos.shape[-1], cos.shape[-1] // 2
    if interleaved:
        sign = torch.tensor([-1.0, 1.0], dtype=sin.dtype, device=sin.device).repeat(half)
        cos, sin = cos[:, :half].repeat_interleave(2, dim=-1), sin[:, :half].repeat_interleave(2, dim=-1) * sign
    elif rot != head_dim:
        raise SlimeLiteError(f"a rotary embedding over {rot} of {head_dim} dims per head is supported only in "
                             "interleaved pairs (GLM4); use --rollout-backend sglang.")
    else:
        sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
    if rot < head_dim:
        pad = (cos.shape[0], head_dim - rot)
        cos = torch.cat((cos, torch.ones(pad, dtype=cos.dtype, device=cos.device)), dim=-1)
        sin = torch.cat((sin, torch.zeros(pad, dtype=sin.dtype, device=sin.device)), dim=-1)
    return cos.contiguous(), sin.contiguous()


class CausalLM:
    """Prefill and decode over an HF model of a supported family with an engine-owned ``KVCache``.

    The layers run with functional ops on the HF model's own parameters. q/k/v and gate/up weights are stored
    fused, with the HF parameters as views into the fused tensors, so in-place weight updates of the HF
    parameters reach the engine without a copy. Rotary cos/sin come from a table the HF rotary module fills.
    """

    def __init__(self, hf_model: Any, max_len: int) -> None:
        self.hf = hf_model
        cfg = hf_model.config
        family = check_config(cfg, "the served model")
        self.interleaved = family.rotary_interleaved
        inner = hf_model.model
        self.embed, self.hf_layers, self.norm = inner.embed_tokens, inner.layers, inner.norm
        attn = self.hf_layers[0].self_attn
        self.head_dim = attn.head_dim
        self.num_heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.n_rep = self.num_heads // self.kv_heads
        self.scaling = attn.scaling
        self.vocab_size = cfg.vocab_size
        self.eps = float(cfg.rms_norm_eps)
        mlp = self.hf_layers[0].mlp
        mlp = mlp.experts if moe.is_moe(mlp) else mlp
        self.act = getattr(mlp, "act_fn", None) or mlp.activation_fn  # GLM4's name
        self.inter = cfg.intermediate_size
        self.max_len = max_len
        self.fns = layer_functions(self.eps, self.num_heads, self.kv_heads, self.head_dim, self.inter, self.act,
                                   self.interleaved)
        self.silu = getattr(cfg, "hidden_act", None) == "silu"  # the fused MLP kernel's activation
        self.graph_fns = self.fns  # enable_compile: compiled pieces for captured steps
        self.compiled = False
        self.routes: moe.RouteStore | None = None  # enable_routes: the experts chosen at each cached position
        self.refresh()

    def refresh(self) -> None:
        """(Re)build fused weights and the rotary table; call after the HF model moved to another device."""
        self.storage_version = getattr(self, "storage_version", 0) + 1  # captured CUDA graphs are stale after this
        self.layers = []
        for layer in self.hf_layers:
            a, m = layer.self_attn, layer.mlp
            sparse = moe.is_moe(m)
            gate_up = getattr(m, "gate_up_proj", None)  # GLM4: one projection, gate rows first
            post_attn, post_mlp = (getattr(layer, n, None) for n in ("post_self_attn_layernorm", "post_mlp_layernorm"))
            self.layers.append(_Layer(
                ln1=layer.input_layernorm.weight, ln2=layer.post_attention_layernorm.weight,
                qkv_w=_fuse([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
                qkv_b=_fuse([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]), o_w=a.o_proj.weight, o_b=a.o_proj.bias,
                gu_w=None if sparse else gate_up.weight if gate_up is not None else _fuse([m.gate_proj.weight,
                                                                                            m.up_proj.weight]),
                gu_b=None if sparse else gate_up.bias if gate_up is not None else _fuse([m.gate_proj.bias,
                                                                                          m.up_proj.bias]),
                down_w=None if sparse else m.down_proj.weight, down_b=None if sparse else m.down_proj.bias,
                qk_norm=_fuse([a.q_norm.weight, a.k_norm.weight]) if hasattr(a, "q_norm") else None,
                post_attn=None if post_attn is None else post_attn.weight,
                post_mlp=None if post_mlp is None else post_mlp.weight, moe=m if sparse else None,
                moe_index=len(self.layers) if sparse else -1,
            ))
        pos = torch.arange(self.max_len, device=self.device)[None]
        probe = torch.zeros(1, dtype=self.dtype, device=self.device)
        cos, sin = self.hf.model.rotary_emb(probe, pos)  # [1, L, rotary dims] in the model dtype, as HF applies them
        self.cos, self.sin = rotary_table(cos[0], sin[0], self.head_dim, self.interleaved)

    def device_tensors(self) -> list[torch.Tensor]:
        """Every tensor the forward pass reads: the HF model's parameters and buffers, the fused weights (whose
        storages the q/k/v and gate/up parameters view) and the rotary table (--offload-rollout moves them)."""
        fused = [t for ly in self.layers for t in (ly.qkv_w, ly.qkv_b, ly.gu_w, ly.gu_b, ly.qk_norm) if t is not None]
        return [*self.hf.parameters(), *self.hf.buffers(), *fused, self.cos, self.sin]

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def enable_routes(self, slots: int, max_len: int) -> None:
        """Keep the experts every MoE layer chooses at each cached position (``routes``), a row per layer as SGLang's
        table (a dense layer's stays 0); SlimeLiteError for a dense model."""
        moe_layers = [ly.moe for ly in self.layers if ly.moe is not None]
        if not moe_layers:
            raise SlimeLiteError("--enable-return-routed-experts: the served model has no MoE layers (routed "
                                 "experts); drop the flag.")
        self.routes = moe.RouteStore(len(self.layers), moe_layers[0].gate.top_k, slots, max_len, self.device)

    def new_cache(self, slots: int, max_len: int) -> KVCache:
        return KVCache(len(self.layers), self.kv_heads, self.head_dim, slots, max_len, self.dtype, self.device)

    def logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states -> float32 logits; with ``out``, logits in the model dtype, written into ``out``."""
        if out is None:
            return self.hf.lm_head(hidden).float()
        head = self.hf.lm_head
        if gemv.head_usable(hidden, head.weight, head.bias):  # decode steps at a few rows: launched with PDL
            return gemv.linear(hidden, head.weight, head.bias, cfg=gemv.head_config(hidden.shape[-1]), out=out)
        return torch.matmul(hidden, head.weight.t(), out=out) if head.bias is None else out.copy_(head(hidden))

    def _qkv(self, ly: _Layer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, graphed: bool = False):
        """Normalized input -> roped q [B, T, H, D] and kv [B, T, 2 * kv, D] (roped K heads, then V heads)."""
        return (self.graph_fns if graphed else self.fns)[0](h, ly.ln1, ly.qkv_w, ly.qkv_b, cos, sin, ly.qk_norm)

    def _finish_layer(self, ly: _Layer, h: torch.Tensor, attn_out: torch.Tensor, graphed: bool = False):
        """Attention output -> o-projection, residual, then the MLP block with its residual."""
        if ly.moe is not None:  # captured steps: fixed-shape experts
            h = h + F.linear(attn_out, ly.o_w, ly.o_b)
            out, ids = moe.moe_mlp(ly.moe, _rms(h, ly.ln2, self.eps), fixed=graphed)
            if self.routes is not None:
                self.routes.write(ly.moe_index, ids)
            return h + out
        fn = (self.graph_fns if graphed else self.fns)[1]
        return fn(h, attn_out, ly.o_w, ly.o_b, ly.ln2, ly.gu_w, ly.gu_b, ly.down_w, ly.down_b, ly.post_attn,
                  ly.post_mlp)

    def enable_compile(self) -> None:
        """``torch.compile`` the per-layer pieces of decode steps that are captured as CUDA graphs (fuses the
        norms, rotary and activation kernels); shapes are dynamic, so one compile serves every batch bucket."""
        self.graph_fns = tuple(torch.compile(fn, dynamic=True) for fn in self.fns)
        self.compiled = True

    def _eager_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         mask: torch.Tensor | None) -> torch.Tensor:
        """Decode attention with plain matmuls (softmax in float32). On CUDA this avoids SDPA backends that
        build a plan for every new (batch, length) shape, which continuous batching produces at every step."""
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.scaling
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return torch.matmul(scores.float().softmax(-1).to(v.dtype), v)

    def prefill(self, tokens: torch.Tensor, slots: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Run right-padded prompts ``tokens [B, T]`` from position 0; store K/V in ``slots``; return hidden [B, T, H].

        Padding sits after each prompt, so causal attention keeps real positions exact; the K/V the padding writes
        lie past the prompt and are overwritten by decode before anything attends to them.
        """
        b, t = tokens.shape
        pos = torch.arange(t, device=tokens.device).unsqueeze(0).expand(b, t)
        h = F.embedding(tokens, self.embed.weight)
        cos, sin = self.cos[:t, None, :], self.sin[:t, None, :]
        index = cache.flat_index(slots, pos)
        if self.routes is not None:
            self.routes.at(slots, pos)
        with _sdpa_without_plans(h.device):
            for i, ly in enumerate(self.layers):
                q, kv = self._qkv(ly, h, cos, sin)
                q, kv = q.transpose(1, 2), kv.transpose(1, 2)
                cache.write(i, index, kv)
                k, v = kv[:, : self.kv_heads], kv[:, self.kv_heads :]
                if self.n_rep > 1:
                    k, v = k.repeat_interleave(self.n_rep, dim=1), v.repeat_interleave(self.n_rep, dim=1)
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scaling)
                h = self._finish_layer(ly, h, out.transpose(1, 2).reshape(b, t, -1))
        return _rms(h, self.norm.weight, self.eps)

    def prefill_extend(self, tokens: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor,
                       cache: KVCache) -> torch.Tensor:
        """Like ``prefill``, for prompts whose first ``starts[i]`` tokens already have K/V in their slot (the prefix
        cache): ``tokens [B, T]`` are the rest, right-padded (``lengths [B]`` real tokens each), placed from position
        ``starts[i]``; they attend to the cached prefix and to each other. Returns hidden [B, T, H].

        Padding writes its K/V at the row's first position past its prompt (overwritten by decode before anything
        attends to it), so no row writes past its own prompt plus one token."""
        b, t = tokens.shape
        steps = torch.arange(t, device=tokens.device)[None, :]
        ends = starts + lengths  # first position after each prompt
        pos = torch.minimum(starts[:, None] + steps, ends[:, None])  # [B, T]
        kv_len = int(ends.max()) + 1
        h = F.embedding(tokens, self.embed.weight)
        cos, sin = self.cos[pos][:, :, None, :], self.sin[pos][:, :, None, :]
        index = cache.flat_index(slots, pos)
        mask = (torch.arange(kv_len, device=tokens.device)[None, None, :] <= pos[:, :, None])[:, None]  # [B,1,T,L]
        if self.routes is not None:
            self.routes.at(slots, pos)
        with _sdpa_without_plans(h.device):
            for i, ly in enumerate(self.layers):
                q, kv = self._qkv(ly, h, cos, sin)
                cache.write(i, index, kv.transpose(1, 2))
                k = cache.k[i][:, :, :kv_len].index_select(0, slots)
                v = cache.v[i][:, :, :kv_len].index_select(0, slots)
                if self.n_rep > 1:
                    k, v = k.repeat_interleave(self.n_rep, dim=1), v.repeat_interleave(self.n_rep, dim=1)
                out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask, scale=self.scaling)
                h = self._finish_layer(ly, h, out.transpose(1, 2).reshape(b, t, -1))
        return _rms(h, self.norm.weight, self.eps)

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, cache: KVCache,
               kv_len: int, slot_range: tuple[int, int] | None = None, same_length: bool = False,
               graphed: bool = False, embedded: torch.Tensor | None = None) -> torch.Tensor:
        """One token per running request: ``tokens``, ``positions``, ``slots`` are ``[B]``; returns hidden [B, H].

        ``kv_len`` is ``max(positions) + 1``; ``slot_range=(a, b)`` says ``slots`` is exactly ``a..b-1`` in order,
        so the cache is read as a view; ``same_length`` says every position is ``kv_len - 1`` (no mask needed).
        ``graphed``: a padded step (captured as a CUDA graph on CUDA, where SDPA's per-shape setup is paid once, at
        capture); it uses the fused layer pieces (``fused_layer``), or the compiled ones after ``enable_compile``.
        ``embedded``: the tokens' embeddings ``[B, 1, H]``, already gathered (the captured step's first kernel).
        """
        b = tokens.shape[0]
        h = F.embedding(tokens[:, None], self.embed.weight) if embedded is None else embedded
        mask = None
        # captured steps on CUDA: each row reads its own slot's prefix (decode_attention): no gather, mask or padding
        own_length = graphed and decode_attention.available(h.device, h.dtype, self.head_dim)
        if not same_length and not own_length:  # [B, 1, 1, L]: broadcast over kv heads and their grouped queries
            mask = (torch.arange(kv_len, device=tokens.device)[None, :] <= positions[:, None])[:, None, None, :]
            if graphed:  # additive, built once per step (SDPA would convert a boolean mask in every layer)
                mask = torch.zeros(mask.shape, dtype=h.dtype, device=h.device).masked_fill_(~mask, float("-inf"))
        if self.routes is not None:
            self.routes.at(slots, positions)
        # captured steps on CUDA: the layer pieces in fewer kernels (fused_layer); the MLP output ``add`` is added
        # to ``h`` by the next norm
        fused = graphed and not self.compiled and fused_layer.usable(h)
        # and the rotary inside the attention kernel, which reads the rotary table at each row's position itself and
        # writes the new K/V into the cache
        rope = fused and own_length and b <= decode_attention.ROPE_MAX_ROWS
        cos = sin = index = None
        if not rope:
            cos, sin = self.cos[positions][:, None, None, :], self.sin[positions][:, None, None, :]
            index = cache.flat_index(slots, positions[:, None])
        add = sq = None  # the MLP output not yet added to h, or the sums of squares of h's rows (fused_layer)
        for i, ly in enumerate(self.layers):
            # the layer's weights that its products may ask into L2 (fused_layer.AHEAD)
            later = {"o": ly.o_w, "gate_up": ly.gu_w, "down": ly.down_w,
                     "next": self.layers[i + 1].qkv_w if i + 1 < len(self.layers) else None}
            if fused:
                h, q, _ = fused_layer.attention_inputs(
                    h, add, ly.ln1, ly.qkv_w, ly.qkv_b, cos, sin, ly.qk_norm, self.num_heads, self.kv_heads,
                    self.head_dim, self.eps, self.interleaved, cache.kv[i].view(-1, self.head_dim), index, sq,
                    rotate=not rope, ahead_w=later)
                add = sq = None
            else:
                q, kv = self._qkv(ly, h, cos, sin, graphed)
                cache.write(i, index, kv)
            kc, vc = cache.k[i][:, :, :kv_len], cache.v[i][:, :, :kv_len]
            # Group the query heads of each kv head ([B, kv, n_rep, D]) instead of repeating K/V.
            qg = None if rope else q.reshape(b, self.kv_heads, self.n_rep, self.head_dim)
            if rope:  # q: the q/k/v product's rows, rotated (and K/V written to the cache) in the attention kernel
                out = decode_attention.decode_attention(q, kc, vc, slots, positions, self.scaling, (
                    self.cos, self.sin, ly.qk_norm, self.eps, self.interleaved))
            elif own_length:
                out = decode_attention.decode_attention(qg, kc, vc, slots, positions, self.scaling)
            else:
                if slot_range is not None:
                    keys, values = kc[slot_range[0] : slot_range[1]], vc[slot_range[0] : slot_range[1]]
                else:
                    keys, values = kc.index_select(0, slots), vc.index_select(0, slots)
                if qg.is_cuda and not graphed:
                    out = self._eager_attention(qg, keys, values, mask)
                else:
                    with _sdpa_without_plans(qg.device):
                        out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask, scale=self.scaling)
            if fused and ly.moe is None and self.silu:
                h, add, sq = fused_layer.mlp_output(h, out.reshape(b, 1, -1), ly.o_w, ly.o_b, ly.ln2, ly.gu_w,
                                                    ly.gu_b, ly.down_w, ly.down_b, ly.post_attn, ly.post_mlp,
                                                    self.eps, later)
            else:
                h = self._finish_layer(ly, h, out.reshape(b, 1, -1), graphed)
        if add is not None:
            return fused_layer.rms_norm(add.contiguous(), self.norm.weight, self.eps, residual=h)[1][:, 0]
        if sq is not None:  # the last layer's output, whole: the norm's kernel
            return fused_layer.rms_norm(h, self.norm.weight, self.eps)[:, 0]
        return _rms(h, self.norm.weight, self.eps)[:, 0]
