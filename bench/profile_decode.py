"""Where a decode step of the embedded engine spends its time on a GPU: graph replay, sampling, host bookkeeping.

    python bench/profile_decode.py --model-config qwen2-0.5b --batch-sizes 64,256

For each batch size: a full in-process run (every slot busy, equal lengths) gives ms per step; then the pieces are
timed alone, each with a device synchronize: ``run`` (host input prep, replay of forward and sampler, the copy of the
sampled tokens to the host), ``replay`` (the graph alone). What is left of a step is the scheduler's Python.
``prefill_ms``: one prefill of all ``B`` prompts (eager; it runs when requests join). ``weight_read_ms``: the floor
of a step, the model's parameter bytes (tied weights once) over the device's copy bandwidth measured in the same run
(``copy_gb_s``: a device-to-device copy of that many bytes, read plus write, per second).

``--compare-fused``: also timed with the eager layer pieces instead of ``fused_layer``'s kernels, ``*_unfused`` keys.
``--compare-edges``: also timed with the step's first and last small ops as torch's kernels (``cuda_graph.FUSED_EDGES``
off: the token/position/slot conversions, the embedding gather, the sampler's casts and output copies),
``*_plainedges`` keys. ``--ahead "none/o/qkv+o+gate_up+down"``: also timed with these products asking the next
product's weights into L2 (``fused_layer.AHEAD``; none: no prefetch), ``*_aheadX`` keys.
``--compare-pdl``: also timed without programmatic dependent launch (``triton_build.PDL`` off: cuBLAS's products,
the kernels launched plainly), ``*_nopdl`` keys. ``--norm-rows 0,32``: also timed with these ``gemv.NORM_MAX_ROWS``
(0: the norms as kernels of their own, not inside the products' kernels), ``*_normrowsN`` keys.
``--attention-bytes 8192,16384``: also timed with these ``decode_attention.BLOCK_BYTES`` (positions per split),
``*_attnN`` keys. ``--compare-rope``: also timed with the rotary as a kernel of its own
(``decode_attention.ROPE_MAX_ROWS`` 0), ``*_ropekernel`` keys. ``--wide-rows 16``: also timed with
``gemv.WIDE_MAX_ROWS`` 16 (gate/up and down by cuBLAS past 16 rows, by ``gemv`` up to 16), ``*_wideN`` keys, and so
with the norms inside the products up to as many rows (``NORM_MAX_ROWS`` too), ``*_wideN_norm`` keys.
``--gemv-configs``: also timed with fixed tile configurations, e.g. ``32x128x8x1x0x1/blas/blas`` (the tiles and
cuBLAS products of the default before 2026-12-06 at 17-32 rows).
``--set gemv.HEAD_MAX_ROWS=32,decode_attention.NUM_WARPS=4``: also timed with these constants of ``slime_lite.engine``'s
modules set (one variant per ``--set``, given again for more), ``*_set<its text>`` keys.
``--spread``: the timed step's rows sit at positions spread evenly over 1..prompt+new tokens (as in an RL rollout,
where a few long answers set the length bucket) instead of all at the middle; ``--compare-attention``: the step is
also timed with the own-length attention kernels switched off (masked SDPA over the bucket), ``*_sdpa`` keys.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository: slime_lite
from bench_engine import make_model_dir, run_engine_inprocess  # noqa: E402


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timeit(fn, n: int = 50) -> float:
    with torch.inference_mode():
        fn()
        sync()
        start = time.perf_counter()
        for _ in range(n):
            fn()
        sync()
    return (time.perf_counter() - start) / n * 1000


def weight_read(model) -> dict:
    """Parameter bytes (each storage once) and the time to read them at the measured device copy bandwidth."""
    seen, nbytes = set(), 0
    for p in model.parameters():  # tied weights share a pointer; fused q/k/v are disjoint views
        if (p.data_ptr(), p.numel()) not in seen:
            seen.add((p.data_ptr(), p.numel()))
            nbytes += p.numel() * p.element_size()
    dev = next(model.parameters()).device
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    ms = timeit(lambda: dst.copy_(src), n=20)
    del src, dst
    gb_s = 2 * nbytes / (ms / 1000) / 1e9  # a copy reads and writes every byte
    return {"weights_gb": nbytes / 1e9, "copy_gb_s": gb_s, "weight_read_ms": nbytes / (gb_s * 1e9) * 1000}


def print_kernels(s, step, top: int) -> None:
    """torch.profiler over 5 eager padded steps: device time per op, costliest first."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    s.decoder.capture = False
    with torch.inference_mode():
        step()
        sync()
        with profile(activities=acts) as prof:
            for _ in range(5):
                step()
            sync()
    s.decoder.capture = True
    key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=top, max_name_column_width=60), flush=True)
    if torch.cuda.is_available():  # device kernels (and copies) per step
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        print(json.dumps({"kernels_per_step": len(kernels) / 5}), flush=True)


