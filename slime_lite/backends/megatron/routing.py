"""Rollout routing replay (--use-rollout-routing-replay, slime's R3): the trainer routes every token of a sample to
the experts the engine chose for it, in the forward and the backward pass, through Megatron's router replay
(``moe_enable_routing_replay``: each router takes its top-k indices from a target instead of its own top-k).

A sample's ``rollout_routed_experts`` is SGLang's table ``[len(tokens) - 1, num_layers, top_k]``: the experts of the
token at each position but the last (which the engine never fed through the model). The trainer's last position and
padding take experts 0..k-1: nothing trained reads their outputs (causal attention: no later token sees them). A
multi-turn sample keeps its last model call's table (that call's prompt was every token before it); the tokens
inserted after it, never trained, take experts 0..k-1 as well.

Megatron's routers see a micro-batch's tokens sequence-first (``[T, B]`` flattened), and with sequence parallelism
each TP rank only its slice of the sequence; each PP stage has the routers of its own layers. ``targets`` builds what
each router of this rank replays. While replaying, every router also computes its own top-k, so each rollout
reports the routing mismatch: the share of (token, layer) pairs whose trainer top-k set differs from the engine's.

--use-routing-replay alone (slime's R2): the routers record their own top-k in the actor's old-policy log-prob pass
(``record``), each sample's experts are kept as a ``[len(tokens), layers, top_k]`` table, and the training passes
replay those tables (``targets`` with ``tables``); the reference pass routes on its own. The mismatch is then counted
in the training passes (train/routing_replay_mismatch): the share of (token, layer) pairs the updated weights would
route elsewhere than the old policy did (0 in the first step, whose weights are the old policy's). Recording reads the routers' token order back
to samples, so it needs TP 1 and PP 1 (args_check).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

from slime_lite.errors import SlimeLiteError
from slime_lite.types import routed_rows_fit


def _sample_table(sample: Any, layers: int, top_k: int) -> torch.Tensor:
    """``[rows, layers, top_k]``: the sample's routed experts, one row per token but the last; fewer rows where the
    sample ends in tokens the engine never fed through the model after its last model turn (a tool or user turn,
    loss_mask 0: nothing trained reads their positions)."""
    if sample.rollout_routed_experts is None:
        raise SlimeLiteError(f"--use-rollout-routing-replay: sample {sample.index} has no rollout_routed_experts "
                             "(its engine did not return them: the embedded engine and SGLang started by slime-lite "
                             "do; an external SGLang server needs --enable-return-routed-experts, and a replayed "
                             "dump must come from such a run; a custom generate hook must ask for them with "
                             "return_routed_experts and keep its last model call's table).")
    table = torch.as_tensor(sample.rollout_routed_experts, dtype=torch.long).reshape(-1, layers, top_k)
    if not routed_rows_fit(sample, table.shape[0]):
        raise ValueError(f"sample {sample.index}: rollout_routed_experts has {table.shape[0]} rows, expected "
                         f"{len(sample.tokens) - 1} (one per token but the last; fewer only before tokens that are "
                         "not trained)")
    return table


def _filler(n: int, layers: int, top_k: int) -> torch.Tensor:
    return torch.arange(top_k).expand(n, layers, top_k)


def targets(samples: list, mb: Any, layer_ids: list[int], num_layers: int, top_k: int,
            sp: bool, tables: dict[int, torch.Tensor] | None = None) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Per router of this rank (global layer ids ``layer_ids``), the ``[tokens, top_k]`` experts of micro-batch
    ``mb`` in the order the router sees its tokens; and which of those tokens were routed at the source (not a
    sample's last token or padding). The source: each sample's rollout_routed_experts, or ``tables`` (by position
    in ``samples``: what ``Replay`` recorded, every token)."""
    def row(i: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        t = _sample_table(samples[i], num_layers, top_k) if tables is None else tables[i]
        routed = torch.arange(width) < t.shape[0]
        return torch.cat([t, _filler(width - t.shape[0], num_layers, top_k)]), routed

    if mb.packed:
        rows = [row(i, len(samples[i].tokens)) for i in mb.indices]
        pad = mb.tokens.shape[1] - sum(r.shape[0] for r, _ in rows)
        grid = torch.cat([r for r, _ in rows] + [_filler(pad, num_layers, top_k)])[:, None]  # [T, 1, L, k]
        valid = torch.cat([v for _, v in rows] + [torch.zeros(pad, dtype=torch.bool)])[:, None]
    else:
        rows = [row(i, mb.tokens.shape[1]) for i in mb.indices]
        grid = torch.stack([r for r, _ in rows], dim=1)  # [T, B, L, k]
        valid = torch.stack([v for _, v in rows], dim=1)
    if sp:
        tp, rank = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()
        grid, valid = grid.chunk(tp, dim=0)[rank], valid.chunk(tp, dim=0)[rank]
    flat = grid.reshape(-1, num_layers, top_k)
    return [flat[:, layer].contiguous() for layer in layer_ids], valid.reshape(-1)


class Replay:
    """This rank's routers, replaying targets; counts of (mismatched, total) (token, layer) pairs per router."""

    def __init__(self, model: Any) -> None:
        self.routers = [m for m in model.modules() if getattr(m, "router_replay", None) is not None]
        self.layer_ids = [r.layer_number - 1 for r in self.routers]
        self.counts = torch.zeros(len(self.routers), 2, dtype=torch.float64)
        self.valid: torch.Tensor | None = None  # the routed tokens of the micro-batch being replayed
        for i, router in enumerate(self.routers):
            router.router_replay.get_replay_topk = self._counting(router.router_replay, i)

    def _counting(self, replay: RouterReplay, i: int):
        original = type(replay).get_replay_topk

        def get_replay_topk(scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
            if replay.router_replay_action is not None and replay.target_topk_idx is not None:
                with torch.no_grad():
                    _, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
                    target = replay.target_topk_idx.to(own.device)
                    same = (own.sort(dim=1).values == target.sort(dim=1).values).all(dim=1)
                    valid = self.valid.to(same.device)
                    self.counts[i, 0] += float((~same & valid).sum())
                    self.counts[i, 1] += float(valid.sum())
            return original(replay, scores, topk, num_groups, group_topk, default_compute_topk)

        return get_replay_topk

    def record(self) -> None:
        """The next forward records each router's own top-k (``recorded``)."""
        RouterReplay.clear_global_indices()
        RouterReplay.set_global_router_replay_action(RouterReplayAction.RECORD)

    def recorded(self, mb: Any, samples: list, tables: dict[int, torch.Tensor]) -> None:
        """Into ``tables`` (by position in ``samples``): each sample of micro-batch ``mb`` (TP 1, PP 1), its tokens'
        experts ``[len(tokens), layers, top_k]`` as the last forward's routers chose them."""
        per_layer = torch.stack([r.router_replay.get_recorded_indices().cpu() for r in self.routers], dim=1)
        if mb.packed:  # one row: the samples back to back, then padding
            start = 0
            for i in mb.indices:
                tables[i] = per_layer[start:start + len(samples[i].tokens)]
                start += len(samples[i].tokens)
        else:  # [T, B] sequence-first: token t of row b is t * B + b
            grid = per_layer.view(mb.tokens.shape[1], mb.tokens.shape[0], *per_layer.shape[1:])
            for b, i in enumerate(mb.indices):
                tables[i] = grid[: len(samples[i].tokens), b]

    def set(self, per_router: list[torch.Tensor], valid: torch.Tensor) -> None:
        """Replay ``per_router`` in the next forward (and a recompute of it in the backward pass); ``valid``: the
        tokens the mismatch counts."""
        RouterReplay.clear_global_indices()  # the previous micro-batch's (and its backward list)
        self.valid = valid
        device = next(iter(self.routers[0].parameters())).device
        for router, t in zip(self.routers, per_router):
            router.router_replay.set_target_indices(t.to(device))
            router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def clear(self) -> None:
        RouterReplay.clear_global_indices()
        RouterReplay.clear_global_router_replay_action()

    def mismatch(self, num_layers: int, name: str = "train/routing_mismatch") -> dict[str, float]:
        """The routing mismatch counted since ``counts`` was zeroed, over every rank: overall and per layer."""
        per_layer = torch.zeros(num_layers, 2, dtype=torch.float64)
        for i, layer in enumerate(self.layer_ids):
            per_layer[layer] += self.counts[i]
        if dist.is_initialized():  # on the routers' device: NCCL reduces CUDA tensors only
            per_layer = per_layer.to(next(iter(self.routers[0].parameters())).device)
            dist.all_reduce(per_layer)  # TP ranks see disjoint sequence slices (MoE TP needs SP), DP their samples
            per_layer = per_layer.cpu()
        self.counts.zero_()
        out = {name: float(per_layer[:, 0].sum() / per_layer[:, 1].sum().clamp(min=1))}
        out.update({f"{name}/layer_{i}": float(m / max(n, 1)) for i, (m, n) in enumerate(per_layer.tolist())})
        return out
