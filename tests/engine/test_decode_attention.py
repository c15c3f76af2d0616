"""engine/decode_attention.py on the CPU, in Triton's interpreter (tests/triton_interpreter.py): the kernels' logic
in CI; tests/engine/test_decode_attention_gpu.py runs them compiled on a GPU, in bf16 too."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F


def _kernels_on_cpu() -> None:
    """Run by ``test_the_kernels_in_the_triton_interpreter`` with TRITON_INTERPRET=1: the kernels on CPU tensors
    (float32 and float16; a head size that is not a power of two; splits of 256 and 128 positions; lengths at the
    split edges; rows reading scattered slots of a larger cache) against float64 masked attention, and the same bits
    for a row alone under a smaller bucket."""
    from slime_lite import triton_build
    from slime_lite.engine.decode_attention import chunk, decode_attention

    assert (chunk(64, torch.bfloat16), chunk(128, torch.bfloat16), chunk(64, torch.float32)) == (256, 128, 128)
    for dtype, kv_heads, n_rep, dim, bucket, tol in [(torch.float32, 2, 7, 32, 600, 1e-5),
                                                    (torch.float16, 1, 2, 16, 300, 2e-3),
                                                    (torch.float32, 1, 3, 24, 300, 1e-5),  # head size padded to 32
                                                    (torch.float32, 2, 2, 64, 300, 1e-5)]:  # splits of 128
        g = torch.Generator().manual_seed(5)
        kv = torch.randn(7, 2 * kv_heads, bucket + 64, dim, generator=g).to(dtype)
        keys, values = kv[:, :kv_heads, :bucket], kv[:, kv_heads:, :bucket]
        q = torch.randn(5, kv_heads, n_rep, dim, generator=g).to(dtype)
        slots = torch.tensor([6, 2, 0, 3, 5])
        size = chunk(dim, dtype)
        positions = torch.tensor([0, size - 1, size, bucket - 1, 17])
        out = decode_attention(q, keys, values, slots, positions, dim ** -0.5)
        mask = (torch.arange(bucket)[None, :] <= positions[:, None])[:, None, None, :]
        want = F.scaled_dot_product_attention(q.double(), keys[slots].double(), values[slots].double(),
                                              attn_mask=mask, scale=dim ** -0.5)
        torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol)
        alone = decode_attention(q[4:5], kv[5:6, :kv_heads, :64], kv[5:6, kv_heads:, :64], torch.tensor([0]),
                                 positions[4:5], dim ** -0.5)
        assert torch.equal(alone, out[4:5])
    assert not any(c.any() for c in triton_build._COUNTERS.values())  # each join reset its counter


def _rope_on_cpu() -> None:
    """Run by ``test_the_kernels_in_the_triton_interpreter``: with ``rope`` the attention kernel takes the q/k/v
    product's rows, norms and rotates them and writes the new K/V into the cache: the same cache and the same bits as
    ``fused_layer.rotary`` (writing the cache) and then the attention, over splits, padded head sizes, GQA groups
    that fill a power of two (the new k head takes the next one), the last row of one (15 query heads) or a single
    query head per KV head, and interleaved pairs."""
    from slime_lite import triton_build
    from slime_lite.engine import fused_layer
    from slime_lite.engine.decode_attention import chunk, decode_attention

    for dtype, kv_heads, n_rep, dim, bucket, norm, interleaved in [(torch.float32, 2, 7, 32, 600, False, False),
                                                                   (torch.float16, 1, 2, 16, 300, True, False),
                                                                   (torch.float32, 2, 3, 24, 300, True, True),
                                                                   (torch.float32, 1, 4, 64, 300, True, False),
                                                                   (torch.float32, 1, 15, 16, 300, True, False),
                                                                   (torch.float32, 1, 16, 16, 300, True, True),
                                                                   (torch.float32, 2, 1, 16, 300, False, False)]:
        g = torch.Generator().manual_seed(7)
        heads, length = kv_heads * n_rep, bucket + 64
        kv = torch.randn(7, 2 * kv_heads, length, dim, generator=g).to(dtype)
        qkv = (torch.randn(5, (heads + 2 * kv_heads) * dim, generator=g) * 2).to(dtype)
        cos, sin = (torch.randn(bucket, dim, generator=g).to(dtype) for _ in range(2))  # tables by position
        qk_norm = (1 + torch.randn(2 * dim, generator=g) * 0.2).to(dtype) if norm else None
        slots = torch.tensor([6, 2, 0, 3, 5])
        size = chunk(dim, dtype)
        positions = torch.tensor([0, size - 1, size, bucket - 1, 17])
        want_kv = kv.clone()
        index = ((slots[:, None] * 2 * kv_heads + torch.arange(2 * kv_heads)) * length + positions[:, None]).reshape(-1)
        q, _ = fused_layer.rotary(qkv, cos[positions], sin[positions], heads, kv_heads, dim, qk_norm, 1e-6,
                                  interleaved, want_kv.view(-1, dim), index)
        want = decode_attention(q.view(5, kv_heads, n_rep, dim), want_kv[:, :kv_heads, :bucket],
                                want_kv[:, kv_heads:, :bucket], slots, positions, dim ** -0.5)
        got = decode_attention(qkv, kv[:, :kv_heads, :bucket], kv[:, kv_heads:, :bucket], slots, positions,
                               dim ** -0.5, (cos, sin, qk_norm, 1e-6, interleaved))
        assert torch.equal(kv, want_kv), (dtype, dim)  # each row's new K/V at its position, nothing else touched
        assert torch.equal(got, want), (dtype, dim)
    assert not any(c.any() for c in triton_build._COUNTERS.values())  # each join reset its counter
    keys, values = kv[:, :kv_heads, :bucket], kv[:, kv_heads:, :bucket]
    with pytest.raises(ValueError, match="with rope, q must be the q/k/v rows"):
        decode_attention(qkv[:, 1:], keys, values, slots, positions, 0.1, (cos, sin, None, 1e-6, False))
    with pytest.raises(ValueError, match="rotary tables"):  # a table shorter than the bucket
        decode_attention(qkv, keys, values, slots, positions, 0.1, (cos[:-1], sin[:-1], None, 1e-6, False))
    with pytest.raises(ValueError, match="in the cache's dtype"):
        decode_attention(qkv.double(), keys, values, slots, positions, 0.1, (cos, sin, None, 1e-6, False))
    with pytest.raises(ValueError, match="qk_norm must be"):
        decode_attention(qkv, keys, values, slots, positions, 0.1, (cos, sin, cos[0], 1e-6, False))


def test_the_kernels_in_the_triton_interpreter():
    """The kernels' logic runs in CI too (CPU, Triton's interpreter); the GPU tests above add bf16 and the compiler."""
    from tests.triton_interpreter import run_interpreted

    run_interpreted("tests.engine.test_decode_attention:_kernels_on_cpu")
    run_interpreted("tests.engine.test_decode_attention:_rope_on_cpu")


def test_shapes_that_do_not_fit_are_refused_before_any_kernel():
    """The kernels trust their shapes (a position past the keys' length would read another slot's memory): keys,
    values, queries, slots and positions that do not fit together are refused with the shapes named."""
    from slime_lite.engine.decode_attention import decode_attention

    kv = torch.zeros(4, 4, 64, 16)
    q, keys, values = torch.zeros(3, 2, 2, 16), kv[:, :2], kv[:, 2:]
    rows = torch.zeros(3, dtype=torch.long)
    with pytest.raises(ValueError, match="do not fit together"):
        decode_attention(q, kv[:, :1], kv[:, 2:3], rows, rows, 0.25)  # 1 kv head of keys for 2 of queries
    with pytest.raises(ValueError, match="do not fit together"):
        decode_attention(q, keys, values, rows, rows[:2], 0.25)  # 2 positions for 3 rows
    with pytest.raises(ValueError, match="do not fit together"):
        decode_attention(q, keys, values, rows[:1], rows, 0.25)  # 1 slot for 3 rows
    with pytest.raises(ValueError, match="share strides"):
        decode_attention(q, keys, values.contiguous(), rows, rows, 0.25)
