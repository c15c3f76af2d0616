"""bench/bench_loop_gpu.py's inputs, reward hook and standalone parts.

Inputs: a Qwen2.5-0.5B-shaped checkpoint (or --shape's) with random bf16 weights and the real 151,936-token vocabulary
(``train_shapes.make_checkpoint``), or the tiny model (``--quick``); a synthetic tokenizer that decodes every id
of the model's vocabulary (the tiny model's character tokenizer, ids past it decode to ``<id>``); the eos set of
``bench_engine.stop_set`` in generation_config.json, so that a random model's responses stop after about
``mean`` tokens (geometric lengths, capped by --rollout-max-response-len); prompts of random letters, one token
per character. ``reward``: ``--custom-rm-path bench.loop_parts.reward``, the share of even token ids in the
response (different for each sample of a group, so advantages and gradients are not zero).

Standalone parts, each a subprocess of the bench (``python bench/loop_parts.py PART ...``, JSON to --json):
``engine``: the embedded engine alone (in-process, as ``EngineActor`` builds it) replays a saved rollout's requests
(same prompt ids, sampling params and seeds, log-probs on), once as warm-up and once timed; ``train``:
``bench_train_gpu.ours`` (the Megatron worker, no Ray) on a saved rollout's samples; ``bcast``: a raw copy of N
bytes on one device, or with ``--gpus 2`` a raw NCCL broadcast of N bytes from GPU 0 to GPU 1 (two processes).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import string
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


async def reward(args, sample, **kwargs) -> float:
    """Share of even token ids in the response: varies within a group, cheap, needs no label."""
    resp = sample.tokens[len(sample.tokens) - sample.response_length:] if sample.response_length else []
    return sum(1 for t in resp if t % 2 == 0) / max(len(resp), 1)


def synthetic_tokenizer(out: str, vocab_size: int) -> None:
    """The character tokenizer with ids up to vocab_size - 1 added (``<id>``): every id the model emits decodes."""
    from slime_lite.tokenizer import build_tokenizer, save_tokenizer

    base = build_tokenizer()
    spec = json.loads(base.backend_tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    for i in range(len(vocab), vocab_size):
        vocab[f"<{i}>"] = i
    save_tokenizer(base, out)
    with open(os.path.join(out, "tokenizer.json"), "w") as f:
        json.dump(spec, f)


def make_inputs(out: str, quick: bool, mean: int, n_prompts: int, prompt_len: int,
                shape: str = "0.5b") -> tuple[str, str]:
    """(checkpoint folder, prompt JSONL): the model (``shape``: a bench_train_gpu shape; ``quick``: the tiny model,
    a tiny Qwen3-MoE for an MoE shape), its synthetic tokenizer and eos set, n_prompts prompts."""
    sys.path.insert(0, HERE)
    from bench_engine import stop_set

    model = os.path.join(out, "model")
    if quick:
        from slime_lite.tiny_model import make_tiny_model

        from train_shapes import MOE_SHAPES

        make_tiny_model(model, warm_start_steps=0, arch="qwen3_moe" if shape in MOE_SHAPES else "qwen2")
    else:
        import torch
        from train_shapes import make_checkpoint

        make_checkpoint(shape, model)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    with open(os.path.join(model, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    synthetic_tokenizer(model, vocab)
    gen = {"bos_token_id": 0, "pad_token_id": 0, "eos_token_id": stop_set(vocab, mean)}
    with open(os.path.join(model, "generation_config.json"), "w") as f:
        json.dump(gen, f)
    data = os.path.join(out, "prompts.jsonl")
    rng = random.Random(0)
    with open(data, "w") as f:
        for _ in range(n_prompts):
            text = "".join(rng.choice(string.ascii_letters) for _ in range(prompt_len))
            f.write(json.dumps({"prompt": text, "label": "0"}) + "\n")
    return model, data


def _samples(path: str) -> list:
    from slime_lite.rollout.dumps import load_rollout_dump

    return load_rollout_dump(path).samples


def engine_alone(model: str, warm: str, dump: str, max_running: int, kv_tokens: int, seed: int,
                 compile: bool = False) -> dict:
    """The engine alone on a saved rollout's requests (warm-up on ``warm``): wall time, tokens, memory."""
    import threading

    import torch

    from slime_lite.engine.request import Request
    from slime_lite.engine.sampling import SamplingParams
    from slime_lite.engine.server import EngineServer

    cuda = torch.cuda.is_available()
    server = EngineServer(model, device="cuda" if cuda else "cpu", dtype="bfloat16" if cuda else "auto", seed=seed,
                          max_running_requests=max_running, kv_cache_tokens=kv_tokens, enable_torch_compile=compile)
    server.start()
    sch = server.scheduler

    def replay(path: str) -> tuple[float, int]:
        samples = _samples(path)
        done, outs, reqs = threading.Semaphore(0), [], []
        for i, s in enumerate(samples):
            params = SamplingParams.from_dict(dict(s.metadata["sampling_params"]))
            req = Request(rid=f"r{i}", input_ids=s.tokens[:len(s.tokens) - s.response_length], params=params,
                          seed=sch.derive_seed(params.sampling_seed, None, 0), return_logprob=True,
                          on_output=lambda o: (outs.append(o), done.release()))
            sch.prepare(req)
            reqs.append(req)
        t0 = time.perf_counter()
        for r in reqs:
            sch.submit(r)
        for _ in reqs:
            done.acquire()
        return time.perf_counter() - t0, sum(len(o.output_ids) for o in outs)

    warm_s, _ = replay(warm)
    if cuda:
        from slime_lite.engine import vmm

        torch.cuda.reset_peak_memory_stats()
        vmm.reset_peak()
    captures = (sch.decoder.num_captures, sch.decoder.capture_seconds) if sch.decoder else (0, 0.0)
    secs, tokens = replay(dump)
    res = {"warmup_s": warm_s, "rollout_s": secs, "tokens": tokens, "tok_per_s": tokens / secs,
           "loop_tokens": sum(s.response_length for s in _samples(dump))}
    if sch.decoder:  # shapes the warm-up did not capture
        res.update(captures=sch.decoder.num_captures - captures[0], capture_s=sch.decoder.capture_seconds - captures[1])
    if cuda:
        from slime_lite.metrics import process_memory

        mem = process_memory()  # torch's allocator and the engine's mapped buffers
        res.update(cuda_allocated_mb=mem["cuda_allocated_mb"], cuda_peak_mb=mem["cuda_peak_mb"])
    server.stop()
    return res


