"""The engine's forward pass: the Hugging Face model's own modules, driven with a KV cache the engine owns.

Only attention and the cache are ours; embeddings, RMSNorm, rotary frequencies, q/k/v/o projections (with their
biases when the checkpoint has them), the SwiGLU MLP and the LM head (tied or not) are the HF model's modules, so
weights updated in the HF model are used at once and a prefill gives the same logits as ``model(input_ids)``.

Supported: the Llama/Qwen2 family (``LlamaForCausalLM``, ``Qwen2ForCausalLM``) with full attention.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F

from slime_lite.errors import SlimeLiteError

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")
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
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(model_path)
    except (OSError, ValueError) as exc:
        raise SlimeLiteError(f"--model-path {model_path}: not a Hugging Face model folder ({exc}).") from None
    archs = list(getattr(config, "architectures", None) or [])
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise SlimeLiteError(
            f"--model-path {model_path}: architecture {archs or '(none)'} is not supported by the embedded engine "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)}); use --rollout-backend sglang for other models."
        )
    if getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None):
        raise SlimeLiteError(f"--model-path {model_path}: sliding-window attention is not supported by the embedded "
                             "engine; use --rollout-backend sglang.")
    torch_dtype = resolve_dtype(dtype, config, device)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype)
    return model.to(device).eval()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class KVCache:
    """Per-slot K/V tensors ``[layers, slots, length, kv_heads, head_dim]``, grown on demand and freed when idle.

    ``slots`` and ``max_len`` are the budget (``--max-running-requests`` and
    ``--kv-cache-tokens // --max-running-requests``); memory is allocated only up to what running requests need.
    """

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, slots: int, max_len: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.shape_tail = (kv_heads, head_dim)
        self.num_layers, self.slots, self.max_len = num_layers, slots, max_len
        self.dtype, self.device = dtype, device
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    @property
    def allocated(self) -> tuple[int, int]:
        return (0, 0) if self.k is None else (self.k.shape[1], self.k.shape[2])

    def ensure(self, slots: int, length: int) -> None:
        """Make room for slot indices < ``slots`` and positions < ``length`` (keeps what is stored)."""
        have_s, have_l = self.allocated
        if slots <= have_s and length <= have_l:
            return
        new_s = min(self.slots, max(have_s, 1 << max(0, slots - 1).bit_length()))
        new_l = min(self.max_len, max(have_l, -(-length // 128) * 128))
        shape = (self.num_layers, new_s, new_l, *self.shape_tail)
        k = torch.zeros(shape, dtype=self.dtype, device=self.device)
        v = torch.zeros(shape, dtype=self.dtype, device=self.device)
        if self.k is not None:
            k[:, :have_s, :have_l] = self.k
            v[:, :have_s, :have_l] = self.v
        self.k, self.v = k, v
        logger.debug("kv cache: %d slots x %d tokens", new_s, new_l)

    def free(self) -> None:
        self.k = self.v = None


class CausalLM:
    """Prefill and decode over an HF Llama/Qwen2 model with an engine-owned ``KVCache``."""

    def __init__(self, hf_model: Any) -> None:
        self.hf = hf_model
        cfg = hf_model.config
        inner = hf_model.model
        self.embed, self.layers, self.norm, self.rotary = inner.embed_tokens, inner.layers, inner.norm, inner.rotary_emb
        attn = self.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.num_heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.n_rep = self.num_heads // self.kv_heads
        self.scaling = attn.scaling
        self.vocab_size = cfg.vocab_size

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def new_cache(self, slots: int, max_len: int) -> KVCache:
        return KVCache(len(self.layers), self.kv_heads, self.head_dim, slots, max_len, self.dtype, self.device)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final hidden states -> float32 logits."""
        return self.hf.lm_head(hidden).float()

    def _qkv(self, layer: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        b, t, _ = x.shape
        attn = layer.self_attn
        q = attn.q_proj(x).view(b, t, self.num_heads, self.head_dim)
        k = attn.k_proj(x).view(b, t, self.kv_heads, self.head_dim)
        v = attn.v_proj(x).view(b, t, self.kv_heads, self.head_dim)
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        return q, k, v

    def _mlp_block(self, layer: Any, h: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        h = h + layer.self_attn.o_proj(attn_out)
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def prefill(self, tokens: torch.Tensor, slots: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Run right-padded prompts ``tokens [B, T]`` from position 0; store K/V in ``slots``; return hidden [B, T, H].

        Padding sits after each prompt, so causal attention keeps real positions exact; the K/V the padding writes
        lie past the prompt and are overwritten by decode before anything attends to them.
        """
        b, t = tokens.shape
        pos = torch.arange(t, device=tokens.device).unsqueeze(0).expand(b, t)
        h = self.embed(tokens)
        cos, sin = self.rotary(h, pos)
        slot_idx = slots[:, None].expand(b, t)
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, layer.input_layernorm(h), cos, sin)
            cache.k[i].index_put_((slot_idx, pos), k)
            cache.v[i].index_put_((slot_idx, pos), v)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            if self.n_rep > 1:
                k, v = k.repeat_interleave(self.n_rep, dim=1), v.repeat_interleave(self.n_rep, dim=1)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scaling)
            h = self._mlp_block(layer, h, out.transpose(1, 2).reshape(b, t, -1))
        return self.norm(h)

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, cache: KVCache,
               slot_range: tuple[int, int] | None = None) -> torch.Tensor:
        """One token per running request: ``tokens``, ``positions``, ``slots`` are ``[B]``; returns hidden [B, H].

        ``slot_range=(a, b)`` says ``slots`` is exactly ``a..b-1`` in order, so the cache is read as a view.
        """
        b = tokens.shape[0]
        kv_len = int(positions.max()) + 1
        h = self.embed(tokens[:, None])
        cos, sin = self.rotary(h, positions[:, None])
        allowed = torch.arange(kv_len, device=tokens.device)[None, :] <= positions[:, None]
        mask = allowed[:, None, None, :]  # [B, 1, 1, L]: broadcast over kv heads and their grouped queries
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, layer.input_layernorm(h), cos, sin)
            kc, vc = cache.k[i], cache.v[i]
            kc.index_put_((slots, positions), k[:, 0])
            vc.index_put_((slots, positions), v[:, 0])
            if slot_range is not None:
                keys, values = kc[slot_range[0]:slot_range[1], :kv_len], vc[slot_range[0]:slot_range[1], :kv_len]
            else:
                keys, values = kc[:, :kv_len].index_select(0, slots), vc[:, :kv_len].index_select(0, slots)
            # Group the query heads of each kv head ([B, kv, n_rep, D]) instead of repeating K/V.
            qg = q.view(b, self.kv_heads, self.n_rep, self.head_dim)
            out = F.scaled_dot_product_attention(qg, keys.transpose(1, 2), values.transpose(1, 2),
                                                 attn_mask=mask, scale=self.scaling)
            h = self._mlp_block(layer, h, out.reshape(b, 1, -1))
        return self.norm(h)[:, 0]
