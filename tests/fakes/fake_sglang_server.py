"""FAKE SGLang server for CPU tests: ``python -m tests.fakes.fake_sglang_server`` stands in for
``python -m sglang.launch_server`` (SGLang cannot be installed here).

It accepts the SGLang flags the launcher and ima-bisect use, then runs slime_lite's embedded engine on CPU. The
test-only ``--fake-fault KIND:TOGGLE`` (repeatable) makes it fail like an IMA would, only while TOGGLE is on:
- KIND: ``crash`` (first /generate prints a CUDA illegal-memory-access report, writes a fake core dump when the CUDA
  core-dump variables are set, and exits 1), ``crash-at-start`` (the same before listening), ``hang`` (/generate
  never answers), ``hang-at-start`` (never listens).
- TOGGLE: ``cuda-graph`` (on unless --disable-cuda-graph), ``spec`` (on with --speculative-algorithm), ``deepep``
  (on with --moe-a2a-backend deepep), ``always``.

With ``--enable-lora`` it keeps adapters loaded by /load_lora_adapter under their names (it never applies them:
SGLang's LoRA kernels are SGLang's business), drops them on /unload_lora_adapter, and refuses a /generate whose
``lora_path`` names no loaded adapter, as SGLang does.
"""

from __future__ import annotations

import argparse
import json
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
    p.add_argument("--enable-lora", action="store_true")
    p.add_argument("--max-lora-rank", type=int, default=None)
    p.add_argument("--lora-target-modules", nargs="*", default=None)
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

    from aiohttp import web

    loras: dict[str, str] = {}  # --enable-lora: adapter name -> PEFT folder (kept by name only, never applied)

    class FakeSGLangEngine(EngineServer):
        async def generate(self, request):
            if "crash" in kinds:
                crash("replay")
            if "hang" in kinds:
                while True:
                    await asyncio.sleep(3600)
            body = await request.json()
            name = body.pop("lora_path", None)
            if name is not None and name not in loras:  # SGLang refuses a request naming an adapter it lacks
                return web.json_response({"error": {"message": f"LoRA adapter {name!r} is not loaded"}}, status=400)
            request._read_bytes = json.dumps(body).encode()  # the embedded engine (base weights) serves the rest
            return await super().generate(request)

        async def load_lora(self, request):
            body = await request.json()
            if not args.enable_lora or not os.path.isfile(os.path.join(body["lora_path"], "adapter_config.json")):
                return web.json_response({"success": False, "error_message": "cannot load"}, status=400)
            loras[body["lora_name"]] = body["lora_path"]
            return web.json_response({"success": True, "loaded_adapters": dict(loras)})

        async def unload_lora(self, request):
            if loras.pop((await request.json())["lora_name"], None) is None:
                return web.json_response({"success": False, "error_message": "not loaded"}, status=400)
            return web.json_response({"success": True, "loaded_adapters": dict(loras)})

        def make_app(self):
            app = super().make_app()
            app.router.add_post("/load_lora_adapter", self.load_lora)
            app.router.add_post("/unload_lora_adapter", self.unload_lora)
            return app

    server = FakeSGLangEngine(args.model_path, host=args.host, port=args.port, device="cpu",
                              seed=args.random_seed, cpu_threads=1, api_key=args.api_key)
    server.run_forever()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
