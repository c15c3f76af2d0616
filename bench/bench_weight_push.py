"""Weight push throughput per transport (MB/s) into a live embedded engine (``slime-lite serve`` in another process),
next to an in-process tensor copy of the same bytes (the baseline), all in one run.

    .venv/bin/python bench/bench_weight_push.py [--hidden 512 --layers 8 --repeat 3]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--repeat", type=int, default=3)
    a = p.parse_args()
    torch.set_num_threads(2)
    from safetensors.torch import load_file

    from slime_lite.backends.megatron import weight_push as wp
    from slime_lite.checks.weight_check import check_weights_equal
    from bench_weight_ipc import _wait
    from slime_lite.io import free_port
    from slime_lite.tiny_model import make_tiny_model

    tmp = tempfile.mkdtemp()
    model = os.path.join(tmp, "model")
    make_tiny_model(model, hidden_size=a.hidden, num_layers=a.layers, num_heads=8, num_kv_heads=4,
                    intermediate_size=a.hidden * 3, warm_start_steps=0)
    named = {k: v + 0.01 for k, v in load_file(os.path.join(model, "model.safetensors")).items()}
    mb = sum(t.numel() * t.element_size() for t in named.values()) / 2**20
    port = free_port()  # the engine in its own process, as a rollout engine runs (a Ray actor)
    proc = subprocess.Popen([sys.executable, "-m", "slime_lite.cli", "serve", "--model-path", model, "--port",
                             str(port), "--device", "cpu"])
    url = f"http://127.0.0.1:{port}"
    try:
        _wait(url, proc)
        targets = {k: torch.empty_like(v) for k, v in named.items()}

        def copy() -> None:
            for k, v in named.items():
                targets[k].copy_(v)

        args = SimpleNamespace(save=tmp, hf_checkpoint=model, colocate=False, rollout_backend="embedded",
                               rollout_num_gpus_per_engine=1, update_weight_buffer_size=512 << 20)
        by_value = SimpleNamespace(**vars(args))
        wp_mode = wp.payload_mode  # an engine on another host gets the tensors by value
        runs = {
            "in-process tensor copy (baseline)": copy,
            "tensor (SGLang payload, shared-memory handles)": lambda: wp._push_tensor(args, named, [url], 1),
            "tensor (SGLang payload, by value: base64 in JSON)": lambda: _by_value(wp, wp_mode, by_value, named, url),
            # colocated=True keeps gloo on a CUDA machine too: the engine here is on the CPU
            "distributed (gloo, one broadcast per bucket: flattened_bucket)":
                lambda: wp._push_distributed(named, [url], 1, colocated=True),
            "distributed (gloo, one broadcast per tensor: what SGLang servers get)":
                lambda: wp._push_distributed(named, [url], 1, colocated=True, flattened=False),
            "disk (HF folder + update_weights_from_disk)": lambda: wp._push_disk(args, named, [url], 1),
        }
        rows = []
        for name, fn in runs.items():
            fn()  # warm-up (the broadcast group is created here)
            best = min(_timed(fn) for _ in range(a.repeat))
            rows.append((name, best))
        check_weights_equal(named, [url])
    finally:
        proc.terminate()
        proc.wait(60)
    base = rows[0][1]
    print(f"{mb:.1f} MB of fp32 weights ({len(named)} tensors), one engine in another process on loopback, best of "
          f"{a.repeat}")
    print("| transport | s | MB/s | time vs copy |")
    print("|---|---|---|---|")
    for name, t in rows:
        print(f"| {name} | {t:.3f} | {mb / t:.0f} | {t / base:.1f}x |")


def _by_value(wp, mode, args, named, url) -> None:
    wp.payload_mode = lambda *a: "by_value"
    try:
        wp._push_tensor(args, named, [url], 1)
    finally:
        wp.payload_mode = mode


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
