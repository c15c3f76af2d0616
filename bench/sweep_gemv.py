"""Tile configurations of the decode step's small products (``engine/gemv.py``) against cuBLAS, on a GPU with PDL.

    python3 bench/sweep_gemv.py [--rows 1,8,16,32] [--model-shape 896,1152,4864] [--products gate_up,down]
        [--ksteps 1,2,4,8] [--swap 0,1] [--stages 1,3] [--tiles 32,64x128,256x4,8] [--best-out FILE]

For each product of a layer of the given shape (hidden, q/k/v width, MLP width: q/k/v with bias, o, gate/up with the
SiLU, down; down_silu: down from gate/up's output, the SiLU by its kernel then cuBLAS, or inside gemv's kernel) and
each row count: a CUDA graph of 24 x (the engine's RMSNorm kernel, then the product), the norm
launched with programmatic dependent launch as in the engine's steps; the product by cuBLAS (``F.linear``, plus the
SiLU kernel for gate/up) or by ``gemv.linear`` with each configuration (BN x BK x warps x KSTEPS, the K slices a
program adds up: 1 unless ``--ksteps`` lists more; then 1 where ``--swap`` says so: the tile products as ``w @ x.T``;
then STAGES, ``--stages``: past 1 the slices after the first in a loop Triton pipelines).
Prints us per (norm + product) pair and the best configuration of each product and row count; ``--best-out``
writes, for the last row count, the best of each kind as ``profile_decode.py --gemv-configs`` reads it
(q/k/v and o: the best of their sum, then gate/up, then down).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository: slime_lite
from slime_lite.engine import fused_layer, gemv  # noqa: E402
from slime_lite.swiglu import silu_and_mul  # noqa: E402



def graph_us(fn, n: int = 200) -> float:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(n):
            graph.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / n * 1000)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,8,16,32")
    ap.add_argument("--model-shape", default="896,1152,4864", help="hidden, q/k/v width, MLP width")
    ap.add_argument("--chain", type=int, default=24)
    ap.add_argument("--products", default="qkv,o,gate_up,down",
                    help="which of a layer's products, comma-separated (down_silu: down reading gate/up's output, "
                         "the SiLU by silu_mul then cuBLAS, or inside gemv's kernel)")
    ap.add_argument("--ksteps", default="1", help="K slices per program to sweep, comma-separated (past a product's "
                                                  "slices: all of them)")
    ap.add_argument("--swap", default="0", help="1: the tile products as w @ x.T; comma-separated values to sweep")
    ap.add_argument("--stages", default="1", help="pipeline stages of the K loop to sweep, comma-separated (1: the "
                                                  "next slice's weights in registers)")
    ap.add_argument("--tiles", default="32,64,128x128,256,512x4,8", help="BN values x BK values x warps values")
    ap.add_argument("--best-out", default="", help="file for the last row count's best as --gemv-configs reads it")
    args = ap.parse_args()
    bns, bks, warps = ([int(v) for v in part.split(",")] for part in args.tiles.split("x"))
    tiles = [(bn, bk, w) for bn in bns for bk in bks for w in warps]
    hid, qkv, inter = (int(v) for v in args.model_shape.split(","))
    dt, dev = torch.bfloat16, torch.device("cuda")
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    g = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape):
        return (torch.randn(*shape, generator=g, device=dev) * 0.03).to(dt)

    products = {"qkv": (qkv, hid, True, False), "o": (hid, hid, False, False), "gate_up": (2 * inter, hid, False, True),
                "down": (hid, inter, False, False), "down_silu": (hid, inter, False, False)}
    best_of = {}
    for rows in [int(r) for r in args.rows.split(",")]:
        for name in args.products.split(","):
            n, k, bias, swiglu = products[name]
            ws = [(rnd(n, k), rnd(n) if bias else None) for _ in range(args.chain)]
            silu_in = name == "down_silu"  # gate/up's output in, the SiLU by its kernel or inside gemv's
            x, ln = rnd(rows, 2 * k if silu_in else k) * 30, 1 + rnd(2 * k if silu_in else k)

            def chain(cfg):
                for w, b in ws:
                    y = fused_layer.rms_norm(x, ln, 1e-6)
                    if silu_in and cfg is None:
                        F.linear(silu_and_mul(y), w, b)
                    elif silu_in:
                        gemv.linear(y, w, b, silu_in=True, cfg=cfg)
                    elif cfg is None:
                        y = F.linear(y, w, b)
                        if swiglu:
                            silu_and_mul(y)
                    else:
                        gemv.linear(y, w, b, swiglu=swiglu, cfg=cfg)

            res = {"cublas": graph_us(lambda: chain(None)) / args.chain}
            configs = {(bn, bk, w, min(int(s), -(-k // bk)), int(sw), int(st)) for bn, bk, w in tiles
                       for s in args.ksteps.split(",") for sw in args.swap.split(",") for st in args.stages.split(",")}
            for cfg in sorted(configs):
                if cfg[0] * cfg[1] * (2 if swiglu else 1) > 65536:  # the weight tile past 128 KB of registers
                    continue
                if cfg[5] > 1 and cfg[3] < 3:  # nothing to pipeline
                    continue
                try:
                    res[cfg] = graph_us(lambda c=cfg: chain(c)) / args.chain
                except Exception as e:  # noqa: BLE001  (a configuration that does not compile: say so)
                    print(f"rows {rows} {name} {cfg}: {type(e).__name__}: {str(e)[:160]}", flush=True)
            best = min((c for c in res if c != "cublas"), key=res.get)
            line = " ".join(f"{'x'.join(map(str, c))}={v:.2f}" for c, v in res.items() if c != "cublas")
            print(f"rows {rows:2d} {name:8s} cublas {res['cublas']:.2f} us, best {best} {res[best]:.2f} us | {line}",
                  flush=True)
            best_of[name] = res
            if args.best_out:  # after every product: a sweep cut short still leaves what it measured
                write_best(args.best_out, best_of)


def write_best(path: str, best_of: dict) -> None:
    def spec(names):
        common = set.intersection(*(set(best_of[n]) - {"cublas"} for n in names))
        return "x".join(map(str, min(common, key=lambda c: sum(best_of[n][c] for n in names))))

    kinds = [[n for n in ("qkv", "o") if n in best_of], ["gate_up"], ["down"]]
    with open(path, "w") as f:
        f.write("/".join(spec(names) for names in kinds if names and all(n in best_of for n in names)) + "\n")


if __name__ == "__main__":
    main()
