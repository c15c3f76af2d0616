"""A multi-turn rollout against a single-turn one of the same generated tokens, through the embedded engine's HTTP
API and the rollout's own multi-turn helpers (rollout.multi_turn.model_turn: each turn sent as input_ids).

``--samples`` samples at once, each a ``--prompt-len``-token prompt; single-turn: one request of ``--new-tokens``
tokens; multi-turn: ``--turns`` model turns of ``--new-tokens / --turns`` tokens with an inserted turn of
``--inserted-tokens`` tokens after each but the last. The multi-turn rollout runs on an engine with its prefix
cache and on one without (``disable_radix_cache``): generated tokens/s of each (median of ``--rounds``, the three
alternating), and the mean ``cached_tokens`` of a later turn. Examples:
    .venv/bin/python bench/bench_multi_turn.py                                    # tiny model on CPU
    python bench/bench_multi_turn.py --device cuda --model-config qwen2-0.5b --prompt-len 1024 --new-tokens 512
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import tempfile
import time
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_engine import CONFIGS, make_model_dir  # noqa: E402


async def rollout(url: str, prompts: list[list[int]], turns: int, new_tokens: int, inserted: int) -> tuple:
    from slime_lite.engine_client import AsyncEngineClient
    from slime_lite.rollout.multi_turn import TurnLimits, model_turn
    from slime_lite.rollout.turns import append_turn
    from slime_lite.types import Sample

    client = AsyncEngineClient([url], timeout=600)
    args = SimpleNamespace(engine_client=client)
    limits = TurnLimits(max_turns=turns, max_inserted_tokens=inserted, max_context_len=None, tool_timeout=30)
    params = {"max_new_tokens": new_tokens // turns, "temperature": 1.0, "ignore_eos": True}

    async def one(i: int, prompt: list[int]) -> Sample:
        s = Sample(index=i, tokens=list(prompt))
        for t in range(turns):
            await model_turn(args, s, dict(params, sampling_seed=i * 100 + t), limits)
            if t < turns - 1:
                append_turn(s, [(7 * i + k) % 50 + 4 for k in range(inserted)], source="tool")
        return s

    t0 = time.perf_counter()
    samples = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    elapsed = time.perf_counter() - t0
    await client.close()
    generated = sum(sum(s.loss_mask) for s in samples)
    later = [t["cached_tokens"] for s in samples for t in s.metadata["turns"][1:] if t["source"] == "model"]
    return generated / elapsed, (sum(later) / len(later) if later else 0.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-config", default="tiny", help=f"{' | '.join(CONFIGS)} | a JSON dict of Qwen2Config fields")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--inserted-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    from slime_lite.engine.server import EngineServer

    path = make_model_dir(args.model_config, tempfile.mkdtemp(prefix="bench_multi_turn_"))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 60, (args.prompt_len,), generator=gen).tolist() for _ in range(args.samples)]
    tokens = args.prompt_len + args.new_tokens + args.turns * args.inserted_tokens + 8
    configs = (("single-turn", False, 1), ("multi-turn", False, args.turns),
               ("multi-turn, no prefix cache", True, args.turns))
    servers = {}
    for name, disable_cache, _ in configs:
        servers[name] = EngineServer(path, device=args.device, max_running_requests=2 * args.samples,
                                     kv_cache_tokens=2 * args.samples * tokens, disable_radix_cache=disable_cache)
        servers[name].start()
    runs: dict[str, list] = {name: [] for name, _, _ in configs}
    for r in range(args.rounds + 1):  # alternately, so all see the same machine load; round 0 warms up
        for name, _, turns in configs:
            out = asyncio.run(rollout(servers[name].url, prompts, turns, args.new_tokens, args.inserted_tokens))
            if r:
                runs[name].append(out)
    for server in servers.values():
        server.stop()
    results = {name: (statistics.median(o[0] for o in outs), outs[0][1]) for name, outs in runs.items()}
    dev = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or platform.machine()
    print(f"model {args.model_config} on {args.device} ({dev}); {args.samples} samples, prompt {args.prompt_len} "
          f"tokens, {args.new_tokens} generated tokens each; multi-turn: {args.turns} turns, "
          f"{args.inserted_tokens} inserted tokens between turns")
    base = results["single-turn"][0]
    for name, (tps, cached) in results.items():
        print(f"{name:30s} {tps:9.1f} generated tok/s  {tps / base:5.2f}x single-turn   "
              f"mean cached_tokens of a later turn {cached:7.1f}")


if __name__ == "__main__":
    main()
