"""slime's trainer-side hook flags on the train worker itself (one in-process Megatron rank, CPU, float32, no Ray):
--custom-advantage-function-path, --custom-loss-function-path (--loss-type custom_loss) and
--custom-pg-loss-reducer-function-path; and their signature check before Ray starts."""

from __future__ import annotations

import argparse
import textwrap

import pytest

from slime_lite.errors import SlimeLiteError
from slime_lite.io import free_port

pytestmark = pytest.mark.slow

# one optimizer step of the 8 samples, one sample per micro-batch: the step's normalizer is 8
FLAGS = ["--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--global-batch-size", "8", "--lr", "1e-3",
         "--seed", "7"]


def _hook_module(tmp_path, monkeypatch, name: str, body: str) -> str:
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(body))
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def _train(model_dir, dumps, *extra):
    """Rollout 0 of the replay dump trained once: (metrics, the worker's samples)."""
    from slime_lite.args import parse_args
    from slime_lite.backends.megatron.actor import TrainActor
    from slime_lite.backends.megatron.parallel import destroy
    from slime_lite.rollout.dumps import dump_path, load_rollout_dump

    samples = load_rollout_dump(dump_path(dumps, 0)).samples
    try:
        worker = TrainActor(parse_args(["--load-debug-rollout-data", dumps, "--hf-checkpoint", str(model_dir),
                                        *FLAGS, *extra]), 0, 1)
        worker.init("127.0.0.1", free_port())
        result, _ = worker.train(0, samples, None)
    finally:
        destroy()
    return result.metrics, samples


def test_custom_advantage_hook_gives_the_advantages_the_policy_loss_trains_on(tiny_model_dir, replay_dumps, tmp_path,
                                                                              monkeypatch):
    mod = _hook_module(tmp_path, monkeypatch, "adv_hook_t", """
        import torch
        SEEN = {}
        def advantage(args, rollout_data):
            SEEN.update(rollout_data)
            n = len(rollout_data["log_probs"])
            rollout_data["advantages"] = [torch.full_like(lp, 0.5) for lp in rollout_data["log_probs"]]
            rollout_data["returns"] = [torch.full_like(lp, float(i)) for i, lp in enumerate(rollout_data["log_probs"])]
    """)
    metrics, samples = _train(tiny_model_dir, replay_dumps, "--custom-advantage-function-path", f"{mod}.advantage")
    import adv_hook_t
    import torch

    seen = adv_hook_t.SEEN
    assert metrics["rollout/advantages"] == pytest.approx(0.5)
    # on-policy first step: ratio 1, so pg_loss = -(mean advantage) = -0.5 (GRPO's advantages average 0)
    assert metrics["train/pg_loss"] == pytest.approx(-0.5, abs=1e-4)
    assert seen["response_lengths"] == [s.response_length for s in samples]
    assert seen["total_lengths"] == [len(s.tokens) for s in samples]
    assert all(torch.equal(k, torch.zeros_like(k)) for k in seen["kl"])  # no reference, --kl-coef 0
    raw = torch.tensor(seen["raw_reward"]).reshape(-1, 2)  # GRPO's rewards, group-normalised as slime's are
    want = ((raw - raw.mean(1, keepdim=True)) / (raw.std(1, keepdim=True) + 1e-6)).flatten()
    assert seen["rewards"] == pytest.approx(want.tolist(), abs=1e-5)


def test_custom_loss_hook_is_the_whole_policy_loss(tiny_model_dir, replay_dumps, tmp_path, monkeypatch):
    mod = _hook_module(tmp_path, monkeypatch, "loss_hook_t", """
        import torch
        def loss(args, batch, logits, sum_of_sample_mean):
            assert logits.dim() == 3 and len(batch["unconcat_tokens"]) == len(batch["advantages"])
            nll = sum_of_sample_mean(-torch.cat(batch["cur_log_probs"]))
            ones = sum_of_sample_mean(torch.ones_like(torch.cat(batch["loss_masks"])))
            return nll, {"nll": nll.detach(), "samples": ones}
    """)
    from slime_lite.args import parser_defaults
    from slime_lite.args_train import check_slime_train_flags

    with pytest.raises(SlimeLiteError, match="--loss-type custom_loss takes its loss from"):
        check_slime_train_flags(parser_defaults(loss_type="custom_loss"))
    metrics, _ = _train(tiny_model_dir, replay_dumps, "--loss-type", "custom_loss",
                        "--custom-loss-function-path", f"{mod}.loss")
    assert "train/pg_loss" not in metrics and metrics["train/samples"] == pytest.approx(1.0)
    # the mean negative log-likelihood of the step's samples, in slime's units (divided by the 8 samples)
    assert metrics["train/nll"] == pytest.approx(-metrics["rollout/log_probs"], rel=1e-4)
    assert metrics["train/loss"] == pytest.approx(metrics["train/nll"])
    assert metrics["train/grad_norm"] > 0


def test_custom_pg_loss_reducer_reduces_the_policy_gradient_term(tiny_model_dir, replay_dumps, tmp_path,
                                                                   monkeypatch):
    mod = _hook_module(tmp_path, monkeypatch, "reducer_hook_t", """
        CALLS = []
        def get_pg_loss_reducer(total_lengths, response_lengths, loss_masks, calculate_per_token_loss=False):
            CALLS.append((list(total_lengths), list(response_lengths), calculate_per_token_loss))
            def reducer(pg_loss):  # a constant 3 per sample, whatever the tokens
                return pg_loss.sum() * 0 + 3.0 * len(loss_masks)
            return reducer
    """)
    metrics, samples = _train(tiny_model_dir, replay_dumps, "--custom-pg-loss-reducer-function-path",
                              f"{mod}.get_pg_loss_reducer")
    import reducer_hook_t

    calls = reducer_hook_t.CALLS
    assert metrics["train/pg_loss"] == pytest.approx(3.0) and metrics["train/loss"] == pytest.approx(3.0)
    assert len(calls) == len(samples)  # once per micro-batch, one sample each
    assert sorted(c[1][0] for c in calls) == sorted(s.response_length for s in samples)
    assert all(c[0][0] > c[1][0] and c[2] is False for c in calls)  # prompt + response; per-sample means


def test_train_hooks_are_checked_before_ray_starts_and_skipped_without_a_trainer(tmp_path, monkeypatch):
    from slime_lite.args import parser_defaults
    from slime_lite.preflight import check_hooks

    mod = _hook_module(tmp_path, monkeypatch, "bad_hooks_t", """
        def advantage(args):
            pass
        def loss(args, batch, logits):
            pass
        def reducer(total_lengths, response_lengths, loss_masks, calculate_per_token_loss):
            return sum
    """)
    for flag, fn in (("custom_advantage_function_path", "advantage"), ("custom_loss_function_path", "loss")):
        args = parser_defaults(**{flag: f"{mod}.{fn}", "load_debug_rollout_data": "x_{rollout_id}.pt"})
        with pytest.raises(SlimeLiteError, match="cannot be called as"):
            check_hooks(args)  # a replay trains, so the trainer's hooks are checked
        check_hooks(argparse.Namespace(**{**vars(args), "load_debug_rollout_data": None,
                                          "debug_rollout_only": True}))  # no trainer: not called, not checked
    check_hooks(parser_defaults(custom_pg_loss_reducer_function_path=f"{mod}.reducer"))
