"""Issue 13's loop benchmark (first cut): the real `slime-lite train` loop as a subprocess, per-phase times and
memory from its metrics jsonl, plus a raw device copy / NCCL broadcast of the same weight bytes, and the issue's
target ratios where the parts are measured. Each subprocess has a timeout; a failed part prints and the rest goes on.

  python3 bench/bench_loop_gpu.py --layout colocate       # 1 GPU
  python3 bench/bench_loop_gpu.py --layout disagg         # 2 GPUs: sync, then --async
  .venv/bin/python bench/bench_loop_gpu.py --quick        # CPU, tiny model, < 2 min

Not yet: the 151,936-vocab synthetic tokenizer, 64-1,024-token varied responses, and the standalone engine /
train-step parts (targets needing them print "n/a").
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(cmd: list[str], timeout: int, log: str) -> int:
    print("$ " + " ".join(cmd), flush=True)
    t0 = time.time()
    try:
        with open(log, "w") as f:
            rc = subprocess.run(cmd, check=False, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, cwd=ROOT).returncode
    except subprocess.TimeoutExpired:
        rc = 124
    print(f"  rc={rc} in {time.time() - t0:.1f} s (log {log})", flush=True)
    if rc:
        with open(log) as f:
            print("".join(f.readlines()[-15:]))
    return rc


def phases(path: str) -> dict:
    """Mean per-iteration phase times over rollouts >= 1 (rollout 0 is warm-up), plus memory keys."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        rows = [json.loads(x) for x in f if x.strip()]
    rows = [r for r in rows if r.get("rollout_id", -1) >= 0 and "perf/step_time" in r]
    rows = rows[1:] or rows
    if not rows:
        return {}
    out = {}
    for k in sorted({k for r in rows for k in r if k.startswith("perf/")}):
        vals = [r[k] for r in rows if isinstance(r.get(k), (int, float))]
        if vals:
            out[k] = sum(vals) / len(vals)
    return out


def raw_copy_s(nbytes: int, device: str) -> float:
    import torch
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(2):
        dst.copy_(src)
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    dst.copy_(src)
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def ratio(name: str, num, den, target: str) -> str:
    if not num or not den:
        return f"{name}: n/a ({target})"
    return f"{name}: {num / den:.2f} ({target})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layout", choices=["colocate", "disagg"], default="colocate")
    ap.add_argument("--quick", action="store_true", help="CPU, tiny model, few prompts")
    ap.add_argument("--num-rollout", type=int, default=3)
    ap.add_argument("--timeout", type=int, default=200, help="seconds per train subprocess")
    a = ap.parse_args()
    out = os.environ.get("OUT") or "/tmp/bench_loop_gpu"
    os.makedirs(out, exist_ok=True)
    py = sys.executable
    sys.path.insert(0, ROOT)
    from slime_lite.tasks import make_data
    from slime_lite.tiny_model import make_tiny_model
    model, data = os.path.join(out, "model"), os.path.join(out, "addition.jsonl")
    if a.quick:
        make_tiny_model(model)
    else:
        make_tiny_model(model, hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2,
                        intermediate_size=4864, warm_start_steps=0, tie_word_embeddings=True)
    make_data("addition", data, n_train=2048, n_eval=64)
    batch, n, resp = (4, 4, 16) if a.quick else (64, 8, 64)
    common = [py, "-m", "slime_lite.cli", "train", "--hf-checkpoint", model, "--prompt-data", data,
              "--rm-type", "addition", "--rollout-batch-size", str(batch), "--n-samples-per-prompt", str(n),
              "--rollout-max-response-len", str(resp), "--num-rollout", str(a.num_rollout),
              "--micro-batch-size", str(batch * n), "--lr", "1e-6"]
    if not a.quick:
        common += ["--bf16", "--engine-dtype", "bfloat16"]
    runs = {"colocate": ["--colocate"]} if a.layout == "colocate" or a.quick else {
        "disagg_sync": ["--rollout-num-gpus", "1", "--update-weight-transport", "distributed"],
        "disagg_async": ["--rollout-num-gpus", "1", "--update-weight-transport", "distributed", "--async"]}
    results: dict = {"layout": a.layout, "quick": a.quick, "runs": {}}
    for name, extra in runs.items():
        metrics = os.path.join(out, f"{name}.jsonl")
        rc = run(common + extra + ["--metrics-path", metrics], a.timeout, os.path.join(out, f"{name}.log"))
        results["runs"][name] = {"rc": rc, "phases": phases(metrics)}
    try:
        import torch
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        nbytes = sum(os.path.getsize(os.path.join(model, f)) for f in os.listdir(model) if f.endswith(".safetensors"))
        results["raw_copy_s"] = raw_copy_s(nbytes, dev)
        results["weight_bytes"] = nbytes
    except Exception as e:  # noqa: BLE001 - partial results over dying
        print(f"raw copy failed: {e!r}")
    lines = []
    for name, r in results["runs"].items():
        lines.append(f"== {name} (rc {r['rc']}), mean over rollouts >= 1")
        for k, v in r["phases"].items():
            lines.append(f"  {k:40s} {v:10.3f}")
        p = r["phases"]
        if "perf/offload_time" in p:
            lines.append("  " + ratio("offload+onload / iteration", p.get("perf/offload_time"),
                                      p.get("perf/step_time"), "target <= 0.15"))
        if "perf/update_weights_time" in p and results.get("raw_copy_s"):
            lines.append("  " + ratio("raw copy / push", results["raw_copy_s"], p["perf/update_weights_time"],
                                      "item 3 target >= 0.5 vs raw NCCL broadcast"))
    lines.append(f"weight bytes {results.get('weight_bytes')}, raw device copy {results.get('raw_copy_s')} s")
    lines.append("engine-alone and standalone train parts: not measured yet (iteration/rollout targets n/a)")
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(out, "bench_loop_gpu.json"), "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(out, "bench_loop_gpu.txt"), "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
