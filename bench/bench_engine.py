"""Decode throughput of the embedded engine (in-process and through HTTP) vs transformers' ``model.generate``.

Same model, prompts, batch size and sampling (temperature 1, no top-k/top-p) in one run. Two workloads:
- ``equal``: every request generates exactly ``--max-new-tokens`` (eos ignored);
- ``mixed``: requests stop early on a stop-token set sized so the mean length is about ``--mean-len`` (a random
  model's next-token distribution is near uniform), capped at ``--max-new-tokens``; the set is both engines' eos
  ids (as a real model's eos token is). HF generate runs each batch until its longest request ends; the engine
  refills finished slots at once.
Each batch size B runs ``--requests-per-slot`` x B requests: HF generate in chunks of B, the engine with B slots.
Tokens/s counts generated tokens (up to and including the stop token). Prints one table. Examples:
    .venv/bin/python bench/bench_engine.py                                   # tiny model on CPU
    python bench/bench_engine.py --device cuda --model-config qwen2-0.5b      # random 0.5B Qwen2 on a GPU
    python bench/bench_engine.py --device cuda --dtype bfloat16 --model-config moe-2b   # Qwen3-MoE, 0.51B active
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import platform
import sys
import tempfile
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_shapes import MOE_SHAPES, hf_config  # noqa: E402  (the Qwen3-MoE shape, one definition)

CONFIGS = {  # random-init Qwen2 shapes
    "tiny": dict(vocab_size=128, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
    "qwen2-0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                       num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True),
}


def make_model_dir(config: str, out: str) -> str:
    """A random Qwen2 checkpoint, or bench_train_gpu.py's Qwen3-MoE shape (``moe-2b``), with the tiny char
    tokenizer, for the engine's text fields."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from slime_lite.tokenizer import build_tokenizer, save_tokenizer

    ids = dict(max_position_embeddings=4096, eos_token_id=0, bos_token_id=0, pad_token_id=0)
    shape = {} if config in MOE_SHAPES else CONFIGS[config] if config in CONFIGS else json.loads(config)
    if config in MOE_SHAPES or "num_experts" in shape:  # a JSON dict with num_experts: moe-2b with its fields
        cfg = hf_config(config if config in MOE_SHAPES else "moe-2b", **ids, **shape)
    else:
        cfg = Qwen2Config(**shape, **ids, rms_norm_eps=1e-6, architectures=["Qwen2ForCausalLM"])
    torch.manual_seed(0)
    big = config in MOE_SHAPES and torch.cuda.is_available()  # 2.25B: made on the GPU in bf16, not 9 GB of fp32
    with torch.device("cuda" if big else "cpu"):
        model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16 if big else torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    del model
    save_tokenizer(build_tokenizer(), out)
    return out


def stop_set(vocab: int, mean_len: int) -> list[int]:
    return list(range(max(1, round(vocab / mean_len))))


def count_tokens(rows: list[list[int]], stops: set[int] | None) -> int:
    if stops is None:
        return sum(len(r) for r in rows)
    total = 0
    for r in rows:
        end = next((i + 1 for i, t in enumerate(r) if t in stops), len(r))
        total += end
    return total


def run_hf(model, prompts: list[list[int]], batch: int, max_new: int, stops: list[int] | None,
           static: bool = False) -> int:
    """``static``: transformers' static KV cache, with which ``generate`` compiles the decode step itself."""
    from transformers import GenerationConfig

    extra = {"cache_implementation": "static"} if static else {}
    gc = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=max_new,
                          eos_token_id=stops, pad_token_id=stops[0] if stops else 0, **extra)
    model.generation_config.eos_token_id = None  # stop only where told (the engine read its eos ids at start)
    total = 0
    dev = model.device
    with torch.inference_mode():
        for i in range(0, len(prompts), batch):
            ids = torch.tensor(prompts[i:i + batch], device=dev)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gc)
            total += count_tokens(out[:, ids.shape[1]:].tolist(), set(stops) if stops else None)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return total


def sampling_params(max_new: int, stops: list[int] | None, seed: int) -> dict:
    return {"max_new_tokens": max_new, "temperature": 1.0, "sampling_seed": seed, "ignore_eos": stops is None}


