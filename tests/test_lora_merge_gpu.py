"""The LoRA merge on a GPU (skipped without CUDA): ``lora_wire.merged`` gives the same bits on the GPU as on the
host, so an engine merging on its GPU holds exactly the weights the trainer's weight check computes."""

from __future__ import annotations

import pytest
import torch

from slime_lite.lora_wire import merged

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_merge_is_bitwise_the_host_merge(dtype):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(1536, 8960, generator=g).to(dtype)
    a = torch.randn(32, 8960, generator=g).to(dtype) * 0.01
    b = torch.randn(1536, 32, generator=g) * 0.02  # scaled B goes as float32
    host = merged(w, a, b)
    device = merged(w.cuda(), a, b)
    assert device.is_cuda and device.dtype == dtype
    assert torch.equal(device.cpu(), host)
    assert not torch.equal(host, w)  # the adapter changed the weight
