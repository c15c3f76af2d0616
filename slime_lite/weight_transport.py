"""Moving weights from the trainer to rollout engines: code shared by the sender and the engine receiver.

Two transports, both used by the trainer side and by ``slime_lite.engine`` (this module imports neither the engine
nor Megatron, so either side can use it):

- **Serialized tensors** (``/update_weights_from_tensor``): SGLang's payload format, in ``slime_lite.weight_wire``
  (CUDA IPC or shared-memory handles on one host, tensors by value across hosts; a restricted unpickler reads it).
- **A broadcast group** (``/init_weights_update_group`` + ``/update_weights_from_distributed``):
  ``WeightUpdateGroup`` is one member of a torch.distributed group built directly from a TCPStore, without the
  default process group (the trainer already has Megatron's). Rank 0 is the trainer and hosts the store; the
  engines join with rank ``rank_offset + tp_rank``. The store keys are laid out as torch's own ``new_group`` path
  lays them out (``<group>`` then ``<group>/`` then ``<device>/`` prefixes), which is also what SGLang's engines
  use, so a trainer-side member can broadcast to a real SGLang server as well as to the embedded engine.

``tensor_checksums`` is the checksum both sides use for the weight-equality check (``--check-weight-update-equal``,
the engine's ``/get_weights_checksum``): an exact integer checksum of each tensor's raw bytes, computed with torch
ops where the tensors live (GPU or CPU, the same digest on both) and brought to the host once per call.
"""

from __future__ import annotations

import datetime
import functools
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
    import torch

logger = logging.getLogger(__name__)

DEFAULT_GROUP_NAME = "weight_update_group"
WILDCARD_ENV = "SLIME_LITE_WEIGHT_GROUP_ALLOW_WILDCARD"  # "1": a weight group may listen on 0.0.0.0 / ::


def is_wildcard(address: str) -> bool:
    """Whether ``address`` means every interface (``0.0.0.0``, ``::``, empty)."""
    import ipaddress

    try:
        return ipaddress.ip_address(address.strip("[]")).is_unspecified
    except ValueError:
        return address.strip() == ""


def wildcard_allowed() -> bool:
    import os

    return os.environ.get(WILDCARD_ENV, "") == "1"


def check_group_address(address: str) -> None:
    """Refuse a wildcard weight-group address unless the user set ``SLIME_LITE_WEIGHT_GROUP_ALLOW_WILDCARD=1``."""
    if is_wildcard(address) and not wildcard_allowed():
        raise ValueError(f"master_address {address!r} would listen on every interface; give the address to bind "
                         f"(e.g. 127.0.0.1 or this host's cluster address), or set {WILDCARD_ENV}=1 to allow it")


def _local_address_towards(address: str, port: int) -> str:
    """This host's address on the route to ``address`` (the address itself when it is local): what gloo binds."""
    import socket

    if is_wildcard(address):
        return "0.0.0.0"
    info = socket.getaddrinfo(address, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(info[0], socket.SOCK_DGRAM) as s:
        s.connect(info[4])  # UDP: no packet is sent, only the route is chosen
        return s.getsockname()[0]


# ---- the weight-equality checksum ------------------------------------------------------------------------------
CHECKSUM_BLOCK_WORDS = 2048  # part of the digest's definition (see tensor_checksums): changing it changes every digest
CHECKSUM_BATCH_BYTES = 64 << 20  # bytes hashed per batch of device ops (transient memory ~3x this); digests unaffected
_LENGTH_MULT = 0xD6E8FEB86659FD93  # odd: folds the byte length into the second half


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser on a uint64 array (wrapping arithmetic): a fixed pseudo-random 64-bit value per x."""
    import numpy as np

    z = x + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def checksum_multipliers(kind: str, index: np.ndarray) -> np.ndarray:
    """The odd 64-bit multipliers of the checksum, as uint64: ``"word"`` for a word's place inside its block (index
    < CHECKSUM_BLOCK_WORDS), ``"block_a"`` / ``"block_b"`` for the block's place in the tensor, one per half."""
    import numpy as np

    salt = {"word": 0, "block_a": 1 << 40, "block_b": 2 << 40}[kind]
    return _splitmix64(np.asarray(index, dtype=np.uint64) + np.uint64(salt)) | np.uint64(1)


