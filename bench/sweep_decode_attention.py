"""The own-length decode attention kernels (engine/decode_attention.py) alone on a GPU, per ``BLOCK_BYTES`` (the
split's positions: 64, 128 or 256 at this shape; the key ``n``) and ``NUM_WARPS`` of ``partial``: microseconds per
call replayed from a CUDA graph (launched with PDL on Hopper, as in the engine's steps), at the 0.5B shape's
attention (2 KV heads of 7 queries, head size 64) and rows at lengths spread below the bucket.

    python bench/sweep_decode_attention.py --batch-sizes 1,8,32 --buckets 256,1024
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_sampler import graphed  # noqa: E402
from slime_lite.engine import decode_attention as da  # noqa: E402


def replay_us(fn) -> float:
    return graphed(fn, 200) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--buckets", default="256,1024")
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--n-rep", type=int, default=7)
    ap.add_argument("--head-dim", type=int, default=64)
    args = ap.parse_args()
    for b, bucket in itertools.product([int(x) for x in args.batch_sizes.split(",")],
                                       [int(x) for x in args.buckets.split(",")]):
        kv = torch.randn(b + 1, 2 * args.kv_heads, bucket, args.head_dim, device="cuda", dtype=torch.bfloat16)
        keys, values = kv[:, : args.kv_heads], kv[:, args.kv_heads :]
        q = torch.randn(b, args.kv_heads, args.n_rep, args.head_dim, device="cuda", dtype=torch.bfloat16)
        slots = torch.arange(b, device="cuda")
        positions = torch.tensor([(i + 1) * (bucket - 1) // b for i in range(b)], device="cuda")
        row = {"batch": b, "bucket": bucket}
        ref = None
        for block_bytes, warps in itertools.product((8192, 16384, 32768), (2, 4, 8)):
            da.BLOCK_BYTES, da.NUM_WARPS = block_bytes, warps
            block_n = da.chunk(args.head_dim, torch.bfloat16)
            out = da.decode_attention(q, keys, values, slots, positions, args.head_dim ** -0.5)
            ref = out if ref is None else ref
            row[f"us_n{block_n}_w{warps}"] = round(replay_us(
                lambda: da.decode_attention(q, keys, values, slots, positions, args.head_dim ** -0.5)), 2)
            row[f"diff_n{block_n}_w{warps}"] = float((out.float() - ref.float()).abs().max())
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
