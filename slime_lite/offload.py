"""Moving a set of tensors off the device and back as one block (--offload-train, --offload-rollout).

``TensorStash.offload(tensors)`` copies every storage the tensors live in into one host buffer (pinned on CUDA) and
frees the device memory; ``onload()`` allocates one device block, copies the host buffer into it and points each
tensor at its place there. The tensors keep their identity (their ``.data`` is swapped, as Megatron's own buffers
do), so modules, optimizers and views that share a storage (tied weights, the engine's fused q/k/v) see the moved
memory; nothing is re-allocated tensor by tensor. After the first round trip all tensors live in that one block, so
later offloads are one device-to-host copy each. Tensors that joined since (an optimizer's state, created at its
first step) get their own place at the next offload.

Works on CPU too (the host buffer is then a plain CPU tensor): the tests check the bookkeeping there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ALIGN = 512  # bytes: each storage starts where the CUDA caching allocator would start a block


@dataclass
class _Place:
    tensor: torch.Tensor
    offset: int  # in elements of the tensor's dtype, from the start of the block
    size: tuple[int, ...]
    stride: tuple[int, ...]


def _byte_view(storage: torch.UntypedStorage, start: int, end: int) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, start, (end - start,), (1,))


class TensorStash:
    """One device's tensors, offloaded to a host buffer as one block and brought back as one block."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # "cuda" != "cuda:0" in a device comparison
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.host: torch.Tensor | None = None
        self.places: list[_Place] = []
        self.nbytes = 0
        self.offloaded = False

    def offload(self, tensors: list[torch.Tensor], keep_on_host: bool = False) -> int:
        """Copy the storages of ``tensors`` (those on this device, each once) to the host and free them on the
        device; returns the bytes moved. By default the tensors keep their device storages, emptied (Megatron's
        way: autograd's grad accumulators stay valid) and must not be used until ``onload``. ``keep_on_host``: they
        become views of the host buffer instead (for tensors without autograd), so they can be read and written
        while offloaded and ``onload`` brings what was written; a device storage that something outside
        ``tensors`` still views then stays allocated (visible in the measured residual) rather than dangling (unless
        the caller unmaps it: the engine's mapped weight buffer, whose every view is in ``tensors``)."""
        if self.offloaded:
            raise RuntimeError("offload called twice without an onload in between")
        seen: set[int] = set()
        mine = [t for t in tensors if t.device == self.device and t.numel() and not (id(t) in seen or seen.add(id(t)))]
        units: dict[int, list] = {}  # storage address -> [storage, first byte, end byte]
        for t in mine:
            st = t.untyped_storage()
            es = t.element_size()
            if st.nbytes() == 0:
                raise RuntimeError(f"a tensor of shape {tuple(t.shape)} has no storage left (offloaded elsewhere?)")
            start = t.storage_offset() * es
            end = start + (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * es
            u = units.setdefault(st.data_ptr(), [st, start, end])
            u[1], u[2] = min(u[1], start), max(u[2], end)
        where: dict[int, int] = {}  # storage address -> its byte offset in the block
        total = 0
        for key, u in units.items():
            u[1] -= u[1] % 16  # every dtype's alignment, so a tensor's offset in the block stays a whole element
            where[key] = total
            total += -(-(u[2] - u[1]) // ALIGN) * ALIGN
        if self.host is None or self.host.numel() < total:
            self.drop_host()  # the old pinned buffer goes before the new one is made
            self.host = torch.empty(total, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        for key, (st, start, end) in units.items():
            self.host[where[key] : where[key] + end - start].copy_(_byte_view(st, start, end), non_blocking=True)
        self.places = []
        for t in mine:
            key, es = t.untyped_storage().data_ptr(), t.element_size()
            offset = where[key] + t.storage_offset() * es - units[key][1]
            self.places.append(_Place(t, offset // es, tuple(t.shape), tuple(t.stride())))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if keep_on_host:
            self._point_into(self.host)
        else:
            for st, _, _ in units.values():
                st.resize_(0)
        self.nbytes, self.offloaded = total, True
        return total

    def onload(self, block: torch.Tensor | None = None) -> None:
        """One device block for every offloaded tensor, filled from the host buffer; each tensor is a view of it.
        ``block``: that block (uint8, on the device, at least ``nbytes``) instead of a new allocation."""
        if not self.offloaded:
            return
        if block is None:
            block = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
        block[: self.nbytes].copy_(self.host[: self.nbytes], non_blocking=True)
        self._point_into(block)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.offloaded = False

    def drop_host(self) -> None:
        """Free the host buffer (with no offload in progress), torch's pinned-memory cache included."""
        self.host = None
        if self.device.type == "cuda" and hasattr(torch._C, "_host_emptyCache"):
            torch._C._host_emptyCache()  # it would keep the block (sizes round to powers of 2)

    def _point_into(self, buffer: torch.Tensor) -> None:
        storage = buffer.untyped_storage()
        with torch.no_grad():
            for p in self.places:
                p.tensor.data = torch.empty(0, dtype=p.tensor.dtype, device=buffer.device).set_(
                    storage, p.offset, p.size, p.stride)


def clear_cublas_workspaces() -> None:
    """Free cuBLAS's per-(handle, stream) workspaces (tens of MB each on Hopper); cuBLAS makes them again on use.
    Process-wide (every thread's, stream's and device's), as torch.compile's CUDA graphs do: safe with one engine
    per process (CUDA graphs capture their own, engine/cuda_graph.py) or one train worker."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None and torch.cuda.is_available():
        clear()
