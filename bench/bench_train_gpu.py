"""Trainer throughput (issue 12 "Measured"): the actor's log-prob and train phases vs a plain PyTorch step.

One process, no Ray: the Megatron worker code (backends/megatron/actor.py ``TrainActor``) is driven directly with a
torch.distributed world of 1, on rollouts of random tokens: 512 samples, prompt 128, responses spread evenly over
64..2048 tokens, packed (``--use-dynamic-batch-size``). Models: Qwen2.5-0.5B and Qwen2.5-1.5B shapes with the real
151,936-token vocabulary and random weights, bf16; and the Qwen3-MoE shape "moe-2b" (2.25B parameters, 0.51B
active per token: 64 experts, top 8), which has no plain-PyTorch baseline (HF's MoE block loops over experts in
Python) and is read next to the dense 0.5B shape of the same run. The baseline in the same run is a plain HF
transformers + torch bf16 step on the same tokens (SDPA attention, fused AdamW, grad clip 1.0; samples sorted by
length into padded micro-batches of at most the same token budget; loss on the response tokens).

FLOPs (stated so MFU can be checked): N = parameters of every matmul (all but the input embedding; the output
projection counts even when tied), T = real tokens, L layers, A = heads x head_dim, s_i = length of sample i.
forward = 2 N T + 2 L A sum(s_i^2) (causal QK^T and AV: 4 A s^2 halved); train = 3 x forward; the log-prob phase
is two forwards (actor + reference). MoE: N counts the active parameters (the router, the top-k experts).
MFU = FLOPs / time / peak (H200 bf16 dense: 989 TFLOP/s; CPU: not given).
Tokens/s count real tokens only (padding excluded) in both.

Usage (GPU: about 5-6 minutes on one H200, estimated; --quick: the CPU tiny model in about a minute, 15 s of CPU):
    python bench/bench_train_gpu.py [--models 0.5b,1.5b] [--samples 512] [--max-tokens 16384] [--long]
                                    [--with-padded MBS]  # also the unpacked path, padded micro-batches of MBS
    SLIME_LITE_PACKED_ATTENTION=sdpa|varlen|bucketed python bench/bench_train_gpu.py ...  # pin the packed attention
    python bench/bench_train_gpu.py --quick
    python bench/bench_train_gpu.py --models 1.5b --lora-rank 32   # + LoRA: memory, tok/s, push payload vs full
    python bench/bench_train_gpu.py --models 7b --lora-rank 32 --lora-only   # LoRA alone on a 7B shape
    python bench/bench_train_gpu.py --models 0.5b --samples 128 --profile 64  # where our worker's time goes
    python bench/bench_train_gpu.py --models 0.5b,moe-2b --samples 128   # MoE next to dense (--quick: tiny ones)
    python bench/bench_train_gpu.py --models moe-2b --samples 128 --optimizer-cpu-offload  # peak memory with/without
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile
import time
from functools import partial

import torch
from train_probes import VOCAB, attention_microbench, logprob_microbench, profiled, sync, sync_sites
from train_shapes import MOE_SHAPES, PEAK, SHAPES, flops, make_checkpoint, make_samples, matmul_params

def reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def peak_gib() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # process max RSS (CPU)


# ----------------------------------------------------------------------------------------------- ours (Megatron)
MEMORY_FLAGS: dict = {}  # --recompute: the worker's --recompute-* flags
REPEATS = 1  # --repeats: measured passes per run; each phase's time is the median over them


def runs(warm: list, samples: list) -> list[tuple[str, list]]:
    return [("warmup", warm)] + [("measured", samples)] * REPEATS


def median_of(results: list[dict]) -> dict:
    """The last measured pass's numbers with each phase's time (``*_s``) the median over the passes."""
    out = dict(results[-1])
    for k in out:
        if k.endswith("_s"):
            out[k] = statistics.median(r[k] for r in results)
    return out


PROFILE: dict = {}  # --profile: {"n": samples profiled, "rows": table rows}; --sync-debug: {"sync": samples}


def ours(ckpt: str, samples: list, warm: list, max_tokens: int, lp_tokens: int, bf16: bool,
         padded_mbs: int = 0, lora_rank: int | None = None, label: str = "", overlap_ref: bool = True,
         **flags) -> dict:
    """The worker's phases on these samples: packed (padded_mbs 0) or padded micro-batches of padded_mbs samples;
    with ``lora_rank`` LoRA adapters on every linear (alpha = 2 x rank); ``overlap_ref``: the reference weights' copy
    to the GPU started before the actor's pass, as the worker's train() does (else at the reference's pass);
    ``flags``: more train flags (by dest).
    Then what a weight push would gather (``push_payload``)."""
    from slime_lite.args import parser_defaults
    from slime_lite.backends.megatron.actor import TrainActor
    from slime_lite.backends.megatron.parallel import destroy
    from slime_lite.io import free_port

    n = len(samples)
    budgets = {"micro_batch_size": padded_mbs} if padded_mbs else {
        "use_dynamic_batch_size": True, "max_tokens_per_gpu": max_tokens, "log_probs_max_tokens_per_gpu": lp_tokens}
    args = parser_defaults(hf_checkpoint=ckpt, bf16=bf16, **budgets, use_kl_loss=True, kl_loss_coef=0.001,
                           rollout_batch_size=n // 8, n_samples_per_prompt=8, global_batch_size=n, lr=1e-6,
                           lora_rank=lora_rank, lora_alpha=2.0 * lora_rank if lora_rank else None,
                           **{**MEMORY_FLAGS, **flags})
    w = TrainActor(args, 0, 1)
    w.init("127.0.0.1", free_port())
    res: dict = {}
    measured: list[dict] = []
    try:
        for name, batch in runs(warm, samples):
            w.args.rollout_batch_size, w.args.global_batch_size = len(batch) // 8, len(batch)
            length = max(len(s.tokens) for s in batch)
            reset_peak()
            t0 = time.perf_counter()
            plan = w._plan(batch, log_probs=True)
            staged = w._stage_ref() if overlap_ref and hasattr(w, "_stage_ref") else None  # (older trees: none)
            w._forward_all(batch, plan, length, w._log_probs)
            ref_pass = partial(w._forward_all, batch, plan, length, w._log_probs)
            if staged is None:
                w._with_ref_weights(ref_pass)
            else:
                w._with_ref_weights(ref_pass, staged)
            del staged
            sync()
            lp_time, lp_peak = time.perf_counter() - t0, peak_gib()
            reset_peak()
            t0 = time.perf_counter()
            metrics = w.train(0, batch, None)[0].metrics
            sync()
            total = time.perf_counter() - t0
            res = {"logprob_s": lp_time, "logprob_peak": lp_peak,
                   "train_s": total - metrics["perf/log_probs_time"], "train_peak": peak_gib(),
                   "loss": metrics["train/loss"], "grad_norm": metrics["train/grad_norm"]}
            if "train/moe/expert_load_max_over_mean" in metrics:  # MoE: how evenly the random router spreads tokens
                res["expert_load_max_over_mean"] = metrics["train/moe/expert_load_max_over_mean"]
            res.update(push_payload(w))
            if name == "measured":
                measured.append(res)
            rounded = {k: round(v, 4) for k, v in res.items()}
            label = label or (" padded" if padded_mbs else f" LoRA rank {lora_rank}" if lora_rank else "")
            print(f"  ours{label} {name}: {json.dumps(rounded)}", flush=True)
        if PROFILE.get("sync") and torch.cuda.is_available():
            part = samples[: PROFILE["sync"]]
            w.args.rollout_batch_size, w.args.global_batch_size = len(part) // 8, len(part)
            sync_sites(lambda: w.train(0, part, None), f"train (log-probs + step), {len(part)} samples")
        if PROFILE.get("n"):
            part = samples[: PROFILE["n"]]
            w.args.rollout_batch_size, w.args.global_batch_size = len(part) // 8, len(part)
            plan, length = w._plan(part, log_probs=True), max(len(s.tokens) for s in part)
            profiled(lambda: w._forward_all(part, plan, length, w._log_probs), f"actor log-probs, {len(part)} samples",
                     PROFILE["rows"])
            profiled(lambda: w.train(0, part, None), f"train (log-probs + step), {len(part)} samples", PROFILE["rows"])
        res = median_of(measured)
    finally:
        destroy()
        del w  # before collecting: the worker's reference cycles would keep its GPU tensors into the next run's peak
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return res


def push_payload(w) -> dict:
    """Seconds to gather what a push sends from the trainer (full: every HF tensor, on the GPU as a colocated push
    keeps them; LoRA: each adapter's lora_A and float32 scaled lora_B, host copies) and its bytes."""
    sync()
    t0 = time.perf_counter()
    if w.lora is not None:
        adapters = w.hf_lora()
        nbytes = sum(a.numel() * a.element_size() + b.numel() * 4 for a, b in adapters.values())
    else:
        named = w.hf_weights(on_device=torch.cuda.is_available(), views=True)
        nbytes = sum(t.numel() * t.element_size() for t in named.values())
        del named
    sync()
    return {"push_gather_s": time.perf_counter() - t0, "push_mib": nbytes / 2**20}


def lora_report(shape: str, samples: list, full: dict | None, lo: dict, rank: int) -> None:
    tokens = sum(len(s.tokens) for s in samples)
    print(f"\n{shape}: LoRA rank {rank} (all linears) vs full fine-tuning, same samples ({tokens} tokens)")
    print("| run | train tok/s | train peak GiB | log-prob tok/s | log-prob peak GiB | push gather s | push MiB |")
    print("|---|---|---|---|---|---|---|")
    for name, r in (("full", full), (f"LoRA r={rank}", lo)):
        if r:
            print(f"| {shape} {name} | {tokens / r['train_s']:.0f} | {r['train_peak']:.1f} | "
                  f"{2 * tokens / r['logprob_s']:.0f} | {r['logprob_peak']:.1f} | {r['push_gather_s']:.3f} | "
                  f"{r['push_mib']:.1f} |", flush=True)


# ------------------------------------------------------------------------------------------- baseline (plain HF)
def baseline(ckpt: str, samples: list, warm: list, max_tokens: int, bf16: bool) -> dict:
    from transformers import AutoModelForCausalLM

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if bf16 else torch.float32
    model = AutoModelForCausalLM.from_pretrained(ckpt, attn_implementation="sdpa", torch_dtype=dtype).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=dev == "cuda")

    def batches(batch: list) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        order = sorted(batch, key=lambda s: len(s.tokens))
        groups, cur = [], []
        for s in order:  # padded micro-batches of at most max_tokens (rows x longest)
            if cur and (len(cur) + 1) * len(s.tokens) > max_tokens:
                groups.append(cur)
                cur = []
            cur.append(s)
        groups.append(cur)
        out = []
        for grp in groups:
            t = max(len(s.tokens) for s in grp)
            ids = torch.zeros(len(grp), t, dtype=torch.long)
            att = torch.zeros(len(grp), t, dtype=torch.long)
            labels = torch.full((len(grp), t), -100, dtype=torch.long)
            for r, s in enumerate(grp):
                ids[r, : len(s.tokens)] = torch.tensor(s.tokens)
                att[r, : len(s.tokens)] = 1
                p = len(s.tokens) - s.response_length
                labels[r, p:len(s.tokens)] = ids[r, p:len(s.tokens)]
            out.append((ids.to(dev), att.to(dev), labels.to(dev)))
        return out

    measured: list[dict] = []
    for name, batch in runs(warm, samples):
        mbs = batches(batch)
        reset_peak()
        t0 = time.perf_counter()
        model.eval()
        with torch.no_grad():
            for _ in range(2):  # actor + reference
                for ids, att, _ in mbs:
                    logits = model(input_ids=ids, attention_mask=att).logits
                    torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None])
                    del logits
        sync()
        lp_time, lp_peak = time.perf_counter() - t0, peak_gib()
        reset_peak()
        t0 = time.perf_counter()
        model.train()
        opt.zero_grad(set_to_none=True)
        for ids, att, labels in mbs:
            loss = model(input_ids=ids, attention_mask=att, labels=labels).loss / len(mbs)
            loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sync()
        res = {"logprob_s": lp_time, "logprob_peak": lp_peak, "train_s": time.perf_counter() - t0,
               "train_peak": peak_gib(), "grad_norm": float(norm)}
        print(f"  baseline {name}: " + json.dumps({k: round(v, 4) for k, v in res.items()}), flush=True)
        if name == "measured":
            measured.append(res)
    res = median_of(measured)
    del model, opt
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return res


