"""Rollout samples -> per-rank micro-batches of padded token tensors (pure; no Megatron).

Every DP rank sees the same global order: optimizer step k takes samples [k*G, (k+1)*G) of the rollout, and DP
rank d takes a contiguous 1/dp share of that, split into micro-batches. All micro-batches of a rollout are padded
to one length so pipeline stages exchange tensors of one shape, and so the forward-only pass (old log-probs) and
the training pass see identical shapes (KL and ppo_kl are then exactly 0 at the first step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from slime_lite.errors import SlimeLiteError
from slime_lite.types import RewardError, Sample


@dataclass
class MicroBatch:
    indices: list[int]  # positions of the samples in the rollout
    tokens: torch.Tensor  # [B, T] long, right-padded with 0
    position_ids: torch.Tensor  # [B, T]
    prompt_lengths: list[int]
    response_lengths: list[int]


def step_shards(num_samples: int, global_batch: int, dp_rank: int, dp_size: int, micro: int) -> list[list[list[int]]]:
    """Sample indices per optimizer step, per micro-batch, for one DP rank."""
    if num_samples % global_batch or global_batch % (dp_size * micro):
        raise ValueError(f"{num_samples} samples do not split into steps of {global_batch} over dp={dp_size}x{micro}")
    per_rank = global_batch // dp_size
    steps = []
    for start in range(0, num_samples, global_batch):
        lo = start + dp_rank * per_rank
        mine = list(range(lo, lo + per_rank))
        steps.append([mine[i : i + micro] for i in range(0, per_rank, micro)])
    return steps


def padded_length(samples: list[Any], multiple: int = 1) -> int:
    longest = max(len(s.tokens) for s in samples)
    return -(-longest // multiple) * multiple


def make_micro_batch(samples: list[Any], indices: list[int], length: int) -> MicroBatch:
    tokens = torch.zeros(len(indices), length, dtype=torch.long)
    for row, i in enumerate(indices):
        ids = samples[i].tokens
        tokens[row, : len(ids)] = torch.as_tensor(ids, dtype=torch.long)
    positions = torch.arange(length, dtype=torch.long).unsqueeze(0).expand(len(indices), length).contiguous()
    return MicroBatch(
        indices=list(indices),
        tokens=tokens,
        position_ids=positions,
        prompt_lengths=[len(samples[i].tokens) - samples[i].response_length for i in indices],
        response_lengths=[samples[i].response_length for i in indices],
    )


def loss_masks(samples: list[Any]) -> list[torch.Tensor]:
    return [
        torch.tensor(s.loss_mask if s.loss_mask is not None else [1] * s.response_length, dtype=torch.float32)
        for s in samples
    ]


def scalar_rewards(samples: list[Sample], reward_key: str | None) -> list[float]:
    """Each sample's scalar reward (``--reward-key`` picks it from a dict reward); SlimeLiteError if one has none."""
    try:
        return [s.scalar_reward(reward_key) for s in samples]
    except RewardError as exc:  # e.g. a replayed dump with dict rewards and no --reward-key
        raise SlimeLiteError(str(exc)) from None
