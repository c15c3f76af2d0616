"""--offload-train: what a train worker frees while the engines generate, and how it comes back.

- the model's parameters (bf16 weights included: with a non-distributed optimizer Megatron's DDP keeps no param
  buffer, each parameter is its own allocation) and the optimizer's tensors (fp32 master weights, Adam state) go to
  one host buffer and come back as one device block (``slime_lite.offload.TensorStash``);
- the DDP grad buffers are freed and come back zeroed (Megatron's own offload; every step zeroes them anyway);
- caches that hold device memory between steps are dropped: the optimizer's grads, Megatron's rotary-embedding
  cache and global memory buffer, cuBLAS workspaces, weight copies sent by CUDA IPC that the engine has released.

The same path runs on CPU (where it frees nothing but is tested).
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core import parallel_state as ps
from megatron.core.models.common.embeddings import rotary_pos_embedding

from slime_lite.offload import TensorStash, clear_cublas_workspaces


def optimizer_tensors(optimizer: Any) -> list[torch.Tensor]:
    """The tensors a Megatron optimizer (chained or not) steps with: its torch optimizer's params and state."""
    out: list[torch.Tensor] = []
    for opt in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        out += [p for group in inner.param_groups for p in group["params"]]
        out += [v for state in inner.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return out


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def offload(model: Any, optimizer: Any, stash: TensorStash) -> int:
    """Free the worker's device memory; returns the bytes moved to the host."""

    optimizer.zero_grad(set_to_none=True)  # master weights' grads (views of the grad buffers, or copies)
    model.offload_grad_buffers(synchronize=False, empty_cache=False)
    moved = stash.offload(list(model.parameters()) + optimizer_tensors(optimizer))
    rotary_pos_embedding.RotaryEmbedding.forward.cache_clear()  # an lru_cache of cos/sin tables on the device
    buffers = getattr(ps, "_GLOBAL_MEMORY_BUFFER", None)
    if buffers is not None:
        buffers.buffer.clear()  # Megatron's scratch tensors (sequence parallel), re-made on use
    if torch.cuda.is_available():
        clear_cublas_workspaces()
        torch.cuda.ipc_collect()  # copies handed to a colocated engine by CUDA IPC, once the engine let them go
        torch.cuda.empty_cache()
    return moved


def onload(model: Any, stash: TensorStash) -> None:
    stash.onload()
    model.restore_grad_buffers(synchronize=False)
