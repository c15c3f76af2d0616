"""SGLang's update_weights_from_tensor wire format, proven against SGLang's own code (tests/sglang_oracle.py): the
embedded engine applies payloads made by SGLang's MultiprocessingSerializer and FlattenedTensorBucket exactly, SGLang
reads the trainer's payloads back to the same tensors, a payload that names any other global is a 400 and runs
nothing. (Shared-memory handles crossing into another process, an engine in a Ray actor: tests/test_loop.py's
tensor-transport run, with --check-weight-update-equal.)"""

from __future__ import annotations

import base64
import pickle
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from engine_helpers import http, start_engine

from slime_lite import weight_reader, weight_wire
from slime_lite.weight_checksum import tensor_checksums
from tests import sglang_oracle
from tests.fakes.evil_pickle import Evil

NAMED = [("a.weight", torch.randn(3, 4)), ("b.bias", torch.randn(5).to(torch.bfloat16)),
         ("c.count", torch.arange(4, dtype=torch.int64)), ("d.weight", torch.randn(2, 2).to(torch.float16))]


@pytest.fixture(scope="module")
def sgl():
    """SGLang's MultiprocessingSerializer and FlattenedTensorBucket (skips when the pinned sglang is missing)."""
    bucket, _ = sglang_oracle.flattened_tensor_bucket()
    return SimpleNamespace(serializer=sglang_oracle.serializer(), bucket=bucket)


@pytest.fixture(scope="module")
def wire_engine(tiny_model_dir):
    server = start_engine(tiny_model_dir, max_running_requests=2)
    yield server
    server.stop()


@pytest.fixture
def file_system_sharing():
    """SGLang's producers share CPU tensors as torch does by default (file descriptors, readable only by a child);
    a producer for another process sets file_system, as the trainer does."""
    import torch.multiprocessing as mp

    old = mp.get_sharing_strategy()
    mp.set_sharing_strategy("file_system")
    yield
    mp.set_sharing_strategy(old)


def _same(got, want) -> bool:
    return [n for n, _ in got] == [n for n, _ in want] and all(
        a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b) for (_, a), (_, b) in zip(got, want))


@pytest.fixture(scope="module")
def base_weights(tiny_model_dir):
    from safetensors.torch import load_file

    return load_file(str(Path(tiny_model_dir) / "model.safetensors"))