@functools.lru_cache(maxsize=16)
def _multipliers_on(device: str, kind: str, count: int) -> torch.Tensor:
    """``checksum_multipliers(kind, range(count))`` as int64 on ``device``: made once per process."""
    import numpy as np
    import torch

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

    Sums of integers do not depend on their order, so the digest is deterministic on GPUs and CPUs alike. All
    tensors on one device are hashed together in batches of about CHECKSUM_BATCH_BYTES (a few kernels per batch,
    not per tensor) and their digests come to the host in one transfer per device.
    """
    import torch

    out: list[str] = [""] * len(tensors)
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(torch.device(device) if device is not None else t.device, []).append(i)
    for where, idx in by_device.items():
        for i, digest in zip(idx, _checksums_on(where, [tensors[i] for i in idx], dtype)):
            out[i] = digest
    return out


def _checksums_on(device: torch.device, tensors: list[torch.Tensor], dtype: torch.dtype | None) -> list[str]:
    import numpy as np
    import torch

    block = 8 * CHECKSUM_BLOCK_WORDS  # bytes
    per_batch = max(1, CHECKSUM_BATCH_BYTES // block)
    mult = _multipliers_on(str(device), "word", CHECKSUM_BLOCK_WORDS)
    zeros = torch.zeros(block, dtype=torch.uint8, device=device)
    sums: list[torch.Tensor] = []  # (2, blocks of one batch): the per-block sums of p and p * (p >> 32)
    pieces: list[torch.Tensor] = []
    filled = 0

    def flush() -> None:
        w = torch.cat(pieces).view(torch.int64).view(-1, CHECKSUM_BLOCK_WORDS)
        p = w * mult
        mixed = p >> 32
        mixed *= p
        sums.append(torch.stack([p.sum(1), mixed.sum(1)]))

    nbytes, nblocks = [], []
    with torch.no_grad():
        for t in tensors:
            flat = t.detach().contiguous().reshape(-1)  # a view of a contiguous tensor, a copy of any other
            size = (dtype or t.dtype).itemsize
            n = flat.numel() * size
            nbytes.append(n)
            nblocks.append(-(-n // block))
            b = 0
            while b < nblocks[-1]:
                take = min(nblocks[-1] - b, per_batch - filled)
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
        halves = np.zeros((2, len(tensors)), np.uint64)
        if sums:  # per tensor: the sum of its blocks' sums, each times its block's multiplier, on the device
            counts = np.asarray(nblocks, dtype=np.int64)
            ends = np.cumsum(counts)
            place = np.arange(int(ends[-1])) - np.repeat(ends - counts, counts)  # each block's place in its tensor
            bound = 1 << int(counts.max() - 1).bit_length()  # a power of two: few sizes to keep
            weights = torch.stack([_multipliers_on(str(device), kind, bound) for kind in ("block_a", "block_b")])
            at = torch.from_numpy(np.concatenate([place, ends - counts, ends])).to(device)
            running = torch.cumsum(torch.cat(sums, 1) * weights[:, at[: len(place)]], dim=1)
            running = torch.cat([torch.zeros_like(running[:, :1]), running], dim=1)
            per_tensor = running[:, at[len(place) + len(ends):]] - running[:, at[len(place): len(place) + len(ends)]]
            halves = per_tensor.cpu().numpy().view(np.uint64)
    halves[1] += np.asarray(nbytes, dtype=np.uint64) * np.uint64(_LENGTH_MULT)
    return [f"{int(a):016x}{int(c):016x}" for a, c in zip(*halves)]


def dtype_from_name(name: str) -> "torch.dtype":
    """``"bfloat16"`` or ``"torch.bfloat16"`` -> ``torch.bfloat16``; a clear error for anything else."""
    import torch

    dt = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} (expected e.g. 'bfloat16', 'float32')")
    return dt


class WeightUpdateGroup:
    """One member of a broadcast group between the trainer (rank 0) and engine ranks.

    Every member must be constructed at the same time (construction blocks until all ``world_size`` members
    joined, or ``timeout_s`` passed). ``backend`` is ``"gloo"`` (CPU tensors) or ``"nccl"`` (CUDA tensors, the
    current CUDA device).

    Every socket binds to one address, never every interface: rank 0's store listens on ``master_address`` only,
    and gloo's pairs on this host's address towards it. A wildcard ``master_address`` (``0.0.0.0``, ``::``) is
    refused unless ``SLIME_LITE_WEIGHT_GROUP_ALLOW_WILDCARD=1``.
    """

    def __init__(
        self,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        backend: str = "gloo",
        group_name: str = DEFAULT_GROUP_NAME,
        timeout_s: float = 300.0,
    ) -> None:
        import torch.distributed as dist

        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend {backend!r}: expected 'gloo' or 'nccl'")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} out of range for world_size {world_size}")
        check_group_address(master_address)
        self.rank, self.world_size, self.backend, self.group_name = rank, world_size, backend, group_name
        timeout = datetime.timedelta(seconds=timeout_s)
        url = f"tcp://{master_address}:{int(master_port)}"
        if rank == 0:  # torch's TCPStore server binds every interface: hand it a socket bound to the address asked
            import socket

            info = socket.getaddrinfo(master_address.strip("[]"), int(master_port), type=socket.SOCK_STREAM)[0]
            listener = socket.socket(info[0], socket.SOCK_STREAM)
            try:
                listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                listener.bind(info[4])
                listener.listen(max(64, world_size))
            except OSError:
                listener.close()
                raise
            # the store owns the socket from here (it closes it when it goes)
            store = dist.TCPStore(master_address, int(master_port), world_size, True, timeout,
                                  master_listen_fd=listener.detach(), use_libuv=False)
        else:
            store = dist.TCPStore(master_address, int(master_port), world_size, False, timeout)
        store.set_timeout(timeout)
        device = "cuda" if backend == "nccl" else "cpu"
        store = dist.PrefixStore(f"{device}/", dist.PrefixStore(f"{group_name}/", dist.PrefixStore(group_name, store)))
        if backend == "gloo":
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = timeout
            local = master_address if rank == 0 else _local_address_towards(master_address, int(master_port))
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=local)]
            self._pg = dist.ProcessGroupGloo(store, rank, world_size, opts)
        else:
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self._pg = dist.ProcessGroupNCCL(store, rank, world_size, opts)
        self._store = store
        logger.info("weight update group %r: joined as rank %d/%d (%s, %s)", group_name, rank, world_size, backend, url)

    def broadcast(self, tensor: "torch.Tensor", src: int = 0) -> None:
        """Broadcast ``tensor`` in place from rank ``src`` to every member (blocks until done)."""
        import torch.distributed as dist

        if self._pg is None:
            raise RuntimeError(f"weight update group {self.group_name!r} was destroyed")
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        self._pg.broadcast([tensor], opts).wait()

    def destroy(self) -> None:
        """Leave the group and free its communicator."""
        pg, self._pg = self._pg, None
        if pg is not None and self.backend == "nccl":
            try:
                pg.shutdown()
            except Exception:  # noqa: BLE001 - best effort on teardown
                logger.warning("weight update group %r: NCCL shutdown failed", self.group_name, exc_info=True)
        self._store = None
        logger.info("weight update group %r: destroyed (rank %d)", self.group_name, self.rank)
