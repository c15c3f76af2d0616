"""Megatron-core train step (through slime_lite's CPU shim) vs a plain PyTorch train step of the same HF model.

Same model, batch, loss (token cross-entropy) and optimizer (Adam, grad clip 1.0), measured in one run; prints one
table (tokens/s and the ratio). Usage:
    .venv/bin/python bench/bench_train_step.py [--hidden 256 --layers 4 --batch 16 --seq 64 --steps 10]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch


def plain_step_fn(model_dir: str, lr: float):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager")
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=lr, betas=(0.9, 0.98), eps=1e-8)

    def step(tokens: torch.Tensor) -> float:
        opt.zero_grad(set_to_none=True)
        logits = model(tokens).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return float(loss)

    return step


def megatron_step_fn(model_dir: str, lr: float, micro: int):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from transformers import AutoConfig

    from slime_lite.backends.megatron.convert import load_hf_weights
    from slime_lite.backends.megatron.model import build_gpt_model
    from slime_lite.backends.megatron.parallel import init_distributed
    from slime_lite.io import free_port

    init_distributed(1, 1, 0, 1, "127.0.0.1", free_port())
    cfg = AutoConfig.from_pretrained(model_dir)
    gpt = build_gpt_model(cfg)
    load_hf_weights(gpt, model_dir, cfg)
    model = DistributedDataParallel(gpt.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), gpt)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=lr, adam_beta1=0.9, adam_beta2=0.98,
                                                 clip_grad=1.0, weight_decay=0.0), [model])
    gpt.config.finalize_model_grads_func = finalize_model_grads
    fb = get_forward_backward_func()

    def step(tokens: torch.Tensor) -> float:
        chunks = list(tokens.split(micro))
        losses = []

        def forward_step(it, m):
            t = next(it)
            pos = torch.arange(t.shape[1]).unsqueeze(0).expand_as(t)
            logits = m(t, pos, None, runtime_gather_output=True)

            def loss_fn(out, non_loss_data=False):
                loss = torch.nn.functional.cross_entropy(out[:, :-1].reshape(-1, out.shape[-1]).float(),
                                                         t[:, 1:].reshape(-1))
                losses.append(float(loss))
                return loss, {}

            return logits, loss_fn

        model.zero_grad_buffer()
        opt.zero_grad()
        fb(forward_step_func=forward_step, data_iterator=iter(chunks), model=[model], num_microbatches=len(chunks),
           seq_length=tokens.shape[1], micro_batch_size=micro, forward_only=False)
        opt.step()
        return sum(losses) / len(losses)

    return step


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from slime_lite.tiny_model import make_tiny_model

    tmp = tempfile.mkdtemp()
    make_tiny_model(tmp, hidden_size=args.hidden, num_layers=args.layers, num_heads=4, num_kv_heads=2,
                    intermediate_size=args.hidden * 3, warm_start_steps=0)
    params = sum(t.numel() for t in __import__("safetensors.torch").torch.load_file(os.path.join(tmp, "model.safetensors")).values())
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(3, 90, (args.batch, args.seq), generator=g) for _ in range(args.steps + 2)]
    rows = []
    for name, fn in (("plain PyTorch (HF model)", plain_step_fn(tmp, 1e-4)),
                     ("Megatron-core (slime_lite)", megatron_step_fn(tmp, 1e-4, micro=args.batch))):
        for b in batches[:2]:  # warm-up
            fn(b)
        t0 = time.perf_counter()
        losses = [fn(b) for b in batches[2:]]
        dt = time.perf_counter() - t0
        rows.append((name, args.steps * args.batch * args.seq / dt, dt / args.steps, losses[-1]))
    base = rows[0][1]
    print(f"model: {params/1e6:.2f}M params, batch {args.batch} x seq {args.seq}, {args.steps} steps, "
          f"{args.threads} threads")
    print(f"| {'step':<28} | {'tokens/s':>9} | {'s/step':>7} | {'last loss':>9} | {'time vs plain':>13} |")
    print(f"|{'-'*30}|{'-'*11}|{'-'*9}|{'-'*11}|{'-'*15}|")
    for name, tps, sps, loss in rows:
        print(f"| {name:<28} | {tps:9.0f} | {sps:7.3f} | {loss:9.4f} | {base / tps:12.2f}x |")


if __name__ == "__main__":
    main()
