"""Moving weights from the trainer to rollout engines: code shared by the sender and the engine receiver.

Two transports, both used by the trainer side and by ``slime_lite.engine`` (this module imports neither the engine
nor Megatron, so either side can use it):

- **Serialized tensors** (``/update_weights_from_tensor``): ``serialize_named_tensors`` turns ``{name: tensor}``
  into one ASCII string, base64 of ``torch.save`` of a dict of CPU tensors; ``deserialize_named_tensors`` loads it
  with ``weights_only=True`` (no pickled code runs). The request carries a list with one such string per engine
  TP rank.
- **A broadcast group** (``/init_weights_update_group`` + ``/update_weights_from_distributed``):
  ``WeightUpdateGroup`` is one member of a torch.distributed group built directly from a TCPStore, without the
  default process group (the trainer already has Megatron's). Rank 0 is the trainer and hosts the store; the
  engines join with rank ``rank_offset + tp_rank``. The store keys are laid out as torch's own ``new_group`` path
  lays them out (``<group>`` then ``<group>/`` then ``<device>/`` prefixes), which is also what SGLang's engines
  use, so a trainer-side member can broadcast to a real SGLang server as well as to the embedded engine.

``tensor_sha256`` is the checksum both sides use for the weight-equality check: the SHA-256 of the tensor's raw
bytes (contiguous, on CPU, in its own dtype), so compare tensors in the same dtype.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import io
import logging
from typing import TYPE_CHECKING, Iterable, Mapping

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

DEFAULT_GROUP_NAME = "weight_update_group"


def serialize_named_tensors(named: Mapping[str, "torch.Tensor"] | Iterable[tuple[str, "torch.Tensor"]]) -> str:
    """Encode ``{name: tensor}`` (or ``(name, tensor)`` pairs) as base64 text for a JSON body."""
    import torch

    items = named.items() if isinstance(named, Mapping) else named
    payload = {name: t.detach().to("cpu").contiguous() for name, t in items}
    buf = io.BytesIO()
    torch.save(payload, buf)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def deserialize_named_tensors(data: str) -> dict[str, "torch.Tensor"]:
    """Decode what ``serialize_named_tensors`` produced (only tensors load: ``weights_only=True``)."""
    import torch

    raw = base64.b64decode(data.encode("ascii") if isinstance(data, str) else data)
    out = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    if not isinstance(out, dict) or not all(isinstance(k, str) for k in out):
        raise ValueError("serialized tensors must be a dict of name -> tensor")
    return out


def tensor_sha256(t: "torch.Tensor") -> str:
    """SHA-256 of a tensor's raw bytes (dtype-sensitive: bf16 and fp32 copies of one weight differ)."""
    import torch

    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return hashlib.sha256(flat.view(torch.uint8).numpy().tobytes()).hexdigest()


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
        self.rank, self.world_size, self.backend, self.group_name = rank, world_size, backend, group_name
        timeout = datetime.timedelta(seconds=timeout_s)
        url = f"tcp://{master_address}:{int(master_port)}"
        store, _, _ = next(dist.rendezvous(url, rank, world_size, timeout=timeout))
        store.set_timeout(timeout)
        device = "cuda" if backend == "nccl" else "cpu"
        store = dist.PrefixStore(f"{device}/", dist.PrefixStore(f"{group_name}/", dist.PrefixStore(group_name, store)))
        if backend == "gloo":
            self._pg = dist.ProcessGroupGloo(store, rank, world_size, timeout)
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
