"""LoRA on the train worker itself (one in-process rank, CPU, float32, no Ray): the forward-only passes (old-policy
log-probs, values) run without --lora-dropout, full activation recompute trains them (and the layers after a frozen
embedding) as the run without it, and a checkpoint resumes only with the adapters' rank, alpha and base model."""

from __future__ import annotations

import pytest
import torch

from slime_lite.errors import SlimeLiteError
from slime_lite.io import free_port

torch.set_num_threads(1)


def _worker(model_dir, dumps, *extra, lora=("--lora-rank", "4")):
    from slime_lite.args import parse_args
    from slime_lite.backends.megatron.actor import TrainActor

    argv = ["--load-debug-rollout-data", dumps, "--hf-checkpoint", str(model_dir), "--rollout-batch-size", "4",
            "--n-samples-per-prompt", "2", "--seed", "7", *lora, "--lr", "1e-2", *extra]
    worker = TrainActor(parse_args(argv), 0, 1)
    worker.init("127.0.0.1", free_port())
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


@pytest.mark.parametrize("frozen", [("--lora-rank", "4"), ("--freeze-params-name-list", "embedding")])
def test_full_recompute_trains_as_without_it(tiny_model_dir, replay_dumps, frozen):
    """Megatron's full recompute is a reentrant checkpoint: with a frozen embedding (LoRA freezes it too) its input
    needs no grad, and without the embedding's output requiring grad no layer it recomputed got a gradient."""
    from slime_lite.backends.megatron.parallel import destroy
    from slime_lite.rollout.dumps import dump_path, load_rollout_dump

    samples = load_rollout_dump(dump_path(replay_dumps, 0)).samples
    runs = []
    full = ["--recompute-granularity", "full", "--recompute-num-layers", "1", "--recompute-method"]
    for recompute in ([], [*full, "uniform"], [*full, "block"]):
        try:
            worker = _worker(tiny_model_dir, replay_dumps, *recompute, lora=frozen)
            before = {n: p.detach().clone() for n, p in worker.gpt().named_parameters() if p.requires_grad}
            norm = worker.train(0, samples, None)[0].grad_norms[0]
            after = {n: p.detach().clone() for n, p in worker.gpt().named_parameters() if n in before}
        finally:
            destroy()
        runs.append((norm, before, after))
    (norm, before, after), *recomputed = runs
    assert norm > 0 and all(not torch.equal(before[n], after[n]) for n in after if ".lora.A" not in n)
    for other_norm, _, other in recomputed:
        assert other_norm == pytest.approx(norm, rel=1e-5)
        for n in after:
            torch.testing.assert_close(other[n], after[n], rtol=1e-5, atol=1e-6)


def test_resume_on_another_base_model_is_refused(tiny_model_dir, replay_dumps, tmp_path):
    """The checkpoint holds the adapters only: on another --hf-checkpoint of the same shapes they would go on
    silently from a base they were not trained on. A copy of the base elsewhere resumes, and so does a checkpoint
    saved before the base's fingerprint was kept."""
    import shutil

    from slime_lite.backends.megatron.parallel import destroy
    from slime_lite.tiny_model import make_tiny_model

    other, copy, ckpt = tmp_path / "other", tmp_path / "copy", str(tmp_path / "ckpt")
    make_tiny_model(other, warm_start_steps=0, seed=123)
    shutil.copytree(tiny_model_dir, copy)
    try:
        _worker(tiny_model_dir, replay_dumps, "--save", ckpt).save(0, None)
    finally:
        destroy()
    said = (f"holds adapters trained on the base model {tiny_model_dir}, and this run's --hf-checkpoint {other} "
            f"holds other weights .* Resume with --hf-checkpoint {tiny_model_dir} ")
    try:
        with pytest.raises(SlimeLiteError, match=said):
            _worker(other, replay_dumps, "--load", ckpt)
    finally:
        destroy()
    try:
        _worker(copy, replay_dumps, "--load", ckpt)
    finally:
        destroy()
    rank_file = tmp_path / "ckpt" / "iter_0000000" / "rank_000.pt"
    state = torch.load(rank_file, weights_only=True)
    del state["lora_base"]  # as saved before the fingerprint
    torch.save(state, rank_file)
    try:
        _worker(other, replay_dumps, "--load", ckpt)
    finally:
        destroy()
