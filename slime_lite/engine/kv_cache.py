"""The engine's KV cache (one region per batch slot, grown on demand, on CUDA in memory that can be released while
captured graphs keep its addresses) and how many batch slots fit when --max-running-requests is not given."""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from slime_lite.engine import vmm

logger = logging.getLogger(__name__)


def kv_bytes_per_token(hf: Any) -> int:
    """Bytes of KV cache one token takes in this HF model (keys and values of every layer, in its dtype)."""
    cfg = hf.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * kv_heads * head_dim * next(hf.parameters()).dtype.itemsize


AUTO_KV_MEMORY_FRACTION = 0.3  # of the GPU's memory, for the KV cache of automatically sized batch slots


def auto_max_running(device_memory: int | None, requests_hint: int | None, slot_tokens: int, kv_bytes_per_token: int,
                     kv_cache_tokens: int | None = None) -> int:
    """Batch slots when --max-running-requests is not given: 64 on CPU; on CUDA every request of a rollout at once
    (``requests_hint``, at least 64), as many as fit with ``slot_tokens`` each in --kv-cache-tokens when given, else
    in AUTO_KV_MEMORY_FRACTION of the GPU's memory (the cache grows only to what running requests use)."""
    if device_memory is None:
        return 64
    if kv_cache_tokens:
        fit = kv_cache_tokens // slot_tokens
    else:
        fit = int(AUTO_KV_MEMORY_FRACTION * device_memory) // (slot_tokens * kv_bytes_per_token)
    return max(1, min(max(64, requests_hint or 0), fit))


class KVCache:
    """Per-slot K/V in one tensor ``kv [layers, slots + 1, 2 * kv_heads, length, head_dim]`` (K heads first, then V),
    grown on demand and freed when idle; ``k`` and ``v`` are views of its halves. The last slot, ``scratch``, holds
    no request: padded decode steps' idle rows write there, so what free slots hold stays (the prefix cache). On CUDA
    it lives in a ``vmm.MappedBuffer``: ``release`` gives its memory back and keeps its addresses (captured graphs
    stay valid); the next ``ensure`` maps memory there again.

    ``slots`` and ``max_len`` are the budget (``--max-running-requests`` and
    ``--kv-cache-tokens // --max-running-requests``; the scratch slot comes on top); memory is allocated only up to
    what running requests need.
    """

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, slots: int, max_len: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.kv_heads, self.head_dim = kv_heads, head_dim
        self.num_layers, self.slots, self.max_len = num_layers, slots, max_len
        self.dtype, self.device = dtype, device
        self.kv: torch.Tensor | None = None
        self._buffer: vmm.MappedBuffer | None = None

    @property
    def k(self) -> torch.Tensor | None:
        return None if self.kv is None else self.kv[:, :, : self.kv_heads]

    @property
    def v(self) -> torch.Tensor | None:
        return None if self.kv is None else self.kv[:, :, self.kv_heads :]

    @property
    def allocated(self) -> tuple[int, int]:
        """(slots, positions) allocated for requests (the scratch slot not counted)."""
        return (0, 0) if self.kv is None else (self.kv.shape[1] - 1, self.kv.shape[3])

    @property
    def scratch(self) -> int:
        """The index of the slot that holds no request (allocated with the others)."""
        return self.kv.shape[1] - 1

    def ensure(self, slots: int, length: int) -> None:
        """Make room for slot indices < ``slots`` and positions < ``length`` (keeps what is stored; after a
        ``release``, maps memory again, zeroed)."""
        if self._buffer is not None and not self._buffer.mapped:  # released: what it held is lost
            have_s, have_l = self.allocated
            if slots <= have_s and length <= have_l:
                self._buffer.map()
                self.kv.zero_()  # fresh memory: masked attention must not meet NaN bit patterns
            else:  # growing: map only the new size
                slots, length = max(slots, have_s), max(length, have_l)
                self.kv = self._buffer = None
        have_s, have_l = self.allocated
        if slots <= have_s and length <= have_l:
            return
        new_s = min(self.slots, max(have_s, 1 << max(0, slots - 1).bit_length()))
        new_l = min(self.max_len, max(have_l, -(-length // 128) * 128))
        shape = (self.num_layers, new_s + 1, 2 * self.kv_heads, new_l, self.head_dim)
        nbytes = math.prod(shape) * self.dtype.itemsize
        buffer = vmm.buffer(nbytes, self.device)
        if buffer is not None:
            kv = buffer.view()[:nbytes].view(self.dtype).view(shape).zero_()
        else:
            kv = torch.zeros(shape, dtype=self.dtype, device=self.device)
        if self.kv is not None:
            kv[:, :have_s, :, :have_l] = self.kv[:, :have_s]
        self.kv, self._buffer = kv, buffer
        logger.debug("kv cache: %d slots x %d tokens", new_s, new_l)

    def copy_prefix(self, source: int, slot: int, positions: int) -> None:
        """Copy the K/V of positions < ``positions`` from slot ``source`` to slot ``slot`` (every layer)."""
        self.kv[:, slot, :, :positions] = self.kv[:, source, :, :positions]

    def release(self) -> bool:
        """Give the memory back and keep the addresses (what it holds is lost): True; False when the cache cannot
        (not allocated, or not a mapped buffer)."""
        if self._buffer is None:
            return False
        self._buffer.unmap()
        return True

    def free(self) -> None:
        self.kv = self._buffer = None

    def flat_index(self, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Row indices into a layer's cache viewed as ``[-1, head_dim]`` for ``slots [B]`` x K and V heads x
        ``positions [B, T]``, in (slot, head, position) order."""
        heads = torch.arange(2 * self.kv_heads, device=slots.device)
        rows = (slots[:, None] * 2 * self.kv_heads + heads[None, :]) * self.kv.shape[3]
        return (rows[:, :, None] + positions[:, None, :]).reshape(-1)

    def write(self, layer: int, index: torch.Tensor, kv: torch.Tensor) -> None:
        """Store ``kv`` (``[B, 2 * kv_heads, T, D]``: K heads then V heads) at ``flat_index`` rows of ``layer``."""
        self.kv[layer].view(-1, self.head_dim).index_copy_(0, index, kv.reshape(-1, self.head_dim))
