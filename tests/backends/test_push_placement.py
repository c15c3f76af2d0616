"""Where a push's HF copies live (``TrainActor._push_on_device``): on the trainer's GPU for a colocated CUDA-IPC
push and for an NCCL broadcast that fits in half the free memory, else on the host. Fakes: the CUDA device (this
machine has none), its free memory, and Megatron's parallel state."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from slime_lite.backends.megatron.actor import TrainActor

MB = 1 << 20


@pytest.mark.parametrize("transport, colocate, pp, tp, free_mb, cuda, expected", [
    ("tensor", True, 1, 1, 1, True, True),  # CUDA IPC hands out handles of device tensors, whatever the room
    ("tensor", False, 1, 1, 1000, True, False),  # by value to another host: host copies
    ("distributed", False, 1, 1, 100, True, True),  # NCCL from the GPU: 4 MB fits in half of 100 MB
    ("distributed", False, 1, 2, 15, True, False),  # 2 x 4 MB gathered does not fit in half of 15 MB
    ("distributed", True, 1, 1, 1000, True, False),  # colocated engines receive by gloo, on the host
    ("disk", False, 1, 1, 1000, True, False),
    ("distributed", False, 2, 1, 1000, True, False),  # PP stages meet through host objects
    ("distributed", False, 1, 1, 1000, False, False),  # no GPU
])
def test_push_copies_on_the_gpu_only_where_they_are_sent_from_it_and_fit(monkeypatch, transport, colocate, pp, tp,
                                                                          free_mb, cuda, expected) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *_: (free_mb * MB, 2 * free_mb * MB))
    actor = SimpleNamespace(
        args=SimpleNamespace(update_weight_transport=transport, colocate=colocate),
        ps=SimpleNamespace(get_pipeline_model_parallel_world_size=lambda: pp,
                           get_tensor_model_parallel_world_size=lambda: tp),
        model=torch.nn.Linear(1024, 1024, bias=False))  # 4 MB of float32
    assert TrainActor._push_on_device(actor) is expected


@pytest.mark.parametrize("rollout_device, colocate, cuda, expected", [
    ("cpu", False, True, "gloo"),  # a CPU engine cannot join NCCL: it would refuse and the trainer wait 300 s
    ("auto", False, True, "nccl"),
    ("auto", True, True, "gloo"),  # colocated engines share the trainer's GPU
    ("auto", False, False, "gloo"),
])
def test_the_broadcast_group_is_gloo_where_an_engine_cannot_join_nccl(monkeypatch, rollout_device, colocate, cuda,
                                                                       expected) -> None:
    import contextlib

    from slime_lite.backends.megatron import weight_broadcast, weight_push

    chosen = []

    def group(urls, backend, ranks=1):
        chosen.append(backend)
        raise RuntimeError("no group in this test")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(weight_broadcast, "_group", group)
    monkeypatch.setattr(weight_push, "weight_update_session", lambda urls: contextlib.nullcontext())
    args = SimpleNamespace(update_weight_transport="distributed", update_weight_buffer_size=1 << 20,
                           colocate=colocate, rollout_backend="embedded", fully_async=False,
                           rollout_device=rollout_device)
    with pytest.raises(RuntimeError, match="no group"):
        weight_push._transport(args, {"w": torch.ones(2)}, ["http://engine"], 1)
    assert chosen == [expected]


def test_the_disk_transport_keeps_only_the_newest_push_folder(monkeypatch, tmp_path):
    """Pushes every --update-weights-interval 2 come at versions 0, 2, 4: each left its folder behind (only
    v{version-1} was removed), a model's worth of disk per push."""
    import os

    from slime_lite.backends.megatron import weight_push

    monkeypatch.setattr(weight_push, "write_hf_folder", lambda named, base, out: os.makedirs(out))
    args = SimpleNamespace(save=str(tmp_path), hf_checkpoint="unused", fully_async=False)
    for version in (0, 2, 4):
        weight_push._push_disk(args, {}, [], version)
    assert sorted(os.listdir(tmp_path / "weight_push")) == ["v4"]
    # without --save the folder is this host's temporary one: gone once the engines read it (a model's worth of
    # disk was left in /tmp by every run)
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    weight_push._push_disk(SimpleNamespace(save=None, hf_checkpoint="unused", fully_async=False), {}, [], 6)
    assert os.listdir(tmp_path / "tmp") == []
