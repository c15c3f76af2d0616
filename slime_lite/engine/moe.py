"""The routed-expert MLP of Qwen3-MoE and Qwen2-MoE in the engine, and the per-expert names of its weights.

Routing is HF's: a softmax over every expert's router logit (in float32), the top k, renormalised to sum to 1 with
``norm_topk_prob``, cast back to the model dtype. The experts are computed two ways:

- ``eager`` (prefill, CPU and uncaptured decode steps): the HF model's own experts module, which runs only the
  experts some token chose (a data-dependent loop: its shapes change from step to step);
- ``fixed`` (captured CUDA-graph decode steps): fixed shapes for a batch size. With fewer (token, expert) pairs
  than experts, each pair's expert weights are gathered (``[B, k]`` matrices); otherwise every expert runs on every
  row and the rows' weights (zero for the experts a row did not choose) sum them. Either way each token gets the
  same weighted sum of the same experts as in ``eager``, added in another order.

Qwen2-MoE adds its shared expert, scaled by the sigmoid of its gate, to the routed experts' sum.

transformers 5 keeps each layer's experts fused in memory (``mlp.experts.gate_up_proj [E, 2I, H]``, gate rows
first, and ``mlp.experts.down_proj [E, H, I]``) and writes them per expert on disk
(``mlp.experts.E.{gate,up,down}_proj.weight``); ``expert_views`` maps the on-disk names to slices of the fused
parameters, so weights load by either name.
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.nn.functional as F

_FUSED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def is_moe(mlp: Any) -> bool:
    return hasattr(mlp, "experts") and hasattr(mlp, "gate")


def route(x: torch.Tensor, router_w: torch.Tensor, top_k: int, norm_topk: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [N, H]`` -> (weights ``[N, k]`` in x's dtype, expert ids ``[N, k]``), as HF's router computes them."""
    logits = F.linear(x, router_w)
    top, ids = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float), top_k, dim=-1)
    if norm_topk:
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(logits.dtype), ids


def _fixed_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                   down: torch.Tensor, act: Any) -> torch.Tensor:
    """The routed experts' weighted sum with shapes that depend only on ``x``'s: gathered per (row, choice) when
    that is less work than every expert on every row."""
    n, k = ids.shape
    experts, inter = gate_up.shape[0], down.shape[-1]
    if n * k < experts:  # [N, k, 2I, H] of gathered weights
        gu = torch.matmul(gate_up[ids], x[:, None, :, None])[..., 0]  # [N, k, 2I]
        h = act(gu[..., :inter]) * gu[..., inter:]
        out = torch.matmul(down[ids], h[..., None])[..., 0]  # [N, k, H]
        return (out * weights[..., None]).sum(dim=1)
    gu = torch.einsum("nh,eih->nei", x, gate_up)  # [N, E, 2I]
    h = act(gu[..., :inter]) * gu[..., inter:]
    out = torch.einsum("nei,ehi->neh", h, down)  # [N, E, H]
    dense = torch.zeros(n, experts, dtype=x.dtype, device=x.device).scatter_(1, ids, weights)
    return torch.einsum("neh,ne->nh", out, dense)


def moe_mlp(mlp: Any, x: torch.Tensor, fixed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """An HF sparse-MoE block on the normalised hidden states ``x [..., H]`` -> (its output, the chosen expert ids
    ``[N, k]`` of the N = x.numel() / H rows)."""
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    gate, experts = mlp.gate, mlp.experts
    weights, ids = route(flat, gate.weight, gate.top_k, gate.norm_topk_prob)
    if fixed:
        out = _fixed_experts(flat, ids, weights, experts.gate_up_proj, experts.down_proj, experts.act_fn)
    else:
        out = experts(flat, ids, weights)
    shared = getattr(mlp, "shared_expert", None)
    if shared is not None:
        out = out + torch.sigmoid(F.linear(flat, mlp.shared_expert_gate.weight)) * shared(flat)
    return out.reshape(shape), ids


def expert_views(model: Any) -> dict[str, tuple[torch.nn.Parameter, int, slice]]:
    """``{on-disk per-expert name: (fused parameter, expert id, its rows)}`` of every MoE layer (empty for dense
    models); the tensor is ``param.data[expert][rows]``, taken when used (offload swaps ``.data``)."""
    out: dict[str, tuple[torch.nn.Parameter, int, slice]] = {}
    for name, param in model.named_parameters():
        m = _FUSED.match(name)
        if not m:
            continue
        experts, rows = param.shape[0], param.shape[1]
        parts = {"gate_up_proj": [("gate_proj", slice(0, rows // 2)), ("up_proj", slice(rows // 2, rows))],
                 "down_proj": [("down_proj", slice(0, rows))]}[m.group(2)]
        for e in range(experts):
            for part, sl in parts:
                out[f"{m.group(1)}.{e}.{part}.weight"] = (param, e, sl)
    return out


def is_fused(name: str) -> bool:
    """Whether ``name`` is a layer's fused in-memory expert weight (``expert_views`` names its slices)."""
    return _FUSED.match(name) is not None


class RouteStore:
    """The experts each MoE layer chose for every cached position of every batch slot (``--enable-return-routed-
    experts``): ``[slots + 1, max_len, layers, top_k]`` int16, allocated whole at start so that captured decode
    steps keep writing to the same addresses; slot-local like the KV cache, so a prefix reused from the prefix cache
    keeps its routing. ``at`` names the (slot, position) rows of the next forward; each MoE layer then ``write``s."""

    def __init__(self, layers: int, top_k: int, slots: int, max_len: int, device: torch.device) -> None:
        self.buffer = torch.zeros(slots + 1, max_len, layers, top_k, dtype=torch.int16, device=device)
        self.index: torch.Tensor | None = None

    def at(self, slots: torch.Tensor, positions: torch.Tensor) -> None:
        """The rows of ``positions [B, T]`` (or ``[B]``) of ``slots [B]``, in the order the layers see tokens."""
        pos = positions if positions.dim() == 2 else positions[:, None]
        self.index = (slots[:, None] * self.buffer.shape[1] + pos).reshape(-1)

    def write(self, layer: int, ids: torch.Tensor) -> None:
        rows = self.buffer.view(-1, *self.buffer.shape[2:])[:, layer]
        rows.index_copy_(0, self.index, ids.to(torch.int16))

    def copy_prefix(self, source: int, slot: int, positions: int) -> None:
        """Slot ``slot`` takes the routing of positions < ``positions`` of slot ``source`` (a forked prefix)."""
        self.buffer[slot, :positions] = self.buffer[source, :positions]

    def read(self, slot: int, start: int, end: int) -> torch.Tensor:
        """``[end - start, layers, top_k]`` int32 of positions start..end-1 of ``slot`` (on the host)."""
        return self.buffer[slot, start:end].to(device="cpu", dtype=torch.int32)
