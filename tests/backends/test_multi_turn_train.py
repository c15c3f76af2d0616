"""Multi-turn samples in the trainer: inserted (tool, environment) tokens get exactly zero gradient and count in no
loss, KL, entropy, advantage or train/ metric: on CPU through the trainer's own log-prob and loss code, and in the
Megatron replay under TP=2 and PP=2."""

from __future__ import annotations

import pytest
import torch

from slime_lite import rl_math
from slime_lite.args import parser_defaults
from slime_lite.backends.megatron import batch as B
from slime_lite.backends.megatron.actor import masked_max
from slime_lite.backends.megatron.logprobs import sample_log_probs
from slime_lite.backends.megatron.loss import rl_loss
from slime_lite.config import LossConfig
from slime_lite.rollout.turns import append_turn
from slime_lite.types import Sample

VOCAB = 40


def _multi_turn(seed: int) -> Sample:
    """prompt, model turn, tool turn, model turn, trailing environment turn."""
    g = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(4, VOCAB, (n,), generator=g).tolist()  # noqa: E731
    lps = lambda n: (-torch.rand(n, generator=g) * 3).tolist()  # noqa: E731
    s = Sample(tokens=ids(3))
    append_turn(s, ids(4), lps(4))
    append_turn(s, ids(3), source="tool", text="<tool>")
    append_turn(s, ids(2), lps(2))
    append_turn(s, ids(2), source="env", text="<env>")
    return s


@pytest.mark.parametrize("estimator", ["grpo", "reinforce_plus_plus"])
def test_inserted_tokens_get_exactly_zero_gradient_and_count_in_no_loss_term(estimator):
    samples = [_multi_turn(i) for i in range(4)]
    masks = B.loss_masks(samples)
    assert [m.tolist() for m in masks[:1]] == [[1, 1, 1, 1, 0, 0, 0, 1, 1, 0, 0]]
    mb = B.make_micro_batch(samples, list(range(4)), B.padded_length(samples))
    logits = torch.randn(4, mb.tokens.shape[1], VOCAB, dtype=torch.float64, requires_grad=True)
    lp, ent = sample_log_probs(logits, mb, 1.0, VOCAB, with_entropy=True, tp=False)
    old = [x.detach() + 0.01 * torch.randn_like(x) for x in lp]
    ref = [x.detach() - 0.02 for x in lp]
    adv, _ = rl_math.compute_advantages_and_returns(estimator, [1.0, 0.0, 0.5, 0.2], old, ref, None, masks,
                                                    group_size=2, kl_coef=0.1)
    rollout = B.rollout_log_probs(samples)
    cfg = LossConfig.from_args(parser_defaults(entropy_coef=0.01, use_kl_loss=True, kl_loss_coef=0.1, use_tis=True))
    loss, metrics = rl_loss(lp, old, ref, rollout, adv, masks, ent, cfg)
    loss.backward()
    grad = logits.grad
    for row, s in enumerate(samples):
        p = s.prompt_length
        rows = grad[row, p - 1: p - 1 + s.response_length]  # the logits that score each response token
        inserted, model = rows[masks[row] == 0], rows[masks[row] == 1]
        assert inserted.abs().max().item() == 0.0  # exactly zero, not small
        assert (model.abs().sum(dim=1) > 0).all()
    # the same loss and metrics when the inserted tokens' values are replaced by garbage: they are never read
    garbage = [torch.where(m.bool(), x, torch.full_like(x, -1e4)) for x, m in zip(rollout, masks)]
    lp2 = [torch.where(m.bool(), x, torch.full_like(x, 7.0)) for x, m in zip(lp, masks)]
    ent2 = [torch.where(m.bool(), x, torch.full_like(x, 99.0)) for x, m in zip(ent, masks)]
    _, metrics2 = rl_loss(lp2, old, ref, garbage, adv, masks, ent2, cfg)
    assert {k: float(v) for k, v in metrics2.items()} == pytest.approx({k: float(v) for k, v in metrics.items()},
                                                                       rel=1e-12)
    assert masked_max([(x - y).abs() for x, y in zip(lp2, garbage)], masks) < 10  # the -1e4 / 7.0 tokens left out


