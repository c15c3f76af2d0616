"""Weight push throughput per transport (MB/s) into a live embedded engine, next to an in-process tensor copy of
the same bytes (the baseline), all in one run.

    .venv/bin/python bench/bench_weight_push.py [--hidden 512 --layers 8 --repeat 3]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from types import SimpleNamespace

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--repeat", type=int, default=3)
    a = p.parse_args()
    torch.set_num_threads(2)
    from safetensors.torch import load_file

    from slime_lite.backends.megatron import weight_push as wp
    from slime_lite.engine.server import EngineServer
    from slime_lite.tiny_model import make_tiny_model

    tmp = tempfile.mkdtemp()
    model = os.path.join(tmp, "model")
    make_tiny_model(model, hidden_size=a.hidden, num_layers=a.layers, num_heads=8, num_kv_heads=4,
                    intermediate_size=a.hidden * 3, warm_start_steps=0)
    named = {k: v + 0.01 for k, v in load_file(os.path.join(model, "model.safetensors")).items()}
    mb = sum(t.numel() * t.element_size() for t in named.values()) / 2**20
    server = EngineServer(model, device="cpu")
    url = server.start()
    try:
        targets = {k: torch.empty_like(v) for k, v in named.items()}

        def copy() -> None:
            for k, v in named.items():
                targets[k].copy_(v)

        args = SimpleNamespace(save=tmp, hf_checkpoint=model, colocate=False)
        runs = {
            "in-process tensor copy (baseline)": copy,
            "tensor (HTTP, serialized)": lambda: wp._push_tensor(named, [url], 1),
            "distributed (gloo broadcast)": lambda: wp._push_distributed(named, [url], 1),
            "disk (HF folder + update_weights_from_disk)": lambda: wp._push_disk(args, named, [url], 1),
        }
        rows = []
        for name, fn in runs.items():
            fn()  # warm-up (the broadcast group is created here)
            best = min(_timed(fn) for _ in range(a.repeat))
            rows.append((name, best))
        wp.check_weights_equal(named, [url])
    finally:
        server.stop()
    base = rows[0][1]
    print(f"{mb:.1f} MB of fp32 weights ({len(named)} tensors), one engine on loopback, best of {a.repeat}")
    print("| transport | s | MB/s | time vs copy |")
    print("|---|---|---|---|")
    for name, t in rows:
        print(f"| {name} | {t:.3f} | {mb / t:.0f} | {t / base:.1f}x |")


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
