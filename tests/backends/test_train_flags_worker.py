"""slime's checkpoint, optimizer and reference flags on the train worker itself (one in-process Megatron rank, CPU,
float32, no Ray): --no-save-optim, --reset-optimizer-states, --ref-update-interval (with its checkpoint round
trip) and --save-hf."""

from __future__ import annotations

import argparse

import pytest
import torch

from slime_lite.errors import SlimeLiteError
from slime_lite.io import free_port

pytestmark = pytest.mark.slow

FLAGS = ["--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--global-batch-size", "8", "--lr", "1e-3",
         "--seed", "7"]


def _worker(model_dir, dumps, *extra):
    from slime_lite.args import parse_args
    from slime_lite.backends.megatron.actor import TrainActor

    worker = TrainActor(parse_args(["--load-debug-rollout-data", dumps, "--hf-checkpoint", str(model_dir), *FLAGS,
                                    *extra]), 0, 1)
    worker.init("127.0.0.1", free_port())
    return worker


def _samples(dumps):
    from slime_lite.rollout.dumps import dump_path, load_rollout_dump

    return load_rollout_dump(dump_path(dumps, 0)).samples


def _adam_states(worker) -> list[dict]:
    from slime_lite.backends.megatron import optimizer_ops

    return [st for adam in optimizer_ops.torch_adams(worker.optimizer) for st in adam.state.values()]


def test_no_save_optim_writes_no_optimizer_state_and_its_checkpoint_cannot_resume(tiny_model_dir, replay_dumps,
                                                                                  tmp_path):
    from slime_lite.backends.megatron import checkpoint
    from slime_lite.backends.megatron.parallel import destroy
    from slime_lite.config import freeze

    full, slim = tmp_path / "full", tmp_path / "slim"
    try:
        w = _worker(tiny_model_dir, replay_dumps, "--save", str(full))
        w.train(0, _samples(replay_dumps), None)  # Adam has moments now
        w.save(0, None)
        w.args = freeze(argparse.Namespace(**{**vars(w.args), "save": str(slim), "no_save_optim": True}))
        w.save(0, None)
    finally:
        destroy()
    kept = torch.load(full / "iter_0000000" / "rank_000.pt", weights_only=True)
    lean = torch.load(slim / "iter_0000000" / "rank_000.pt", weights_only=True)
    assert "optimizer" in kept and "optimizer" not in lean and "optimizer_param_state" not in lean
    for key in ("model", "rng", "next_rollout_id"):
        assert key in lean
    assert (slim / "iter_0000000" / "rank_000.pt").stat().st_size < (full / "iter_0000000" / "rank_000.pt").stat(
    ).st_size
    assert (slim / "iter_0000000" / "hf" / "model.safetensors").exists()  # the weights' way out
    checkpoint.check_loadable(str(full), critic=False)  # a GRPO run's
    match = r"saved with --no-save-optim .*cannot resume training.*--hf-checkpoint .*iter_0000000/hf"
    with pytest.raises(SlimeLiteError, match=match):  # preflight, before Ray starts
        checkpoint.check_loadable(str(slim), critic=False)
    try:
        with pytest.raises(SlimeLiteError, match=match):  # and the worker's own load
            _worker(tiny_model_dir, replay_dumps, "--load", str(slim), "--save", str(slim))
    finally:
        destroy()


@pytest.mark.parametrize("reset", [False, True])
def test_reset_optimizer_states_clears_adam_before_each_rollout(tiny_model_dir, replay_dumps, reset):
    """As slime: the state is cleared when a rollout's training starts, so the second rollout's one step is a fresh
    Adam's first (step count 1, not 2)."""
    from slime_lite.backends.megatron.parallel import destroy

    try:
        w = _worker(tiny_model_dir, replay_dumps, *(["--reset-optimizer-states"] if reset else []))
        before = {n: p.detach().clone() for n, p in w.gpt().named_parameters()}
        w.train(0, _samples(replay_dumps), None)
        w.train(1, _samples(replay_dumps), None)
        states = _adam_states(w)
        moved = any(not torch.equal(p, before[n]) for n, p in w.gpt().named_parameters())
    finally:
        destroy()
    assert states and moved  # the step ran and updated the weights
    moments = [st[k] for st in states for k in ("exp_avg", "exp_avg_sq")]
    steps = [float(st["step"]) for st in states]
    assert any(m.any() for m in moments)
    assert set(steps) == ({1.0} if reset else {2.0})


