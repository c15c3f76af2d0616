"""The debug tools on multi-turn samples: a real dump written by the rollout manager from a multi-turn generate hook
against an in-process embedded engine (model turns, tool turns), then display-rollouts (each turn with its source
and mask), explain (per turn, masked tokens apart, never highlighted; terminal and HTML), diff-rollouts (the turn
and the loss mask named), send-to-engine (each model turn resent and matched) and replay-reward."""

from __future__ import annotations

import json
import shutil
import textwrap

import pytest
import torch

from slime_lite.args import parser_defaults
from slime_lite.backends.megatron.train_dump import save_train_dump
from slime_lite.cli import main as cli
from slime_lite.rollout.dumps import load_rollout_dump, save_rollout_dump
from tests.engine.engine_helpers import start_engine
from tests.rollout.test_multi_turn import HOOK


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    server = start_engine(tiny_model_dir, max_running_requests=8)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def dump(tiny_model_dir, engine, tmp_path_factory):
    """rollout 0 of 2 prompts x 2 samples, 2 model turns and a tool turn each."""
    import sys

    from slime_lite.rollout.manager import RolloutManager

    out = tmp_path_factory.mktemp("mt_tools")
    (out / "mt_tools_hook.py").write_text(textwrap.dedent(HOOK))
    (out / "mt_tools_rm.py").write_text("def reward(args, sample):\n    return float(len(sample.response) % 2)\n")
    sys.path.insert(0, str(out))
    prompts = out / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "label": "1"}) + "\n" for i in range(2)))
    args = parser_defaults(hf_checkpoint=str(tiny_model_dir), prompt_data=str(prompts), rollout_batch_size=2,
                           n_samples_per_prompt=2, custom_generate_function_path="mt_tools_hook.generate",
                           custom_rm_path="mt_tools_rm.reward", max_turns=2,
                           save_debug_rollout_data=str(out / "data_{rollout_id}.pt"))
    manager = RolloutManager(args, [engine.url])
    manager.generate(0)
    manager.close()
    sys.path.remove(str(out))
    return out


def test_display_rollouts_shows_each_turn_with_source_and_mask(dump, capsys):
    assert cli(["display-rollouts", "--load-debug-rollout-data", str(dump / "data_{rollout_id}.pt")]) == 0
    out = capsys.readouterr().out
    assert "turn 0" in out and "model, response tokens 0..2, loss mask 1" in out
    assert "tool, response tokens 3..6, loss mask 0: =42;" in out and "turn 2" in out
    assert "rollout/turns/mean" in out and "rollout/masked_token_share" in out


def test_explain_shows_a_multi_turn_sample_turn_by_turn(dump, tmp_path, capsys):
    d = load_rollout_dump(str(dump / "data_0.pt"))
    masks = [torch.tensor(s.loss_mask, dtype=torch.float32) for s in d.samples]
    # the trainer's columns as it writes them; the tool tokens' train log-probs are far from their placeholder
    # 0.0 rollout log-probs, which must not be highlighted (they are not trained)
    train_lp = [torch.where(m.bool(), torch.tensor(s.rollout_log_probs), torch.full_like(m, -3.0))
                for s, m in zip(d.samples, masks)]
    columns = {"log_probs": train_lp, "ref_log_probs": train_lp, "rollout_log_probs": None,
               "advantages": [m * 0.5 for m in masks], "returns": [m * 0.5 for m in masks], "loss_masks": masks,
               "values": None, "entropy": None}
    train = save_train_dump(str(tmp_path / "train_{rollout_id}_{rank}.pt"), 0, 0, d.samples, range(4), columns)
    page = tmp_path / "s1.html"
    assert cli(["explain", "--rollout-dump", str(dump / "data_0.pt"), "--train-dump", train, "--sample", "1",
                "--html", str(page)]) == 0
    out = capsys.readouterr().out
    assert "0 model (3 tokens, trained, max |diff| 0), 1 tool (4 tokens, masked), 2 model (3 tokens, trained" in out
    assert "0 token(s) with |diff| > 0.05" in out and "1 tool" in out
    html = page.read_text()
    assert html.count('<b class="turn">') == 3 and "turn 1 tool" in html
    assert 'class="hot"' not in html and html.count('<tr class="off">') == 4


def test_diff_rollouts_names_the_turn_and_the_loss_mask(dump, tmp_path, capsys):
    d = load_rollout_dump(str(dump / "data_0.pt"))
    d.samples[2].loss_mask = [1] * d.samples[2].response_length  # the tool turn left trainable
    other = tmp_path / "other_0.pt"
    save_rollout_dump(str(other), 0, d.samples, d.meta)
    assert cli(["diff-rollouts", str(dump / "data_0.pt"), str(other)]) == 1
    out = capsys.readouterr().out
    assert "loss_mask differs from response token 3 (response, turn 1 (tool))" in out


def test_send_to_engine_resends_each_model_turn(dump, engine, capsys):
    rc = cli(["send-to-engine", "--load-debug-rollout-data", str(dump / "data_{rollout_id}.pt"), "--rollout-id",
              "0", "--url", engine.url, "--all"])
    out = capsys.readouterr().out
    assert "(b) turn 0 (model) regenerated" in out and "(b) turn 2 (model) regenerated" in out
    assert out.count("identical (3 tokens)") == 8 and "verdict: MATCH (4 match" in out, out[-3000:]
    assert rc == 0


def test_replay_reward_recomputes_the_rewards_of_a_multi_turn_dump(dump, tmp_path, capsys, monkeypatch):
    shutil.copy(dump / "mt_tools_rm.py", tmp_path / "mt_tools_rm.py")
    monkeypatch.syspath_prepend(str(tmp_path))
    rc = cli(["replay-reward", "--load-debug-rollout-data", str(dump / "data_{rollout_id}.pt"), "--custom-rm-path",
              "mt_tools_rm.reward"])
    assert rc == 0, capsys.readouterr().out
