"""FAKE SGLang server for CPU tests: ``python -m tests.fakes.fake_sglang_server`` stands in for
``python -m sglang.launch_server`` (SGLang cannot be installed here).

It accepts the SGLang flags the launcher and ima-bisect use, then runs slime_lite's embedded engine on CPU. The
test-only ``--fake-fault KIND:TOGGLE`` (repeatable) makes it fail like an IMA would, only while TOGGLE is on:
- KIND: ``crash`` (first /generate prints a CUDA illegal-memory-access report, writes a fake core dump when the CUDA
  core-dump variables are set, and exits 1), ``crash-at-start`` (the same before listening), ``hang`` (/generate
  never answers), ``hang-at-start`` (never listens).
- TOGGLE: ``cuda-graph`` (on unless --disable-cuda-graph), ``spec`` (on with --speculative-algorithm), ``deepep``
  (on with --moe-a2a-backend deepep), ``always``.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fake_sglang_server")
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--random-seed", type=int, default=0)
    p.add_argument("--enable-memory-saver", action="store_true")
    p.add_argument("--api-key", default=None)
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--mem-fraction-static", type=float, default=None)
    p.add_argument("--speculative-algorithm", default=None)
    p.add_argument("--speculative-num-steps", type=int, default=None)
    p.add_argument("--speculative-eagle-topk", type=int, default=None)
    p.add_argument("--speculative-num-draft-tokens", type=int, default=None)
    p.add_argument("--moe-a2a-backend", default="none")
    p.add_argument("--deepep-mode", default=None)
    p.add_argument("--some-offset", type=int, default=0, help="a flag whose value may start with '-'")
    p.add_argument("--fake-fault", action="append", default=[], metavar="KIND:TOGGLE")
    return p


def active_toggles(args: argparse.Namespace) -> set[str]:
    on = {"always"}
    if not args.disable_cuda_graph:
        on.add("cuda-graph")
    if args.speculative_algorithm:
        on.add("spec")
    if args.moe_a2a_backend == "deepep":
        on.add("deepep")
    return on


def fault_kinds(args: argparse.Namespace) -> set[str]:
    on = active_toggles(args)
    kinds = set()
    for spec in args.fake_fault:
        kind, _, toggle = spec.partition(":")
        if toggle in on:
            kinds.add(kind)
    return kinds


def crash(where: str) -> None:
    """Print what PyTorch prints on an IMA, write a fake core dump if asked, exit non-zero."""
    env = os.environ
    print(f"[fake sglang] CUDA_LAUNCH_BLOCKING={env.get('CUDA_LAUNCH_BLOCKING')} "
          f"SGLANG_CUDA_COREDUMP={env.get('SGLANG_CUDA_COREDUMP')}", flush=True)
    print("Traceback (most recent call last):", flush=True)
    print(f'  File "fake_cuda_graph_runner.py", line 1, in {where}', flush=True)
    print("RuntimeError: CUDA error: an illegal memory access was encountered", flush=True)
    print("CUDA kernel errors might be asynchronously reported at some other API call.", flush=True)
    print("[fake sglang] failing kernel: fake_paged_attention_kernel<128>", flush=True)
    if env.get("CUDA_ENABLE_COREDUMP_ON_EXCEPTION") == "1" and env.get("CUDA_COREDUMP_FILE"):
        path = (env["CUDA_COREDUMP_FILE"].replace("%h", socket.gethostname()).replace("%p", str(os.getpid()))
                .replace("%t", str(int(time.time()))))
        with open(path, "w") as f:
            f.write("FAKE CUDA CORE DUMP written by tests/fakes/fake_sglang_server.py\n"
                    f"CUDA_COREDUMP_GENERATION_FLAGS={env.get('CUDA_COREDUMP_GENERATION_FLAGS')}\n"
                    f"CUDA_COREDUMP_SHOW_PROGRESS={env.get('CUDA_COREDUMP_SHOW_PROGRESS')}\n")
        print(f"[fake sglang] wrote fake GPU core dump {path}", flush=True)
    sys.stdout.flush()
    os._exit(1)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    kinds = fault_kinds(args)
    print(f"[fake sglang] toggles on: {sorted(active_toggles(args) - {'always'})}; faults armed: {sorted(kinds)}; "
          f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')}", flush=True)
    if "crash-at-start" in kinds:
        crash("capture")
    if "hang-at-start" in kinds:
        while True:
            time.sleep(3600)

    import asyncio

    from slime_lite.engine.server import EngineServer

    class FakeSGLangEngine(EngineServer):
        async def generate(self, request):
            if "crash" in kinds:
                crash("replay")
            if "hang" in kinds:
                while True:
                    await asyncio.sleep(3600)
            return await super().generate(request)

    server = FakeSGLangEngine(args.model_path, host=args.host, port=args.port, device="cpu",
                              seed=args.random_seed, cpu_threads=1, api_key=args.api_key)
    server.run_forever()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
