"""Repeated prompts through the embedded engine with and without its prefix cache (``--disable-radix-cache``).

Two engines (schedulers, in process) over the same random checkpoint, one with the prefix cache and one without,
run the same workloads in one process, alternately; the ratios are printed next to the numbers:
- ``repeat``: one prompt of ``--prompt-len`` tokens sent ``--rounds`` times one after another (latency per request,
  median; the first, cold request is not counted);
- ``groups``: ``--groups`` distinct prompts, sent as ``--rounds`` waves of all of them at once (a GRPO-like
  pattern: the same prompts come back every wave); requests/s and prompt tokens/s over the waves after the first.
Every request generates ``--max-new-tokens`` tokens (eos ignored, greedy). Examples:
    .venv/bin/python bench/bench_prefix_cache.py                                  # tiny model on CPU
    python bench/bench_prefix_cache.py --device cuda --model-config qwen2-0.5b --prompt-len 2000
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_engine import CONFIGS, make_model_dir  # noqa: E402


def run(scheduler, prompts: list[list[int]], max_new: int) -> list:
    """Submit ``prompts`` at once; wait for all; return their outputs."""
    from slime_lite.engine.request import Request
    from slime_lite.engine.sampling import SamplingParams

    done = threading.Semaphore(0)
    outs: list = []
    params = SamplingParams.from_dict({"max_new_tokens": max_new, "temperature": 0.0, "ignore_eos": True})
    reqs = []
    for i, p in enumerate(prompts):
        req = Request(rid=f"p{time.monotonic_ns()}_{i}", input_ids=p, params=params, seed=i,
                      on_output=lambda o: (outs.append(o), done.release()))
        scheduler.prepare(req)
        reqs.append(req)
    for r in reqs:
        scheduler.submit(r)
    for _ in reqs:
        done.acquire()
    assert all(o.finish_reason["type"] == "length" for o in outs), outs[0].finish_reason
    return outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", default=None, help="an HF Llama/Qwen2 folder (default: a random --model-config)")
    ap.add_argument("--model-config", default="tiny", help=f"{' | '.join(CONFIGS)} | a JSON dict of Qwen2Config fields")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--prompt-len", type=int, default=1500)
    ap.add_argument("--max-new-tokens", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--groups", type=int, default=8)
    args = ap.parse_args()

    from slime_lite.engine.scheduler import Scheduler

    tmp = tempfile.mkdtemp(prefix="bench_prefix_")
    path = args.model_path or make_model_dir(args.model_config, tmp)
    engines = {}
    for cached in (True, False):
        s = Scheduler(path, device=args.device, max_running_requests=max(8, args.groups),
                      kv_cache_tokens=max(8, args.groups) * (args.prompt_len + args.max_new_tokens + 8),
                      disable_radix_cache=not cached)
        s.start()
        engines[cached] = s
    vocab = engines[True].lm.vocab_size
    gen = torch.Generator().manual_seed(0)

    def prompt() -> list[int]:
        return torch.randint(1, vocab, (args.prompt_len,), generator=gen).tolist()

    # repeat: one prompt, one request at a time
    p = prompt()
    lat: dict[bool, list[float]] = {True: [], False: []}
    hits: dict[bool, list[int]] = {True: [], False: []}
    for r in range(args.rounds + 1):
        for cached in (True, False):  # alternate: both engines see the same machine load
            t0 = time.perf_counter()
            out = run(engines[cached], [p], args.max_new_tokens)[0]
            if r:
                lat[cached].append(time.perf_counter() - t0)
                hits[cached].append(out.cached_tokens)
    # groups: waves of the same distinct prompts
    ps = [prompt() for _ in range(args.groups)]
    wave: dict[bool, list[float]] = {True: [], False: []}
    for r in range(args.rounds + 1):
        for cached in (True, False):
            t0 = time.perf_counter()
            run(engines[cached], ps, args.max_new_tokens)
            if r:
                wave[cached].append(time.perf_counter() - t0)
    for s in engines.values():
        s.stop()

    dev = torch.cuda.get_device_name() if args.device == "cuda" else f"{platform.processor() or platform.machine()}"
    print(f"model {args.model_path or args.model_config} on {args.device} ({dev}), torch threads "
          f"{torch.get_num_threads()}; prompt {args.prompt_len} tokens, {args.max_new_tokens} new tokens, "
          f"{args.rounds} timed rounds")
    on, off = statistics.median(lat[True]), statistics.median(lat[False])
    print(f"repeat  latency/request  cache {on * 1e3:8.1f} ms   no cache {off * 1e3:8.1f} ms   "
          f"speed-up {off / on:5.2f}x   cached_tokens {hits[True][0]} vs {hits[False][0]}")
    n = args.groups * args.rounds
    t_on, t_off = sum(wave[True]), sum(wave[False])
    print(f"groups  requests/s       cache {n / t_on:8.1f}      no cache {n / t_off:8.1f}      "
          f"speed-up {t_off / t_on:5.2f}x   prompt tokens/s {n * args.prompt_len / t_on:,.0f} vs "
          f"{n * args.prompt_len / t_off:,.0f}")


if __name__ == "__main__":
    main()
