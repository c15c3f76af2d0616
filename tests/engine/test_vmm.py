"""engine/vmm.py's fallback, on CPU: the driver calls are faked (no GPU here); tests/engine/test_vmm_gpu.py runs the
real ones on a GPU."""

from __future__ import annotations

import logging

import pytest
import torch


def test_a_driver_error_falls_back_to_torch_once_and_out_of_memory_is_raised(monkeypatch, caplog):
    from slime_lite.engine import vmm

    calls = []

    class FakeBuffer:  # a fake: fails as MappedBuffer does on a driver error, or on out of memory
        def __init__(self, nbytes, device):
            calls.append(device)
            raise self.error

    monkeypatch.setattr(vmm, "MappedBuffer", FakeBuffer)
    monkeypatch.setattr(vmm, "_failed", set())
    monkeypatch.setattr(vmm, "_driver", lambda: _FakeDriver())
    dev = torch.device("cuda", 3)
    assert vmm.available(dev)
    FakeBuffer.error = torch.OutOfMemoryError("CUDA out of memory mapping 1.00 GiB")
    with pytest.raises(torch.OutOfMemoryError):
        vmm.buffer(1 << 30, dev)
    assert vmm.available(dev)  # out of memory says nothing about the device
    FakeBuffer.error = RuntimeError("CUDA driver call cuMemMap failed with CUresult 1")
    with caplog.at_level(logging.WARNING, logger="slime_lite.engine.vmm"):
        assert vmm.buffer(1 << 20, dev) is None
    assert "allocating with torch" in caplog.text and "cuMemMap" in caplog.text
    assert not vmm.available(dev) and vmm.buffer(1 << 20, dev) is None
    assert calls == [dev, dev]  # not tried again on that device
    assert vmm.available(torch.device("cuda", 2)) and not vmm.available(torch.device("cpu"))


class _FakeDriver:
    """A fake of libcuda's attribute query: every device supports virtual memory management."""

    def cuDeviceGetAttribute(self, out, attribute, index):
        out._obj.value = 1
        return 0