def _fixed_config(spec: str):
    """``--gemv-configs``' BNxBKxW[xKSTEPS[xSWAP[xSTAGES]]] (every product) or A/B/C (q/k/v and o, gate/up, down)
    as a ``gemv.config`` (SWAP 1: the tile products as ``w @ x.T``; STAGES past 1: the K loop pipelined), and the
    kinds given as ``blas`` (cuBLAS's product, as past 16 rows before 2026-12-06)."""
    parts = spec.split("/")
    kinds = [None if part == "blas" else tuple(int(v) for v in part.split("x")) for part in parts]
    kinds = [c if c is None else c + (1,) * (4 - len(c)) for c in kinds]
    from slime_lite.engine import gemv

    by_kind = dict(zip(("narrow", "gate_up", "down"), kinds * 3 if len(kinds) == 1 else kinds))
    return ((lambda rows, out_n, k, swiglu: gemv._fit(by_kind[gemv.kind(k, swiglu)], k)),
            {n for n, c in by_kind.items() if c is None})


def _usable_but(usable, blas: set):
    """``gemv.usable`` that leaves the products of the ``blas`` kinds to cuBLAS, each product's kind as
    ``gemv.kind`` tells it (a gate/up weight: twice as many rows as columns or more)."""
    from slime_lite.engine import gemv

    def pick(x, w, b=None, silu_in=False):
        return gemv.kind(w.shape[1], w.shape[0] >= 2 * w.shape[1]) not in blas and usable(x, w, b, silu_in)

    return pick


