"""LoRA on the train worker itself (one in-process rank, CPU, float32, no Ray): the forward-only passes (old-policy
log-probs, values) run without --lora-dropout, and a checkpoint resumes only with the adapters' rank and alpha."""

from __future__ import annotations

import pytest
import torch

from slime_lite.errors import SlimeLiteError
from slime_lite.io import free_port

torch.set_num_threads(1)


def _worker(model_dir, dumps, *extra):
    from slime_lite.args import parse_args
    from slime_lite.backends.megatron.actor import TrainActor

    argv = ["--load-debug-rollout-data", dumps, "--hf-checkpoint", str(model_dir), "--rollout-batch-size", "4",
            "--n-samples-per-prompt", "2", "--seed", "7", "--lora-rank", "4", "--lr", "1e-2", *extra]
    worker = TrainActor(parse_args(argv), 0, 1, "127.0.0.1")
    worker.init(free_port())
    return worker


def test_log_prob_pass_applies_no_lora_dropout(tiny_model_dir, replay_dumps):
    """After a train step (adapters non-zero, model left in train mode) the old-policy log-probs are those of the
    adapted model without dropout, the weights the engines are sent."""
    from slime_lite.backends.megatron import batch as B
    from slime_lite.backends.megatron import lora
    from slime_lite.backends.megatron.parallel import destroy
    from slime_lite.rollout.dumps import dump_path, load_rollout_dump

    try:
        worker = _worker(tiny_model_dir, replay_dumps, "--lora-dropout", "0.5")
        samples = load_rollout_dump(dump_path(replay_dumps, 0)).samples
        worker.train(0, samples, None)
        steps, length = worker._plan(samples, log_probs=True), B.padded_length(samples)

        def log_probs():
            return worker._forward_all(samples, steps, length, worker._log_probs)

        first, second = log_probs(), log_probs()
        for _, _, mod in lora.adapted_linears(worker.model):
            mod.lora.dropout = torch.nn.Identity()
        plain = log_probs()
    finally:
        destroy()
    assert first.keys() == plain.keys()
    for i in plain:
        assert torch.equal(first[i], plain[i]) and torch.equal(second[i], plain[i]), i


def test_resume_with_another_lora_alpha_is_refused(tiny_model_dir, replay_dumps, tmp_path):
    from slime_lite.backends.megatron.parallel import destroy

    ckpt = str(tmp_path / "ckpt")
    try:
        _worker(tiny_model_dir, replay_dumps, "--lora-alpha", "16", "--save", ckpt).save(0, None)
    finally:
        destroy()
    try:
        with pytest.raises(SlimeLiteError, match=r"--lora-rank 4 --lora-alpha 16 and this run has --lora-rank 4 "
                                                 r"--lora-alpha 4 .*resume with --lora-rank 4 --lora-alpha 16"):
            _worker(tiny_model_dir, replay_dumps, "--load", ckpt)
    finally:
        destroy()
    try:
        _worker(tiny_model_dir, replay_dumps, "--lora-alpha", "16", "--load", ckpt)  # the same flags resume
    finally:
        destroy()
