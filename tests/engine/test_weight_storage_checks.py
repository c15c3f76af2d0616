"""Every tensor of an update_weights_from_tensor payload is checked against the bytes of its storage before it is
built: crafted payloads whose offset, sizes or strides reach past the storage (torch would grow the storage and the
engine would serve whatever memory it got) are a 400 naming the parameter, for every rebuild call torch's pickles use
(the typed and the untyped storage, by value, shared memory, CUDA IPC handles) and every load_format; the weights,
their version and /get_weights_by_name stay as they were. The CUDA IPC path on a GPU:
tests/engine/test_weight_ipc_gpu.py."""

from __future__ import annotations

import base64
import io

import pytest
import torch
import torch.multiprocessing as torch_mp
from engine_helpers import http, start_engine
from torch.multiprocessing import reductions as red

from slime_lite import weight_reader, weight_wire

NAME = "model.norm.weight"


class Forged:
    """A payload entry that pickles as ``fn(*args)``: what a hostile sender writes by hand."""

    def __init__(self, fn, *args) -> None:
        self.fn, self.args = fn, args


class _Pickler(weight_wire._WirePickler):
    """The engine's wire pickler (SGLang's class paths for the bucket metadata), plus forged entries; a shared
    storage goes as its shared-memory handle, anything else with its bytes."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, by_value=True)

    def reducer_override(self, obj):  # noqa: ANN001, ANN201
        if isinstance(obj, Forged):
            return obj.fn, obj.args
        if isinstance(obj, torch.UntypedStorage) and obj.is_shared():
            return red.reduce_storage(obj)
        return super().reducer_override(obj)


def payload(obj) -> str:
    buf = io.BytesIO()
    old = torch_mp.get_sharing_strategy()
    torch_mp.set_sharing_strategy("file_system")
    try:
        pickler = _Pickler(buf)
        pickler.dump(obj)
    finally:
        torch_mp.set_sharing_strategy(old)
    return base64.b64encode(weight_wire._header(pickler.used) + buf.getvalue()).decode()


def typed(nbytes: int, dtype=torch.float32) -> torch.TypedStorage:
    """A by-value storage (pickled with its bytes, read back through torch.load)."""
    return torch.TypedStorage(wrap_storage=torch.UntypedStorage(nbytes), dtype=dtype, _internal=True)


def tensor(storage, offset, size, stride, v2=False) -> Forged:
    if v2:
        return Forged(torch._utils._rebuild_tensor_v2, storage, offset, size, stride, False, None)
    return Forged(red.rebuild_tensor, torch.Tensor, storage, (offset, size, stride, False))


def cuda_tensor(size, stride, offset, storage_bytes) -> Forged:
    return Forged(red.rebuild_cuda_tensor, torch.Tensor, size, stride, offset, torch.UntypedStorage, torch.float32,
                  0, b"handle", storage_bytes, 0, False, b"ref", 0, b"event", False)


def shared_segment(nbytes: int) -> torch.UntypedStorage:
    """A storage in a named shared-memory segment (torch's file_system sharing, as the trainer sends CPU tensors)."""
    storage = torch.UntypedStorage(nbytes)
    old = torch_mp.get_sharing_strategy()
    torch_mp.set_sharing_strategy("file_system")
    try:
        storage.share_memory_()
    finally:
        torch_mp.set_sharing_strategy(old)
    return storage


def declared_larger(segment: torch.UntypedStorage, nbytes: int) -> Forged:
    """The segment's handle with a size larger than the segment (torch would grow the sender's segment)."""
    old = torch_mp.get_sharing_strategy()
    torch_mp.set_sharing_strategy("file_system")
    try:
        fn, (cls, manager, handle, _) = red.reduce_storage(segment)
    finally:
        torch_mp.set_sharing_strategy(old)
    return Forged(fn, cls, manager, handle, nbytes)


H = 128  # the tiny model's hidden size: model.norm.weight is (128,) float32, 512 bytes


def hostile_tensors() -> dict[str, Forged]:
    """Each a model.norm.weight of the right shape and dtype on a storage too small for it, or a malformed view."""
    empty = Forged(red.rebuild_storage_empty, torch.UntypedStorage)
    segment = shared_segment(16)
    return {
        "typed storage, 8 bytes": tensor(typed(8), 0, (H,), (1,)),
        "typed storage, _rebuild_tensor_v2": tensor(typed(8), 0, (H,), (1,), v2=True),
        "offset past the end": tensor(typed(4 * H), H, (H,), (1,)),
        "offset one element short": tensor(typed(4 * H), 1, (H,), (1,)),
        "stride reaching past the end": tensor(typed(4 * H), 0, (H,), (2,)),
        "negative stride": tensor(typed(4 * H), H - 1, (H,), (-1,)),
        "negative size": tensor(typed(4 * H), 0, (-H,), (1,)),
        "overflowing size": tensor(typed(4 * H), 0, (H, 2**62), (1, 0)),
        "overflowing stride": tensor(typed(4 * H), 0, (H,), (2**63,)),
        "sizes and strides of different lengths": tensor(typed(4 * H), 0, (H,), (1, 1)),
        "zero-size storage": tensor(Forged(red.rebuild_typed_storage, empty, torch.float32), 0, (H,), (1,)),
        "untyped storage": tensor(shared_segment(4 * H), 0, (H,), (1,)),  # a handle without a dtype
        "bytes not whole elements": tensor(Forged(red.rebuild_typed_storage, shared_segment(4 * H + 2),
                                                  torch.float32), 0, (H,), (1,)),
        "shared memory declared larger than its segment": tensor(
            Forged(red.rebuild_typed_storage, declared_larger(segment, 4 * H), torch.float32), 0, (H,), (1,)),
        "shared memory view past its segment": tensor(
            Forged(red.rebuild_typed_storage, segment, torch.float32), 0, (H,), (1,)),
        "CUDA IPC view past its declared storage": cuda_tensor((H,), (1,), 0, 8),
        "CUDA IPC negative storage size": cuda_tensor((H,), (1,), 0, -4 * H),
    }


@pytest.fixture(scope="module")
def storage_engine(tiny_model_dir):
    server = start_engine(tiny_model_dir, max_running_requests=2)
    yield server
    server.stop()


def test_hostile_views_are_400_naming_the_parameter_and_change_nothing(storage_engine):
    url = storage_engine.url
    before = http(url, "/get_weights_checksum", {})[1]
    values = http(url, "/get_weights_by_name", {"name": NAME, "truncate_size": H})[1]
    version = http(url, "/get_weight_version")[1]
    bodies = []
    for case, forged in hostile_tensors().items():  # null and "direct" formats; the bucket's own tensor: below
        bodies.append((case, None, payload([(NAME, forged)])))
        bodies.append((case + " (LocalSerializedTensor)", "direct", weight_wire.serialize([(NAME, weight_wire.
                       LocalSerializedTensor(values=[base64.b64decode(payload(forged))]))])))
    for case, load_format, body in bodies:
        status, out = http(url, "/update_weights_from_tensor", {"serialized_named_tensors": [body],
                                                               "load_format": load_format, "weight_version": "bad"})
        assert status == 400 and out["success"] is False, (case, out)
        assert f"'{NAME}'" in out["message"] and "nothing was loaded" in out["message"], (case, out)
    bucket = tensor(typed(8, torch.uint8), 0, (4 * H,), (1,))
    meta = [weight_wire.FlattenedTensorMetadata(NAME, torch.Size([H]), torch.float32, 0, 4 * H, 4 * H)]
    status, out = http(url, "/update_weights_from_tensor", {
        "serialized_named_tensors": [payload({"flattened_tensor": bucket, "metadata": meta})],
        "load_format": "flattened_bucket"})
    assert status == 400 and "flattened_tensor: size (512,)" in out["message"], out
    assert http(url, "/get_weights_checksum", {})[1] == before
    assert http(url, "/get_weights_by_name", {"name": NAME, "truncate_size": H})[1] == values
    assert http(url, "/get_weight_version")[1] == version


def test_refused_views_name_the_limit():
    """The reason says what the view needs and what the storage holds (nothing built: the storage keeps its size)."""
    storage = typed(8)
    got = weight_reader.deserialize(payload([(NAME, tensor(storage, 0, (H,), (1,)))]))
    with pytest.raises(ValueError, match=r"needs 128 torch.float32 elements \(512 bytes\), but its storage holds 2 "
                                         r"\(8 bytes\)"):
        weight_reader.named_tensors(got, None)
    assert storage._untyped_storage.nbytes() == 8
    with pytest.raises(ValueError, match="shared-memory segment /torch_.* holds 16 bytes, the payload declares 512"):
        weight_reader.named_tensors(weight_reader.deserialize(payload([(NAME, hostile_tensors()[
            "shared memory declared larger than its segment"])])), None)


def test_views_that_fit_still_load():
    """Views inside their storage are built as before: a slice at an offset, a zero-size tensor on an empty
    storage (a zero-size parameter), a shared-memory tensor, and the CPU and handle payloads the trainer writes."""
    base = typed(4 * 10)
    base._untyped_storage.copy_(torch.arange(10, dtype=torch.float32).untyped_storage())
    empty = Forged(red.rebuild_typed_storage, Forged(red.rebuild_storage_empty, torch.UntypedStorage), torch.float32)
    segment = shared_segment(16)
    named = weight_reader.named_tensors(weight_reader.deserialize(payload([
        ("slice", tensor(base, 6, (2, 2), (2, 1))), ("empty", tensor(empty, 0, (0, 3), (3, 1), v2=True)),
        ("shm", tensor(Forged(red.rebuild_typed_storage, segment, torch.float32), 0, (4,), (1,)))])), None)
    assert named[0][1].tolist() == [[6.0, 7.0], [8.0, 9.0]] and named[1][1].shape == (0, 3)
    assert named[2][1].shape == (4,)
    for by_value in (False, True):
        pairs = [("a", torch.randn(3, 4)), ("b", torch.arange(5, dtype=torch.int64)[1:])]
        got = weight_reader.named_tensors(weight_reader.deserialize(weight_wire.serialize(pairs, by_value=by_value)), None)
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, pairs))
