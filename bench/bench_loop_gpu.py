"""Issue 13's loop benchmark: the real `slime-lite train` loop next to its parts measured alone, in one run.

Workload (inputs and hooks: bench/loop_parts.py): a Qwen2.5-0.5B-shaped model (--shape), random bf16 weights, the real
151,936-token vocabulary with a synthetic tokenizer that decodes every id; 64 prompts x 8 samples per rollout,
prompts of 128 tokens; responses sampled at temperature 1 up to 1,024 tokens, stopping on an eos set sized for a
mean of about --mean-response tokens (geometric lengths: the random model's next token is near uniform; no 64-token
floor as in the issue, since the rollout's sampling params have no min_new_tokens); reward
hook ``bench.loop_parts.reward`` (share of even token ids: varied within each group, so the train step has
non-zero advantages). Training: packed micro-batches (16,384 tokens; log-probs 32,768), KL loss, as
bench/bench_train_gpu.py. Every rollout is saved (--save-debug-rollout-data) for the standalone parts (written in
the background while the trainer trains).

1. The loop as a subprocess with a timeout: ``--layout colocate`` (1 GPU, --colocate), or ``--layout disagg``
   (2 GPUs, each run under --ci-test: synchronous with NCCL push, --async, synchronous with over-sampling and
   --partial-rollout, --fully-async with --max-policy-version-lag 1 and 2). Per-phase means over rollouts >= 1 (rollout 0 is warm-up)
   from the metrics jsonl: time, tokens/s (rollout: response tokens; log-probs: actor + reference tokens; train:
   all tokens), memory (perf/memory/<group>/*: allocated and peak, after offload/release too).
2. Standalone, each a subprocess with a timeout, after the loop (the GPU free): the engine alone replaying the last
   rollout's requests (same prompt ids, sampling params and seeds; warm-up on rollout 0's); the train step alone
   (bench_train_gpu.ours: log-probs then train) on the last rollout's samples; a raw copy (colocate) or a raw NCCL
   broadcast GPU 0 -> GPU 1 (disagg) of the checkpoint's weight bytes.
3. Targets (issue 13) as ratios: colocated iteration <= 1.25x (rollout + train + log-probs alone); disagg async
   iteration <= 1.15x max(rollout, train + log-probs) alone, fully asynchronous <= 1.1x (with its lag metrics); rollout tok/s in the loop >= 0.7x the engine alone;
   offload + onload <= 0.15 of the iteration; memory left after offload/release <= 5% of peak; push >= 0.5x the
   raw broadcast. A part that fails or times out prints its log tail; its ratios print "n/a".
4. ``--layout partial`` (1 GPU, issue 36): the colocated loop twice, back to back in this process: as it is, then
   with ``--over-sampling-batch-size`` (--over-sampling, default 1.5x the prompts) and ``--partial-rollout``. Per
   run: trained response tokens per second of the loop (the saved rollouts' response tokens / iteration time),
   the engine's decode steps per rollout, rollout time, and for the partial run the share of trained tokens carried
   from an earlier rollout and the tokens aborts wasted; target: trained tokens/s >= 1.3x. No standalone parts.
   ``--partial-queue``: the partial run's engine runs no more requests at once than the plain run's; the extra
   groups wait in its queue and start as others finish (a full batch through the tail, no heavier steps).
5. ``--layout replay`` (1 GPU, issue 35): bench_train_gpu.py's Qwen3-MoE shape ``moe-2b`` (2.25B parameters, 0.51B
   active; ``--quick``: a tiny Qwen3-MoE), the colocated loop twice, back to back: as it is, then with
   ``--use-rollout-routing-replay`` (the engine returns each token's experts, the trainer replays them). Per run:
   iteration, rollout, log-prob, train and push times, and the routing metrics; the cost is the ratio of the two
   iterations (no target). Smaller default workload: 16 prompts, mean response 128, 2 rollouts.
6. Where nvidia-smi is found, each subprocess runs with it sampling every 200 ms; the report gives, per GPU, the SM
   clock, power and temperature while busy (utilization >= 50%), so the loop's GPU and the parts' can be compared.

  python3 bench/bench_loop_gpu.py --layout colocate       # 1 GPU, about 5-6 minutes (estimated)
  python3 bench/bench_loop_gpu.py --layout disagg         # 2 GPUs: sync, --async, partial, --fully-async lag 1 and 2
  .venv/bin/python bench/bench_loop_gpu.py --quick        # CPU, tiny model (vocab 128), 4 x 8 samples, < 2 min
  python3 bench/bench_loop_gpu.py --layout colocate --lora-rank 32   # the loop with LoRA (push bytes and time)
  python3 bench/bench_loop_gpu.py --layout colocate --lora-rank 32 --shape 7b --prompts 16 --num-rollout 2 \
      --max-tokens 8192 --timeout 470 --budget 520   # LoRA on a 7B shape, colocated (the standalone parts run full fine-tuning)
  .venv/bin/python bench/bench_loop_gpu.py --quick --layout disagg   # the five disaggregated loops on CPU (a check)
  python3 bench/bench_loop_gpu.py --layout partial        # 1 GPU: without and with over-sampling + partial rollout
  .venv/bin/python bench/bench_loop_gpu.py --quick --layout partial  # the same on CPU (a check)
  python3 bench/bench_loop_gpu.py --layout replay         # 1 GPU: MoE loop without and with rollout routing replay
  .venv/bin/python bench/bench_loop_gpu.py --quick --layout replay   # the same on CPU, tiny Qwen3-MoE (a check)
--budget (default 360 s colocate, 570 s disagg and partial, 420 s replay): no subprocess runs past it (each also
has its own timeout).
Output: text and JSON under $OUT (default /tmp/bench_loop_gpu), with each subprocess's log.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.join(ROOT, "bench")


DEADLINE = [float("inf")]  # --budget: no subprocess runs past it
GPU_FIELDS = ("index", "clocks.sm", "power.draw", "utilization.gpu", "temperature.gpu")
DISAGG = ["--rollout-num-gpus", "1", "--update-weight-transport", "distributed", "--ci-test"]
PER_ROLLOUT = ("perf/step_time", "perf/rollout_time", "perf/log_probs_time", "perf/actor_train_time")
GPU_BUSY = {}  # log name -> per GPU, its samples while busy (gpu_busy): is the GPU itself slower in the loop?


def gpu_busy(csv: str) -> dict:
    """Per GPU index, over nvidia-smi's samples with utilization >= 50%: mean and 10th-percentile SM clock (MHz),
    mean power (W), highest temperature (C), and how many samples."""
    per: dict = {}
    with open(csv) as f:
        for line in f:
            try:
                idx, clock, power, util, temp = (float(x) for x in line.split(","))
            except ValueError:  # a partial last line, "[N/A]"
                continue
            if util >= 50:
                per.setdefault(int(idx), []).append((clock, power, temp))
    out = {}
    for idx, rows in sorted(per.items()):
        clocks = sorted(r[0] for r in rows)
        out[idx] = {"sm_mhz": round(sum(clocks) / len(clocks)), "sm_mhz_p10": round(clocks[len(clocks) // 10]),
                    "power_w": round(sum(r[1] for r in rows) / len(rows)), "temp_max": max(r[2] for r in rows),
                    "samples": len(rows)}
    return out


def run(cmd: list[str], timeout: int, log: str) -> int:
    timeout = min(timeout, int(DEADLINE[0] - time.time()))
    if timeout < 5:
        print(f"skipped (--budget spent): {' '.join(cmd[:4])} ...", flush=True)
        return 125
    print(f"$ {' '.join(cmd)}  (timeout {timeout} s)", flush=True)
    t0 = time.time()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")):  # NVLink multicast stays off
        env.setdefault(k, v)
    csv, sampler = log + ".gpu.csv", None
    if shutil.which("nvidia-smi"):  # every 200 ms while the command runs (GPU_BUSY)
        with open(csv, "w") as f:
            sampler = subprocess.Popen(["nvidia-smi", f"--query-gpu={','.join(GPU_FIELDS)}",
                                        "--format=csv,noheader,nounits", "-lms", "200"], stdout=f,
                                       stderr=subprocess.DEVNULL)
    try:
        with open(log, "w") as f:
            rc = subprocess.run(cmd, check=False, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, cwd=ROOT,
                                env=env).returncode
    except subprocess.TimeoutExpired:
        rc = 124
    finally:
        if sampler is not None:
            sampler.terminate()
            sampler.wait(10)
    if sampler is not None:
        GPU_BUSY[os.path.basename(log).removesuffix(".log")] = gpu_busy(csv)
    print(f"  rc={rc} in {time.time() - t0:.1f} s (log {log})", flush=True)
    if rc:
        with open(log, errors="replace") as f:
            print("".join(line for line in f.readlines()[-15:]), flush=True)
    return rc


def part(name: str, args: list[str], timeout: int, out: str) -> dict:
    path = os.path.join(out, f"part_{name}.json")
    rc = run([sys.executable, os.path.join(HERE, "loop_parts.py"), name.split("_")[0], "--json", path, *args],
             timeout, os.path.join(out, f"part_{name}.log"))
    if rc or not os.path.exists(path):
        return {"rc": rc}
    with open(path) as f:
        return {"rc": rc, **json.load(f)}


def phases(path: str) -> dict:
    """Mean of every numeric perf/* key over rollouts >= 1 (rollout 0 is warm-up); under "each", the values of
    PER_ROLLOUT keys rollout by rollout (does the loop still warm up after rollout 0?)."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        rows = [json.loads(x) for x in f if x.strip()]
    rows = [r for r in rows if r.get("rollout_id", -1) >= 0 and "perf/step_time" in r]
    rows = rows[1:] or rows
    out: dict = {"each": {k: [round(r[k], 3) for r in rows if k in r] for k in PER_ROLLOUT}}
    for k in sorted({k for r in rows for k in r if k.startswith(("perf/", "rollout/partial/", "rollout/over_sampling/",
                                                                 "train/routing", "train/moe/", "rollout/async/",
                                                                 "rollout/off_policy_lag"))}):
        vals = [r[k] for r in rows if isinstance(r.get(k), (int, float))]
        if vals:
            out[k] = sum(vals) / len(vals)
    return out


def dump_stats(template: str, ids: range) -> dict:
    """Mean tokens of the saved rollouts ``ids``: all tokens, response tokens; response length spread; rewards."""
    sys.path.insert(0, ROOT)
    from slime_lite.rollout.dumps import load_rollout_dump

    tot, resp, lens, rewards = [], [], [], []
    for i in ids:
        path = template.format(rollout_id=i)
        if not os.path.exists(path):
            continue
        samples = load_rollout_dump(path).samples
        tot.append(sum(len(s.tokens) for s in samples))
        resp.append(sum(s.response_length for s in samples))
        lens += sorted(s.response_length for s in samples)
        rewards += [float(s.reward) for s in samples]
    if not tot:
        return {}
    lens.sort()
    mean_r = sum(rewards) / len(rewards)
    return {"tokens": sum(tot) / len(tot), "response_tokens": sum(resp) / len(resp), "resp_min": lens[0],
            "resp_p50": lens[len(lens) // 2], "resp_max": lens[-1], "reward_mean": mean_r,
            "reward_std": (sum((r - mean_r) ** 2 for r in rewards) / len(rewards)) ** 0.5}


def ratio(name: str, num, den, op: str, target: float) -> str:
    if not num or not den:
        return f"  {name}: n/a (target {op} {target})"
    r = num / den
    ok = r <= target if op == "<=" else r >= target
    return f"  {name}: {r:.2f} (target {op} {target}: {'met' if ok else 'NOT met'})"


def report(res: dict) -> list[str]:
    eng, tr, raw = res["engine_alone"], res["train_alone"], res["raw"]
    alone_lp, alone_train, alone_roll = tr.get("logprob_s"), tr.get("train_s"), eng.get("rollout_s")
    lines = [f"workload (saved rollouts >= 1): {json.dumps({k: round(v, 3) for k, v in res['workload'].items()})}",
             f"engine alone: {json.dumps({k: round(v, 3) for k, v in eng.items()})}",
             f"train step alone: {json.dumps({k: round(v, 3) for k, v in tr.items()})}",
             f"raw transfer of the weight bytes: {json.dumps(raw)}"]
    tok = res["workload"].get("tokens")
    for name, r in res["runs"].items():
        p = r["phases"]
        lp, step = p.get("perf/log_probs_time"), p.get("perf/step_time")
        train = p["perf/train_time"] - lp if "perf/train_time" in p and lp is not None else None
        lines.append(f"== {name} (rc {r['rc']}), mean over rollouts >= 1")
        trained = r.get("workload", {}).get("tokens")
        if trained and step:
            lines.append(f"  {'trained tokens/s':28s} {trained / step:10.0f}")
        lines += [f"  {k:40s} {v:12.3f}" for k, v in p.items() if k.startswith(("rollout/async/", "rollout/off_policy"))]
        rows = [("iteration", step, None), ("rollout", p.get("perf/rollout_time"), p.get("perf/rollout_tokens_per_s")),
                ("log-probs", lp, 2 * tok / lp if tok and lp else None),
                ("train (without log-probs)", train, tok / train if tok and train else None),
                ("  of it in the actor's call", p["perf/actor_train_time"] - lp
                 if "perf/actor_train_time" in p and lp is not None else None, None),
                ("weight push", p.get("perf/update_weights_time"), None),
                ("offload + onload", p.get("perf/offload_time"), None)]
        for label, secs, tps in rows:
            if secs is not None:
                lines.append(f"  {label:28s} {secs:8.3f} s" + (f"  {tps:10.0f} tok/s" if tps else ""))
        for k, v in p.get("each", {}).items():
            lines.append(f"  {k.removeprefix('perf/'):28s} {v} (rollout by rollout)")
        for k, v in p.items():  # where the rollout's time goes (rollout/timing.py), then memory
            if k.startswith(("perf/rollout/", "perf/offload/", "perf/update_weights/")):
                lines.append(f"  {k.removeprefix('perf/'):40s} {v:12.3f}")
        for k, v in p.items():
            if k.startswith("perf/memory/") and "rss" not in k:
                lines.append(f"  {k.removeprefix('perf/memory/'):40s} {v:12.3f}")
        lines.append("  targets (issue 13):")
        if name == "colocate":
            alone = alone_roll + alone_train + alone_lp if alone_roll and alone_train and alone_lp else None
            lines.append(ratio("iteration / (rollout + train + log-probs alone)", step, alone, "<=", 1.25))
        if name == "disagg_async" or name.startswith("disagg_fully_async"):
            alone = max(alone_roll, alone_train + alone_lp) if alone_roll and alone_train and alone_lp else None
            lines.append(ratio("iteration / max(rollout, train + log-probs) alone", step, alone, "<=",
                               1.15 if name == "disagg_async" else 1.1))
        lines.append(ratio("rollout tok/s in loop / engine alone", p.get("perf/rollout_tokens_per_s"),
                           eng.get("tok_per_s"), ">=", 0.7))
        if "perf/offload_time" in p:
            lines.append(ratio("offload + onload / iteration", p["perf/offload_time"], step, "<=", 0.15))
        for group in ("actor_offloaded", "engine_released"):
            key = f"perf/memory/{group}/cuda_allocated_of_peak"
            if key in p:
                lines.append(f"  {group} residual / peak: {p[key]:.3f} (target <= 0.05: "
                             f"{'met' if p[key] <= 0.05 else 'NOT met'})")
        push = p.get("perf/update_weights_time")
        if "raw_broadcast_s" in raw:
            lines.append(ratio("raw NCCL broadcast / push", raw["raw_broadcast_s"], push, ">=", 0.5))
        elif "raw_copy_s" in raw and push:
            lines.append(f"  raw device copy / push: {raw['raw_copy_s'] / push:.3f} (information; no target)")
    if GPU_BUSY:  # the same GPU in the loop and in the parts alone: clocks, power (no target)
        lines.append("GPU while busy (nvidia-smi every 200 ms, samples with utilization >= 50%):")
        lines += [f"  {name:16s} GPU {idx}: {json.dumps(v)}" for name, per in GPU_BUSY.items() for idx, v in per.items()]
    return lines


def report_partial(res: dict) -> list[str]:
    """--layout partial: each run's trained tokens per second of the loop, and the ratio of the two."""
    lines, tps = [], {}
    for name, r in res["runs"].items():
        p, w = r["phases"], r.get("workload", {})
        step = p.get("perf/step_time")
        tps[name] = w["response_tokens"] / step if step and w.get("response_tokens") else None
        lines.append(f"== {name} (rc {r['rc']}), mean over rollouts >= 1")
        lines.append(f"  workload: {json.dumps({k: round(v, 3) for k, v in w.items()})}")
        for label, value in (("iteration s", step), ("rollout s", p.get("perf/rollout_time")),
                             ("trained response tokens/s", tps[name]),
                             ("decode steps per rollout", p.get("perf/rollout/engine_decode_steps")),
                             ("carried token share", p.get("rollout/partial/carried_token_share")),
                             ("samples carried", p.get("rollout/partial/samples_carried")),
                             ("carried age max (versions)", p.get("rollout/partial/age_max")),
                             ("tokens wasted by aborts", p.get("rollout/over_sampling/tokens_wasted")),
                             ("groups aborted", p.get("rollout/over_sampling/aborted_groups"))):
            if value is not None:
                lines.append(f"  {label:30s} {value:12.3f}")
    lines.append("  target (issue 36):")
    lines.append(ratio("trained tokens/s, over-sampling + partial / without", tps.get("colocate_partial"),
                       tps.get("colocate"), ">=", 1.3))
    return lines


def report_replay(res: dict) -> list[str]:
    """--layout replay: each run's phase times and routing metrics, and the cost of replay (ratios, no target)."""
    lines, step = [], {}
    for name, r in res["runs"].items():
        p = r["phases"]
        step[name] = p.get("perf/step_time")
        lp = p.get("perf/log_probs_time")
        lines.append(f"== {name} (rc {r['rc']}), mean over rollouts >= 1; workload "
                     f"{json.dumps({k: round(v, 3) for k, v in r.get('workload', {}).items()})}")
        for label, key in (("iteration s", "perf/step_time"), ("rollout s", "perf/rollout_time"),
                           ("log-probs s", "perf/log_probs_time"), ("train s (with log-probs)", "perf/train_time"),
                           ("weight push s", "perf/update_weights_time"), ("offload + onload s", "perf/offload_time"),
                           ("rollout tok/s", "perf/rollout_tokens_per_s")):
            if p.get(key) is not None:
                lines.append(f"  {label:30s} {p[key]:12.3f}")
        for k, v in p.items():
            if k.startswith(("train/routing", "train/moe/")) and "/layer_" not in k:
                lines.append(f"  {k:30s} {v:12.6f}")
        if lp is None:
            lines.append("  (no metrics: see the run's log)")
    on, off = step.get("colocate_replay"), step.get("colocate")
    lines.append("  cost of rollout routing replay (no target):")
    lines.append(f"  iteration with / without: {on / off:.3f}" if on and off else "  iteration with / without: n/a")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layout", choices=["colocate", "disagg", "partial", "replay"], default="colocate")
    ap.add_argument("--quick", action="store_true", help="CPU, tiny model, few prompts")
    ap.add_argument("--num-rollout", type=int, default=3, help="rollout 0 is warm-up (default: %(default)s)")
    ap.add_argument("--prompts", type=int, default=None, help="prompts per rollout (default 64; --quick 4)")
    ap.add_argument("--mean-response", type=int, default=None, help="eos set sized for this mean (default 256)")
    ap.add_argument("--timeout", type=int, default=None, help="seconds per train run (default 270; --quick 150)")
    ap.add_argument("--part-timeout", type=int, default=None, help="seconds per standalone part (default 120)")
    ap.add_argument("--over-sampling", type=int, default=None,
                    help="--layout partial: --over-sampling-batch-size of the partial run (default 1.5x --prompts)")
    ap.add_argument("--partial-queue", action="store_true",
                    help="--layout partial: the partial run's engine runs as many requests at once as the plain "
                         "run's (the over-sampled groups wait in its queue and start as others finish), instead of "
                         "all of them at once")
    ap.add_argument("--engine-compile", action="store_true",
                    help="the engine (in the loop and alone) with --engine-enable-torch-compile")
    ap.add_argument("--lora-rank", type=int, default=None, metavar="R",
                    help="the loop with LoRA adapters of rank R on every linear (alpha 2R; adapter-only pushes); "
                         "the standalone train part stays full fine-tuning")
    ap.add_argument("--shape", default="0.5b", choices=("0.5b", "1.5b", "7b"),
                    help="the model's shape (bench_train_gpu.py's; default %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=None, metavar="N",
                    help="--max-tokens-per-gpu of the train step (log-probs: 2N; default 16384, --quick 512)")
    ap.add_argument("--budget", type=int, default=None,
                    help="seconds for the whole bench; no subprocess runs past it (default: colocate 360, replay "
                         "420, disagg and partial 570; --quick 170, disagg 600, replay 700)")
    a = ap.parse_args()
    out = os.environ.get("OUT") or "/tmp/bench_loop_gpu"
    os.makedirs(os.path.join(out, "dumps"), exist_ok=True)
    for f in os.listdir(os.path.join(out, "dumps")):  # an earlier run's rollouts would pass for this one's
        os.remove(os.path.join(out, "dumps", f))
    sys.path.insert(0, ROOT)
    sys.path.insert(0, HERE)
    from loop_parts import make_inputs
    from slime_lite.metrics import train_steps_path

    q, replay = a.quick, a.layout == "replay"
    prompts, n, plen = (a.prompts or (4 if q else 16 if replay else 64)), 8, (16 if q else 128)
    max_resp = 32 if q else 512 if replay else 1024
    mean = a.mean_response or (8 if q else 128 if replay else 256)
    if replay and a.num_rollout == ap.get_default("num_rollout"):
        a.num_rollout = 2
    max_tok, lp_tok = (512, 1024) if q else (16384, 32768)
    max_tok, lp_tok = a.max_tokens or max_tok, a.max_tokens and 2 * a.max_tokens or lp_tok
    timeout = a.timeout or (300 if q and replay else 150 if q else 190 if replay else 270)
    part_timeout = a.part_timeout or 120
    t0 = time.time()
    DEADLINE[0] = t0 + (a.budget or (700 if q and replay else 600 if q and a.layout == "disagg"
                                     else 170 if q and a.layout != "partial"
                                     else 360 if a.layout == "colocate" else 420 if replay else 570))
    over = a.over_sampling or prompts * 3 // 2
    rows = (2 * over if a.layout in ("partial", "disagg") else prompts) * a.num_rollout  # over-sampling: more
    model, data = make_inputs(out, q, mean, rows, plen, "moe-2b" if replay else a.shape)
    print(f"inputs in {time.time() - t0:.1f} s: {model}, {data}", flush=True)
    kv = (over if a.layout == "partial" else prompts) * n * (plen + max_resp + 16)
    common = [sys.executable, "-m", "slime_lite.cli", "train", "--hf-checkpoint", model, "--prompt-data", data,
              "--custom-rm-path", "bench.loop_parts.reward", "--rollout-batch-size", str(prompts),
              "--n-samples-per-prompt", str(n), "--rollout-max-response-len", str(max_resp),
              "--num-rollout", str(a.num_rollout), "--use-dynamic-batch-size", "--max-tokens-per-gpu", str(max_tok),
              "--log-probs-max-tokens-per-gpu", str(lp_tok), "--use-kl-loss", "--kl-loss-coef", "0.001",
              "--lr", "1e-6", "--engine-max-running-requests", str(kv // (plen + max_resp + 16)),
              "--engine-kv-cache-tokens", str(kv)]
    if not q:
        common += ["--bf16", "--engine-dtype", "bfloat16"]
    if a.engine_compile:
        common += ["--engine-enable-torch-compile"]
    if a.lora_rank:
        common += ["--lora-rank", str(a.lora_rank), "--lora-alpha", str(2 * a.lora_rank)]
    runs = {"colocate": ["--colocate"]} if a.layout == "colocate" else {
        "colocate": ["--colocate"], "colocate_replay": ["--colocate", "--use-rollout-routing-replay"],
    } if replay else {
        "colocate": ["--colocate"],
        "colocate_partial": ["--colocate", "--over-sampling-batch-size", str(over), "--partial-rollout"]
        + ["--engine-max-running-requests", str(prompts * n)] * a.partial_queue,
    } if a.layout == "partial" else {
        "disagg_sync": DISAGG, "disagg_async": DISAGG + ["--async"],
        "disagg_sync_partial": DISAGG + ["--over-sampling-batch-size", str(over), "--partial-rollout"],
        **{f"disagg_fully_async_lag{k}": DISAGG + ["--fully-async", "--max-policy-version-lag", str(k)]
           for k in (1, 2)}}
    res: dict = {"layout": a.layout, "quick": q, "runs": {}}
    first = None
    for name, extra in runs.items():
        metrics, dumps = os.path.join(out, f"{name}.jsonl"), os.path.join(out, "dumps", name + "_{rollout_id}.pt")
        for path in (metrics, train_steps_path(metrics)):  # --metrics-path and its steps' file append
            if os.path.exists(path):
                os.remove(path)
        rc = run(common + extra + ["--metrics-path", metrics, "--save-debug-rollout-data", dumps], timeout,
                 os.path.join(out, f"{name}.log"))
        res["runs"][name] = {"rc": rc, "phases": phases(metrics),
                             "workload": dump_stats(dumps, range(1, a.num_rollout))}
        first = first or dumps
    if a.layout in ("partial", "replay"):
        finish(res, (report_partial if a.layout == "partial" else report_replay)(res), out, t0)
        return
    last = a.num_rollout - 1
    res["workload"] = dump_stats(first, range(1, a.num_rollout))
    warm, dump = first.format(rollout_id=0), first.format(rollout_id=last)
    if os.path.exists(dump):
        res["engine_alone"] = part("engine", ["--model", model, "--warm", warm, "--dump", dump, "--max-running",
                                              str(prompts * n), "--kv-tokens", str(kv)] + ["--compile"] * a.engine_compile,
                                  part_timeout, out)
    else:
        print(f"no rollout dump {dump}: the standalone engine and train parts are skipped", flush=True)
        res["engine_alone"] = res["train_alone"] = {}
    nbytes = sum(os.path.getsize(os.path.join(model, f)) for f in os.listdir(model) if f.endswith(".safetensors"))
    gpus = "2" if a.layout == "disagg" and not q else "1"
    res["raw"] = part("bcast" if gpus == "2" else "bcast_copy", ["--bytes", str(nbytes), "--gpus", gpus],
                      part_timeout, out)
    if os.path.exists(dump):  # last: the longest part
        res["train_alone"] = part("train", ["--model", model, "--warm", warm, "--dump", dump, "--max-tokens",
                                            str(max_tok), "--log-probs-max-tokens", str(lp_tok)], part_timeout, out)
    finish(res, report(res), out, t0)


def finish(res: dict, lines: list[str], out: str, t0: float) -> None:
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(out, "bench_loop_gpu.json"), "w") as f:
        json.dump({**res, "gpu_busy": GPU_BUSY}, f, indent=1)
    with open(os.path.join(out, "bench_loop_gpu.txt"), "w") as f:
        f.write(text + "\n")
    print(f"total {time.time() - t0:.0f} s; output under {out}")


if __name__ == "__main__":
    main()
