"""SGLang's ``update_weights_from_tensor`` payloads: written by the trainer, read by the embedded engine.

The wire format is SGLang's (checked against sglang 0.5.23): ``serialized_named_tensors`` is a list with one entry
per engine TP rank, each the base64 text of a pickle (SGLang's ``MultiprocessingSerializer``) of either

- a list of ``(name, tensor)`` pairs (``load_format`` null or ``"direct"``; SGLang's own engine may wrap each tensor
  in ``LocalSerializedTensor(values=[per-rank payload bytes])``), or
- ``{"flattened_tensor": uint8 tensor, "metadata": [FlattenedTensorMetadata, ...]}``
  (``load_format: "flattened_bucket"``): the tensors viewed as bytes and concatenated.

A tensor travels in one of three ways (``serialize``):

- **CUDA IPC handle** (tensor on a GPU): the engine maps the trainer's memory and copies on the device; no host copy.
  The device is named by its UUID (as SGLang's patched reductions do), so processes with different
  ``CUDA_VISIBLE_DEVICES`` agree on it.
- **shared-memory handle** (CPU tensor, engine on the same host): torch's ``file_system`` sharing (a named segment
  in /dev/shm), the only strategy an unrelated process can open (``file_descriptor`` needs the sender's
  multiprocessing authkey). A handle is meant to be read once, by one engine rank.
- **by value** (``by_value=True``, any host): a plain pickle whose tensors carry their bytes (``torch.save`` of each
  storage). SGLang's unpickler reads it too; it is the fallback for an engine on another host.

The engine reads these payloads with slime_lite/weight_reader.py's restricted unpickler.
"""

from __future__ import annotations

import base64
import io
import pickle
import threading
from dataclasses import dataclass, fields
from typing import Any, Iterable

import torch
import torch.multiprocessing as torch_mp
from torch.multiprocessing import reductions as _red

LOAD_FORMATS = (None, "direct", "flattened_bucket")
SGLANG_BUCKET_MODULE = "sglang.srt.weight_sync.tensor_bucket"
SGLANG_LOCAL_MODULES = ("sglang.srt.model_executor.model_runner_components.weight_updater",
                 "sglang.srt.model_executor.model_runner")


