"""Rollout-side costs on the tiny model (CPU), each against a baseline measured in the same run:

1. HTTP path overhead: a 256-sample rollout through the Ray rollout manager + HTTP engine vs the same requests
   (same prompts, seeds and sampling params) submitted to the engine's scheduler in-process.
2. Time from `slime-lite train --debug-rollout-only` start to the first dumped rollout.
3. Peak RSS of the engine and the rollout manager over several 256-sample rollouts (memory must not grow).

    .venv/bin/python bench/bench_rollout.py [--model DIR] [--rollouts 5]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time


def inprocess_rollout(model: str, prompts: list[list[int]], n: int, params: dict, seed_base: int) -> tuple[float, int]:
    from slime_lite.engine.sampling import SamplingParams
    from slime_lite.engine.request import Request
    from slime_lite.engine.scheduler import Scheduler

    sched = Scheduler(model, device="cpu", max_running_requests=64)
    sched.start()
    try:
        done = threading.Semaphore(0)
        tokens = [0]

        def on_output(out):  # called by the model thread on every update
            if out.finish_reason is not None:
                tokens[0] += len(out.output_ids)
                done.release()

        reqs = []
        for i, ids in enumerate(prompts):
            for j in range(n):
                idx = i * n + j
                sp = SamplingParams.from_dict(dict(params, sampling_seed=seed_base + idx))
                req = Request(rid=f"r{idx}", input_ids=ids, params=sp,
                              seed=sched.derive_seed(seed_base + idx, f"r{idx}"), return_logprob=True,
                              on_output=on_output)
                sched.prepare(req)
                reqs.append(req)
        t0 = time.perf_counter()
        for r in reqs:
            sched.submit(r)
        for _ in reqs:
            done.acquire()
        return time.perf_counter() - t0, tokens[0]
    finally:
        sched.stop()


def manager_rollout(model: str, data: str, prompts: int, n: int, max_len: int, rollouts: int) -> list[dict]:
    import ray

    from slime_lite.args import parse_args
    from slime_lite.placement import create_placement_group, init_ray, plan_layout
    from slime_lite.rollout.engines import start_engines
    from slime_lite.rollout.manager import RolloutManager

    args = parse_args(["--debug-rollout-only", "--hf-checkpoint", model, "--prompt-data", data, "--rm-type",
                       "addition", "--rollout-batch-size", str(prompts), "--n-samples-per-prompt", str(n),
                       "--rollout-max-response-len", str(max_len)])
    layout = plan_layout(args)
    init_ray(args, layout.num_bundles)
    try:
        pg = create_placement_group(layout)
        engines, urls = start_engines(args, pg, layout.rollout)
        manager = ray.remote(RolloutManager).remote(args, urls)
        out = []
        for rid in range(rollouts):
            t0 = time.perf_counter()
            samples, metrics = ray.get(manager.generate.remote(rid))
            wall = time.perf_counter() - t0
            out.append({"wall": wall, "tokens": sum(s.response_length for s in samples),
                        "engine": ray.get(engines[0].memory.remote()), "manager": ray.get(manager.memory.remote()),
                        "prompts": [s.tokens[: len(s.tokens) - s.response_length] for s in samples[::n]],
                        "params": samples[0].metadata["sampling_params"],
                        "parts": {k: v for k, v in metrics.items() if k.startswith("perf/rollout")}})
        return out
    finally:
        ray.shutdown()


def time_to_first_dump(model: str, data: str, out: str) -> float:
    template = os.path.join(out, "d_{rollout_id}.pt")
    cmd = [sys.executable, "-m", "slime_lite.cli", "train", "--debug-rollout-only", "--hf-checkpoint", model,
           "--prompt-data", data, "--rm-type", "addition", "--rollout-batch-size", "8", "--n-samples-per-prompt", "4",
           "--rollout-max-response-len", "8", "--num-rollout", "1", "--save-debug-rollout-data", template]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    first = template.format(rollout_id=0)
    while not os.path.exists(first):
        if proc.poll() is not None and not os.path.exists(first):
            raise RuntimeError("the rollout-only run ended without a dump")
        time.sleep(0.05)
    elapsed = time.perf_counter() - t0
    proc.wait(timeout=300)
    return elapsed


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None, help="HF model dir (default: a fresh random tiny model)")
    p.add_argument("--rollouts", type=int, default=5)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--max-len", type=int, default=8)
    a = p.parse_args()
    from slime_lite.tasks import make_data
    from slime_lite.tiny_model import make_tiny_model

    tmp = tempfile.mkdtemp()
    model = a.model or os.path.join(tmp, "model")
    if a.model is None:
        make_tiny_model(model, warm_start_steps=0)
    data, _ = make_data("addition", os.path.join(tmp, "data.jsonl"), n_train=512, n_eval=8)

    runs = manager_rollout(model, data, a.prompts, a.n, a.max_len, a.rollouts)
    first = runs[0]
    seed_base = first["params"]["sampling_seed"]
    params = {k: v for k, v in first["params"].items() if k != "sampling_seed"}
    base_wall, base_tokens = inprocess_rollout(model, first["prompts"], a.n, params, seed_base)
    steady = runs[1:] or runs
    http_wall = min(r["wall"] for r in steady)
    http_tokens = steady[0]["tokens"]
    samples = a.prompts * a.n
    print(f"| rollout of {samples} samples (tiny model, CPU) | wall s | tokens | tokens/s |")
    print("|---|---|---|---|")
    print(f"| in-process engine scheduler (baseline) | {base_wall:.3f} | {base_tokens} | {base_tokens / base_wall:.0f} |")
    print(f"| Ray rollout manager -> HTTP -> engine (best of {len(steady)}) | {http_wall:.3f} | {http_tokens} | "
          f"{http_tokens / http_wall:.0f} |")
    print("\nperf/rollout/* of the steady rollouts (rollout/timing.py):")
    for key in sorted(steady[0]["parts"]):
        print(f"  {key:45s} " + " ".join(f"{r['parts'][key]:9.3f}" for r in steady))
    print(f"\nHTTP path / in-process, per token: {(http_wall / http_tokens) / (base_wall / base_tokens):.3f}x")
    print(f"time from `slime-lite train --debug-rollout-only` to the first dump: "
          f"{time_to_first_dump(model, data, os.path.join(tmp, 'ttfd')):.1f} s")
    print("\n| rollout | engine RSS MB | engine peak RSS MB | manager RSS MB | manager peak RSS MB |")
    print("|---|---|---|---|---|")
    for i, r in enumerate(runs):
        e, m = r["engine"], r["manager"]
        print(f"| {i} | {e.get('rss_mb', 0):.0f} | {e['peak_rss_mb']:.0f} | {m.get('rss_mb', 0):.0f} | "
              f"{m['peak_rss_mb']:.0f} |")
    print(json.dumps({"http_over_inprocess": (http_wall / http_tokens) / (base_wall / base_tokens)}))


if __name__ == "__main__":
    main()
