"""The embedded engine's reader of SGLang's ``update_weights_from_tensor`` payloads (the format and its writer:
slime_lite/weight_wire.py).

``RestrictedUnpickler`` is the engine's reader: it allows only the globals that rebuild tensors (torch's
multiprocessing rebuild functions, storage and dtype classes, ``torch.Size``) and SGLang's two data classes, which
it maps to the equivalents here (sglang is never imported); any other global is refused with ``UnsafePayload``
naming it, before it is looked up. Nothing from the payload is called except those rebuild functions, each
checking its arguments first: every tensor's offset, sizes and strides must lie within the bytes of the storage it
names (or, for a CUDA IPC or shared-memory handle, within the size it declares, which may not exceed the segment),
in whole elements of its dtype, before anything is built; torch would otherwise grow the storage to fit and the
engine would serve uninitialised memory. Such a tensor is refused naming its parameter.
"""

from __future__ import annotations

import binascii
import collections
import ctypes
import io
import os
import pickle
import re
import time
from typing import Any

import torch
from torch.multiprocessing import reductions as _red

from slime_lite.weight_wire import (
    SGLANG_BUCKET_MODULE,
    SGLANG_LOCAL_MODULES,
    LOAD_FORMATS,
    FlattenedTensorMetadata,
    LocalSerializedTensor,
    device_uuid,
)


class UnsafePayload(ValueError):
    """A payload that names a global outside the allow-list (nothing of it ran)."""


_LIMIT = 1 << 62  # sizes, strides and offsets past this would overflow torch's int64 arithmetic
_SHM_HEADER = 64  # torch's shared-memory segments start with a refcount block of this many bytes