def test_sglang_payloads_update_the_engine_exactly(sgl, wire_engine, base_weights, file_system_sharing):
    url = wire_engine.url
    gen = torch.Generator().manual_seed(3)
    new = {n: t + torch.randn(t.shape, generator=gen) * 0.01 for n, t in base_weights.items()}
    names = sorted(new)
    direct, flat, wrapped = names[: len(names) // 2], names[len(names) // 2: -1], names[-1]
    ms = sgl.serializer
    bucket = sgl.bucket(named_tensors=[(n, new[n]) for n in flat])
    bodies = [
        (None, ms.serialize([(n, new[n]) for n in direct], output_str=True)),
        ("flattened_bucket", ms.serialize({"flattened_tensor": bucket.get_flattened_tensor(),
                                           "metadata": bucket.get_metadata()}, output_str=True)),
        # SGLang's own engine wraps each rank's tensor in LocalSerializedTensor (raw payload bytes per TP rank)
        ("direct", weight_wire.serialize([(wrapped, weight_wire.LocalSerializedTensor(
            values=[ms.serialize(new[wrapped])]))])),
    ]
    for load_format, payload in bodies:
        status, out = http(url, "/update_weights_from_tensor", {"serialized_named_tensors": [payload],
                                                               "load_format": load_format})
        assert status == 200 and out["success"] is True, out
    got = http(url, "/get_weights_checksum", {})[1]
    assert {n: got[n] for n in new} == dict(zip(new, tensor_checksums(list(new.values()))))


def test_our_payloads_are_read_by_sglang(sgl):
    ms = sgl.serializer
    unpadded = [NAMED[i] for i in (2, 0, 3, 1)]  # int64, fp32, fp16, bf16: each starts aligned, one copy fills it
    assert weight_wire.flatten_bucket(unpadded)["flattened_tensor"].numel() == sum(
        t.numel() * t.element_size() for _, t in NAMED)
    for by_value in (False, True):  # handles (shared memory here) and tensors by value
        assert _same(ms.deserialize(weight_wire.serialize([(n, t.clone()) for n, t in NAMED], by_value=by_value)),
                     NAMED)
        for named in (NAMED, unpadded):  # a bucket with padding (the int64 after 58 bytes) and one without
            data = ms.deserialize(weight_wire.serialize(weight_wire.flatten_bucket(named), by_value=by_value))
            assert type(data["metadata"][0]).__module__ == "sglang.srt.weight_sync.tensor_bucket"
            rebuilt = sgl.bucket(flattened_tensor=data["flattened_tensor"],
                                 metadata=data["metadata"]).reconstruct_tensors()
            assert _same(rebuilt, named)
    empty = ms.deserialize(weight_wire.serialize(weight_wire.flatten_bucket([])))  # slime sends these for idle ranks
    assert empty["metadata"] == [] and empty["flattened_tensor"].numel() == 0


def test_names_and_bytes_that_look_like_pickle_opcodes_travel_as_they_are(sgl):
    """SGLang's class paths come from a header that fills the pickler's memo slots, not from rewriting bytes: a
    tensor name or tensor bytes spelling a class's GLOBAL line reach both readers unchanged."""
    line = f"c{weight_wire.__name__}\nFlattenedTensorMetadata\n"
    odd = [(line, torch.ones(2)), ("w", torch.tensor(list(line.encode()), dtype=torch.uint8))]
    for by_value in (False, True):
        for payload, load_format in ((odd, None), (weight_wire.flatten_bucket(odd), "flattened_bucket")):
            text = weight_wire.serialize(payload, by_value=by_value)
            ours = weight_reader.named_tensors(weight_reader.deserialize(text), load_format)
            theirs = sgl.serializer.deserialize(text)
            if load_format:
                theirs = sgl.bucket(flattened_tensor=theirs["flattened_tensor"],
                                    metadata=theirs["metadata"]).reconstruct_tensors()
            assert _same(ours, odd) and _same(theirs, odd)


def test_unaligned_sglang_bucket_is_read(sgl):
    """SGLang's FlattenedTensorBucket does not pad: an int64 after 10 bytes of bf16 is read all the same."""
    named = [("x", torch.randn(5).to(torch.bfloat16)), ("y", torch.arange(3, dtype=torch.int64))]
    b = sgl.bucket(named_tensors=named)
    obj = {"flattened_tensor": b.get_flattened_tensor(), "metadata": b.get_metadata()}
    got = weight_reader.named_tensors(weight_reader.deserialize(pickle.dumps(obj)), "flattened_bucket")
    assert _same(got, named)


def _pickled(obj) -> str:
    return base64.b64encode(pickle.dumps(obj)).decode()


class _ForgedShm:
    """A shared-memory handle naming a file torch never made."""

    def __reduce__(self):  # noqa: ANN204
        from torch.multiprocessing.reductions import rebuild_storage_filename

        return (rebuild_storage_filename, (torch.UntypedStorage, b"/tmp/torch-shm-dir-x/manager.sock",
                                           b"/../../etc/passwd", 16))


def test_hostile_payloads_are_400_and_run_nothing(wire_engine, tmp_path):
    url = wire_engine.url
    before = http(url, "/get_weights_checksum", {})[1]
    marker = tmp_path / "marker"
    evil = [("model.norm.weight", Evil(str(marker)))]
    import os

    cases = [
        (None, _pickled(evil), "tests.fakes.evil_pickle.write_marker"),
        ("flattened_bucket", _pickled({"flattened_tensor": Evil(str(marker)), "metadata": []}),
         "tests.fakes.evil_pickle.write_marker"),
        (None, weight_wire.serialize([("model.norm.weight", weight_wire.LocalSerializedTensor(  # nested payload
            values=[pickle.dumps(Evil(str(marker)))]))]), "tests.fakes.evil_pickle.write_marker"),
        (None, _pickled([("model.norm.weight", os.system)]), "posix.system"),
        (None, _pickled([("model.norm.weight", _ForgedShm())]), "not one torch makes"),
        ("flattened_bucket", weight_wire.serialize({"flattened_tensor": torch.zeros(4, dtype=torch.uint8),
                                                    "metadata": [weight_wire.FlattenedTensorMetadata(
                                                        "model.norm.weight", torch.Size([8]), torch.float32, 0, 32,
                                                        32)]}), "do not hold"),
        ("pickle", _pickled([]), "load_format"),
    ]
    for load_format, payload, said in cases:
        status, out = http(url, "/update_weights_from_tensor", {"serialized_named_tensors": [payload],
                                                               "load_format": load_format})
        assert status == 400 and said in str(out), (said, out)
    assert not marker.exists()
    assert http(url, "/get_weights_checksum", {})[1] == before


def test_file_descriptor_sharing_is_refused_with_the_fix():
    import torch.multiprocessing as mp
    from multiprocessing.reduction import ForkingPickler

    assert mp.get_sharing_strategy() == "file_descriptor"
    payload = ForkingPickler.dumps([("w", torch.ones(3))]).tobytes()
    with pytest.raises(weight_reader.UnsafePayload, match="file_system"):
        weight_reader.deserialize(payload)


def test_a_shared_memory_manager_timeout_is_read_again_and_other_failures_are_not(monkeypatch):
    """torch's shared-memory manager not answering in time (once, on a loaded 2-core machine) failed a whole push:
    the payload is read again a few times (the sender still holds its segments); any other failure is not."""
    payload = weight_wire.serialize([("w", torch.ones(3))], by_value=True)
    real, calls = weight_reader.RestrictedUnpickler.load, []

    def flaky(self, fails: int, message: str):
        calls.append(1)
        if len(calls) <= fails:
            raise RuntimeError(message)
        return real(self)

    monkeypatch.setattr(weight_reader.time, "sleep", lambda s: None)
    monkeypatch.setattr(weight_reader.RestrictedUnpickler, "load",
                        lambda self: flaky(self, 2, weight_reader.SHM_TIMEOUT))
    (name, value), = weight_reader.deserialize(payload)
    assert name == "w" and torch.equal(value, torch.ones(3)) and len(calls) == 3
    calls.clear()
    monkeypatch.setattr(weight_reader.RestrictedUnpickler, "load",
                        lambda self: flaky(self, 9, weight_reader.SHM_TIMEOUT))
    with pytest.raises(ValueError, match="malformed payload: RuntimeError: Shared memory manager connection"):
        weight_reader.deserialize(payload)
    assert len(calls) == weight_reader.SHM_ATTEMPTS
    calls.clear()
    monkeypatch.setattr(weight_reader.RestrictedUnpickler, "load", lambda self: flaky(self, 1, "another failure"))
    with pytest.raises(ValueError, match="malformed payload: RuntimeError: another failure"):
        weight_reader.deserialize(payload)
    assert len(calls) == 1


def test_trainer_push_in_sglang_format_inside_a_session(wire_engine, base_weights, monkeypatch):
    """weight_push's tensor transport: several flattened buckets, begin/end session, scramble first, then the
    equality check; the engine holds exactly the trainer's tensors."""
    from slime_lite.backends.megatron import weight_push

    url = wire_engine.url
    named = {n: t + 0.125 for n, t in base_weights.items()}
    routes = []
    real = weight_push.request_json
    monkeypatch.setattr(weight_push, "request_json", lambda u, r, *a, **k: routes.append(r) or real(u, r, *a, **k))
    args = SimpleNamespace(update_weight_transport="tensor", colocate=False, fully_async=False,
                           rollout_backend="embedded",
                           rollout_num_gpus_per_engine=1, update_weight_buffer_size=64 << 10,
                           debug_scramble_engine_weights=True, debug_inject_fault=None,
                           check_weight_update_equal=True)
    weight_push.push(args, named, [url], 5)
    assert weight_push.payload_mode(url, named, False, 64 << 10) == "shared_memory"
    tensor_posts = routes.count("/update_weights_from_tensor")
    assert tensor_posts >= 4  # two pushes (noise, then the weights) of at least two buckets each
    assert routes[0] == "/begin_weight_update" and routes.count("/end_weight_update") == 2
    got = http(url, "/get_weights_checksum", {})[1]
    assert {n: got[n] for n in named} == dict(zip(named, tensor_checksums(list(named.values()))))
    assert http(url, "/get_weight_version")[1]["weight_version"] == "5"
    assert weight_push.payload_mode("http://192.0.2.1:1", named, False, 1) == "by_value"  # TEST-NET: not here


def test_shared_memory_room_is_checked_for_the_largest_bucket_not_the_limit(wire_engine, base_weights, monkeypatch):
    """A tensor larger than --update-weight-buffer-size is a bucket of its own: /dev/shm must hold that bucket, so
    the room is checked for the largest bucket's bytes (the limit passed, and the push died out of shared memory)."""
    from slime_lite.backends.megatron import weight_push

    asked = []
    real = weight_push.payload_mode
    monkeypatch.setattr(weight_push, "payload_mode", lambda u, named, colocated, nbytes: asked.append(nbytes) or
                        real(u, named, colocated, nbytes))
    args = SimpleNamespace(update_weight_transport="tensor", colocate=False, fully_async=False,
                           rollout_backend="embedded", rollout_num_gpus_per_engine=1, update_weight_buffer_size=1024,
                           debug_scramble_engine_weights=False, debug_inject_fault=None,
                           check_weight_update_equal=False)
    weight_push.push(args, base_weights, [wire_engine.url], 3)
    largest = max(t.numel() * t.element_size() for t in base_weights.values())
    assert largest > 1024 and asked == [largest]


def test_weight_check_names_a_changed_parameter_and_accepts_a_cast(wire_engine, base_weights, caplog):
    """check_weights_equal: equal weights pass; one parameter off by one bit is named; the trainer's bf16 tensors
    against the engine's float32 parameters are equal after the cast (done on the tensors' device) and reported."""
    from slime_lite.backends.megatron import weight_push
    from slime_lite.checks import weight_check
    from slime_lite.errors import SlimeLiteError

    url = wire_engine.url
    named = {n: (t + 0.5).to(torch.bfloat16) for n, t in base_weights.items()}  # values a float32 holds exactly
    args = SimpleNamespace(colocate=False, fully_async=False, rollout_backend="embedded", rollout_num_gpus_per_engine=1,
                           update_weight_buffer_size=1 << 20)
    weight_push._push_tensor(args, {n: t.float() for n, t in named.items()}, [url], 6)
    weight_check.check_weights_equal({n: t.float() for n, t in named.items()}, [url])
    with caplog.at_level("WARNING", logger=weight_check.__name__):
        weight_check.check_weights_equal(named, [url])
    assert f"{len(http(url, '/get_weights_checksum', {})[1])} parameter(s) equal only after a dtype cast" in caplog.text
    changed = "model.layers.0.mlp.up_proj.weight"
    off = {n: t.float() for n, t in named.items()}
    off[changed].view(torch.int32).view(-1)[-1] ^= 1  # the lowest bit of the last element
    with pytest.raises(SlimeLiteError, match=rf"1 differ \['{changed}'\]; 0 never pushed"):
        weight_check.check_weights_equal(off, [url])


def test_weight_check_names_an_engine_that_is_gone(wire_engine, base_weights):
    """check_weights_equal over two engines, one not there: an EngineError naming it (the other's answer is dropped
    and its connection closed), not a comparison against a partial answer."""
    from slime_lite.checks.weight_check import check_weights_equal
    from slime_lite.errors import EngineError
    from slime_lite.io import free_port

    gone = f"http://127.0.0.1:{free_port()}"
    for urls in ([wire_engine.url, gone], [gone, wire_engine.url]):
        with pytest.raises(EngineError, match=rf"engine {gone}/get_weights_checksum did not answer"):
            check_weights_equal(base_weights, urls)


def test_a_dead_engine_is_named_by_rank_and_url_at_the_push(wire_engine, base_weights):
    """An engine whose server is gone (nothing listens at its URL): the push says engine 1 died, naming its URL,
    not "connection refused" on /begin_weight_update; the live engine is left without an open session."""
    from slime_lite.backends.megatron import weight_push
    from slime_lite.errors import EngineError
    from slime_lite.io import free_port

    gone = f"http://127.0.0.1:{free_port()}"
    args = SimpleNamespace(update_weight_transport="tensor", colocate=False, fully_async=False,
                           rollout_backend="embedded",
                           rollout_num_gpus_per_engine=1, update_weight_buffer_size=64 << 10,
                           debug_scramble_engine_weights=False, debug_inject_fault=None,
                           check_weight_update_equal=False)
    with pytest.raises(EngineError, match=rf"engine 1 \({gone}\) died: nothing listens at its address any more; "
                                          r"the weight push could not reach it \(/begin_weight_update\)"):
        weight_push.push(args, dict(base_weights), [wire_engine.url, gone], 9)
    assert http(wire_engine.url, "/begin_weight_update", {})[0] == 200  # no session was left open
    assert http(wire_engine.url, "/end_weight_update", {})[0] == 200
