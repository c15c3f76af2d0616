"""A train step without the host waiting for the GPU where it need not. optimizer_ops: the foreach versions of
Megatron's optimizer helpers give what Megatron's local helpers give (on CPU tensors here; on CUDA in the gpu test),
are installed on CUDA only, and torch's fused AdamW steps as its foreach AdamW within float32 rounding (gpu). The
trainer's one-copy sum of a step's metrics; its host->device copies of micro-batch inputs (no sync on CUDA: gpu)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from slime_lite.backends.megatron import batch as B
from slime_lite.backends.megatron import cpu_compat, optimizer_ops
from slime_lite.backends.megatron.worker import _summed


def _lists(device: str):
    g = torch.Generator().manual_seed(3)
    src = [torch.randn(n, generator=g).to(device) for n in (1000, 17, 4096, 1)]
    return src, [torch.empty(t.shape, dtype=torch.bfloat16, device=device) for t in src]


def _check_helpers_match_megatron(device: str) -> None:
    cpu_compat.apply()  # Megatron's local helpers create their result with device="cuda" (CPU here: cpu_compat)
    from megatron.core.utils import local_multi_tensor_l2_norm, local_multi_tensor_scale

    src, dst = _lists(device)
    want, _ = local_multi_tensor_l2_norm(2048, None, [src], False)
    got, _ = optimizer_ops.l2_norm(2048, None, [src], False)
    assert got.shape == (1,) and got.dtype == torch.float32 and got.device == want.device
    assert got.item() == pytest.approx(want.item(), rel=1e-6)
    for factor in (1.0, 0.37):
        want_dst = [torch.empty_like(t) for t in dst]
        local_multi_tensor_scale(2048, None, [src, want_dst], factor)
        optimizer_ops.scale(2048, None, [src, dst], factor)
        assert all(torch.equal(a, b) for a, b in zip(dst, want_dst))
    inplace, want_in = [t.clone() for t in src], [t.clone() for t in src]
    optimizer_ops.scale(2048, None, [inplace, inplace], 0.5)  # the clip: [grads, grads], no temporaries
    local_multi_tensor_scale(2048, None, [want_in, want_in], 0.5)
    assert all(torch.equal(a, b) for a, b in zip(inplace, want_in))
    optimizer_ops.copy_this_to_that(src, dst)
    assert all(torch.equal(d, s.to(torch.bfloat16)) for d, s in zip(dst, src))


def test_foreach_helpers_give_megatrons_values():
    _check_helpers_match_megatron("cpu")


def test_install_and_fused_adam_leave_the_cpu_as_it_is():
    from megatron.core.optimizer import clip_grads

    before = clip_grads.l2_norm_impl
    optimizer_ops.install()
    if not torch.cuda.is_available():
        assert clip_grads.l2_norm_impl is before
    adam = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))])
    assert optimizer_ops.use_fused_adam(SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=adam)])) == 0
    assert not adam.param_groups[0]["fused"]


def test_step_metrics_are_summed_in_order_with_one_copy():
    reported = [{"loss": torch.tensor(0.1, dtype=torch.float64), "n": 1.0},
                {"loss": torch.tensor(0.2, dtype=torch.float32), "n": 2.0, "extra": torch.tensor(5.0)}]
    out = _summed(reported)
    assert out == {"loss": 0.1 + float(torch.tensor(0.2, dtype=torch.float32).double()), "n": 3.0, "extra": 5.0}
    assert all(type(v) is float for v in out.values())
    assert _summed([]) == {} and _summed([{}, {}]) == {}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_helpers_and_fused_adam_on_a_gpu():
    _check_helpers_match_megatron("cuda")
    g = torch.Generator().manual_seed(5)
    start = [torch.randn(n, generator=g) for n in (513, 4096, 7)]
    grads = [[torch.randn(t.shape, generator=g) for t in start] for _ in range(3)]
    runs = []
    for fused in (False, True):
        params = [torch.nn.Parameter(t.cuda()) for t in start]
        adam = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
        if fused:
            holder = SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=adam)])  # Megatron's nesting
            assert optimizer_ops.use_fused_adam(holder) == 1 and adam.param_groups[0]["fused"]
        for step in grads:
            for p, gr in zip(params, step):
                p.grad = gr.cuda()
            adam.step()
        runs.append([p.detach().cpu() for p in params])
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def _check_copies(device: str) -> None:
    xs = {3: torch.arange(4.0), 1: torch.tensor([7.0]), 5: torch.arange(3, dtype=torch.float32) / 3}
    got = B.samples_to_device(xs, [5, 3, 1], device)
    assert [g.device.type for g in got] == [device] * 3
    assert all(torch.equal(g.cpu(), xs[i]) for g, i in zip(got, [5, 3, 1]))
    tokens = torch.randint(0, 100, (1, 33))
    assert torch.equal(B.to_device(tokens, device).cpu(), tokens)


def test_micro_batch_inputs_to_the_device():
    _check_copies("cpu")
    t = torch.ones(2)
    assert B.to_device(t, "cpu") is t  # nothing to copy


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_micro_batch_inputs_reach_the_gpu_without_a_sync():
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronizing call raises
    try:
        xs = {i: torch.full((1000 + i,), float(i)) for i in range(8)}
        got = B.samples_to_device(xs, list(range(8)), "cuda")
        tok = B.to_device(torch.randint(0, 100, (1, 4096)), torch.device("cuda", torch.cuda.current_device()))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert all(torch.equal(g.cpu(), xs[i]) for i, g in enumerate(got)) and tok.shape == (1, 4096)
    _check_copies("cuda")


_CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=_CUDA)])
def test_a_fused_adam_state_survives_a_checkpoint_round_trip(tmp_path, device):
    """What a resume of a fused AdamW does (torch has a fused AdamW kernel on CPU too, and ``use_fused_adam`` sets
    these group flags on CUDA): the saved groups carry ``fused``, a fresh optimizer loading them steps on fused, and
    the resumed steps equal the uninterrupted ones."""
    from slime_lite.backends.megatron.checkpoint import plain_state

    g = torch.Generator().manual_seed(11)
    start = [torch.randn(n, generator=g).to(device) for n in (9, 130)]
    grads = [[torch.randn(t.shape, generator=g).to(device) for t in start] for _ in range(4)]

    def adam(params):
        a = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)
        for group in a.param_groups:  # as use_fused_adam sets them on CUDA
            group["fused"], group["foreach"] = True, False
        return a

    def steps(a, params, gs):
        for step in gs:
            for p, gr in zip(params, step):
                p.grad = gr.clone()
            a.step()

    whole = [torch.nn.Parameter(t.clone()) for t in start]
    steps(adam(whole), whole, grads)
    first = [torch.nn.Parameter(t.clone()) for t in start]
    a = adam(first)
    steps(a, first, grads[:2])
    torch.save(plain_state(a.state_dict()), tmp_path / "opt.pt")
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in first]
    b = torch.optim.AdamW(resumed, lr=1e-2, weight_decay=0.01)  # a fresh optimizer, as a resumed run builds it
    b.load_state_dict(torch.load(tmp_path / "opt.pt", weights_only=True))
    assert all(group["fused"] for group in b.param_groups)
    steps(b, resumed, grads[2:])
    assert all(torch.equal(x, y) for x, y in zip(resumed, whole))
