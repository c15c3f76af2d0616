"""Device memory that keeps its address when its memory is given back (CUDA virtual memory management).

Captured CUDA graphs hold the addresses of the KV cache and the weights. Freed and allocated again, those move, and
every graph must be captured again: in a colocated loop that was a few dozen captures, about a second, per rollout.
A ``MappedBuffer`` reserves a range of device addresses once and maps physical memory into it: ``unmap()`` gives the
memory back to the GPU (the trainer can use it) and keeps the range; ``map()`` maps new memory at the same
addresses, so the graphs stay valid (SGLang gets the same from torch_memory_saver). The contents are lost at
``unmap``: callers copy out what they keep first.

The driver API is called through ctypes (libcuda, which every CUDA torch loads). ``available(device)`` says
whether this device supports it; elsewhere (CPU, no libcuda, the ``ENABLED`` switch off) callers allocate as usual.
Memory mapped here is not in torch's allocator statistics: ``mapped_bytes()`` counts it for the memory reports.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading

import torch

logger = logging.getLogger(__name__)

ENABLED = True  # False: callers allocate with torch (graphs are then captured again after a release)

_PINNED, _DEVICE, _READ_WRITE, _VMM_SUPPORTED, _OUT_OF_MEMORY = 1, 1, 3, 102, 2  # CUDA driver enum values
_lock = threading.Lock()
_mapped = {"now": 0, "peak": 0}
_failed: set[int] = set()  # devices where a buffer could not be made (callers allocate with torch there)
_deferred: list[MappedBuffer] = []  # buffers collected during a CUDA graph capture: closed at the next buffer made


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocationProp(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("compressionType", ctypes.c_ubyte),
                ("gpuDirectRDMACapable", ctypes.c_ubyte), ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


@functools.lru_cache(maxsize=1)
def _driver():
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    u64, size = ctypes.c_ulonglong, ctypes.c_size_t
    for name, args in [("cuDeviceGetAttribute", [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int]),
                       ("cuMemGetAllocationGranularity", [ctypes.POINTER(size), ctypes.POINTER(_AllocationProp),
                                                          ctypes.c_int]),
                       ("cuMemAddressReserve", [ctypes.POINTER(u64), size, size, u64, u64]),
                       ("cuMemAddressFree", [u64, size]),
                       ("cuMemCreate", [ctypes.POINTER(u64), size, ctypes.POINTER(_AllocationProp), u64]),
                       ("cuMemRelease", [u64]),
                       ("cuMemMap", [u64, size, size, u64, u64]),
                       ("cuMemUnmap", [u64, size]),
                       ("cuMemSetAccess", [u64, size, ctypes.POINTER(_AccessDesc), size])]:
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, ctypes.c_int
    return lib


def _check(result: int, call: str) -> None:
    if result != 0:
        raise RuntimeError(f"CUDA driver call {call} failed with CUresult {result}")


def _prop(index: int) -> _AllocationProp:
    prop = _AllocationProp()
    prop.type, prop.location.type, prop.location.id = _PINNED, _DEVICE, index
    return prop


def available(device: torch.device) -> bool:
    """This CUDA device supports virtual memory management (and the switch is on)."""
    if not ENABLED or device.type != "cuda" or _driver() is None:
        return False
    flag = ctypes.c_int(0)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return (index not in _failed and _driver().cuDeviceGetAttribute(ctypes.byref(flag), _VMM_SUPPORTED, index) == 0
            and bool(flag.value))


def buffer(nbytes: int, device: torch.device) -> MappedBuffer | None:
    """A ``MappedBuffer``, or None where they are not available or cannot be made (a driver error other than out of
    memory: logged, and the device is not tried again); the caller then allocates with torch."""
    if not available(device):
        return None
    try:
        return MappedBuffer(nbytes, device)
    except torch.OutOfMemoryError:
        raise
    except RuntimeError as e:
        _failed.add(device.index if device.index is not None else torch.cuda.current_device())
        logger.warning("mapped device memory unavailable (%s): allocating with torch; CUDA graphs will be captured "
                       "again after each memory release", e)
        return None


def mapped_bytes() -> tuple[int, int]:
    """Bytes mapped by ``MappedBuffer``s in this process now, and at most so far (not in torch's statistics)."""
    with _lock:
        return _mapped["now"], _mapped["peak"]


def reset_peak() -> None:
    """Start the peak of ``mapped_bytes`` from now (as ``torch.cuda.reset_peak_memory_stats``)."""
    with _lock:
        _mapped["peak"] = _mapped["now"]


def _count(delta: int) -> None:
    with _lock:
        _mapped["now"] += delta
        _mapped["peak"] = max(_mapped["peak"], _mapped["now"])


class MappedBuffer:
    """``nbytes`` (rounded up to the device's granularity) of device memory at addresses that stay the same while
    it is unmapped and mapped again; ``view()`` is a uint8 tensor over all of it (not to be touched while unmapped).
    Views keep the buffer alive; it is closed when the last one goes."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        while _deferred:
            _deferred.pop().close()
        self.device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        drv, index = _driver(), self.device.index
        grain = ctypes.c_size_t(0)
        _check(drv.cuMemGetAllocationGranularity(ctypes.byref(grain), ctypes.byref(_prop(index)), 0),
               "cuMemGetAllocationGranularity")
        self.nbytes = -(-max(1, nbytes) // grain.value) * grain.value
        self.ptr, self.handle, self.mapped = ctypes.c_ulonglong(0), None, False
        with torch.cuda.device(self.device):  # a current context for the driver calls
            _check(drv.cuMemAddressReserve(ctypes.byref(self.ptr), self.nbytes, grain.value, 0, 0),
                   "cuMemAddressReserve")
        try:
            self.map()
        except Exception:
            self.close()
            raise

    def view(self) -> torch.Tensor:
        return torch.as_tensor(_ArrayInterface(self), device=self.device)

    def map(self) -> None:
        """Map fresh physical memory at the buffer's addresses (its contents are undefined)."""
        if self.mapped:
            return
        drv, index = _driver(), self.device.index
        handle = ctypes.c_ulonglong(0)
        with torch.cuda.device(self.device):
            result = drv.cuMemCreate(ctypes.byref(handle), self.nbytes, ctypes.byref(_prop(index)), 0)
            if result == _OUT_OF_MEMORY:  # torch's cache may hold what is free: give it back and try once more
                torch.cuda.empty_cache()
                result = drv.cuMemCreate(ctypes.byref(handle), self.nbytes, ctypes.byref(_prop(index)), 0)
            if result == _OUT_OF_MEMORY:
                free, total = torch.cuda.mem_get_info(self.device)
                raise torch.OutOfMemoryError(f"CUDA out of memory mapping {self.nbytes / 2**30:.2f} GiB on "
                                             f"{self.device} ({free / 2**30:.2f} of {total / 2**30:.2f} GiB free)")
            _check(result, "cuMemCreate")
            try:
                _check(drv.cuMemMap(self.ptr.value, self.nbytes, 0, handle.value, 0), "cuMemMap")
                access = _AccessDesc()
                access.location.type, access.location.id, access.flags = _DEVICE, index, _READ_WRITE
                _check(drv.cuMemSetAccess(self.ptr.value, self.nbytes, ctypes.byref(access), 1), "cuMemSetAccess")
            except Exception:
                drv.cuMemUnmap(self.ptr.value, self.nbytes)
                drv.cuMemRelease(handle.value)
                raise
        self.handle, self.mapped = handle, True
        _count(self.nbytes)

    def unmap(self) -> None:
        """Give the physical memory back (after the device's queued work); the addresses stay reserved."""
        if not self.mapped:
            return
        torch.cuda.synchronize(self.device)
        drv = _driver()
        with torch.cuda.device(self.device):
            _check(drv.cuMemUnmap(self.ptr.value, self.nbytes), "cuMemUnmap")
            _check(drv.cuMemRelease(self.handle.value), "cuMemRelease")
        self.handle, self.mapped = None, False
        _count(-self.nbytes)

    def close(self) -> None:
        """Unmap and give the addresses back too."""
        if self.ptr.value:
            self.unmap()
            with torch.cuda.device(self.device):
                _driver().cuMemAddressFree(self.ptr.value, self.nbytes)
            self.ptr = ctypes.c_ulonglong(0)

    def __del__(self) -> None:
        ptr = getattr(self, "ptr", None)  # None: the constructor failed before reserving
        if ptr is None or not ptr.value:
            return
        try:
            if torch.cuda.is_current_stream_capturing():  # collected inside a capture: no synchronize there
                _deferred.append(self)  # kept alive until the next buffer is made, then closed
                return
            self.close()
        except Exception:  # noqa: BLE001, S110 (interpreter shutdown: the driver may be gone)
            pass


class _ArrayInterface:
    """``__cuda_array_interface__`` of a buffer's bytes, for ``torch.as_tensor`` (the tensor keeps this object, and
    with it the buffer, alive)."""

    def __init__(self, buffer: MappedBuffer) -> None:
        self.buffer = buffer
        self.__cuda_array_interface__ = {"shape": (buffer.nbytes,), "typestr": "|u1", "data": (buffer.ptr.value, False),
                                         "version": 3, "strides": None}
