"""Probes for ``bench_train_gpu.py``: where a phase's time goes (torch's profiler), where the host waits for the
device (CUDA's sync debug mode), and micro-benchmarks of the packed attention backends and of the log-prob kernels."""

from __future__ import annotations

import os
import time

import torch

VOCAB = 151936  # the Qwen2 vocabulary: the log-prob micro-benchmark's width


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def profiled(fn, label: str, rows: int) -> None:
    """Run fn under torch's profiler and print where the time goes: device-kernel time vs wall time, then the top
    operators by self device time and by self host time (a host-bound phase has kernel time << wall time)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    sync()
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        fn()
        sync()
    wall = time.perf_counter() - t0
    ev = prof.key_averages()
    dev_key = "self_device_time_total" if hasattr(ev[0], "self_device_time_total") else "self_cuda_time_total"
    # the kernels' own rows only (the operators that launched them carry the same time again)
    kernels = sum(getattr(e, dev_key) for e in ev if e.device_type == torch.autograd.DeviceType.CUDA) / 1e6
    print(f"\n== profile {label}: wall {wall:.2f} s (under the profiler), device-kernel time {kernels:.2f} s "
          f"({100 * kernels / wall:.0f}% busy)", flush=True)
    for key in (dev_key, "self_cpu_time_total", "cpu_time_total"):
        print(ev.table(sort_by=key, row_limit=rows, max_name_column_width=70), flush=True)


def sync_sites(fn, label: str) -> None:
    """Run fn with CUDA's sync debug mode on and print where the host waited for the device: each call site (the
    innermost three frames of slime_lite or megatron) with how many times."""
    import collections
    import traceback
    import warnings

    counts: collections.Counter = collections.Counter()

    def seen(message, *args, **kwargs) -> None:
        if "synchroniz" not in str(message):  # other warnings (Megatron's deprecations) are not syncs
            return
        frames = [f for f in traceback.extract_stack()[:-1] if "slime_lite" in f.filename or "megatron" in f.filename]
        counts[" <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in frames[::-1][:3])] += 1

    sync()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = seen
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    print(f"\n== device syncs in {label}: {sum(counts.values())}", flush=True)
    for site, n in counts.most_common():
        print(f"  {n:5d}  {site}", flush=True)


# ------------------------------------------------------------------------------------------ attention backends
def attention_microbench(lengths: list[int], heads: int, kv: int, dim: int, dtype: torch.dtype) -> dict[str, float]:
    """Forward + backward of one layer's packed causal attention over these sample lengths, per backend (ms)."""
    from slime_lite.backends.megatron import attention as A

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    t = sum(lengths)
    cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0).to(torch.int32)
    q = torch.randn(t, heads, dim, device=dev, dtype=dtype, requires_grad=True)
    k = torch.randn(t, kv, dim, device=dev, dtype=dtype, requires_grad=True)
    v = torch.randn(t, kv, dim, device=dev, dtype=dtype, requires_grad=True)
    backends = ["sdpa", "bucketed"] + (["varlen"] if dev == "cuda" and A._varlen() is not None and dtype != torch.float32
                                      else [])
    out, first = {}, None
    for b in backends:
        for rep in range(3):
            sync()
            t0 = time.perf_counter()
            o = A.packed_causal_attention(q, k, v, cu, max(lengths), dim ** -0.5, b)
            o.float().sum().backward()
            sync()
            out[b] = min(out.get(b, float("inf")), (time.perf_counter() - t0) * 1e3)  # best of 3
        first = o.detach() if first is None else first
        if b != backends[0]:  # the same attention: its output next to the first backend's
            out[f"{b} max abs diff vs {backends[0]}"] = float((o.detach().float() - first.float()).abs().max())
    return out


def logprob_microbench(tokens: int, vocab: int = VOCAB) -> dict[str, float]:
    """Forward + backward of the log-probs and entropy of ``tokens`` rows of bf16 logits over the vocabulary (ms,
    best of 3): ours (logprobs.token_log_probs: the Triton kernels on CUDA, one read of the logits forward and one
    read + write backward), ours by chunked torch ops (hand-written backward; the CPU path), and plain autograd
    through a float32 log-softmax (what the baseline's loss does)."""
    from slime_lite.backends.megatron.logprobs import token_log_probs

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=dev).manual_seed(0)
    base = torch.randn(tokens, vocab, generator=g, device=dev).mul_(3).to(torch.bfloat16)
    target = torch.randint(0, vocab, (tokens,), generator=g, device=dev)

    def ours(x, fused=None):
        lp, ent = token_log_probs(x, target, 1.0, True, fused=fused)
        return lp.sum() + 0.01 * ent.sum()

    def plain(x):
        logp = torch.log_softmax(x.float(), -1)
        return logp.gather(-1, target[:, None]).sum() - 0.01 * (logp.exp() * logp).sum()

    out = {}
    runs = [("ours", ours), ("ours, torch ops", lambda x: ours(x, False)), ("plain autograd", plain)]
    for name, fn in runs if dev == "cuda" else [runs[0], runs[2]]:
        for _ in range(3):
            x = base.clone().requires_grad_(True)
            sync()
            t0 = time.perf_counter()
            fn(x).backward()
            sync()
            out[name] = min(out.get(name, float("inf")), (time.perf_counter() - t0) * 1e3)
    return out