def train_alone(model: str, warm: str, dump: str, max_tokens: int, lp_tokens: int) -> dict:
    """bench_train_gpu's worker driver on the saved rollout (warm-up: 16 samples of ``warm``)."""
    import torch

    sys.path.insert(0, HERE)
    from bench_train_gpu import ours

    samples = _samples(dump)
    res = ours(model, samples, _samples(warm)[:16], max_tokens, lp_tokens, torch.cuda.is_available())
    res["tokens"] = sum(len(s.tokens) for s in samples)
    return res


def _bcast_worker(rank: int, nbytes: int, port: int, path: str) -> None:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    buf = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(5):  # 2 warm-up, best of 3; a barrier after the broadcast: both sides have the bytes
        dist.barrier(device_ids=[rank])
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dist.broadcast(buf, 0)
        dist.barrier(device_ids=[rank])
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    if rank == 0:
        with open(path, "w") as f:
            json.dump({"raw_broadcast_s": min(times[2:]), "bytes": nbytes}, f)
    dist.destroy_process_group()


def raw_transfer(nbytes: int, gpus: int) -> dict:
    """gpus 2: a raw NCCL broadcast GPU 0 -> GPU 1; else a raw copy on one device (GPU, or CPU)."""
    import torch

    if gpus == 2:
        import tempfile

        import torch.multiprocessing as mp

        from slime_lite.io import free_port

        path = os.path.join(tempfile.mkdtemp(), "bcast.json")
        mp.spawn(_bcast_worker, args=(nbytes, free_port(), path), nprocs=2)
        with open(path) as f:
            return json.load(f)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    times = []
    for _ in range(5):
        if dev == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        if dev == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return {"raw_copy_s": min(times[2:]), "bytes": nbytes, "device": dev}


def main() -> None:
    ap = argparse.ArgumentParser(description="one standalone part of bench/bench_loop_gpu.py")
    ap.add_argument("part", choices=("engine", "train", "bcast"))
    ap.add_argument("--json", required=True)
    ap.add_argument("--model")
    ap.add_argument("--warm", help="rollout dump for the warm-up")
    ap.add_argument("--dump", help="rollout dump to time")
    ap.add_argument("--max-running", type=int, default=512)
    ap.add_argument("--kv-tokens", type=int, default=None)
    ap.add_argument("--compile", action="store_true", help="the engine with --enable-torch-compile")
    ap.add_argument("--seed", type=int, default=42, help="the engine's seed (--rollout-seed of engine 0)")
    ap.add_argument("--max-tokens", type=int, default=16384)
    ap.add_argument("--log-probs-max-tokens", type=int, default=32768)
    ap.add_argument("--bytes", type=int, default=0)
    ap.add_argument("--gpus", type=int, default=1)
    a = ap.parse_args()
    sys.path.insert(0, os.path.dirname(HERE))
    if a.part == "engine":
        res = engine_alone(a.model, a.warm, a.dump, a.max_running, a.kv_tokens, a.seed, a.compile)
    elif a.part == "train":
        res = train_alone(a.model, a.warm, a.dump, a.max_tokens, a.log_probs_max_tokens)
    else:
        res = raw_transfer(a.bytes, a.gpus)
    print(json.dumps(res), flush=True)
    with open(a.json, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main()
