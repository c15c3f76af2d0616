"""Fixtures for train-side tests: replayable rollout dumps whose log-probs come from an HF forward of the tiny model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


def make_replay_dumps(model_dir: Path, out: Path, num_rollout: int = 2, prompts: int = 4, n: int = 2,
                      seed: int = 0, temperature: float = 1.0) -> str:
    """Dumps like the engine writes them: random responses, rollout log-probs from the HF model, 0/1 rewards."""
    import torch
    from transformers import AutoModelForCausalLM

    from slime_lite.rollout.dumps import make_meta, save_rollout_dump
    from slime_lite.tasks import make_data
    from slime_lite.tokenizer import load_tokenizer, tokenizer_fingerprint
    from slime_lite.types import Sample, Status

    out.mkdir(parents=True, exist_ok=True)
    data = out / "data.jsonl"
    make_data("addition", str(data), n_train=64, n_eval=8, seed=seed)
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    tok = load_tokenizer(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), attn_implementation="eager").eval()
    gen = torch.Generator().manual_seed(seed)
    meta_args = type("A", (), {"n_samples_per_prompt": n, "rollout_batch_size": prompts, "hf_checkpoint": str(model_dir)})
    for rid in range(num_rollout):
        samples = []
        for gi in range(prompts):
            row = rows[(rid * prompts + gi) % len(rows)]
            ids = tok(row["prompt"], add_special_tokens=False)["input_ids"]
            for j in range(n):
                resp = torch.randint(4, 60, (2 + (j + gi) % 4,), generator=gen).tolist()
                with torch.no_grad():
                    logits = model(torch.tensor([ids + resp])).logits[0].float() / temperature
                lp = torch.log_softmax(logits, -1)
                rlp = [lp[len(ids) - 1 + k, t].item() for k, t in enumerate(resp)]
                samples.append(Sample(
                    group_index=gi, index=len(samples), prompt=row["prompt"], tokens=ids + resp,
                    response=tok.decode(resp), response_length=len(resp), label=row["label"],
                    reward=float(torch.rand((), generator=gen) < 0.5), loss_mask=[1] * len(resp),
                    rollout_log_probs=rlp, status=Status.COMPLETED,
                ))
        save_rollout_dump(str(out / f"dump_{rid}.pt"), rid, samples, make_meta(meta_args, tokenizer_fingerprint(tok)))
    return str(out / "dump_{rollout_id}.pt")


@pytest.fixture(scope="session")
def replay_dumps(tiny_model_dir, tmp_path_factory) -> str:
    return make_replay_dumps(tiny_model_dir, tmp_path_factory.mktemp("replay"))


def run_train(argv: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "slime_lite.cli", "train", *argv], capture_output=True, text=True,
                          timeout=timeout)


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


@pytest.fixture(scope="session")
def train_cli():
    """``train_cli(argv) -> CompletedProcess`` of ``slime-lite train`` in a subprocess."""
    return run_train


@pytest.fixture(scope="session")
def metrics_of():
    return read_metrics


@pytest.fixture(scope="module")
def medium_model(tmp_path_factory) -> tuple[Path, str]:
    """A ~20M-parameter model (hidden 512, 8 layers, tied embeddings) and replay dumps of it: big enough that fixed
    costs do not hide a leak in the GPU memory tests."""
    from slime_lite.tiny_model import make_tiny_model

    out = tmp_path_factory.mktemp("medium_model")
    make_tiny_model(out, hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=2, intermediate_size=1536,
                    warm_start_steps=0, tie_word_embeddings=True)
    return out, make_replay_dumps(out, tmp_path_factory.mktemp("medium_replay"))