SUMMARY: list[str] = []  # one row per shape (ours): the table printed last, the shapes side by side


def report(shape: str, arch, samples: list, o: dict, b: dict | None, device: str,
           plain_ops: dict | None = None) -> None:
    """The table of ours (and the baseline's, ``b``; ``plain_ops``: ours without fused_ops' kernels and the overlapped
    reference copy) on these samples;
    MoE MFU counts active-parameter FLOPs."""
    tokens = sum(len(s.tokens) for s in samples)
    peak = PEAK.get(device)

    def row(name: str, r: dict) -> str:
        lp_fl, tr_fl = 2 * flops(arch, samples, 1), flops(arch, samples, 3)
        mfu = (lambda f, s: f"{100 * f / s / peak:5.1f}%") if peak else (lambda f, s: "  -  ")
        return (f"| {shape} {name:9s} | {2 * tokens / r['logprob_s']:10.0f} | {mfu(lp_fl, r['logprob_s'])} | "
                f"{r['logprob_peak']:7.1f} | {tokens / r['train_s']:10.0f} | {mfu(tr_fl, r['train_s'])} | "
                f"{r['train_peak']:7.1f} |")

    head = "| run | log-prob tok/s | MFU | peak GiB | train tok/s | MFU | peak GiB |\n|---|---|---|---|---|---|---|"
    print(f"\n{shape}: {len(samples)} samples, {tokens} tokens; log-prob tok/s counts actor + reference tokens")
    print(head)
    print(row("ours", o))
    SUMMARY[:] = SUMMARY or [head]
    SUMMARY.append(row("ours", o))
    if plain_ops is not None:
        print(row("no-fused", plain_ops))
        SUMMARY.append(row("no-fused", plain_ops))
        print(f"fused_ops' SwiGLU/RoPE kernels and the overlapped reference copy: train "
              f"{plain_ops['train_s'] / o['train_s']:.2f}x, log-prob {plain_ops['logprob_s'] / o['logprob_s']:.2f}x "
              "the same worker without them", flush=True)
    if b is None:
        print(f"(no baseline for an MoE shape) ours log-prob/train tok/s {2 * o['train_s'] / o['logprob_s']:.2f}x",
              flush=True)
        return
    print(row("baseline", b))
    print(f"ratios: train {b['train_s'] / o['train_s']:.2f}x baseline, log-prob {b['logprob_s'] / o['logprob_s']:.2f}x "
          f"baseline; ours log-prob/train tok/s {2 * o['train_s'] / o['logprob_s']:.2f}x (target >= 2)", flush=True)


