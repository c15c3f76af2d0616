"""The weight-equality check's checksum (``--check-weight-update-equal``, the engine's ``/get_weights_checksum``): an
exact integer checksum of each tensor's raw bytes, computed where the tensors live (GPU or CPU, the same digest on
both) and brought to the host once per call. The trainer and the engine both use ``tensor_checksums``."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch

from slime_lite.triton_build import triton_kernels

CHECKSUM_BLOCK_WORDS = 2048  # part of the digest's definition (see tensor_checksums): changing it changes every digest
CHECKSUM_BATCH_BYTES = 64 << 20  # bytes hashed per batch of device ops (transient memory ~3x this); digests unaffected
_LENGTH_MULT = 0xD6E8FEB86659FD93  # odd: folds the byte length into the second half


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser on a uint64 array (wrapping arithmetic): a fixed pseudo-random 64-bit value per x."""

    z = x + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def checksum_multipliers(kind: str, index: np.ndarray) -> np.ndarray:
    """The odd 64-bit multipliers of the checksum, as uint64: ``"word"`` for a word's place inside its block (index
    < CHECKSUM_BLOCK_WORDS), ``"block_a"`` / ``"block_b"`` for the block's place in the tensor, one per half."""

    salt = {"word": 0, "block_a": 1 << 40, "block_b": 2 << 40}[kind]
    return _splitmix64(np.asarray(index, dtype=np.uint64) + np.uint64(salt)) | np.uint64(1)


@functools.lru_cache(maxsize=16)
def _multipliers_on(device: str, kind: str, count: int) -> torch.Tensor:
    """``checksum_multipliers(kind, range(count))`` as int64 on ``device``: made once per process."""

    return torch.from_numpy(checksum_multipliers(kind, np.arange(count)).view(np.int64)).to(device)


def tensor_checksums(tensors: Sequence[torch.Tensor], dtype: torch.dtype | None = None,
                     device: torch.device | str | None = None) -> list[str]:
    """A 128-bit checksum (32 hex digits) of each tensor's raw bytes (after a cast to ``dtype``, done on the tensor's
    device, when given). With ``device``, every tensor is hashed there (host tensors on a GPU: copied a batch at a
    time); the digests are the same wherever they are computed. A checksum for finding weight-sync bugs, NOT a cryptographic hash: anyone can forge a
    collision on purpose.

    Definition (all arithmetic modulo 2**64): the bytes, zero-padded to a multiple of 8, are read as little-endian
    signed 64-bit words ``w[j]``; word ``j`` sits at place ``r = j % B`` of block ``k = j // B`` (``B`` =
    CHECKSUM_BLOCK_WORDS); ``p[j] = w[j] * M[r]``; the first half is ``sum(A[k] * p[j])``, the second
    ``sum(C[k] * p[j] * (p[j] >> 32)) + nbytes * L`` (``>>`` arithmetic: ``p``'s signed upper half), where ``M``,
    ``A``, ``C`` are the odd ``checksum_multipliers`` and ``L`` is odd. So:

    - equal bytes give equal digests, on any device, in any batch; they depend on the bytes only (an int16 view
      of a bf16 tensor has its digest), and on the byte length (8 zero bytes differ from 4);
    - any change confined to one 8-byte word (e.g. any single flipped bit) always changes the first half: its
      multiplier is odd, hence invertible modulo 2**64;
    - a change of several words goes unseen only if it cancels in both halves at once: the first half is linear in
      the words, the second quadratic (each ``p`` times its own upper half), so a change that cancels in one
      rarely cancels in the other. The weakest case we know is a change confined to the top bit or two of two
      8-byte words (e.g. two sign flips: they always cancel in the first half), unseen with a chance of about
      2**-33 over the data; for changes that look random the chance is about 2**-64.

    Sums of integers do not depend on their order, so the digest is deterministic on GPUs and CPUs alike. The
    per-block sums of all tensors on one device come from one Triton kernel that reads each byte once (CUDA, when
    Triton is installed and no cast or host copy is asked for), else from torch ops over batches of about
    CHECKSUM_BATCH_BYTES (a few kernels per batch, not per tensor); the digests come to the host in one transfer
    per device.
    """

    out: list[str] = [""] * len(tensors)
    by_device: dict[torch.device, list[int]] = {}
    where = None if device is None else torch.device(device)
    if where is not None and where.type == "cuda" and where.index is None:
        where = torch.device("cuda", torch.cuda.current_device())  # "cuda" is the device the tensors say cuda:N of
    for i, t in enumerate(tensors):
        by_device.setdefault(where or t.device, []).append(i)
    for dev, idx in by_device.items():
        for i, digest in zip(idx, _checksums_on(dev, [tensors[i] for i in idx], dtype)):
            out[i] = digest
    return out


