"""LoRA in the Megatron trainer on replayed rollouts (--ci-test runs in the real loop: run-tiny-grpo.sh with
--lora-rank): step 1 is the base model (KL 0 against the reference, the
base without adapters), TP=2 x PP=2 x DP=2 passes the single-rank run's grad-norms, a resumed run continues
bitwise, and the PEFT export of a checkpoint starts a run (--lora-adapter-path)."""

from __future__ import annotations

import json

import pytest
import torch
from tests.backends.test_train_replay import args_for, strip_perf

pytestmark = pytest.mark.slow

LORA = ["--lora-rank", "4", "--lora-alpha", "8", "--lora-target-modules", "all-linear", "--lr", "1e-3"]


@pytest.fixture(scope="module")
def lora_ref(tiny_model_dir, replay_dumps, tmp_path_factory, train_cli, metrics_of):
    """The (1, 1, 1) LoRA replay: 2 rollouts of 2 steps, every step's grad-norm saved."""
    out = tmp_path_factory.mktemp("lora_ref")
    proc = train_cli(args_for(tiny_model_dir, replay_dumps, out, "ref", *LORA, "--num-steps-per-rollout", "2",
                              "--ci-save-grad-norm", str(out / "grad_norms.json")))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return metrics_of(out / "ref.jsonl"), out / "grad_norms.json"


def test_lora_step1_is_the_base_and_tp2_pp2_dp2_gives_the_single_rank_run(tiny_model_dir, replay_dumps, tmp_path,
                                                                          train_cli, metrics_of, lora_ref):
    rows, grad_norms = lora_ref
    first = rows[0]
    assert first["rollout/kl"] == 0.0 and first["rollout/log_probs_ref_max_abs_diff"] == 0.0
    assert first["train/first_step/ppo_kl"] == 0.0 and first["train/first_step/kl_loss"] == 0.0
    assert rows[1]["rollout/kl"] > 0  # the adapters moved the policy away from the base
    proc = train_cli(args_for(tiny_model_dir, replay_dumps, tmp_path, "par", *LORA, "--num-steps-per-rollout", "2",
                              "--actor-num-gpus-per-node", "8", "--tensor-model-parallel-size", "2",
                              "--pipeline-model-parallel-size", "2", "--ci-load-grad-norm", str(grad_norms)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    for a, b in zip(rows, metrics_of(tmp_path / "par.jsonl"), strict=True):
        for key in ("train/loss", "train/grad_norm", "rollout/log_probs", "rollout/kl"):
            assert abs(a[key] - b[key]) <= 1e-4 * max(abs(a[key]), 1e-6), (key, a[key], b[key])


def test_lora_resume_is_bitwise_and_the_peft_export_starts_a_run(tiny_model_dir, replay_dumps, tmp_path,
                                                                 train_cli, metrics_of, lora_ref):
    rows, _ = lora_ref
    ckpt = tmp_path / "ckpt"
    part = train_cli(args_for(tiny_model_dir, replay_dumps, tmp_path, "part", *LORA, "--num-steps-per-rollout", "2",
                              "--num-rollout", "1", "--save", str(ckpt), "--save-interval", "1"))
    assert part.returncode == 0, part.stderr[-3000:]
    it = ckpt / "iter_0000000"
    saved = torch.load(it / "rank_000.pt", weights_only=True)["model"]
    assert saved and all(".lora." in k for k in saved)  # the frozen base is not in the checkpoint
    config = json.loads((it / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8.0, "LORA")
    assert not (it / "hf").exists()
    resumed = train_cli(args_for(tiny_model_dir, replay_dumps, tmp_path, "resumed", *LORA,
                                 "--num-steps-per-rollout", "2", "--load", str(ckpt)))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert strip_perf(metrics_of(tmp_path / "resumed.jsonl")) == strip_perf(rows[1:])
    started = train_cli(args_for(tiny_model_dir, replay_dumps, tmp_path, "started", *LORA,
                                 "--num-steps-per-rollout", "2", "--num-rollout", "1",
                                 "--lora-adapter-path", str(it / "adapter")))
    assert started.returncode == 0, started.stderr[-3000:]
    got = metrics_of(tmp_path / "started.jsonl")[0]
    # the reference is the base (the fresh run's policy); the policy is the exported adapter's
    assert got["rollout/ref_log_probs"] == rows[0]["rollout/log_probs"]
    assert got["rollout/kl"] > 0 and got["rollout/log_probs"] != rows[0]["rollout/log_probs"]
