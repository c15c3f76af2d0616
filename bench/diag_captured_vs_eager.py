"""Captured (CUDA graphs, fused kernels) vs eager decode of the tiny Qwen2-MoE and Qwen3-MoE on a GPU, sampled and
greedy: per row, the first token where the two paths differ, their log-prob agreement before it, each path against
the HF forward, and at the first difference the two tokens' HF log-probs. Run from the repo root on a GPU machine:
  PYTHONPATH=$PWD python3 bench/diag_captured_vs_eager.py   (output of 2026-12-03: bench/results/h200_captured_vs_eager_moe.txt)
"""
import sys
sys.path.insert(0, "tests/engine"); sys.path.insert(0, "tests")
import torch
from transformers import AutoModelForCausalLM
from slime_lite.tiny_model import make_tiny_model
from slime_lite.engine.scheduler import Scheduler
from test_padded_decode import run_requests
PROMPTS = [[3, 9, 27, 4, 11], [5, 6, 7], [8, 1, 2, 30, 31, 32, 33]]
for arch in ("qwen2_moe", "qwen3_moe"):
    out = f"/tmp/diag_{arch}"
    make_tiny_model(out, arch=arch, warm_start_steps=0, num_layers=2)
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.2)
    hf.save_pretrained(out)
    def hf_lp(prompt, output):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + output])).logits[0, len(prompt) - 1:-1].float()
        return torch.log_softmax(logits, -1)
    for sampling in ({}, {"temperature": 0.0}):
        made = {}
        for graphs in (True, False):
            s = Scheduler(out, device="cuda", dtype="float32", max_running_requests=4, kv_cache_tokens=640, cuda_graph=graphs)
            s.start(); made[graphs] = s
        specs = [(p, 70, 7 + i) for i, p in enumerate(PROMPTS)]
        got, want = run_requests(made[True], specs, **sampling), run_requests(made[False], specs, **sampling)
        for s in made.values(): s.stop()
        for k, (gg, w, p) in enumerate(zip(got, want, PROMPTS)):
            n = next((i for i, (a, b) in enumerate(zip(gg.output_ids, w.output_ids)) if a != b), None)
            upto = n if n is not None else min(len(gg.output_ids), len(w.output_ids))
            d = max([abs(a - b) for a, b in zip(gg.output_logprobs[:upto], w.output_logprobs[:upto])] or [0])
            lp_g = hf_lp(p, gg.output_ids); lp_w = hf_lp(p, w.output_ids)
            hf_g = (torch.tensor(gg.output_logprobs) - lp_g.gather(1, torch.tensor(gg.output_ids)[:, None])[:, 0]).abs().max().item()
            hf_w = (torch.tensor(w.output_logprobs) - lp_w.gather(1, torch.tensor(w.output_ids)[:, None])[:, 0]).abs().max().item()
            extra = ""
            if n is not None:
                row = lp_g[n]; top = row.topk(3)
                extra = f" at {n}: graph {gg.output_ids[n]} (hf lp {row[gg.output_ids[n]]:.5f}) eager {w.output_ids[n]} (hf lp {row[w.output_ids[n]]:.5f}) top3 {top.values.tolist()}"
            print(f"{arch} {sampling or 'sampled'} row {k}: first diff {n}, max lp diff before {d:.2e}, vs HF: graph {hf_g:.2e} eager {hf_w:.2e}{extra}", flush=True)
