"""engine/decode_attention.py on a GPU (skipped without CUDA): each row's attention over its own cache prefix
equals masked attention over the whole length bucket (float64 reference), and a row's result does not depend on
its batch, its neighbours' lengths or the bucket."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.engine.engine_helpers import captured

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _cache(slots, kv_heads, length, dim, dtype, seed=0):
    """A cache laid out as the engine's (K heads then V heads of one layer), keys/values as the step slices them."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    kv = torch.randn(slots, 2 * kv_heads, length, dim, generator=g, device="cuda").to(dtype)
    return kv, kv[:, :kv_heads], kv[:, kv_heads:]


def _reference(q, keys, values, positions, scale):
    mask = (torch.arange(keys.shape[2], device="cuda")[None, :] <= positions[:, None])[:, None, None, :]
    return F.scaled_dot_product_attention(q.double(), keys.double(), values.double(), attn_mask=mask, scale=scale)


@pytest.mark.parametrize("dtype,kv_heads,n_rep,dim,bucket", [
    (torch.bfloat16, 2, 7, 64, 2048),   # Qwen2.5-0.5B's attention: 14 query heads on 2 KV heads
    (torch.bfloat16, 2, 6, 128, 1024),  # Qwen2.5-1.5B's
    (torch.float16, 4, 1, 64, 300),     # no grouping; a bucket that is not a multiple of the split
    (torch.float32, 2, 2, 32, 640),     # the float32 engine (the tiny test models)
    (torch.bfloat16, 4, 2, 80, 512),    # a head size that is not a power of two (padded to 128 in the kernels)
])
def test_own_length_attention_matches_masked_attention(dtype, kv_heads, n_rep, dim, bucket):
    from slime_lite.engine.decode_attention import available, chunk, decode_attention

    assert available(torch.device("cuda"), dtype, dim), "Triton should come with CUDA torch"
    rows = 40
    _, keys, values = _cache(rows + 3, kv_heads, bucket + 64, dim, dtype)
    keys, values = keys[:, :, :bucket], values[:, :, :bucket]  # the step's positions of a larger cache
    slots = torch.randperm(rows + 3, device="cuda")[:rows]  # rows read scattered slots
    q = torch.randn(rows, kv_heads, n_rep, dim, device="cuda").to(dtype)
    size = chunk(dim, dtype)
    edges = [0, 1, size - 1, size, size + 1, bucket - 1]
    positions = torch.tensor(edges + torch.randint(0, bucket, (rows - len(edges),)).tolist(), device="cuda")
    out = decode_attention(q, keys, values, slots, positions, dim ** -0.5)
    assert out.dtype == dtype and out.shape == q.shape
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    want = _reference(q, keys[slots], values[slots], positions, dim ** -0.5)
    torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol)


def test_a_rows_result_does_not_depend_on_its_batch_or_bucket():
    """The same row (query, cache prefix, position) alone, with other neighbours, in another slot or under a larger
    length bucket gives the same bits: splits sit at fixed positions and empty ones add exact zeros."""
    from slime_lite.engine.decode_attention import decode_attention

    _, keys, values = _cache(64, 2, 2048, 64, torch.bfloat16)
    q = torch.randn(64, 2, 7, 64, device="cuda").to(torch.bfloat16)
    positions = torch.randint(0, 600, (64,), device="cuda")
    slots = torch.arange(64, device="cuda")
    whole = decode_attention(q, keys[:, :, :1024], values[:, :, :1024], slots, positions, 0.125)
    wider = decode_attention(q, keys, values, slots, positions, 0.125)
    assert torch.equal(whole, wider)
    others = positions.clone()
    others[1::2] = 2047  # neighbours at the bucket's end
    mixed = decode_attention(q, keys, values, slots, others, 0.125)
    assert torch.equal(mixed[0::2], whole[0::2])
    alone = decode_attention(q[5:6], keys[:, :, :640], values[:, :, :640], slots[5:6], positions[5:6], 0.125)
    assert torch.equal(alone, whole[5:6])
    moved = keys.clone(), values.clone()
    for t in moved:
        t[9] = t[5]  # row 5's cache copied to slot 9
    elsewhere = decode_attention(q[5:6], moved[0], moved[1], slots[9:10], positions[5:6], 0.125)
    assert torch.equal(elsewhere, whole[5:6])