class RefusedTensor:
    """What a rebuild function returns for a tensor (or a storage) that does not fit its bytes: nothing was built or
    mapped. A rebuild given a refused storage passes it on, and the reader raises when it meets one, naming the
    parameter (in a payload the name comes after the tensor)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < _LIMIT


def view_problem(nbytes: int, dtype: Any, offset: Any, size: Any, stride: Any) -> str | None:
    """Why a tensor of ``dtype`` at element ``offset`` with ``size`` and ``stride`` does not fit in a storage of
    ``nbytes`` bytes (None when it does). torch itself would grow the storage to fit (serving whatever memory it
    got) or overflow; this is checked before anything is built."""
    if not isinstance(dtype, torch.dtype) or dtype.itemsize <= 0:
        return f"dtype {dtype!r} is not a tensor dtype"
    if not (isinstance(size, (tuple, list)) and isinstance(stride, (tuple, list)) and len(size) == len(stride)):
        return f"size {size!r} and stride {stride!r} must be sequences of the same length"
    if not (_count(offset) and all(map(_count, size)) and all(map(_count, stride))):
        return (f"offset {offset!r}, size {tuple(size)!r} and stride {tuple(stride)!r} must be integers in "
                f"[0, 2**62)")
    if nbytes % dtype.itemsize:
        return f"the storage's {nbytes} bytes are not a whole number of {dtype} elements"
    elements = nbytes // dtype.itemsize
    if 0 in size:
        end = offset
    else:
        end = offset + 1 + sum((n - 1) * st for n, st in zip(size, stride))
    if end > elements:
        return (f"size {tuple(size)} with stride {tuple(stride)} at offset {offset} needs {end} {dtype} elements "
                f"({end * dtype.itemsize} bytes), but its storage holds {elements} ({nbytes} bytes)")
    return None


def _view_of(storage: Any, offset: Any, size: Any, stride: Any) -> RefusedTensor | None:
    """A refusal when a tensor view does not fit ``storage`` (typed: an untyped one carries no dtype), else None."""
    if isinstance(storage, RefusedTensor):
        return storage
    if isinstance(storage, torch.UntypedStorage):
        return RefusedTensor("a tensor on an untyped storage has no dtype (torch wraps its storage in a typed one)")
    if not isinstance(storage, torch.TypedStorage):
        raise ValueError("a tensor rebuild needs a storage")
    problem = view_problem(storage._untyped_storage.nbytes(), storage.dtype, offset, size, stride)
    return RefusedTensor(problem) if problem else None


def _tensor_class(cls: Any) -> None:
    if cls not in (torch.Tensor, torch.nn.Parameter):
        raise ValueError(f"tensor class {cls!r}: expected torch.Tensor or torch.nn.Parameter")


def _rebuild_tensor(cls: Any, storage: Any, metadata: Any) -> torch.Tensor | RefusedTensor:
    _tensor_class(cls)
    if not (isinstance(metadata, tuple) and len(metadata) == 4):
        raise ValueError("rebuild_tensor: metadata must be (offset, size, stride, requires_grad)")
    offset, size, stride, _ = metadata
    refused = _view_of(storage, offset, size, stride)
    if refused:
        return refused
    return _red.rebuild_tensor(torch.Tensor, storage, (offset, tuple(size), tuple(stride), False)).detach()


def _local_device(device: Any) -> int:
    """The local index of the CUDA device a payload names (an index, or a UUID as SGLang writes it)."""
    if not torch.cuda.is_available():
        raise ValueError("the payload holds CUDA IPC handles but this engine has no CUDA device (CUDA IPC works "
                         "only between processes on one host that see the same GPU)")
    if isinstance(device, int) and not isinstance(device, bool) and 0 <= device < torch.cuda.device_count():
        return device
    if isinstance(device, str):
        for i in range(torch.cuda.device_count()):
            if device_uuid(i) == device:
                return i
        raise ValueError(f"CUDA device {device} (by UUID) is not visible to this engine; CUDA IPC needs the "
                         "trainer's GPU visible in the engine's process")
    raise ValueError(f"CUDA device {device!r}: expected a device index or UUID")


def _rebuild_cuda_tensor(*args: Any) -> torch.Tensor | RefusedTensor:
    if len(args) != 15:
        raise ValueError(f"rebuild_cuda_tensor takes 15 arguments, got {len(args)}")
    _tensor_class(args[0])
    size, stride, offset, storage_cls, dtype = args[1:6]
    storage_bytes, storage_offset_bytes = args[8:10]
    if storage_cls not in (torch.UntypedStorage, torch.TypedStorage) or not isinstance(dtype, torch.dtype):
        raise ValueError("rebuild_cuda_tensor: unexpected storage class or dtype")
    if not (_count(storage_bytes) and _count(storage_offset_bytes)):
        return RefusedTensor(f"CUDA storage size {storage_bytes!r} and offset {storage_offset_bytes!r} (bytes) must "
                             "be integers in [0, 2**62)")
    problem = view_problem(storage_bytes, dtype, offset, size, stride)  # before the sender's memory is mapped
    if problem:
        return RefusedTensor(problem)
    device = _local_device(args[6])
    args = (torch.Tensor, tuple(size), tuple(stride), offset, storage_cls, dtype, device, *args[7:10], False,
            *args[11:])
    tensor = _red.rebuild_cuda_tensor(*args)  # maps the sender's allocation; nothing of it is read yet
    room = _allocation_room(tensor.untyped_storage().data_ptr(), device) if storage_bytes else None
    if room is not None and storage_bytes > room:
        return RefusedTensor(f"the CUDA IPC handle's allocation holds {room} bytes from the storage's start, the "
                             f"payload declares {storage_bytes}")
    return tensor


def _allocation_room(ptr: int, device: int) -> int | None:
    """Bytes from ``ptr`` to the end of the CUDA allocation holding it (the driver's ``cuMemGetAddressRange``): a
    storage declared larger than its IPC allocation would read past it. None when the driver cannot say."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    fn = cuda.cuMemGetAddressRange_v2
    fn.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]
    with torch.cuda.device(device):  # the pointer belongs to this device's context
        if fn(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr)) != 0:
            return None
    return base.value + size.value - ptr


_SHM_HANDLE = re.compile(rb"/torch_\d+_\d+_\d+")
_SHM_MANAGER = re.compile(rb"/[\w./-]*/torch-shm-[\w.-]+/manager\.sock")


def _rebuild_storage_filename(cls: Any, manager: Any, handle: Any, size: Any, dtype: Any = None) -> Any:
    """A CPU shared-memory segment by name: only names torch's ``file_system`` sharing makes, and no larger than the
    segment is (torch would grow the sender's segment to the size a payload declares)."""
    if cls is not torch.UntypedStorage and cls is not torch.TypedStorage:
        raise ValueError(f"storage class {cls!r} is not accepted")
    if not (isinstance(handle, bytes) and _SHM_HANDLE.fullmatch(handle)):
        raise ValueError(f"shared-memory handle {handle!r} is not one torch makes (/torch_<pid>_<n>_<n>)")
    if not (isinstance(manager, bytes) and _SHM_MANAGER.fullmatch(manager) and b".." not in manager):
        raise ValueError(f"shared-memory manager {manager!r} is not torch's manager socket")
    if not _count(size) or (dtype is not None and not isinstance(dtype, torch.dtype)):
        raise ValueError("shared-memory size/dtype malformed")
    nbytes = size * (dtype.itemsize if dtype is not None else 1)
    try:
        segment = os.stat(f"/dev/shm{handle.decode()}").st_size - _SHM_HEADER
    except OSError as exc:
        raise ValueError(f"shared-memory segment {handle.decode()} cannot be opened ({exc.strerror})") from None
    if nbytes > segment:
        return RefusedTensor(f"shared-memory segment {handle.decode()} holds {max(segment, 0)} bytes, the payload "
                             f"declares {nbytes}")
    return _red.rebuild_storage_filename(cls, manager, handle, size, dtype)


