"""Rollout samples -> per-rank micro-batches of padded token tensors (pure; no Megatron).

Every DP rank sees the same global order: optimizer step k takes trajectories [k*G, (k+1)*G) of the rollout (the
samples [k*G, (k+1)*G) unless a trajectory was split into several samples: all of them), and DP rank d takes a
contiguous 1/dp share of that, split into micro-batches. All micro-batches of a rollout are padded
to one length so pipeline stages exchange tensors of one shape, and so the forward-only pass (old log-probs) and
the training pass see identical shapes (KL and ppo_kl are then exactly 0 at the first step).

With ``--use-dynamic-batch-size`` a step's samples are instead packed without padding into micro-batches of at
most ``--max-tokens-per-gpu`` tokens (one row, per-sample positions and ``cu_seqlens``; a longer sample gets a
micro-batch of its own), and every DP rank gets the same number of micro-batches with the tokens balanced.
Which micro-batch a sample lands in changes nothing but speed: attention stays inside each sample and the loss is
normalised per step, not per micro-batch (loss.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from slime_lite.errors import SlimeLiteError
from slime_lite.types import POST_PROCESSED_REWARD, TOKEN_VERSIONS, RewardError, Sample


class SampleTensors(dict):
    """``{sample index: tensor}`` (log-probs, values, returns of a rollout) that pickles as one flat tensor and the
    shapes: what crosses Ray or ``all_gather_object`` is one buffer, not one pickled tensor per sample (512 small
    tensors took 0.1-0.2 s a call that way on CPU). Anything else (mixed dtypes, a device tensor, one that needs a
    gradient, a value that is not a tensor) pickles as a plain dict. ``copy.copy`` of a flattened one copies the
    tensors too."""

    def __reduce__(self) -> tuple:
        values = list(self.values())
        if (not values or any(not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.requires_grad
                              for t in values) or len({t.dtype for t in values}) != 1):
            return SampleTensors, (dict(self),)
        flat = torch.cat([t.reshape(-1) for t in values])
        return _unflatten, (list(self), [tuple(t.shape) for t in values], flat)


def _unflatten(keys: list, shapes: list, flat: torch.Tensor) -> SampleTensors:
    parts = flat.split([int(torch.Size(s).numel()) for s in shapes])
    return SampleTensors((k, p.view(s)) for k, s, p in zip(keys, shapes, parts))


@dataclass
class MicroBatch:
    indices: list[int]  # positions of the samples in the rollout
    tokens: torch.Tensor  # [B, T] long, right-padded with 0
    position_ids: torch.Tensor  # [B, T]
    prompt_lengths: list[int]
    response_lengths: list[int]
    cu_seqlens: torch.Tensor | None = None  # packed: [n+1] int32 sample boundaries in the one row
    max_seqlen: int = 0

    @property
    def packed(self) -> bool:
        return self.cu_seqlens is not None


def to_device(t: torch.Tensor, device: Any) -> torch.Tensor:
    """``t`` on ``device`` without the host waiting for the GPU. A plain ``.to("cuda")`` of pageable host memory
    synchronizes the stream (the GPU's queue drains and it idles until the host launches again); a CPU tensor goes to
    CUDA through pinned memory, asynchronously (torch's caching host allocator does not reuse the pinned block before
    the copy is done). Anything else is ``t.to(device)``."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def samples_to_device(xs: Any, indices: list[int], device: Any) -> list[torch.Tensor]:
    """``[xs[i] for i in indices]`` (1-D tensors) on ``device``, in one copy: views of one tensor."""
    return list(to_device(torch.cat([xs[i] for i in indices]), device).split([xs[i].numel() for i in indices]))


def sample_flops(lengths: list[int], hidden_size: int) -> list[float]:
    """Each sample's training cost up to a constant: Megatron's FLOPs estimate of a sequence of length L, linear in
    L (the matrix products) plus quadratic (attention): L * (1 + L / (6 * hidden))."""
    return [n * (1 + n / (6 * hidden_size)) for n in lengths]


def deal(items: list[Any], cost: dict[Any, float], sizes: list[int]) -> list[list[Any]]:
    """``items`` dealt to ``len(sizes)`` ranks, ``sizes[r]`` to rank r: the costliest first, each to the cheapest
    rank with room (every rank computes the same plan: no communication)."""
    ranks: list[list[Any]] = [[] for _ in sizes]
    load = [0.0] * len(sizes)
    for item in sorted(items, key=lambda i: (-cost[i], i)):
        r = min((r for r in range(len(sizes)) if len(ranks[r]) < sizes[r]), key=lambda r: (load[r], r))
        ranks[r].append(item)
        load[r] += cost[item]
    return ranks


def trajectory_steps(samples: list[Any], global_batch: int) -> list[list[int]]:
    """The sample positions of each optimizer step: ``global_batch`` trajectories a step (``Sample.trajectory``, in
    the order they first appear), each with all its samples, so a trajectory split into several samples (an agent's
    rewritten history, a generate hook's list) trains in one step; unsplit, step k is samples [k*G, (k+1)*G)."""
    parts: dict[tuple, list[int]] = {}
    for i, s in enumerate(samples):
        parts.setdefault(s.trajectory, []).append(i)
    if len(parts) % global_batch:
        raise ValueError(f"{len(parts)} trajectories do not split into steps of {global_batch}")
    keys = list(parts)
    return [sorted(i for k in keys[start:start + global_batch] for i in parts[k])
            for start in range(0, len(keys), global_batch)]


def _even(n: int, parts: int) -> list[int]:
    return [n // parts + (k < n % parts) for k in range(parts)]


def step_shards(steps: list[list[int]], dp_rank: int, dp_size: int, micro: int,
                costs: list[float] | None = None) -> list[list[list[int]]]:
    """Sample indices per optimizer step (``steps``: each step's samples), per micro-batch, for one DP rank: each
    rank takes a contiguous share of a step's samples in order, or with ``costs`` (--balance-data:
    ``sample_flops``) a share dealt by cost. Every rank runs the same number of micro-batches of at most ``micro``
    samples; a step of split trajectories, whose sample count need not divide by ``dp_size x micro``, gets
    micro-batches of near-equal sizes (with ``micro`` 1 and a count that does not divide by ``dp_size``, a few of
    two samples: a rank cannot run an empty one)."""
    out = []
    for idx in steps:
        n = len(idx)
        if n < dp_size:
            raise ValueError(f"a step of {n} samples cannot feed {dp_size} data-parallel ranks")
        per_rank_mbs = min(-(-n // (dp_size * micro)), n // dp_size)
        sizes = _even(n, dp_size * per_rank_mbs)  # the step's micro-batch sizes, rank by rank
        rank_sizes = [sum(sizes[r * per_rank_mbs:(r + 1) * per_rank_mbs]) for r in range(dp_size)]
        if costs is None:
            lo = sum(rank_sizes[:dp_rank])
            mine = idx[lo:lo + rank_sizes[dp_rank]]
        else:
            mine = sorted(deal(list(idx), {i: costs[i] for i in idx}, rank_sizes)[dp_rank])
        mbs, start = [], 0
        for size in sizes[dp_rank * per_rank_mbs:(dp_rank + 1) * per_rank_mbs]:
            mbs.append(mine[start:start + size])
            start += size
        out.append(mbs)
    return out


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


def make_packed_micro_batch(samples: list[Any], indices: list[int], multiple: int = 1) -> MicroBatch:
    """The samples concatenated into one row [1, T] with positions restarting at 0 for each sample. With
    ``multiple`` > 1 (--sequence-parallel: T must divide by TP) the row ends with a segment of padding tokens of
    its own (its own entry in cu_seqlens, so no sample attends to it; nothing reads its outputs)."""
    lens = [len(samples[i].tokens) for i in indices]
    pad = -sum(lens) % multiple
    seqs = [torch.as_tensor(samples[i].tokens, dtype=torch.long) for i in indices]
    tokens = torch.cat(seqs + [torch.zeros(pad, dtype=torch.long)]).unsqueeze(0)
    segs = lens + ([pad] if pad else [])
    positions = torch.cat([torch.arange(n, dtype=torch.long) for n in segs]).unsqueeze(0)
    cu = torch.zeros(len(segs) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(segs, dtype=torch.int32), 0)
    return MicroBatch(
        indices=list(indices), tokens=tokens, position_ids=positions,
        prompt_lengths=[len(samples[i].tokens) - samples[i].response_length for i in indices],
        response_lengths=[samples[i].response_length for i in indices], cu_seqlens=cu, max_seqlen=max(segs),
    )


def _first_fit(order: list[int], lengths: dict[int, int], max_tokens: int) -> list[list[int]]:
    bins: list[list[int]] = []
    load: list[int] = []
    for i in order:
        for b in range(len(bins)):
            if load[b] + lengths[i] <= max_tokens:
                bins[b].append(i)
                load[b] += lengths[i]
                break
        else:
            bins.append([i])
            load.append(lengths[i])
    return bins


def _balanced_bins(order: list[int], lengths: dict[int, int], count: int, max_tokens: int) -> list[list[int]] | None:
    """Longest-first into the least-loaded of `count` bins; None if a bin would pass max_tokens with 2+ samples."""
    bins: list[list[int]] = [[] for _ in range(count)]
    load = [0] * count
    for i in order:
        b = min(range(count), key=lambda k: (load[k], k))
        if bins[b] and load[b] + lengths[i] > max_tokens:
            return None
        bins[b].append(i)
        load[b] += lengths[i]
    return bins if all(bins) else None


def dynamic_step_shards(lengths: list[int], steps: list[list[int]], dp_rank: int, dp_size: int,
                        max_tokens: int, costs: list[float] | None = None) -> list[list[list[int]]]:
    """Like `step_shards` with micro-batches packed by token count: sample indices per optimizer step (``steps``:
    each step's samples), per micro-batch, for one DP rank. Every rank computes the same plan (no communication)
    and gets the same number of micro-batches per step, dealt by their tokens (with ``costs``: by their samples'
    costs); a sample longer than max_tokens is alone in its micro-batch (unless a step of split trajectories has
    too few samples for that: then as many micro-batches as its samples allow, a multiple of the DP size)."""
    out = []
    for idx in steps:
        if len(idx) < dp_size:
            raise ValueError(f"a step of {len(idx)} samples cannot feed {dp_size} data-parallel ranks")
        ln = {i: lengths[i] for i in idx}
        order = sorted(idx, key=lambda i: (-ln[i], i))
        most = len(idx) // dp_size * dp_size  # the most micro-batches every rank can have as many of
        # as many micro-batches as first-fit needs, rounded up to a multiple of dp (never more than the samples)
        count = min(-(-len(_first_fit(order, ln, max_tokens)) // dp_size) * dp_size, most)
        bins = _balanced_bins(order, ln, count, max_tokens)
        while bins is None:
            count += dp_size
            if count >= most:
                bins = [[i] for i in order] if most == len(idx) else _balanced_bins(order, ln, most, float("inf"))
            else:
                bins = _balanced_bins(order, ln, count, max_tokens)
        bins = {min(b): sorted(b) for b in bins}  # each by its first sample (a tie-break that every rank shares)
        weight = {k: sum(costs[i] if costs else ln[i] for i in b) for k, b in bins.items()}
        out.append([bins[k] for k in sorted(deal(list(bins), weight, [len(bins) // dp_size] * dp_size)[dp_rank])])
    return out


def loss_masks(samples: list[Any]) -> list[torch.Tensor]:
    return [
        torch.tensor(s.loss_mask if s.loss_mask is not None else [1] * s.response_length, dtype=torch.float32)
        for s in samples
    ]


def trajectory_tokens(samples: list[Any], masks: list[torch.Tensor]) -> dict[Any, float]:
    """Each trajectory's loss-mask tokens, summed over the samples it was split into (``Sample.trajectory``)."""
    total: dict[Any, float] = {}
    for s, m in zip(samples, masks):
        total[s.trajectory] = total.get(s.trajectory, 0.0) + float(m.sum())
    return total


def trajectory_denominators(samples: list[Any], masks: list[torch.Tensor]) -> list[float] | None:
    """Per sample, its trajectory's loss-mask tokens: what a sample's masked token sum is divided by, so each
    trajectory is one token mean however many samples it trains as (slime's per-rollout mask sums); None when no
    trajectory was split (each sample's own mask count)."""
    total = trajectory_tokens(samples, masks)
    return None if len(total) == len(samples) else [total[s.trajectory] for s in samples]


def newest_weight_masks(samples: list[Any], masks: list[torch.Tensor]) -> list[torch.Tensor]:
    """``masks`` without the tokens generated by weights older than the newest in the batch (a sample continued by
    --partial-rollout holds tokens of earlier weight versions): what the train/rollout log-prob comparison is over,
    since only the newest tokens were sampled from the weights the trainer has."""
    versions = [s.metadata.get(TOKEN_VERSIONS) if isinstance(s.metadata, dict) else None for s in samples]
    newest = max((max(v) for v in versions if v), default=None)
    return [m if not v or min(v) == newest else m * (torch.tensor(v) == newest).to(m.dtype)
            for m, v in zip(masks, versions)]


def rollout_log_probs(samples: list[Any]) -> list[torch.Tensor] | None:
    """The engine's log-probs of each sample's response tokens; None when a sample has none (e.g. a replayed dump
    made without them): the train/rollout comparisons and rollout correction then have nothing to compare."""
    if any(s.rollout_log_probs is None for s in samples):
        return None
    return [torch.tensor(s.rollout_log_probs) for s in samples]


def post_processed_rewards(samples: list[Sample]) -> list[float]:
    """The rewards --custom-reward-post-process-path gave the samples (the rollout manager stores them)."""
    missing = [s.index for s in samples if POST_PROCESSED_REWARD not in (s.metadata or {})]
    if missing:
        raise SlimeLiteError(f"sample {missing[0]} has no metadata[{POST_PROCESSED_REWARD!r}]: the samples did not "
                             "go through --custom-reward-post-process-path (the rollout manager calls it on every "
                             "rollout it hands to training).")
    return [float(s.metadata[POST_PROCESSED_REWARD]) for s in samples]


def has_post_processed_rewards(samples: list[Sample]) -> bool:
    """Every sample carries a reward for the estimator as it is (the manager keeps one per sample of a rollout
    whose trajectories were split, or none)."""
    return bool(samples) and all(POST_PROCESSED_REWARD in (s.metadata or {}) for s in samples)


def scalar_rewards(samples: list[Sample], reward_key: str | None) -> list[float]:
    """Each sample's scalar reward (``--reward-key`` picks it from a dict reward); SlimeLiteError if one has none."""
    try:
        return [s.scalar_reward(reward_key) for s in samples]
    except RewardError as exc:  # e.g. a replayed dump with dict rewards and no --reward-key
        raise SlimeLiteError(str(exc)) from None
