"""Colocated weight push on one GPU: CUDA IPC handles vs the same tensors by value, into an engine in another process.

The trainer side is ``weight_push``'s tensor transport (SGLang's ``update_weights_from_tensor``, flattened buckets of
``--bucket-mb``); the engine is ``slime-lite serve`` on the same GPU (as a colocated engine runs, in its own process).
Measured in one run: a raw device copy of the same bytes (the floor); the push by CUDA IPC (``--colocate``; the
train worker's ``weight_push.push``, with its weight-update session) without and with ``--check-weight-update-equal``
(after the push, the engine's ``/get_weights_checksum``, the trainer's digests computed meanwhile); the push by value
(host copy + base64 + HTTP, what an engine on another host gets); the check alone (``checks.weight_check.check_weights_equal``:
the engine's digests and the trainer's, both on the GPU); the trainer's checksums alone (Triton kernel on CUDA) and by
torch ops. The last line is what the check adds to a push (issue 13 item 4: at most 20%).

    python bench/bench_weight_ipc.py [--config qwen2-0.5b --bucket-mb 512 --repeat 3] [--skip-by-value]
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
IPC = "tensor push by CUDA IPC (--colocate)"
IPC_CHECK = "tensor push by CUDA IPC + --check-weight-update-equal check"
CHECK = "check alone (engine's /get_weights_checksum + trainer's checksums)"


def _wait(url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    from slime_lite.engine_client import request_json
    from slime_lite.errors import EngineError

    deadline = time.time() + timeout
    while True:
        if proc.poll() is not None:
            raise SystemExit("engine exited")
        try:
            request_json(url, "/health", timeout=5)
            return
        except EngineError:
            if time.time() > deadline:
                raise SystemExit("engine did not start") from None
            time.sleep(1)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="qwen2-0.5b", help="a bench_engine.CONFIGS name or a JSON Qwen2 shape")
    p.add_argument("--bucket-mb", type=int, default=512)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--skip-by-value", action="store_true", help="leave out the push by value (about a minute)")
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA")
    from bench_engine import make_model_dir
    from safetensors.torch import load_file

    from slime_lite.backends.megatron import weight_push as wp
    from slime_lite.checks.weight_check import check_weights_equal
    from slime_lite.io import free_port
    from slime_lite.weight_checksum import tensor_checksums

    tmp = tempfile.mkdtemp()
    model = make_model_dir(a.config, os.path.join(tmp, "model"))
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "slime_lite.cli", "serve", "--model-path", model, "--port",
                             str(port), "--device", "cuda", "--dtype", "bfloat16", "--disable-cuda-graph"])
    url = f"http://127.0.0.1:{port}"
    try:
        _wait(url, proc)
        named = {n: (t.to(torch.bfloat16) + 0.001).cuda() for n, t in load_file(os.path.join(model,
                                                                                                "model.safetensors")).items()}
        mb = sum(t.numel() * t.element_size() for t in named.values()) / 2**20
        targets = {n: torch.empty_like(t) for n, t in named.items()}

        def copy() -> None:
            for n, t in named.items():
                targets[n].copy_(t)
            torch.cuda.synchronize()

        def push(colocate: bool, check: bool = False):  # weight_push.push: what the train worker calls
            args = SimpleNamespace(colocate=colocate, rollout_backend="embedded", rollout_num_gpus_per_engine=1,
                                   update_weight_buffer_size=a.bucket_mb << 20, update_weight_transport="tensor",
                                   check_weight_update_equal=check, debug_scramble_engine_weights=False,
                                   debug_inject_fault=None)
            return lambda: wp.push(args, named, [url], 1)

        def check() -> None:
            check_weights_equal(named, [url])  # raises unless every parameter is equal

        assert wp.payload_mode(url, named, True, a.bucket_mb << 20) == "cuda_ipc"
        runs = {"device copy of the same bytes (floor)": copy,
                IPC: push(True),
                IPC_CHECK: push(True, check=True),
                CHECK: check,
                "trainer's tensor_checksums alone (on the GPU)": lambda: tensor_checksums(list(named.values())),
                "the same by torch ops (the path without Triton)": lambda: torch_ops(tensor_checksums, named)}
        if not a.skip_by_value:
            runs["tensor push by value (host copy + base64 + HTTP)"] = push(False)
        rows = []
        for name, fn in runs.items():
            fn()  # warm-up
            times = []
            for _ in range(a.repeat):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            rows.append((name, min(times)))
    finally:
        proc.terminate()
        proc.wait(60)
    print(f"{mb:.0f} MB of bf16 weights ({len(named)} tensors, config {a.config}), buckets of {a.bucket_mb} MB, one "
          f"engine in another process on {torch.cuda.get_device_name()}, best of {a.repeat}")
    print("| path | s | GB/s | vs device copy |")
    print("|---|---|---|---|")
    base = rows[0][1]
    for name, t in rows:
        print(f"| {name} | {t:.3f} | {mb / 1024 / t:.1f} | {t / base:.1f}x |")
    best = dict(rows)
    added = best[IPC_CHECK] - best[IPC]
    print(f"the check found every parameter equal; it adds {added * 1e3:.1f} ms to the {best[IPC] * 1e3:.1f} ms IPC "
          f"push ({added / best[IPC]:.0%}; target <= 20%); alone it takes {best[CHECK] * 1e3:.1f} ms")


def torch_ops(tensor_checksums, named: dict) -> list[str]:
    """The checksums with the fused Triton kernel switched off (what a machine without Triton runs)."""
    from slime_lite import weight_checksum as wc

    fused = wc._fused_digests
    wc._fused_digests = lambda *_: None
    try:
        return tensor_checksums(list(named.values()))
    finally:
        wc._fused_digests = fused


if __name__ == "__main__":
    main()
