"""LoRA adapters on the wire to the embedded engine, and the one formula both sides use for the weights it serves.

An adapter-only push names each adapted HF weight ``P.weight`` by two tensors, ``P.lora_A.weight`` ([R, in]) and
``P.lora_B.weight`` ([out, R]) with B already multiplied by the scaling alpha/R (so the engine needs no config).
The engine serves the adapters merged: ``merged(W, A, sB)`` is W + sB A computed in float32 in one fixed order
(one outer product per rank, added in rank order, then a single rounding to W's dtype). Elementwise IEEE operations
in a fixed order give the same bits on any device, so the trainer computes exactly the weights an engine holds and
the weight-equality check covers them.
"""

from __future__ import annotations

import torch

LORA_A, LORA_B = ".lora_A.weight", ".lora_B.weight"


def adapter_names(weight_name: str) -> tuple[str, str]:
    """The wire names of the A and (scaled) B of the HF weight ``weight_name`` (``...q_proj.weight``)."""
    base = weight_name.removesuffix(".weight")
    return base + LORA_A, base + LORA_B


def split_adapters(named: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """(plain weights, {HF weight name: {"A": ..., "B": ...}}) of an update; an adapter may lack one half (it
    arrives in another bucket)."""
    plain: dict[str, torch.Tensor] = {}
    adapters: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in named.items():
        for suffix, part in ((LORA_A, "A"), (LORA_B, "B")):
            if name.endswith(suffix):
                adapters.setdefault(name.removesuffix(suffix) + ".weight", {})[part] = t
                break
        else:
            plain[name] = t
    return plain, adapters


@torch.no_grad()
def merged(weight: torch.Tensor, a: torch.Tensor, scaled_b: torch.Tensor) -> torch.Tensor:
    """W + sB A in W's dtype and on W's device: float32, one outer product per rank added in rank order, one
    rounding at the end (the same bits on every device)."""
    if a.dim() != 2 or scaled_b.dim() != 2 or a.shape[0] != scaled_b.shape[1] or \
            (scaled_b.shape[0], a.shape[1]) != tuple(weight.shape):
        raise ValueError(f"adapter shapes A {tuple(a.shape)}, B {tuple(scaled_b.shape)} do not fit the weight "
                         f"{tuple(weight.shape)} (A: [rank, in], B: [out, rank])")
    out = weight.to(torch.float32, copy=True)
    a = a.to(device=out.device, dtype=torch.float32)
    b = scaled_b.to(device=out.device, dtype=torch.float32)
    for r in range(a.shape[0]):
        out.add_(b[:, r : r + 1] * a[r : r + 1, :])
    return out.to(weight.dtype)