def _assignments(ap, text: str) -> list:
    """``--set``'s ``module.NAME=value,...`` as (module of slime_lite.engine, name, value) triples, checked: the
    constant must exist (a typo would time the default under another name)."""
    import ast
    import importlib
    import re

    out = []
    for part in re.split(r",(?=\w+\.\w+=)", text):  # a comma before the next MODULE.NAME=: values may hold commas
        target, _, value = part.partition("=")
        module, _, name = target.rpartition(".")
        try:
            m = importlib.import_module(f"slime_lite.engine.{module}")
            getattr(m, name)
            out.append((m, name, ast.literal_eval(value)))
        except (ImportError, AttributeError, ValueError, SyntaxError) as e:
            ap.error(f"--set {text}: {part!r} is not MODULE.NAME=VALUE for an existing constant of a "
                     f"slime_lite.engine module ({e})")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-config", default="qwen2-0.5b")
    ap.add_argument("--batch-sizes", default="64,256")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--enable-torch-compile", action="store_true")
    ap.add_argument("--device", default="cuda", help="cpu runs the padded steps eagerly (a check of this script)")
    ap.add_argument("--spread", action="store_true", help="timed step: rows at positions spread over the length")
    ap.add_argument("--compare-attention", action="store_true",
                    help="also time the step with masked SDPA instead of the own-length attention kernels")
    ap.add_argument("--compare-fused", action="store_true",
                    help="also time the step with the eager layer pieces instead of the fused kernels, *_unfused keys")
    ap.add_argument("--compare-rope", action="store_true",
                    help="also time the step with the rotary as a kernel of its own, not inside the attention "
                         "kernel, *_ropekernel keys")
    ap.add_argument("--compare-edges", action="store_true",
                    help="also time the step with its input conversions, embedding gather and sampler copies as "
                         "torch's kernels (cuda_graph.FUSED_EDGES off), *_plainedges keys")
    ap.add_argument("--ahead", default="",
                    help="also time the step with these products prefetching the next one's weights, sets separated "
                         "by / of names joined by + (none: no set; name>target: asking o, gate_up, down or next, "
                         "the next layer's q/k/v, instead), *_aheadX keys")
    ap.add_argument("--head-configs", default="",
                    help="also time the step with the output projection by these tiles of engine/gemv.py "
                         "(BNxBKxWARPSxKSTEPSxSWAPxSTAGES, comma-separated; blas: cuBLAS's), *_headX keys")
    ap.add_argument("--compare-pdl", action="store_true",
                    help="also time the step without programmatic dependent launch (cuBLAS products), *_nopdl keys")
    ap.add_argument("--norm-rows", default="",
                    help="also time the step with these gemv.NORM_MAX_ROWS (0: the norms as kernels of their own), "
                         "comma-separated, *_normrowsN keys")
    ap.add_argument("--attention-bytes", default="",
                    help="also time the step with these decode_attention.BLOCK_BYTES (comma-separated), *_attnN keys")
    ap.add_argument("--gemv-configs", default="",
                    help="also time the step with these tile configs of engine/gemv.py: comma-separated, each "
                         "BNxBKxWARPS[xKSTEPS[xSWAP[xSTAGES]]] for every product or three of them joined by / (q/k/v "
                         "and o, gate/up, down; blas: cuBLAS's), at every row count (the wide products by gemv past "
                         "16 rows too)")
    ap.add_argument("--wide-rows", default="",
                    help="also time the step with these gemv.WIDE_MAX_ROWS (16: gate/up and down by cuBLAS past 16 "
                         "rows), comma-separated, *_wideN keys; *_wideN_norm: NORM_MAX_ROWS N too")
    ap.add_argument("--silu-in-rows", default="",
                    help="also time the step with these gemv.SILU_IN_MAX_ROWS (32: past 16 rows the down product by "
                         "gemv with the SiLU inside, after cuBLAS's gate/up: gemv.WIDE_MAX_ROWS 16 in these "
                         "variants; gemv.SILU_IN_CONFIG's tiles, which --gemv-configs does not change), "
                         "comma-separated, *_siluinN keys")
    ap.add_argument("--compare-blaslt", action="store_true",
                    help="also time the step with torch's preferred BLAS library cuBLASLt for the cuBLAS products "
                         "(the output projection; gate/up and down too with --wide-rows 16), *_blaslt keys")
    ap.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=VALUE[,...]",
                    help="also time the step with these constants of slime_lite.engine's modules set (a Python "
                         "literal each), one variant per --set, *_set<text> keys")
    ap.add_argument("--kernels", type=int, default=0, metavar="N",
                    help="also profile eager padded steps (same kernels as the graph) and print the N costliest ops")
    args = ap.parse_args()
    entries = [n.partition(">") for a in args.ahead.split("/") for n in a.split("+") if n]
    bad = [a + s + t for a, s, t in entries if a not in ("none", "qkv", "o", "gate_up", "down")
           or t not in ("", "o", "gate_up", "down", "next") or (a == "none" and s)]
    heads = [c for c in args.head_configs.split(",") if c and c != "blas"]
    if any(len(c.split("x")) != 6 or not all(v.isdigit() for v in c.split("x")) for c in heads):
        ap.error(f"--head-configs: {heads} must each be blas or BNxBKxWARPSxKSTEPSxSWAPxSTAGES (six integers; KSTEPS "
                 "covering all of K)")
    if bad:
        ap.error(f"--ahead: unknown entries {bad} (qkv, o, gate_up, down or none, each optionally >o, >gate_up, "
                 ">down or >next)")

    sets = {f"_set{text}": _assignments(ap, text) for text in args.set}
    from slime_lite import triton_build
    from slime_lite.engine import decode_attention, fused_layer, gemv
    from slime_lite.engine import cuda_graph
    from slime_lite.engine.cuda_graph import StepInputs
    from slime_lite.engine.scheduler import Scheduler

    auto_config, norm_rows, block_bytes, wide_rows = (gemv.config, gemv.NORM_MAX_ROWS, decode_attention.BLOCK_BYTES,
                                                      gemv.WIDE_MAX_ROWS)
    auto_usable = gemv.usable
    silu_rows = gemv.SILU_IN_MAX_ROWS
    rope_rows = decode_attention.ROPE_MAX_ROWS
    ahead = fused_layer.AHEAD
    head_rows, head_cfg = gemv.HEAD_MAX_ROWS, gemv.HEAD_CONFIG
    tmp = tempfile.TemporaryDirectory()
    model_dir = make_model_dir(args.model_config, tmp.name)
    for b in [int(x) for x in args.batch_sizes.split(",")]:
        s = Scheduler(model_dir, device=args.device, dtype="bfloat16" if args.device == "cuda" else "float32",
                      cuda_graph=True, enable_torch_compile=args.enable_torch_compile, max_running_requests=b,
                      kv_cache_tokens=b * (args.prompt_len + args.max_new_tokens))
        s.start()
        vocab = s.hf.config.vocab_size
        prompts = torch.randint(1, vocab, (b, args.prompt_len)).tolist()
        run_engine_inprocess(s, prompts, args.max_new_tokens, None)  # warm-up: captures
        start = time.perf_counter()
        n = run_engine_inprocess(s, prompts, args.max_new_tokens, None)
        step = (time.perf_counter() - start) / args.max_new_tokens * 1000
        slots, toks, pos = list(range(b)), [1] * b, [args.prompt_len + args.max_new_tokens // 2] * b
        if args.spread:
            pos = [(i + 1) * (args.prompt_len + args.max_new_tokens - 1) // b for i in range(b)]
        row = {"batch": b, "tok_s": round(n / (step / 1000 * args.max_new_tokens)), "step_ms": step}
        one = StepInputs(token=toks, position=pos, temperature=[1.0] * b, uniform=[0.5] * b, greedy=[False] * b)
        variants = [""] + ["_sdpa"] * args.compare_attention + ["_unfused"] * args.compare_fused
        variants += ["_nopdl"] * args.compare_pdl + [f"_gemv{c}" for c in args.gemv_configs.split(",") if c]
        variants += ["_ropekernel"] * args.compare_rope
        variants += [f"_normrows{n}" for n in args.norm_rows.split(",") if n]
        variants += [f"_attn{n}" for n in args.attention_bytes.split(",") if n]
        variants += [f"_wide{n}{norm}" for n in args.wide_rows.split(",") if n for norm in ("", "_norm")]
        variants += [f"_siluin{n}" for n in args.silu_in_rows.split(",") if n]
        variants += ["_blaslt"] * args.compare_blaslt
        variants += ["_plainedges"] * args.compare_edges
        variants += [f"_ahead{a}" for a in args.ahead.split("/") if a]
        variants += [f"_head{c}" for c in args.head_configs.split(",") if c]
        variants += list(sets)
        blas = torch.backends.cuda.preferred_blas_library()
        for suffix in variants:
            if args.device == "cuda":
                torch.backends.cuda.preferred_blas_library("cublaslt" if suffix == "_blaslt" else blas)
            decode_attention.ENABLED, fused_layer.ENABLED = suffix != "_sdpa", suffix != "_unfused"
            triton_build.PDL = suffix != "_nopdl"
            cuda_graph.FUSED_EDGES = suffix != "_plainedges"
            fused_layer.AHEAD = (tuple(a for a in suffix[6:].split("+") if a != "none")
                                 if suffix.startswith("_ahead") else ahead)
            decode_attention.ROPE_MAX_ROWS = 0 if suffix == "_ropekernel" else rope_rows
            gemv.config, gemv.usable = auto_config, auto_usable
            gemv.HEAD_MAX_ROWS = 0 if suffix == "_headblas" else head_rows
            gemv.HEAD_CONFIG = (tuple(int(v) for v in suffix[5:].split("x"))
                                if suffix.startswith("_head") and suffix != "_headblas" else head_cfg)
            if suffix.startswith("_gemv"):
                gemv.config, blas_kinds = _fixed_config(suffix[5:])
                gemv.usable = _usable_but(auto_usable, blas_kinds)
            gemv.NORM_MAX_ROWS = int(suffix[9:]) if suffix.startswith("_normrows") else norm_rows
            gemv.WIDE_MAX_ROWS = int(suffix[5:].removesuffix("_norm")) if suffix.startswith("_wide") else wide_rows
            if suffix.startswith("_gemv"):  # a fixed configuration serves every product at every row count
                gemv.WIDE_MAX_ROWS = gemv.MAX_ROWS
            if suffix.startswith("_wide") and suffix.endswith("_norm"):
                gemv.NORM_MAX_ROWS = gemv.WIDE_MAX_ROWS
            decode_attention.BLOCK_BYTES = int(suffix[5:]) if suffix.startswith("_attn") else block_bytes
            gemv.SILU_IN_MAX_ROWS = int(suffix[7:]) if suffix.startswith("_siluin") else silu_rows
            if suffix.startswith("_siluin"):  # gate/up by cuBLAS past 16 rows, so down can read its output
                gemv.WIDE_MAX_ROWS = 16
            kept = [(m, name, getattr(m, name)) for m, name, _ in sets.get(suffix, ())]
            for m, name, value in sets.get(suffix, ()):
                setattr(m, name, value)
            s.decoder.reset()
            row["run_ms" + suffix] = timeit(lambda: s.decoder.sampled(s.decoder.run(slots, one)))
            graph = next((g for (bs, _), g in s.decoder.graphs.items() if bs == b), None)
            if graph is not None:
                row["replay_ms" + suffix] = timeit(graph.replay)
            for m, name, value in kept:
                setattr(m, name, value)
        decode_attention.ENABLED = fused_layer.ENABLED = triton_build.PDL = cuda_graph.FUSED_EDGES = True
        fused_layer.AHEAD = ahead
        if args.device == "cuda":
            torch.backends.cuda.preferred_blas_library(blas)
        decode_attention.ROPE_MAX_ROWS = rope_rows
        gemv.config, gemv.NORM_MAX_ROWS, decode_attention.BLOCK_BYTES = auto_config, norm_rows, block_bytes
        gemv.usable = auto_usable
        gemv.HEAD_MAX_ROWS, gemv.HEAD_CONFIG = head_rows, head_cfg
        gemv.WIDE_MAX_ROWS, gemv.SILU_IN_MAX_ROWS = wide_rows, silu_rows
        row["python_ms"] = row["step_ms"] - row["run_ms"]
        dev = s.lm.device
        ptoks, pslots = torch.tensor(prompts, device=dev), torch.arange(b, device=dev)
        row["prefill_ms"] = timeit(lambda: s.lm.prefill(ptoks, pslots, s.cache), n=5)
        row.update(weight_read(s.hf))
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
        if args.kernels:
            print_kernels(s, lambda: s.decoder.sampled(s.decoder.run(slots, one)), args.kernels)
        s.stop()
        del s
    tmp.cleanup()


if __name__ == "__main__":
    main()