def _multi_turn_dumps(model_dir, dump_template: str, out_dir, extra_turn: bool) -> str:
    """The replay dumps made multi-turn: each response split into a model turn, an inserted tool turn (mask 0,
    log-prob 0.0) and the rest as a second model turn, the model turns' log-probs from an HF forward of the whole
    sequence (as an engine would give them); with ``extra_turn`` a masked environment turn is appended at the end."""
    from transformers import AutoModelForCausalLM

    from slime_lite.rollout.dumps import dump_path, load_rollout_dump, save_rollout_dump

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), attn_implementation="eager").eval()
    tool, env = [7, 8, 9], [10, 11, 12, 13]
    for rid in range(2):
        dump = load_rollout_dump(dump_path(dump_template, rid))
        samples = []
        for s in dump.samples:
            prompt, resp = s.tokens[:s.prompt_length], s.tokens[s.prompt_length:]
            seq = prompt + resp[:1] + tool + resp[1:]
            with torch.no_grad():
                lp = torch.log_softmax(model(torch.tensor([seq])).logits[0].float(), -1)
            lps = [lp[k - 1, seq[k]].item() for k in range(len(prompt), len(seq))]
            m = Sample(group_index=s.group_index, index=s.index, prompt=s.prompt, tokens=list(prompt), label=s.label,
                       reward=s.reward, status=s.status)
            append_turn(m, resp[:1], lps[:1])
            append_turn(m, tool, source="tool", text="tool")
            append_turn(m, resp[1:], lps[1 + len(tool):])
            if extra_turn:
                append_turn(m, env, source="env", text="env")
            samples.append(m)
        save_rollout_dump(str(out_dir / f"mt_{rid}.pt"), rid, samples, dump.meta)
    return str(out_dir / "mt_{rollout_id}.pt")


@pytest.mark.slow
def test_a_trailing_inserted_turn_changes_no_train_metric_under_tp2_and_pp2(tiny_model_dir, replay_dumps, tmp_path,
                                                                           train_cli, metrics_of):
    """Multi-turn dumps replayed at TP=PP=1, then the same with one more masked turn at the end of every response at
    TP=2 and at PP=2: the trailing tokens sit after every trained token (causal attention: they change no earlier
    logit), so if the mask keeps them out of every term, every step's grad-norm (--ci-load-grad-norm, float32 rtol)
    and the loss, KL, entropy and log-prob metrics are those of the run without them."""
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    base = _multi_turn_dumps(tiny_model_dir, replay_dumps, tmp_path / "a", extra_turn=False)
    longer = _multi_turn_dumps(tiny_model_dir, replay_dumps, tmp_path / "b", extra_turn=True)
    common = ["--hf-checkpoint", str(tiny_model_dir), "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
              "--num-rollout", "1", "--num-steps-per-rollout", "2", "--use-kl-loss", "--kl-loss-coef", "0.1",
              "--entropy-coef", "0.01", "--lr", "1e-4", "--seed", "7"]
    gn = tmp_path / "gn.json"
    ref = train_cli(["--load-debug-rollout-data", base, *common, "--metrics-path", str(tmp_path / "ref.jsonl"),
                     "--ci-save-grad-norm", str(gn)])
    assert ref.returncode == 0, ref.stderr[-3000:]
    a = metrics_of(tmp_path / "ref.jsonl")[0]
    assert a["train/train_rollout_logprob_abs_diff"] < 1e-5  # the inserted tokens' 0.0 log-probs are not compared
    for name, layout in (("tp2", ["--tensor-model-parallel-size", "2"]), ("pp2", ["--pipeline-model-parallel-size",
                                                                                   "2"])):
        proc = train_cli(["--load-debug-rollout-data", longer, *common, "--metrics-path",
                          str(tmp_path / f"{name}.jsonl"), "--actor-num-gpus-per-node", "2", *layout,
                          "--ci-load-grad-norm", str(gn)])
        assert proc.returncode == 0, (name, proc.stderr[-3000:])
        b = metrics_of(tmp_path / f"{name}.jsonl")[0]
        for key in ("train/loss", "train/grad_norm", "train/pg_loss", "train/kl_loss", "train/entropy_loss",
                    "rollout/log_probs", "rollout/advantages"):
            assert abs(a[key] - b[key]) <= 1e-4 * max(abs(a[key]), 1e-6), (name, key, a[key], b[key])
        # float32 noise on both (a masked token counted would add its |log-prob - 0.0|, about 3)
        for key in ("train/train_rollout_logprob_abs_diff", "train/train_rollout_logprob_abs_diff_max"):
            assert b[key] < 1e-5, (name, key, b[key])