def _rebuild_storage_empty(cls: Any) -> Any:
    if cls is not torch.UntypedStorage:
        raise ValueError(f"storage class {cls!r} is not accepted")
    return torch.UntypedStorage()


def _rebuild_typed_storage(storage: Any, dtype: Any) -> Any:
    if isinstance(storage, RefusedTensor):
        return storage
    if not isinstance(storage, torch.UntypedStorage) or not isinstance(dtype, torch.dtype):
        raise ValueError("rebuild_typed_storage: expected an untyped storage and a dtype")
    if storage.nbytes() % dtype.itemsize:
        return RefusedTensor(f"a storage of {storage.nbytes()} bytes is not a whole number of {dtype} elements")
    return _red.rebuild_typed_storage(storage, dtype)


def _load_from_bytes(data: Any) -> Any:
    """A by-value storage: ``torch.save`` bytes, read with ``weights_only`` (no code runs)."""
    if not isinstance(data, bytes):
        raise ValueError("_load_from_bytes: expected bytes")
    storage = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    if not isinstance(storage, (torch.UntypedStorage, torch.TypedStorage)):
        raise ValueError(f"expected a storage, got {type(storage).__name__}")
    return storage


def _rebuild_tensor_v2(storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any = False,
                       hooks: Any = None, metadata: Any = None) -> torch.Tensor | RefusedTensor:
    if hooks or metadata:
        raise ValueError("_rebuild_tensor_v2: tensors with hooks or metadata are not accepted")
    refused = _view_of(storage, offset, size, stride)
    if refused:
        return refused
    return torch._utils._rebuild_tensor_v2(storage, offset, tuple(size), tuple(stride), False,
                                           collections.OrderedDict())


_FD_GLOBALS = {("torch.multiprocessing.reductions", "rebuild_storage_fd"), ("multiprocessing.resource_sharer", "DupFd")}


_ALLOWED: dict[tuple[str, str], Any] = {
    ("torch", "Tensor"): torch.Tensor,
    ("torch.nn.parameter", "Parameter"): torch.nn.Parameter,
    ("torch", "Size"): torch.Size,
    ("torch", "UntypedStorage"): torch.UntypedStorage,
    ("torch.storage", "UntypedStorage"): torch.UntypedStorage,
    ("torch.storage", "TypedStorage"): torch.TypedStorage,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch.multiprocessing.reductions", "rebuild_tensor"): _rebuild_tensor,
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"): _rebuild_cuda_tensor,
    ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified"): _rebuild_cuda_tensor,
    ("torch.multiprocessing.reductions", "rebuild_storage_filename"): _rebuild_storage_filename,
    ("torch.multiprocessing.reductions", "rebuild_storage_empty"): _rebuild_storage_empty,
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"): _rebuild_typed_storage,
    ("torch.storage", "_load_from_bytes"): _load_from_bytes,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    (SGLANG_BUCKET_MODULE, "FlattenedTensorMetadata"): FlattenedTensorMetadata,
    **{(m, "LocalSerializedTensor"): LocalSerializedTensor for m in SGLANG_LOCAL_MODULES},
}


class RestrictedUnpickler(pickle.Unpickler):
    """Rebuilds tensors (and SGLang's two payload classes) only; any other global is an ``UnsafePayload``."""

    def find_class(self, module: str, name: str) -> Any:
        found = _ALLOWED.get((module, name))
        if found is not None:
            return found
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in _FD_GLOBALS:
            raise UnsafePayload(f"refused global {module}.{name}: file-descriptor shared memory (torch's default "
                                "sharing strategy) cannot be opened by another process; serialize with "
                                "torch.multiprocessing.set_sharing_strategy('file_system')")
        raise UnsafePayload(f"refused global {module}.{name} in the payload: only tensor-rebuild globals are "
                            "accepted (nothing of the payload ran)")


