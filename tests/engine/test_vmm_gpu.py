"""engine/vmm.py on a GPU (skipped without CUDA): a mapped buffer gives its memory back to the GPU and maps new
memory at the same addresses, so a CUDA graph captured over it keeps working across the round trip."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_a_graph_over_a_mapped_buffer_survives_unmap_and_map():
    from slime_lite.engine import vmm

    dev = torch.device("cuda", torch.cuda.current_device())
    assert vmm.available(dev)
    mapped0 = vmm.mapped_bytes()[0]
    buf = vmm.MappedBuffer(300 << 20, dev)
    assert buf.nbytes >= 300 << 20 and vmm.mapped_bytes()[0] == mapped0 + buf.nbytes
    x = buf.view()[: 300 << 20].view(torch.float32)
    x.fill_(1.0)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.graph(graph, stream=stream):
        x.mul_(3.0)
    graph.replay()
    torch.cuda.synchronize()
    assert x[:5].tolist() == [3.0] * 5 and x[-1].item() == 3.0
    address = x.data_ptr()
    free = torch.cuda.mem_get_info()[0]
    buf.unmap()
    assert torch.cuda.mem_get_info()[0] >= free + buf.nbytes - (64 << 20)  # back to the GPU
    assert vmm.mapped_bytes()[0] == mapped0 and not buf.mapped
    buf.map()
    assert x.data_ptr() == address and vmm.mapped_bytes()[0] == mapped0 + buf.nbytes
    x.fill_(2.0)
    graph.replay()
    torch.cuda.synchronize()
    assert x[:5].tolist() == [6.0] * 5 and x[-1].item() == 6.0
    del graph, x
    free = torch.cuda.mem_get_info()[0]
    del buf  # the last view went with x: closed
    assert vmm.mapped_bytes()[0] == mapped0
    assert torch.cuda.mem_get_info()[0] >= free + (300 << 20) - (64 << 20)