def params(arch) -> str:
    """"494M" or, MoE, "2095M total, 509M active": matmul parameters (``matmul_params``)."""
    total, active = matmul_params(arch, active=False) / 1e6, matmul_params(arch) / 1e6
    return f"{total:.0f}M" if arch.moe is None else f"{total:.0f}M total, {active:.0f}M active"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="CPU tiny model, small rollout (a smoke test of this script)")
    p.add_argument("--models", default="0.5b,1.5b",
                   help=f"shapes, comma-separated: {', '.join([*SHAPES, *MOE_SHAPES])} (with --quick, an MoE shape "
                        "adds the tiny Qwen3-MoE)")
    p.add_argument("--samples", type=int, default=512)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--min-response", type=int, default=64)
    p.add_argument("--max-response", type=int, default=2048)
    p.add_argument("--max-tokens", type=int, default=16384, help="--max-tokens-per-gpu of the train pass")
    p.add_argument("--log-probs-max-tokens", type=int, default=32768)
    p.add_argument("--long", action="store_true", help="also: 0.5B on 16,384-token and 1.5B on 8,192-token samples")
    p.add_argument("--with-padded", type=int, default=0, metavar="MBS",
                   help="also run the worker without packing, padded micro-batches of MBS samples (the old path)")
    p.add_argument("--recompute", choices=("full", "selective"), default=None,
                   help="activation recompute in our worker: full (uniform, 1 layer per chunk) or selective")
    p.add_argument("--compare-fused-ops", action="store_true",
                   help="also our worker without fused_ops' SwiGLU and RoPE kernels (Megatron's ops) and with the "
                        "reference weights copied to the GPU at the reference's pass, not during the actor's; same "
                        "process")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="only our worker (no baseline): after the measured run, profile the log-prob and train "
                        "phases on the first N samples and print the top operators by device and by host time")
    p.add_argument("--sync-debug", type=int, default=0, metavar="N",
                   help="only our worker (no baseline): after the measured run, its train (log-probs + step) on "
                        "the first N samples in CUDA's sync debug mode: where the host waited for the device, and "
                        "how often (CUDA only)")
    p.add_argument("--repeats", type=int, default=1, metavar="R",
                   help="measured passes per run (after one warm-up); each phase's time is the median over them")
    p.add_argument("--profile-rows", type=int, default=25)
    p.add_argument("--lora-rank", type=int, default=None, metavar="R",
                   help="also our worker with LoRA adapters of rank R on every linear (alpha 2R): train tok/s, "
                        "peak memory and the push's payload next to full fine-tuning")
    p.add_argument("--lora-only", action="store_true",
                   help="with --lora-rank: only the LoRA run (no full fine-tuning, no baseline; for shapes whose "
                        "full fine-tuning does not fit)")
    p.add_argument("--optimizer-cpu-offload", action="store_true",
                   help="also our worker with --optimizer-cpu-offload --overlap-cpu-optimizer-d2h-h2d "
                        "--use-precision-aware-optimizer (Megatron's hybrid CPU optimizer; CUDA only): train "
                        "peak memory and tok/s next to the optimizer on the GPU")
    a = p.parse_args()
    global REPEATS
    REPEATS = a.repeats
    if a.profile:
        PROFILE.update(n=a.profile, rows=a.profile_rows)
    if a.sync_debug:
        PROFILE.update(sync=a.sync_debug)
    if a.recompute == "full":
        MEMORY_FLAGS.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    elif a.recompute == "selective":
        MEMORY_FLAGS.update(recompute_granularity="selective")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"device {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}, torch {torch.__version__}, "
          f"packed attention backend {os.environ.get('SLIME_LITE_PACKED_ATTENTION', 'auto')}", flush=True)
    from slime_lite.backends.megatron.model import hf_arch

    with tempfile.TemporaryDirectory() as tmp:
        if a.quick:
            from slime_lite.tiny_model import make_tiny_model

            plan = []
            for name, arch in (("tiny", "qwen2"), ("tiny-moe", "qwen3_moe")):
                if arch != "qwen2" and not any(m in MOE_SHAPES for m in a.models.split(",")):
                    continue
                ckpt = os.path.join(tmp, name)
                make_tiny_model(ckpt, warm_start_steps=0, arch=arch)
                plan.append((name, ckpt, make_samples(32, 8, 4, 48, 60, 8), make_samples(8, 8, 4, 16, 60, 8, seed=1),
                             256, 512))
            bf16 = False
        else:
            plan = []
            for shape in a.models.split(","):
                ckpt = make_checkpoint(shape, os.path.join(tmp, shape))
                samples = make_samples(a.samples, a.prompt, a.min_response, a.max_response, VOCAB, 8)
                warm = make_samples(16, a.prompt, a.min_response, a.max_response, VOCAB, 8, seed=1)
                plan.append((shape, ckpt, samples, warm, a.max_tokens, a.log_probs_max_tokens))
            bf16 = True
        for shape, ckpt, samples, warm, mt, lpt in plan:
            from transformers import AutoConfig

            arch = hf_arch(AutoConfig.from_pretrained(ckpt))
            print(f"\n{shape}: {params(arch)} matmul parameters", flush=True)
            lens = [len(s.tokens) for s in samples[:64]]
            ms = attention_microbench(lens, arch.num_heads, arch.num_kv_heads, arch.head_dim,
                                      torch.bfloat16 if bf16 else torch.float32)
            print(f"\n{shape}: packed attention fwd+bwd of one layer over {len(lens)} samples (ms): {ms}", flush=True)
            if shape == plan[0][0]:
                n = 512 if a.quick else 8192
                print(f"log-probs + entropy fwd+bwd, {n} tokens x {VOCAB} vocabulary (ms): {logprob_microbench(n)}",
                      flush=True)
            if a.lora_rank and a.lora_only:
                lora_report(shape, samples, None, ours(ckpt, samples, warm, mt, lpt, bf16, lora_rank=a.lora_rank),
                            a.lora_rank)
                continue
            o = ours(ckpt, samples, warm, mt, lpt, bf16)
            if PROFILE:
                continue
            if a.lora_rank:
                lora_report(shape, samples, o, ours(ckpt, samples, warm, mt, lpt, bf16, lora_rank=a.lora_rank),
                            a.lora_rank)
            plain_ops = None
            if a.compare_fused_ops:  # the same worker with Megatron's SwiGLU and RoPE ops
                from slime_lite.backends.megatron import fused_ops

                fused_ops.ENABLED = False
                plain_ops = ours(ckpt, samples, warm, mt, lpt, bf16, label=" without fused ops", overlap_ref=False)
                fused_ops.ENABLED = True
            b = None if arch.moe else baseline(ckpt, samples, warm, mt, bf16)  # HF's MoE: a per-expert loop
            report(shape, arch, samples, o, b, device, plain_ops)
            if a.optimizer_cpu_offload and device == "cpu":
                print("--optimizer-cpu-offload: skipped on CPU (Megatron's hybrid optimizer needs CUDA)", flush=True)
            elif a.optimizer_cpu_offload:
                off = ours(ckpt, samples, warm, mt, lpt, bf16, label=" optimizer-cpu-offload",
                           optimizer_cpu_offload=True, overlap_cpu_optimizer_d2h_h2d=True,
                           use_precision_aware_optimizer=True)
                tokens = sum(len(s.tokens) for s in samples)
                print(f"{shape} --optimizer-cpu-offload: train peak {off['train_peak']:.1f} GiB vs "
                      f"{o['train_peak']:.1f} GiB with the optimizer on the GPU "
                      f"({off['train_peak'] / o['train_peak']:.2f}x); "
                      f"train {tokens / off['train_s']:.0f} vs {tokens / o['train_s']:.0f} tok/s; grad-norm "
                      f"{off['grad_norm']:.6g} vs {o['grad_norm']:.6g}", flush=True)
            if a.with_padded:
                pd = ours(ckpt, samples, warm, mt, lpt, bf16, padded_mbs=a.with_padded)
                print(f"{shape} padded micro-batches of {a.with_padded}: train {pd['train_s'] / o['train_s']:.2f}x "
                      f"and log-prob {pd['logprob_s'] / o['logprob_s']:.2f}x the packed time; peak train "
                      f"{pd['train_peak']:.1f} GiB, log-prob {pd['logprob_peak']:.1f} GiB", flush=True)
            if a.long and not a.quick:
                n_tok = {"0.5b": 16384, "1.5b": 8192}[shape]
                long = make_samples(8, a.prompt, n_tok - a.prompt, n_tok - a.prompt, VOCAB, 8, seed=2)
                lo = ours(ckpt, long, long[:8], n_tok, n_tok, bf16)
                print(f"{shape} long samples ({n_tok} tokens x 8): train {8 * n_tok / lo['train_s']:.0f} tok/s, "
                      f"peak {lo['train_peak']:.1f} GiB; log-prob {16 * n_tok / lo['logprob_s']:.0f} tok/s, "
                      f"peak {lo['logprob_peak']:.1f} GiB", flush=True)
    if len(SUMMARY) > 2:
        print("\nshapes side by side (MoE MFU on active-parameter FLOPs):\n" + "\n".join(SUMMARY), flush=True)


if __name__ == "__main__":
    main()