def _checksums_on(device: torch.device, tensors: list[torch.Tensor], dtype: torch.dtype | None) -> list[str]:
    block = 8 * CHECKSUM_BLOCK_WORDS  # bytes
    nbytes = [t.numel() * (dtype or t.dtype).itemsize for t in tensors]
    nblocks = [-(-n // block) for n in nbytes]
    with torch.no_grad():
        per_tensor = _fused_digests(device, tensors, dtype, nbytes, nblocks)
        if per_tensor is None:
            sums = _torch_block_sums(device, tensors, dtype, nbytes, nblocks)
            per_tensor = None if sums is None else _combine(device, sums, nblocks)
        halves = (np.zeros((2, len(tensors)), np.uint64) if per_tensor is None
                  else per_tensor.cpu().numpy().view(np.uint64))
    halves[1] += np.asarray(nbytes, dtype=np.uint64) * np.uint64(_LENGTH_MULT)
    text = halves.T.astype(">u8").tobytes().hex()  # big-endian: each half as "%016x"; per tensor, first then second
    return [text[i: i + 32] for i in range(0, len(text), 32)]


def _combine(device: torch.device, sums: torch.Tensor, nblocks: list[int]) -> torch.Tensor:
    """(2, tensors) int64: per tensor, the sum of its blocks' sums (``sums``, (2, all blocks)) each times its block's
    multiplier."""

    counts = np.asarray(nblocks, dtype=np.int64)
    ends = np.cumsum(counts)
    place = np.arange(int(ends[-1])) - np.repeat(ends - counts, counts)  # each block's place in its tensor
    weights = torch.stack([_block_multipliers(device, kind, max(nblocks)) for kind in ("block_a", "block_b")])
    at = torch.from_numpy(np.concatenate([place, ends - counts, ends])).to(device)
    running = torch.cumsum(sums * weights[:, at[: len(place)]], dim=1)
    running = torch.cat([torch.zeros_like(running[:, :1]), running], dim=1)
    return running[:, at[len(place) + len(ends):]] - running[:, at[len(place): len(place) + len(ends)]]


def _block_multipliers(device: torch.device, kind: str, count: int) -> torch.Tensor:
    """At least ``count`` of the ``kind`` block multipliers on ``device`` (a power of two of them: few sizes kept)."""
    return _multipliers_on(str(device), kind, 1 << int(count - 1).bit_length())


def _torch_block_sums(device: torch.device, tensors: list[torch.Tensor], dtype: torch.dtype | None,
                      nbytes: list[int], nblocks: list[int]) -> torch.Tensor | None:
    """(2, all blocks) int64: each block's sum of p and of p * (p >> 32), in torch ops over batches of about
    CHECKSUM_BATCH_BYTES (host tensors copied, casts done, a batch at a time); None when there are no blocks."""

    block = 8 * CHECKSUM_BLOCK_WORDS
    per_batch = max(1, CHECKSUM_BATCH_BYTES // block)
    mult = _multipliers_on(str(device), "word", CHECKSUM_BLOCK_WORDS)
    zeros = torch.zeros(block, dtype=torch.uint8, device=device)
    sums: list[torch.Tensor] = []
    pieces: list[torch.Tensor] = []
    filled = 0

    def flush() -> None:
        w = torch.cat(pieces).view(torch.int64).view(-1, CHECKSUM_BLOCK_WORDS)
        p = w * mult
        mixed = p >> 32
        mixed *= p
        sums.append(torch.stack([p.sum(1), mixed.sum(1)]))

    for t, n, count in zip(tensors, nbytes, nblocks):
        flat = t.detach().contiguous().reshape(-1)  # a view of a contiguous tensor, a copy of any other
        size = (dtype or t.dtype).itemsize
        b = 0
        while b < count:
            take = min(count - b, per_batch - filled)
            start, end = b * block, min((b + take) * block, n)
            if dtype is None or dtype == flat.dtype:
                pieces.append(flat.view(torch.uint8)[start:end].to(device))
            else:  # block boundaries fall on element boundaries: element sizes divide the block size
                pieces.append(flat[start // size: end // size].to(device).to(dtype).view(torch.uint8))
            if (b + take) * block > end:
                pieces.append(zeros[: (b + take) * block - end])
            b += take
            filled += take
            if filled == per_batch:
                flush()
                pieces, filled = [], 0
    if pieces:
        flush()
    return torch.cat(sums, 1) if sums else None


def _fused_usable(device: torch.device) -> bool:
    """The fused kernel serves tensors on ``device``: CUDA with Triton installed."""
    return device.type == "cuda" and _block_sums_kernel() is not None


def _fused_digests(device: torch.device, tensors: list[torch.Tensor], dtype: torch.dtype | None,
                   nbytes: list[int], nblocks: list[int]) -> torch.Tensor | None:
    """``_combine``'s result from one Triton kernel (each byte read once, no copies of contiguous tensors; each block's
    sums times its block multipliers) and a running sum on the device; only a few host calls per tensor. Only on
    CUDA with Triton installed, every tensor already on ``device`` and no cast asked for; None otherwise (the caller
    falls back to torch ops), or when there are no blocks."""

    total = sum(nblocks)
    if total == 0 or not _fused_usable(device):
        return None
    if (dtype is not None and any(t.dtype != dtype for t in tensors)) or any(t.device != device for t in tensors):
        return None
    starts = [t.data_ptr() for t in tensors]  # where each tensor's bytes start: word-aligned, a whole number of words
    keep = []  # zero-padded contiguous copies of the tensors that are not so (rare: parameters are)
    for i in [i for i, (t, s, n) in enumerate(zip(tensors, starts, nbytes)) if s % 8 or n % 8 or not t.is_contiguous()]:
        padded = torch.zeros(-(-nbytes[i] // 8) * 8, dtype=torch.uint8, device=device)
        padded[: nbytes[i]] = tensors[i].contiguous().reshape(-1).view(torch.uint8)
        keep.append(padded)
        starts[i] = padded.data_ptr()
    counts = np.asarray(nblocks, dtype=np.int64)
    ends = np.cumsum(counts)
    # per tensor: its address, its words, its first block, the block after its last
    meta = torch.from_numpy(np.stack([np.asarray(starts, dtype=np.int64), (np.asarray(nbytes, dtype=np.int64) + 7) // 8,
                                      ends - counts, ends])).to(device)
    owner = torch.repeat_interleave(torch.arange(len(tensors), device=device), meta[3] - meta[2], output_size=total)
    out = torch.empty(2, total, dtype=torch.int64, device=device)
    with torch.cuda.device(device if device.type == "cuda" else -1):  # -1: the Triton interpreter (tests)
        _block_sums_kernel()[(total,)](
            meta, owner, _multipliers_on(str(device), "word", CHECKSUM_BLOCK_WORDS),
            _block_multipliers(device, "block_a", max(nblocks)), _block_multipliers(device, "block_b", max(nblocks)),
            out, len(tensors), total, CHECKSUM_BLOCK_WORDS, num_warps=8)
    running = torch.cat([torch.zeros_like(out[:, :1]), torch.cumsum(out, dim=1)], dim=1)  # wraps, as every sum here
    return running[:, meta[3]] - running[:, meta[2]]  # ``keep`` may go: its memory is reused only after the kernel


@triton_kernels
def _block_sums_kernel(triton, tl):
    """The Triton kernel behind ``_fused_digests``, or None where Triton is not installed (the CPU build)."""
    @triton.jit(do_not_specialize=["tensors", "blocks"])  # counts that vary by call: no variant compiled per count
    def block_sums(meta, owner, mult, mult_a, mult_b, out, tensors, blocks, words: tl.constexpr):
        k = tl.program_id(0)
        t = tl.load(owner + k)  # the tensor this block belongs to, and the block's place in it
        place = k - tl.load(meta + 2 * tensors + t)
        base = (tl.load(meta + t) + place * words * 8).to(tl.pointer_type(tl.int64))
        r = tl.arange(0, words)
        valid = tl.load(meta + tensors + t) - place * words  # the short last block: zero words, as the definition pads
        w = tl.load(base + r, mask=r < valid, other=0)
        p = w * tl.load(mult + r)  # wrapping int64 arithmetic, as in torch
        tl.store(out + k, tl.sum(p, axis=0) * tl.load(mult_a + place))
        tl.store(out + blocks + k, tl.sum(p * (p >> 32), axis=0) * tl.load(mult_b + place))  # >>: arithmetic

    return block_sums