def run_engine_inprocess(scheduler, prompts: list[list[int]], max_new: int, stops: list[int] | None) -> int:
    from slime_lite.engine.sampling import SamplingParams
    from slime_lite.engine.request import Request

    done = threading.Semaphore(0)
    outs: list = []
    reqs = []
    for i, p in enumerate(prompts):
        params = SamplingParams.from_dict(sampling_params(max_new, stops, i))
        req = Request(rid=f"b{i}", input_ids=p, params=params, seed=i,
                      on_output=lambda o: (outs.append(o), done.release()))
        scheduler.prepare(req)
        reqs.append(req)
    for r in reqs:
        scheduler.submit(r)
    for _ in reqs:
        done.acquire()
    assert all(o.finish_reason["type"] != "abort" for o in outs), outs[0].finish_reason
    return sum(len(o.output_ids) for o in outs)


def run_engine_http(url: str, prompts: list[list[int]], max_new: int, stops: list[int] | None) -> int:
    import aiohttp

    async def main() -> int:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                         timeout=aiohttp.ClientTimeout(total=3600)) as session:
            async def one(i: int, p: list[int]) -> int:
                body = {"input_ids": p, "sampling_params": sampling_params(max_new, stops, i)}
                async with session.post(url + "/generate", json=body) as resp:
                    out = await resp.json()
                assert out["meta_info"]["finish_reason"]["type"] != "abort", out
                return out["meta_info"]["completion_tokens"]

            return sum(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))

    return asyncio.run(main())


def timed(fn, *args) -> tuple[int, float, float]:
    """(tokens, wall seconds, CPU seconds of this process, all threads)."""
    wall, cpu = time.perf_counter(), time.process_time()
    n = fn(*args)
    return n, time.perf_counter() - wall, time.process_time() - cpu


