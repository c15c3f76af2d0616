"""Megatron's optimizer step on CUDA without Apex or Transformer Engine: no device sync per parameter, fewer kernels.

Without either package megatron-core 0.16.1 falls back to local helpers: the gradient norm takes one ``torch.norm``
per parameter and builds a host tensor of them (a device sync per parameter: ~290 in one step at the 0.5B shape),
the copies between the float32 main weights and the model's bf16 ones run one ``copy_`` per parameter, and torch's
AdamW runs its foreach path (several passes over the moments). On CUDA (``install``, ``use_fused_adam``):

- the gradient norm is ``torch._foreach_norm`` and one norm of those norms on the device (the one sync left is
  Megatron's ``.item()`` of the total);
- ``multi_tensor_scale`` (the clip's scaling of the gradients) is ``_foreach_mul_`` in place, or ``_foreach_mul`` +
  ``_foreach_copy_``; the main -> model weight copy (``_multi_tensor_copy_this_to_that``, a ``copy_`` per parameter
  in bf16) is one ``_foreach_copy_``;
- torch's fused AdamW kernel (one pass) for the torch Adam/AdamW Megatron built, when every parameter is on CUDA.
  Set on a fresh optimizer only: a checkpoint's saved param groups (``fused`` included) replace these on a load.

The values are those of Megatron's helpers (the same per-element ops; the norm of the per-tensor norms is reduced on
the device instead of the host, so the grad-norm may differ in the last float32 bit; fused AdamW rounds as torch's
AdamW to within float32 rounding). The CPU keeps Megatron's own helpers: CPU runs are unchanged.
"""

from __future__ import annotations

from typing import Any

import torch


def l2_norm(chunk_size: int, noop_flag: Any, tensor_lists: list, per_tensor: bool, *args: Any) -> tuple:
    """``multi_tensor_l2norm``'s contract (Megatron calls it with per_tensor False): ([total norm], None)."""
    norms = torch._foreach_norm(tensor_lists[0])
    total = torch.linalg.vector_norm(torch.stack([n.to(torch.float32) for n in norms]))
    return total.reshape(1), None


def scale(chunk_size: int, noop_flag: Any, tensor_lists: list, factor: float) -> None:
    """``multi_tensor_scale``'s contract: dst = src * factor for the lists [src, dst]."""
    src, dst = tensor_lists
    if all(a is b for a, b in zip(src, dst)):
        torch._foreach_mul_(dst, factor)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, factor) if factor != 1.0 else src)


def copy_this_to_that(this: list, that: list, overflow_buf: Any = None) -> None:
    """Megatron's ``_multi_tensor_copy_this_to_that``: that[i] = this[i] (cast to its dtype)."""
    torch._foreach_copy_(that, this)


def install() -> None:
    """Route Megatron's clip_grads / optimizer helpers to the foreach versions above, on CUDA only (idempotent)."""
    if not torch.cuda.is_available():
        return
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as mcore_optimizer
    from megatron.core.utils import local_multi_tensor_applier

    if clip_grads.multi_tensor_applier is local_multi_tensor_applier:  # Apex / TE absent: the slow local helpers
        clip_grads.l2_norm_impl = l2_norm
        clip_grads.multi_tensor_scale_impl = scale
    if mcore_optimizer.multi_tensor_applier is local_multi_tensor_applier:
        mcore_optimizer._multi_tensor_copy_this_to_that = copy_this_to_that


def torch_adams(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The torch Adam/AdamW instances inside Megatron's (chained) optimizer."""
    inner = [getattr(o, "optimizer", None) for o in getattr(optimizer, "chained_optimizers", None) or [optimizer]]
    return [o for o in inner if type(o) in (torch.optim.Adam, torch.optim.AdamW)]


def use_fused_adam(optimizer: Any) -> int:
    """Switch each of ``torch_adams(optimizer)`` to torch's fused kernel when all its parameters are on CUDA and it
    has no state yet; returns how many were switched."""
    switched = 0
    for adam in torch_adams(optimizer):
        params = [p for g in adam.param_groups for p in g["params"]]
        if adam.state or not params or not all(p.is_cuda and p.is_floating_point() for p in params):
            continue
        for group in adam.param_groups:
            group["fused"], group["foreach"] = True, False
        switched += 1
    return switched


def reset_states(optimizer: Any) -> int:
    """--reset-optimizer-states: every Adam moment and step count of ``torch_adams(optimizer)`` set to zero in place
    (the tensors stay where they are: an offload keeps its references), so the next step is a fresh Adam's first.
    Returns how many parameter states were cleared."""
    cleared = 0
    for adam in torch_adams(optimizer):
        for group in adam.param_groups:
            if "step" in group:
                group["step"] = 0
        for state in adam.state.values():
            for key in ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
                value = state.get(key)
                if torch.is_tensor(value):
                    value.zero_()
                elif value is not None:
                    state[key] = 0
            cleared += 1
    return cleared
