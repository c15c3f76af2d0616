"""The in-graph sampler alone on a GPU: eager PyTorch vs its two Triton kernels (``block_stats``),
each captured in a CUDA graph, on bfloat16 logits as the engine's step hands them over.

    python bench/bench_sampler.py --batch-sizes 64,256 --vocab 151936

Prints ms per call (replay of a graph holding one ``sample_rows``), whether both draw the same tokens, and the time
one read of the logits takes at the H200's 4.8 TB/s.
"""

from __future__ import annotations

import argparse
import json

import torch

from slime_lite.engine import block_stats
from slime_lite.engine.sampling import sample_rows


_KEEP: list = []


def graphed(fn, n: int = 50) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=stream):
        fn()
    g.replay()
    torch.cuda.synchronize()
    _KEEP.append(g)  # its outputs live in the graph's pool
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch-sizes", default="64,256")
    ap.add_argument("--vocab", type=int, default=151936)
    args = ap.parse_args()
    for b in [int(x) for x in args.batch_sizes.split(",")]:
        gen = torch.Generator(device="cuda").manual_seed(b)
        logits = (torch.randn(b, args.vocab, device="cuda", generator=gen) * 3).bfloat16()
        temps = torch.full((b,), 0.8, device="cuda")
        u = torch.rand(b, dtype=torch.float64, device="cuda", generator=gen)
        greedy = torch.zeros(b, dtype=torch.bool, device="cuda")
        out = {}
        row = {"batch": b}
        with torch.inference_mode():
            for name, use_triton in (("eager", False), ("triton", True)):
                block_stats.available = lambda device, use=use_triton: use

                def fn(name=name):
                    out[name] = sample_rows(logits, temps, u, greedy)
                row[f"{name}_ms"] = round(graphed(fn), 4)
        row["same_tokens"] = bool(torch.equal(out["eager"][0], out["triton"][0]))
        row["max_logprob_diff"] = float((out["eager"][1] - out["triton"][1]).abs().max())
        row["read_bound_ms"] = round(logits.numel() * logits.element_size() / 4.8e12 * 1000, 4)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