def deserialize(data: str | bytes) -> Any:
    """Read one ``MultiprocessingSerializer`` payload (base64 text or raw pickle bytes) with the restricted reader."""
    if isinstance(data, str):
        try:
            data = binascii.a2b_base64(data.encode("ascii"), strict_mode=True)
        except (binascii.Error, ValueError) as exc:
            raise ValueError(f"not base64: {exc}") from None
    if not isinstance(data, (bytes, bytearray)):
        raise ValueError(f"a payload is base64 text or bytes, not {type(data).__name__}")
    attempt = 0
    while True:
        try:
            return RestrictedUnpickler(io.BytesIO(bytes(data))).load()
        except UnsafePayload:
            raise
        except ValueError as exc:  # a rebuild function's check
            raise ValueError(f"malformed payload: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - any other unpickling failure is the sender's
            attempt += 1
            if SHM_TIMEOUT in str(exc) and attempt < SHM_ATTEMPTS:  # a busy host: the segments are still there
                time.sleep(0.5 * attempt)
                continue
            raise ValueError(f"malformed payload: {type(exc).__name__}: {exc}") from None


# torch's shared-memory manager (file_system sharing) did not answer in time, seen once on a loaded 2-core machine:
# the sender still holds the segments, so the payload is read again a few times before the push fails
SHM_TIMEOUT = "Shared memory manager connection has timed out"
SHM_ATTEMPTS = 4


def _tensor(value: Any, name: str, tp_rank: int) -> torch.Tensor:
    if isinstance(value, LocalSerializedTensor):
        if not isinstance(value.values, list) or not tp_rank < len(value.values):
            raise ValueError(f"{name!r}: LocalSerializedTensor has no value for TP rank {tp_rank}")
        value = deserialize(value.values[tp_rank])
    if isinstance(value, RefusedTensor):
        raise ValueError(f"{name!r}: {value.reason}; nothing was loaded")
    if not isinstance(value, torch.Tensor) or value.layout != torch.strided:
        raise ValueError(f"{name!r}: expected a dense tensor, got {type(value).__name__}")
    return value


def named_tensors(obj: Any, load_format: str | None, tp_rank: int = 0) -> list[tuple[str, torch.Tensor]]:
    """The ``(name, tensor)`` pairs a deserialized payload holds, its structure checked (ValueError otherwise).
    For a flattened bucket the tensors are views into the bucket (nothing is copied)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format {load_format!r} is not supported (use null, 'direct' or 'flattened_bucket')")
    if load_format == "flattened_bucket":
        if not isinstance(obj, dict) or set(obj) != {"flattened_tensor", "metadata"}:
            raise ValueError("a flattened_bucket payload is {'flattened_tensor': ..., 'metadata': [...]}")
        flat, metadata = obj["flattened_tensor"], obj["metadata"]
        if isinstance(flat, RefusedTensor):
            raise ValueError(f"flattened_tensor: {flat.reason}; nothing was loaded")
        if not (isinstance(flat, torch.Tensor) and flat.dtype == torch.uint8 and flat.dim() == 1):
            raise ValueError("flattened_tensor must be a 1-D uint8 tensor")
        if not isinstance(metadata, list) or not all(isinstance(m, FlattenedTensorMetadata) for m in metadata):
            raise ValueError("metadata must be a list of FlattenedTensorMetadata")
        out = []
        for m in metadata:
            shape = tuple(m.shape) if isinstance(m.shape, (tuple, list)) else None
            if (not isinstance(m.name, str) or shape is None or not all(isinstance(d, int) and d >= 0 for d in shape)
                    or not isinstance(m.dtype, torch.dtype) or not all(isinstance(x, int) for x in
                                                                        (m.start_idx, m.end_idx, m.numel))):
                raise ValueError(f"metadata entry {m.name!r} is malformed")
            nbytes = torch.Size(shape).numel() * m.dtype.itemsize
            if not (0 <= m.start_idx <= m.end_idx <= flat.numel() and m.end_idx - m.start_idx == m.numel == nbytes):
                raise ValueError(f"{m.name!r}: bytes [{m.start_idx}, {m.end_idx}) do not hold shape {shape} of "
                                 f"{m.dtype} within the bucket's {flat.numel()} bytes")
            part = flat[m.start_idx:m.end_idx]
            if m.start_idx % m.dtype.itemsize:  # SGLang's own buckets do not pad: an unaligned slice is copied
                part = part.clone()
            out.append((m.name, part.view(m.dtype).reshape(shape)))
    else:
        if not isinstance(obj, (list, tuple)) or not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in obj):
            raise ValueError("a direct payload is a list of (name, tensor) pairs")
        out = []
        for name, value in obj:
            if not isinstance(name, str):
                raise ValueError(f"tensor name {name!r} is not a string")
            out.append((name, _tensor(value, name, tp_rank)))
    dupes = sorted(n for n, c in collections.Counter(n for n, _ in out).items() if c > 1)
    if dupes:
        raise ValueError(f"{dupes[:5]} named more than once")
    return out