@dataclass
class FlattenedTensorMetadata:
    """One tensor inside a flattened bucket: ``flattened_tensor[start_idx:end_idx]`` viewed as ``dtype``, ``shape``.
    Same fields and order as SGLang's class of the same name (pickled under SGLang's module path)."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int  # bytes (the uint8 slice's length), as in SGLang

    def __setstate__(self, state: Any) -> None:  # a payload sets fields through pickle's BUILD: these fields only
        names = {f.name for f in fields(self)}
        if not isinstance(state, dict) or set(state) != names:
            raise ValueError(f"FlattenedTensorMetadata state must have exactly the fields {sorted(names)}")
        self.__dict__.update(state)


@dataclass
class LocalSerializedTensor:
    """SGLang's per-rank wrapper: ``values[r]`` is the payload (bytes) of TP rank r's tensor."""

    values: list

    def __setstate__(self, state: Any) -> None:
        if not isinstance(state, dict) or set(state) != {"values"}:
            raise ValueError("LocalSerializedTensor state must be {'values': [...]}")
        self.__dict__.update(state)


# ---------------------------------------------------------------------------------------------------- writing
_strategy_lock = threading.Lock()  # torch's sharing strategy is process-wide: switched only under this lock


def flatten_bucket(named: Iterable[tuple[str, torch.Tensor]], shared: bool = False) -> dict[str, Any]:
    """``{"flattened_tensor", "metadata"}`` of SGLang's ``flattened_bucket`` format: one new uint8 tensor on the
    tensors' device (mixed dtypes allowed, each tensor aligned to its element size, so a reader can view it in
    place). ``shared``: a CPU bucket is made in shared memory at once (no second copy when it is sent as a handle).
    An empty input gives an empty bucket."""
    named = list(named)
    metadata, offset = [], 0
    for name, t in named:
        offset += -offset % t.element_size()
        nbytes = t.numel() * t.element_size()
        metadata.append(FlattenedTensorMetadata(name, t.shape, t.dtype, offset, offset + nbytes, nbytes))
        offset += nbytes
    device = named[0][1].device if named else torch.device("cpu")
    padded = offset != sum(m.numel for m in metadata)
    flat = (torch.zeros if padded else torch.empty)(offset, dtype=torch.uint8, device=device)  # padding: zeros
    if shared and device.type == "cpu" and offset:
        with _strategy_lock:
            old = torch_mp.get_sharing_strategy()
            torch_mp.set_sharing_strategy("file_system")
            try:
                flat.share_memory_()
            finally:
                torch_mp.set_sharing_strategy(old)
    if named and not padded and all(t.device == device for _, t in named):
        # no padding: one copy of every tensor's bytes, back to back (not one copy per tensor)
        torch.cat([t.detach().resolve_conj().resolve_neg().reshape(-1).view(torch.uint8) for _, t in named], out=flat)
    else:
        for (_, t), m in zip(named, metadata):
            flat[m.start_idx:m.end_idx].view(t.dtype).view(t.shape).copy_(t.detach())
    return {"flattened_tensor": flat, "metadata": metadata}


def device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


_WIRE_NAMES = {FlattenedTensorMetadata: (SGLANG_BUCKET_MODULE, "FlattenedTensorMetadata"),
               LocalSerializedTensor: (SGLANG_LOCAL_MODULES[0], "LocalSerializedTensor")}


_CLASSES = list(_WIRE_NAMES)  # memo slots 0, 1, ... of every payload we write


class _WirePickler(pickle.Pickler):
    """The C pickler (a bucket's hundreds of metadata entries pickle ~15x faster than with ``pickle._Pickler``).
    sglang is never imported here, so the pickler cannot write SGLang's class paths itself: its memo starts with
    our classes in slots 0, 1, ..., so it only refers to them (``BINGET``), and ``_header`` defines those slots."""

    def __init__(self, file: io.BytesIO, by_value: bool) -> None:
        super().__init__(file, protocol=4)
        self.by_value = by_value
        self.used: set[type] = set()
        self.memo = {id(cls): (i, cls) for i, cls in enumerate(_CLASSES)}

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) in _WIRE_NAMES:
            self.used.add(type(obj))
            return NotImplemented
        if self.by_value:
            return NotImplemented  # tensors pickle themselves with their bytes (torch.save of the storage)
        if isinstance(obj, torch.Tensor):
            fn, args = _red.reduce_tensor(obj)
            if obj.is_cuda:  # the device by UUID (SGLang's convention): CUDA_VISIBLE_DEVICES differs per process
                args = (*args[:6], device_uuid(args[6]), *args[7:])
            return fn, args
        if isinstance(obj, torch.UntypedStorage):
            return _red.reduce_storage(obj)
        if isinstance(obj, torch.TypedStorage):
            return _red.reduce_typed_storage(obj)
        return NotImplemented


def _header(used: set[type]) -> bytes:
    """Pickle opcodes that put SGLang's class for each of ``_CLASSES`` in its memo slot (``None`` for one the
    payload does not use: a reader never imports it) and leave the stack empty; the pickler's output follows."""
    out = [pickle.PROTO + bytes([4])]
    for i, cls in enumerate(_CLASSES):
        module, name = _WIRE_NAMES[cls]
        out += [pickle.GLOBAL + f"{module}\n{name}\n".encode() if cls in used else pickle.NONE,
                pickle.BINPUT + bytes([i]), pickle.POP]
    return b"".join(out)


def serialize(obj: Any, by_value: bool = False) -> str:
    """Base64 text of ``obj`` as SGLang's ``MultiprocessingSerializer.serialize(obj, output_str=True)`` reads it.

    Tensors go as CUDA IPC / shared-memory handles (the default: same host only; each result is for one reader),
    or with their bytes (``by_value``: CPU copies; any host)."""
    if by_value:
        obj = _to_cpu(obj)
    buf = io.BytesIO()
    with _strategy_lock:
        old = torch_mp.get_sharing_strategy()
        torch_mp.set_sharing_strategy("file_system")  # a named segment another process can open
        try:
            pickler = _WirePickler(buf, by_value)
            pickler.dump(obj)
        finally:
            torch_mp.set_sharing_strategy(old)
    return base64.b64encode(_header(pickler.used) + buf.getvalue()).decode("ascii")


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu").contiguous()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj
