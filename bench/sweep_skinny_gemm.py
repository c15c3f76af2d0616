"""A decode layer's matrix products at small batches on a GPU: cuBLAS with the fused norm/SiLU kernels (what captured
steps ran before) against ``skinny_gemm.linear`` (norm and SiLU inside), per tile configuration; microseconds per
call replayed from a CUDA graph, bf16, the 0.5B shape (or ``--shape 1.5b``).

    python bench/sweep_skinny_gemm.py --rows 1,8,32
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from slime_lite.engine import fused_layer, skinny_gemm  # noqa: E402

SHAPES = {"0.5b": (896, 4864, 1152), "1.5b": (1536, 8960, 2048)}  # hidden, intermediate, q/k/v width


def replay_us(fn, n: int = 200) -> float:
    fn()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--shape", default="0.5b", choices=sorted(SHAPES))
    args = ap.parse_args()
    hidden, inter, qkv_n = SHAPES[args.shape]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    dt, dev, eps = torch.bfloat16, "cuda", 1e-6

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, device=dev) * scale).to(dt)

    w_qkv, b_qkv, w_o = r(qkv_n, hidden, scale=0.05), r(qkv_n), r(hidden, hidden, scale=0.05)
    w_gu, w_down, ln = r(2 * inter, hidden, scale=0.05), r(hidden, inter, scale=0.02), r(hidden, scale=0.1) + 1
    for rows in [int(x) for x in args.rows.split(",")]:
        h, add, act = r(rows, 1, hidden), r(rows, 1, hidden), r(rows, 1, inter)
        ops = {  # name: (cuBLAS pieces, skinny call taking a config, output columns, K)
            "qkv": (lambda: F.linear(fused_layer.rms_norm(add, ln, eps, residual=h)[1], w_qkv, b_qkv),
                    lambda c: skinny_gemm.linear(h, w_qkv, b_qkv, norm=ln, eps=eps, add=add, cfg=c)[1], qkv_n,
                    hidden),
            "o": (lambda: F.linear(h, w_o), lambda c: skinny_gemm.linear(h, w_o, cfg=c), hidden, hidden),
            "gate_up": (lambda: fused_layer.silu_and_mul(F.linear(fused_layer.rms_norm(add, ln, eps, residual=h)[1],
                                                                  w_gu)),
                        lambda c: skinny_gemm.linear(h, w_gu, norm=ln, eps=eps, add=add, swiglu=True, cfg=c)[1],
                        inter, hidden),
            "down": (lambda: F.linear(act, w_down), lambda c: skinny_gemm.linear(act, w_down, cfg=c), hidden, inter),
        }
        for name, (base, skinny, n, k) in ops.items():
            row = {"rows": rows, "op": name, "cublas_us": round(replay_us(base), 2)}
            want = base().float()
            tried = {}
            for bn, bk, cover in itertools.product((32, 64), (64, 128, 256), (1, 2, 4)):
                bm = 16 if rows <= 16 else 32
                tiles, blocks = -(-n // bn), -(-k // bk)
                split = max(1, min(blocks, (cover * sms) // tiles))
                split = -(-blocks // -(-blocks // split))
                cfg = (bm, bn, bk, split)
                if cfg in tried:
                    continue
                err = (skinny(cfg).float() - want).abs().max().item()
                tried[cfg] = (round(replay_us(lambda: skinny(cfg)), 2), err)
            best = min(tried, key=lambda c: tried[c][0])
            default = skinny_gemm.config(rows, n, k, sms)
            row.update(best_cfg=best, best_us=tried[best][0], default_cfg=default,
                       default_us=tried.get(default, (None,))[0], max_abs_diff=max(e for _, e in tried.values()))
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