@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="needs Hopper (programmatic dependent launch)")
@pytest.mark.parametrize("rope_inside,heads,dim,norm,interleaved", [
    (False, 14, 64, False, False), (True, 14, 64, False, False),  # Qwen2.5-0.5B's attention
    (True, 32, 80, True, True),  # QK-norm, interleaved pairs, a padded head size, 16 query heads per KV head
])
def test_the_current_position_is_read_after_the_rotary_writes_it(rope_inside, heads, dim, norm, interleaved,
                                                                   monkeypatch):
    """The engine's chain in a graph (norm, q/k/v product, rotary writing K/V into the cache, attention; or with
    ``rope_inside`` the rotary and the cache write inside the attention kernel), launched with programmatic
    dependent launch and without: before each replay the input changes and the cache holds a sentinel at every row's
    current position. The attention reads the rest of its block before its wait; had it read the current position
    or the product's rows (or had any kernel read its predecessor's output) early, the bits would differ. Both
    chains give the same attention and the same cache within one rounding step of the rotary (and of the QK-norm,
    whose sum runs in another order in each kernel)."""
    from slime_lite import triton_build
    from slime_lite.engine import fused_layer, gemv
    from slime_lite.engine.decode_attention import decode_attention

    dt, rows, kv_heads, slots_n, length = torch.bfloat16, 8, 2, 10, 512
    hid = heads * dim
    g = torch.Generator(device="cuda").manual_seed(0)
    qk_norm = (1 + 0.2 * torch.randn(2 * dim, generator=g, device="cuda")).to(dt) if norm else None
    qkv_w = (torch.randn((heads + 2 * kv_heads) * dim, hid, generator=g, device="cuda") * 0.03).to(dt)
    ln = (1 + 0.1 * torch.randn(hid, generator=g, device="cuda")).to(dt)
    cache = torch.randn(slots_n, 2 * kv_heads, length, dim, generator=g, device="cuda").to(dt)
    slots = torch.randperm(slots_n, generator=g, device="cuda")[:rows]
    positions = torch.randint(0, length, (rows,), generator=g, device="cuda")
    heads_at = torch.arange(2 * kv_heads, device="cuda")
    index = ((slots[:, None] * 2 * kv_heads + heads_at[None, :]) * length + positions[:, None]).reshape(-1)
    angle = torch.rand(length, dim // 2, generator=g, device="cuda") * 6  # the rotary tables, by position
    cos = torch.cat((angle.cos(), angle.cos()), -1).to(dt)
    sin = torch.cat((-angle.sin(), angle.sin()), -1).to(dt)
    cos_rows, sin_rows = cos[positions], sin[positions]  # the rotary kernel's: taken before the step
    h = torch.empty(rows, hid, device="cuda", dtype=dt)
    inputs = [torch.randn(rows, hid, generator=g, device="cuda").to(dt) for _ in range(30)]

    def step(inside=rope_inside):
        qkv = gemv.linear(fused_layer.rms_norm(h, ln, 1e-6), qkv_w)
        if inside:
            return decode_attention(qkv, cache[:, :kv_heads], cache[:, kv_heads:], slots, positions, dim ** -0.5,
                                    (cos, sin, qk_norm, 1e-6, interleaved))
        q, _ = fused_layer.rotary(qkv, cos_rows, sin_rows, heads, kv_heads, dim, qk_norm, 1e-6, interleaved,
                                  cache.view(-1, dim), index)
        return decode_attention(q.view(rows, kv_heads, heads // kv_heads, dim), cache[:, :kv_heads],
                                cache[:, kv_heads:], slots, positions, dim ** -0.5)

    outs = {}
    for pdl in (True, False):
        monkeypatch.setattr(triton_build, "PDL", pdl)
        h.copy_(inputs[0])
        graph, out = captured(step)
        outs[pdl] = []
        for x in inputs:
            h.copy_(x)
            cache.view(-1, dim)[index] = 1e4  # the sentinel the rotary overwrites
            graph.replay()
            outs[pdl].append(out.clone())
    assert all(torch.equal(a, b) for a, b in zip(outs[True], outs[False]))
    assert all(o.abs().max() < 100 for o in outs[True]) and not torch.equal(outs[True][0], outs[True][1])
    after = cache.clone()  # the last replay's cache: its new K/V at each row's position, the rest as it was
    cache.view(-1, dim)[index] = 1e4
    other = step(not rope_inside)  # the other chain, eagerly, on the last input
    torch.testing.assert_close(other, outs[True][-1], rtol=1.6e-2, atol=1.6e-2)
    torch.testing.assert_close(cache, after, rtol=1.6e-2, atol=1.6e-2)
    cache.view(-1, dim)[index] = 1e4  # the written rows alone differ: the rest is untouched bits
    after.view(-1, dim)[index] = 1e4
    assert torch.equal(cache, after)
