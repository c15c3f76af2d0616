"""--offload-train: what a train worker frees while the engines generate, and how it comes back.

- the model's parameters (bf16 weights included: with a non-distributed optimizer Megatron's DDP keeps no param
  buffer, each parameter is its own allocation) and the optimizer's tensors (fp32 master weights, Adam state) go to
  one host buffer and come back as one device block (``slime_lite.offload.TensorStash``);
- the DDP grad buffers are freed and come back zeroed (Megatron's own offload; every step zeroes them anyway);
- caches that hold device memory between steps are dropped: the optimizer's grads, Megatron's rotary-embedding
  cache and global memory buffer, cuBLAS workspaces, weight copies sent by CUDA IPC that the engine has released.

With the distributed optimizer (--optimizer-cpu-offload) every weight is a view of DDP's parameter buffer, which
Megatron's own code keeps using: that buffer is copied to the host and its storage emptied and refilled in place
(as the grad buffers), so every view stays valid; the optimizer state already on the host stays there.

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


def param_buffers(model: Any) -> list[torch.Tensor]:
    """DDP's parameter buffers (the distributed optimizer's: every weight a view of one); [] without them."""
    bufs = list(getattr(model, "buffers", None) or []) + list(getattr(model, "expert_parallel_buffers", None) or [])
    return [b.param_data for b in bufs if getattr(b, "param_data", None) is not None]


def offload(model: Any, optimizer: Any, stash: TensorStash, held: list) -> int:
    """Free the worker's device memory; returns the bytes moved to the host. ``held``: the parameter buffers' host
    copies and storage sizes (kept from one offload to the next)."""

    optimizer.zero_grad(set_to_none=True)  # master weights' grads (views of the grad buffers, or copies)
    model.offload_grad_buffers(synchronize=False, empty_cache=False)
    buffers = param_buffers(model)
    in_place = {b.untyped_storage().data_ptr() for b in buffers}
    moved = stash.offload([t for t in list(model.parameters()) + optimizer_tensors(optimizer)
                           if t.untyped_storage().data_ptr() not in in_place])
    if len(held) != len(buffers):
        held[:] = [[torch.empty(b.shape, dtype=b.dtype, pin_memory=b.is_cuda), 0] for b in buffers]
    for b, h in zip(buffers, held):  # emptied and refilled in place: Megatron's views of them stay valid
        h[0].copy_(b)
        h[1] = b.untyped_storage().nbytes()
        b.untyped_storage().resize_(0)
        moved += h[0].numel() * h[0].element_size()
    rotary_pos_embedding.RotaryEmbedding.forward.cache_clear()  # an lru_cache of cos/sin tables on the device
    buffers = getattr(ps, "_GLOBAL_MEMORY_BUFFER", None)
    if buffers is not None:
        buffers.buffer.clear()  # Megatron's scratch tensors (sequence parallel), re-made on use
    if torch.cuda.is_available():
        clear_cublas_workspaces()
        torch.cuda.ipc_collect()  # copies handed to a colocated engine by CUDA IPC, once the engine let them go
        torch.cuda.empty_cache()
    return moved


def onload(model: Any, stash: TensorStash, held: list) -> None:
    stash.onload()
    for b, (host, nbytes) in zip(param_buffers(model), held):
        if b.untyped_storage().nbytes() == 0:
            b.untyped_storage().resize_(nbytes)
            b.copy_(host)
    model.restore_grad_buffers(synchronize=False)
