"""The optimizer flags mean what Megatron makes of them, on the worker itself (one in-process rank, CPU, float32):
--weight-decay leaves biases and 1-D weights (the norms) undecayed (Megatron's wd_mult 0 groups), a resumed run
trains at its own --lr and --weight-decay (not the checkpoint's param groups)."""

from __future__ import annotations

import pytest

from slime_lite.io import free_port

pytestmark = pytest.mark.slow


def _worker(model_dir, dumps, *extra):
    from slime_lite.args import parse_args
    from slime_lite.backends.megatron.actor import TrainActor

    argv = ["--load-debug-rollout-data", dumps, "--hf-checkpoint", str(model_dir), "--rollout-batch-size", "4",
            "--n-samples-per-prompt", "2", "--seed", "7", *extra]
    worker = TrainActor(parse_args(argv), 0, 1)
    worker.init("127.0.0.1", free_port())
    return worker


def _groups(worker) -> list[tuple[float, float, list[int]]]:
    """(lr, weight_decay, the dims of its parameters) of each param group."""
    return [(g["lr"], g["weight_decay"], sorted({p.dim() for p in g["params"]}))
            for g in worker.optimizer.param_groups if g["params"]]


def test_weight_decay_skips_norms_and_biases(tiny_model_dir, replay_dumps):
    from slime_lite.backends.megatron.parallel import destroy

    try:
        groups = _groups(_worker(tiny_model_dir, replay_dumps, "--lr", "1e-4", "--weight-decay", "0.1"))
    finally:
        destroy()
    assert {dims[0] for _, _, dims in groups} == {1, 2}, groups  # the model has norms (1-D) and matrices
    for lr, wd, dims in groups:
        assert lr == 1e-4 and wd == (0.0 if dims == [1] else 0.1), groups


def test_a_resumed_run_trains_at_its_own_lr_and_weight_decay(tiny_model_dir, replay_dumps, tmp_path):
    from slime_lite.backends.megatron.parallel import destroy

    ckpt = str(tmp_path / "ckpt")
    try:
        _worker(tiny_model_dir, replay_dumps, "--lr", "1e-4", "--weight-decay", "0.1", "--save", ckpt).save(0, None)
    finally:
        destroy()
    try:
        groups = _groups(_worker(tiny_model_dir, replay_dumps, "--lr", "3e-4", "--weight-decay", "0.05", "--load",
                                 ckpt, "--save", ckpt))
    finally:
        destroy()
    for lr, wd, dims in groups:
        assert lr == 3e-4 and wd == (0.0 if dims == [1] else 0.05), groups
