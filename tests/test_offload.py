"""slime_lite/offload.py on CPU: the bookkeeping of moving tensors to a host buffer and back as one block (the same
code moves them off a GPU; tests/backends/test_train_offload.py and tests/engine/test_release_gpu.py run it there)."""

from __future__ import annotations

import pytest
import torch

from slime_lite.offload import ALIGN, TensorStash


def _tensors():
    gen = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(8, 6)
    fused = torch.randn(12, 8, generator=gen)
    q = torch.nn.Parameter(fused[:6], requires_grad=False)  # a parameter viewing part of another tensor's storage
    state = torch.randn(3, 5, dtype=torch.float64, generator=gen)
    half = torch.randn(7, generator=gen).to(torch.bfloat16)
    strided = torch.randn(4, 6, generator=gen).t()  # not contiguous
    return lin, [lin.weight, lin.bias, fused, q, state, half, strided, lin.weight]  # lin.weight twice: tied


def test_round_trip_is_exact_and_ends_in_one_block():
    lin, ts = _tensors()
    before = [t.detach().clone() for t in ts]
    stash = TensorStash("cpu")
    moved = stash.offload(ts)
    assert moved % ALIGN == 0 and moved >= sum(b.numel() * b.element_size() for b in before[:-1])
    assert all(t.untyped_storage().nbytes() == 0 for t in ts)  # freed where they were
    stash.onload()
    assert all(torch.equal(t, b) and t.stride() == b.stride() for t, b in zip(ts, before))
    assert len({t.untyped_storage().data_ptr() for t in ts}) == 1  # one block, no per-tensor allocations
    fused, q = ts[2], ts[3]
    with torch.no_grad():
        fused[0, 0] = 42.0
    assert q[0, 0] == 42.0  # a view stays a view
    # later offloads move that block as one piece; training still works on the moved parameters
    assert stash.offload(ts) == moved
    stash.onload()
    lin(torch.ones(2, 8)).sum().backward()
    assert lin.weight.grad is not None and lin.weight.grad.shape == (6, 8)


def test_a_tensor_that_joined_later_gets_a_place():
    _, ts = _tensors()
    stash = TensorStash("cpu")
    stash.offload(ts)
    stash.onload()
    new = torch.arange(10.0)  # optimizer state made at the first step, after the first offload
    stash.offload(ts + [new])
    stash.onload()
    assert torch.equal(new, torch.arange(10.0))
    assert len({t.untyped_storage().data_ptr() for t in ts + [new]}) == 1


def test_keep_on_host_lets_writes_while_offloaded_reach_the_device():
    lin, ts = _tensors()
    stash = TensorStash("cpu")
    stash.offload(ts, keep_on_host=True)
    assert all(t.untyped_storage().data_ptr() == stash.host.untyped_storage().data_ptr() for t in ts)
    with torch.no_grad():
        ts[0].fill_(3.0)  # a weight update while the engine's memory is released
    stash.onload()
    assert torch.equal(lin.weight, torch.full((6, 8), 3.0))
    assert lin.weight.untyped_storage().data_ptr() != stash.host.untyped_storage().data_ptr()


def test_offload_twice_is_refused():
    _, ts = _tensors()
    stash = TensorStash("cpu")
    stash.offload(ts)
    with pytest.raises(RuntimeError, match="without an onload"):
        stash.offload(ts)
