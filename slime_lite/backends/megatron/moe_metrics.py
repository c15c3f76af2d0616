"""What an MoE model's routers did in one rollout's training passes, as train/ metrics (every rollout):

- ``train/moe/expert_load_max_over_mean`` (and ``/layer_L``): per MoE layer, the tokens its busiest expert received
  over the mean tokens per expert (1 = perfectly balanced; ``num_experts / top_k`` = every token on the same k
  experts), counted over the real tokens of every training micro-batch (padding excluded), averaged over layers;
- ``train/moe/load_balancing_loss`` and ``train/moe/z_loss`` (and ``/layer_L``): Megatron's router aux loss and
  z-loss per micro-batch, unscaled by their coefficients, when --moe-aux-loss-coeff / --moe-z-loss-coeff turn them on.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.router import TopKRouter


def real_tokens(samples: list, mb: Any, sp: bool) -> torch.Tensor:
    """Which of micro-batch ``mb``'s tokens, in the order the routers see them (sequence-first; this TP rank's slice
    with sequence parallelism), are a sample's and not padding."""
    return _real(samples, mb, sp).reshape(-1)


def padding_mask(samples: list, mb: Any, sp: bool) -> torch.Tensor:
    """Megatron's ``padding_mask`` of micro-batch ``mb`` ([rows, positions], True on padding; this TP rank's
    positions with ``sp``): the MoE routers leave those tokens out of the load-balancing and z losses, which would
    otherwise change with the padding (--micro-batch-size, the rollout's longest sample)."""
    return ~_real(samples, mb, sp).T.contiguous()


def _real(samples: list, mb: Any, sp: bool) -> torch.Tensor:
    """[positions, rows]: True where the token is a sample's (see real_tokens)."""
    lengths = [len(samples[i].tokens) for i in mb.indices]
    width = mb.tokens.shape[1]
    if mb.packed:
        real = (torch.arange(width) < sum(lengths))[:, None]
    else:
        real = torch.arange(width)[:, None] < torch.tensor(lengths)[None, :]  # [T, B]
    if sp:
        tp, rank = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()
        real = real.chunk(tp, dim=0)[rank]
    return real


class ExpertLoad:
    """Tokens per expert of this rank's routers while ``counting`` (hooks on Megatron's TopKRouter)."""

    def __init__(self, model: torch.nn.Module, num_layers: int, num_experts: int) -> None:
        routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
        device = next(model.parameters()).device
        self.counts = torch.zeros(num_layers, num_experts, dtype=torch.float32, device=device)
        self.real: torch.Tensor | None = None  # the micro-batch's real tokens (``real_tokens``)
        self.seen: set[int] = set()  # layers counted for it (a recompute in the backward pass counts nothing)
        self.counting = False
        self.micro_batches = 0
        for r in routers:
            r.register_forward_hook(self._hook(r.layer_number - 1))

    def _hook(self, layer: int):
        def hook(module: Any, inputs: Any, output: Any) -> None:
            if self.counting and self.real is not None and layer not in self.seen:
                self.seen.add(layer)
                routing_map = output[1]  # [tokens, experts] bool: the experts each token goes to
                real = self.real.to(routing_map.device)
                self.counts[layer] += (routing_map & real[:, None]).sum(0).float()
        return hook

    def next_micro_batch(self, real: torch.Tensor) -> None:
        """Before a training micro-batch's forward: its real tokens (``real_tokens``)."""
        self.real, self.seen = real, set()
        self.micro_batches += 1

    def start(self) -> None:
        self.counts.zero_()
        self.micro_batches = 0
        self.counting = True
        moe_utils.clear_aux_losses_tracker()

    def metrics(self, prefix: str = "train/") -> dict[str, float]:
        """The rollout's metrics over every rank, named ``{prefix}moe/...`` (every rank calls it: all-reduces)."""
        self.counting = False
        counts = self.counts
        if dist.is_initialized():  # each rank counted its own tokens (DP, sequence slices) and its own layers (PP)
            dist.all_reduce(counts)
        out: dict[str, float] = {}
        ratios = []
        for layer, row in enumerate(counts.cpu()):
            if row.sum() > 0:
                ratios.append(float(row.max() / row.mean()))
                out[f"{prefix}moe/expert_load_max_over_mean/layer_{layer}"] = ratios[-1]
        if ratios:
            out[f"{prefix}moe/expert_load_max_over_mean"] = sum(ratios) / len(ratios)
        tracker = moe_utils.get_moe_layer_wise_logging_tracker()
        if tracker:
            moe_utils.reduce_aux_losses_tracker_across_ranks()
            for name, entry in tracker.items():
                values = entry["values"].float().cpu() / max(self.micro_batches, 1)
                out[f"{prefix}moe/{name}"] = float(values[values != 0].mean()) if (values != 0).any() else 0.0
                out.update({f"{prefix}moe/{name}/layer_{i}": float(v) for i, v in enumerate(values.tolist()) if v})
            moe_utils.clear_aux_losses_tracker()
        return out