def test_ref_update_interval_moves_the_reference_and_a_checkpoint_keeps_it(tiny_model_dir, replay_dumps, tmp_path):
    """The driver's cadence (TrainSideConfig) and the worker's copy: after the update the reference log-probs are
    the actor's own (KL exactly 0); a checkpoint holds the moved reference and a resume takes it back."""
    from slime_lite.args import parser_defaults
    from slime_lite.backends.megatron.parallel import destroy
    from slime_lite.config import TrainSideConfig

    cfg = TrainSideConfig.from_args(parser_defaults(ref_update_interval=2))
    assert [cfg.updates_reference_after(r) for r in range(4)] == [False, True, False, True]
    assert not TrainSideConfig.from_args(parser_defaults()).updates_reference_after(0)
    samples = _samples(replay_dumps)
    ckpt = str(tmp_path / "ckpt")
    kl = ["--use-kl-loss", "--kl-loss-coef", "0.1", "--ref-update-interval", "2", "--save", ckpt]
    try:
        w = _worker(tiny_model_dir, replay_dumps, *kl)
        first = w.train(0, samples, None)[0].metrics
        second = w.train(1, samples, None)[0].metrics  # no update after rollout 0: the start weights
        assert first["rollout/kl"] == 0.0 and second["rollout/kl"] != 0.0
        w.update_reference()  # after rollout 1 (the driver's call)
        third = w.train(2, samples, None)[0].metrics
        assert third["rollout/kl"] == 0.0 and third["rollout/ref_log_probs"] == third["rollout/log_probs"]
        moved = {n: t.clone() for n, t in w.ref_state.items()}
        w.save(2, None)
    finally:
        destroy()
    try:
        resumed = _worker(tiny_model_dir, replay_dumps, *kl[:-2], "--load", ckpt, "--save", ckpt)
        assert all(torch.equal(resumed.ref_state[n], t) for n, t in moved.items())
    finally:
        destroy()


def test_save_hf_writes_the_actor_as_a_hugging_face_model_at_each_save(tiny_model_dir, replay_dumps, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from slime_lite.backends.megatron.parallel import destroy

    ckpt, out = tmp_path / "ckpt", tmp_path / "hf_out"
    try:
        w = _worker(tiny_model_dir, replay_dumps, "--save", str(ckpt), "--save-interval", "1", "--save-hf",
                    str(out / "rollout_{rollout_id}"))
        w.train(0, _samples(replay_dumps), None)
        w.save(0, None)
        w.train(1, _samples(replay_dumps), None)
        w.save(1, None)
    finally:
        destroy()
    assert sorted(p.name for p in out.iterdir()) == ["rollout_0", "rollout_1"]  # no temporary folder left
    for rid in (0, 1):  # the trained weights of that save, as its checkpoint's own export has them
        saved = load_file(out / f"rollout_{rid}" / "model.safetensors")
        export = load_file(ckpt / f"iter_{rid:07d}" / "hf" / "model.safetensors")
        assert saved.keys() == export.keys() and all(torch.equal(saved[k], export[k]) for k in saved)
    first = load_file(out / "rollout_0" / "model.safetensors")
    second = load_file(out / "rollout_1" / "model.safetensors")
    assert any(not torch.equal(first[k], second[k]) for k in first)
    AutoModelForCausalLM.from_pretrained(str(out / "rollout_1"))  # a model folder transformers loads


def test_save_hf_with_lora_writes_the_merged_model(tiny_model_dir, replay_dumps, tmp_path):
    from safetensors.torch import load_file

    from slime_lite.backends.megatron.parallel import destroy

    try:
        w = _worker(tiny_model_dir, replay_dumps, "--lora-rank", "4", "--lr", "1e-2", "--save", str(tmp_path / "c"),
                    "--save-interval", "1", "--save-hf", str(tmp_path / "hf"))
        w.train(0, _samples(replay_dumps), None)  # the adapters' B is no longer zero
        w.save(0, None)
        base, adapters = w.hf_weights(), w.hf_lora()
        want = w._effective(base, adapters)
    finally:
        destroy()
    saved = load_file(tmp_path / "hf" / "model.safetensors")
    assert saved.keys() == want.keys() and all(torch.equal(saved[k], want[k]) for k in saved)
    assert any(not torch.equal(saved[k], base[k]) for k in adapters)  # merged, not the base
    assert (tmp_path / "c" / "iter_0000000" / "adapter").is_dir()  # the checkpoint's own PEFT export is unchanged