def time_static(jobs: list, model_dir: str, args) -> None:
    """Static-cache ``generate`` (compiled, CUDA graphs through inductor) on a fresh copy of the model, after all
    engine runs: on an H200 the engine, run in the same process after that compile, twice died with an illegal
    memory access (not seen otherwise; under investigation, see BENCHMARKS.md)."""
    if not jobs:
        return
    from slime_lite.engine.model import load_hf_model

    hf = load_hf_model(model_dir, args.dtype, torch.device(args.device))
    for row, b, prompts in jobs:
        start = time.perf_counter()  # warm-up at the timed shape: compiles the decode step
        run_hf(hf, prompts[:b], b, args.max_new_tokens, None, True)
        row["hfs_warmup_s"] = time.perf_counter() - start
        for _ in range(args.repeats):
            n, secs, cpu = timed(functools.partial(run_hf, static=True), hf, prompts, b, args.max_new_tokens, None)
            row["hfs_tok"], row["hfs_tps"] = n, max(row.get("hfs_tps", 0.0), n / secs)
            row["hfs_cpu"] = max(row.get("hfs_cpu", 0.0), n / cpu)
        print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", default=None, help="an HF Llama/Qwen2 folder (default: a random --model-config)")
    ap.add_argument("--model-config", default="tiny",
                    help=f"{' | '.join([*CONFIGS, *MOE_SHAPES])} (Qwen3-MoE) | a JSON dict of Qwen2Config fields "
                         "(with num_experts: Qwen3MoeConfig fields over moe-2b's)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    ap.add_argument("--batch-sizes", default="1,16,64,256")
    ap.add_argument("--requests-per-slot", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--mean-len", type=int, default=32, help="target mean output length of the mixed workload")
    ap.add_argument("--workloads", default="equal,mixed")
    ap.add_argument("--no-http", action="store_true")
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per method; the best counts")
    ap.add_argument("--hf-static-batches", default="",
                    help="batch sizes at which to also time generate with the static cache (compiled; equal only)")
    ap.add_argument("--disable-cuda-graph", action="store_true", help="the engine decodes eagerly")
    ap.add_argument("--enable-torch-compile", action="store_true", help="the engine compiles its graphed decode")
    args = ap.parse_args()

    from slime_lite.engine.server import EngineServer

    tmp = tempfile.TemporaryDirectory()
    model_dir = args.model_path or make_model_dir(args.model_config, tmp.name)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    rows, static_jobs = [], []
    for b in batch_sizes:
        server = EngineServer(model_dir, device=args.device, dtype=args.dtype, max_running_requests=b,
                              kv_cache_tokens=b * (args.prompt_len + args.max_new_tokens),
                              cuda_graph=False if args.disable_cuda_graph else None,
                              enable_torch_compile=args.enable_torch_compile)
        server.start()
        hf = server.scheduler.hf  # the same weights, dtype and device as the engine
        vocab = hf.config.vocab_size
        gen = torch.Generator().manual_seed(b)
        n_req = b * args.requests_per_slot
        prompts = torch.randint(1, vocab, (n_req, args.prompt_len), generator=gen).tolist()
        for workload in args.workloads.split(","):
            stops = stop_set(vocab, args.mean_len) if workload == "mixed" else None
            server.scheduler.eos_ids = set(stops or [])  # the stop set plays the model's eos token
            run_hf(hf, prompts[:b], b, 16, stops)  # warm-up (kernels, allocator, cache growth)
            run_engine_inprocess(server.scheduler, prompts[:b], 16, stops)
            if not args.no_http:
                run_engine_http(server.url, prompts[:b], 16, stops)
            runs = {"hf": (run_hf, hf, prompts, b), "eng": (run_engine_inprocess, server.scheduler, prompts)}
            if not args.no_http:
                runs["http"] = (run_engine_http, server.url, prompts)
            row = {"workload": workload, "batch": b, "requests": n_req}
            if workload == "equal" and str(b) in args.hf_static_batches.split(","):
                static_jobs.append((row, b, prompts))  # after every engine run: see ``time_static``
            for _ in range(args.repeats):  # interleaved; the best run of each counts (shared machines are noisy)
                for key, (fn, *fn_args) in runs.items():
                    n, secs, cpu = timed(fn, *fn_args, args.max_new_tokens, stops)
                    row[f"{key}_tok"] = n
                    row[f"{key}_tps"] = max(row.get(f"{key}_tps", 0.0), n / secs)
                    row[f"{key}_cpu"] = max(row.get(f"{key}_cpu", 0.0), n / cpu)
            dec = server.scheduler.decoder
            if dec is not None:
                row["graphs"], row["capture_s"] = len(dec.graphs), dec.capture_seconds
            rows.append(row)
            print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
        server.stop()
        del server, hf
        if args.device == "cuda":
            torch.cuda.empty_cache()

    time_static(static_jobs, model_dir, args)
    dev = torch.cuda.get_device_name() if args.device == "cuda" else f"{platform.processor() or 'cpu'} x{os.cpu_count()}"
    print(f"\nengine vs HF generate: {args.model_path or args.model_config}, {args.device} ({dev}), "
          f"torch threads {torch.get_num_threads()}, prompt {args.prompt_len}, max_new {args.max_new_tokens}, "
          f"mixed mean ~{args.mean_len}, {args.requests_per_slot} requests/slot, best of {args.repeats}")
    print("x HF = tokens/s ratio by wall time; (cpu) = by this process's CPU time, steadier on a shared machine")
    head = f"{'workload':<8} {'batch':>5} {'reqs':>5} {'HF tok/s':>9} {'engine tok/s':>12} {'x HF':>5} {'(cpu)':>6}"
    head += "" if args.no_http else f" {'HTTP tok/s':>10} {'x HF':>5} {'(cpu)':>6}"
    print(head)
    for r in rows:
        line = (f"{r['workload']:<8} {r['batch']:>5} {r['requests']:>5} {r['hf_tps']:>9.0f} {r['eng_tps']:>12.0f} "
                f"{r['eng_tps'] / r['hf_tps']:>5.2f} {r['eng_cpu'] / r['hf_cpu']:>6.2f}")
        if "http_tps" in r:
            line += f" {r['http_tps']:>10.0f} {r['http_tps'] / r['hf_tps']:>5.2f} {r['http_cpu'] / r['hf_cpu']:>6.2f}"
        if "hfs_tps" in r:
            line += (f"  | HF static-cache tok/s {r['hfs_tps']:.0f} (warm-up {r['hfs_warmup_s']:.0f} s), "
                     f"engine x static {r['eng_tps'] / r['hfs_tps']:.2f}")
        print(line)
    tmp.cleanup()


if __name__ == "__main__":
    main()
