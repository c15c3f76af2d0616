"""Batch invariance of the trainer (issue 12 item 5), tested on the worker itself (one in-process Megatron rank,
CPU, float32, no Ray): one replayed rollout trained with padded micro-batches and with packed micro-batches of
three --max-tokens-per-gpu budgets (and log-prob passes packed differently from the train pass) gives step-1 KL
and ppo_kl exactly 0 and the same loss and grad-norm to 1e-6; so does --calculate-per-token-loss across budgets.
On CUDA in bf16 (marked gpu) the same comparison prints its spread: GPU matmuls are not batch invariant, so only
ppo_kl with the same packing in both passes is exact there."""

from __future__ import annotations

import pytest
import torch

from slime_lite.io import free_port

pytestmark = pytest.mark.slow


def _worker(tiny_model_dir, replay_dumps, *extra):
    from slime_lite.args import parse_args
    from slime_lite.backends.megatron.actor import TrainActor
    from slime_lite.backends.megatron.parallel import destroy
    from slime_lite.rollout.dumps import dump_path, load_rollout_dump

    argv = ["--load-debug-rollout-data", replay_dumps, "--hf-checkpoint", str(tiny_model_dir),
            "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--use-kl-loss", "--kl-loss-coef", "0.1",
            "--entropy-coef", "0.01", "--lr", "1e-4", "--seed", "7", *extra]
    worker = TrainActor(parse_args(argv), 0, 1)
    worker.init("127.0.0.1", free_port())
    start = {n: p.detach().clone() for n, p in worker.gpt().named_parameters()}
    samples = load_rollout_dump(dump_path(replay_dumps, 0)).samples
    yield worker, start, samples
    destroy()


@pytest.fixture(scope="module")
def worker_and_samples(tiny_model_dir, replay_dumps):
    yield from _worker(tiny_model_dir, replay_dumps)


@pytest.fixture(scope="module")
def bf16_worker(tiny_model_dir, replay_dumps):
    yield from _worker(tiny_model_dir, replay_dumps, "--bf16")


def run(worker_and_samples, **flags):
    """Step-1 metrics of one train() from the same start weights with these flag values."""
    import argparse

    from slime_lite.config import freeze

    worker, start, samples = worker_and_samples
    changed = {"use_dynamic_batch_size": "max_tokens_per_gpu" in flags, "micro_batch_size": 1,
               "calculate_per_token_loss": False, "log_probs_max_tokens_per_gpu": None, **flags}
    worker.args = freeze(argparse.Namespace(**{**vars(worker.args), **changed}))  # the same worker, other flags
    with torch.no_grad():
        for n, p in worker.gpt().named_parameters():
            p.copy_(start[n])
    return worker.train(0, samples, None)[0].metrics


def close(a: float, b: float, rel: float = 1e-6) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b), 1e-12)


def test_packing_and_budgets_change_nothing_but_speed(worker_and_samples):
    samples = worker_and_samples[2]
    longest = max(len(s.tokens) for s in samples)
    total = sum(len(s.tokens) for s in samples)
    runs = {
        "padded mbs 1": run(worker_and_samples),
        "padded mbs 4": run(worker_and_samples, micro_batch_size=4),
        "packed longest": run(worker_and_samples, max_tokens_per_gpu=longest),
        "packed 2x longest, log-probs all": run(worker_and_samples, max_tokens_per_gpu=2 * longest,
                                                log_probs_max_tokens_per_gpu=total),
        "packed all, log-probs longest": run(worker_and_samples, max_tokens_per_gpu=total,
                                             log_probs_max_tokens_per_gpu=longest),
    }
    ref = runs["padded mbs 1"]
    for name, m in runs.items():
        assert m["rollout/kl"] == 0.0 and m["rollout/log_probs_ref_max_abs_diff"] == 0.0, name
        assert m["train/first_step/ppo_kl"] == 0.0, name  # old log-probs == train log-probs, bit for bit
        for key in ("train/loss", "train/pg_loss", "train/grad_norm", "train/entropy_loss", "rollout/log_probs"):
            assert close(m[key], ref[key]), (name, key, m[key], ref[key])
    # per-token loss: another normalisation (so another loss), the same under any budget
    tok = [run(worker_and_samples, max_tokens_per_gpu=n, calculate_per_token_loss=True) for n in (longest, total)]
    tok.append(run(worker_and_samples, calculate_per_token_loss=True))
    for m in tok:
        assert m["train/first_step/ppo_kl"] == 0.0
        for key in ("train/loss", "train/grad_norm"):
            assert close(m[key], tok[0][key]), (key, m[key], tok[0][key])
    assert not close(tok[0]["train/loss"], ref["train/loss"], 1e-3)  # it did change the normalisation


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_packing_spread_in_bf16_on_gpu(bf16_worker):
    samples = bf16_worker[2]
    longest = max(len(s.tokens) for s in samples)
    total = sum(len(s.tokens) for s in samples)
    runs = {
        "padded mbs 1": run(bf16_worker),
        "packed longest": run(bf16_worker, max_tokens_per_gpu=longest),
        "packed 2x longest": run(bf16_worker, max_tokens_per_gpu=2 * longest),
        "packed all": run(bf16_worker, max_tokens_per_gpu=total),
        "packed all, log-probs longest": run(bf16_worker, max_tokens_per_gpu=total,
                                             log_probs_max_tokens_per_gpu=longest),
    }
    ref = runs["padded mbs 1"]
    for name, m in runs.items():
        print(f"bf16 {name}: ppo_kl {m['train/first_step/ppo_kl']:.3g} loss {m['train/loss']:.6g} "
              f"grad_norm {m['train/grad_norm']:.6g} (rel {abs(m['train/grad_norm'] / ref['train/grad_norm'] - 1):.2e})")
        assert m["rollout/kl"] == 0.0, name  # actor and reference forwards use the same packing
        if "log-probs" not in name:  # the same packing in both passes: the same kernels, bit for bit
            assert m["train/first_step/ppo_kl"] == 0.0, name
        assert abs(m["train/first_step/ppo_kl"]) < 1e-3, name
        for key in ("train/grad_norm", "rollout/log_probs"):
            assert close(m[key], ref[key], 3e-2), (name, key, m[key], ref[key])
