"""Flags checked in the mode that reads them, and only there: a replay (no engines) does not need SGLang, a
--debug-rollout-only run still checks what its engines serve (routing replay, LoRA), a flag that does nothing alone
is refused, and an error names the flag the user gave."""

from __future__ import annotations

import json
import sys

import pytest

from slime_lite.args import parse_args
from tests.test_args import err


@pytest.fixture()
def base(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2", "num_attention_heads": 4,
                                                   "num_key_value_heads": 2, "num_hidden_layers": 2,
                                                   "intermediate_size": 64}))
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "1+1=", "label": "2"}\n')
    return ["--hf-checkpoint", str(model), "--prompt-data", str(data), "--rm-type", "addition"]


def test_a_replay_of_an_sglang_script_needs_no_sglang_here(base, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", None)  # as on a machine without SGLang: its import fails
    replay = base + ["--rollout-backend", "sglang", "--load-debug-rollout-data", str(tmp_path / "d_{rollout_id}.pt")]
    assert parse_args(replay).debug_train_only
    assert "SGLang" in err(base + ["--rollout-backend", "sglang"])  # a run that starts SGLang engines still checks


def test_a_rollout_only_run_checks_what_its_engines_serve(base):
    only = base + ["--debug-rollout-only"]
    assert "has no experts to route" in err(only + ["--use-rollout-routing-replay"])
    assert "--lora-rank -4 must be a positive integer" in err(only + ["--lora-rank", "-4"])
    assert "no trainer" in err(only + ["--lora-rank", "8", "--lora-adapter-path", "/nonexistent"])
    assert parse_args(only + ["--lora-rank", "8"]).lora_rank == 8


def test_flags_that_do_nothing_alone_or_cannot_work_are_refused(base):
    assert "--tis-clip has no effect without --use-tis" in err(base + ["--tis-clip", "3"])
    assert parse_args(base + ["--tis-clip", "3", "--use-tis"]).tis_clip == 3.0
    assert parse_args(base + ["--tis-clip", "3", "--use-rs"]).tis_clip == 3.0
    assert "--lora-alpha inf must be a finite number" in err(base + ["--lora-rank", "8", "--lora-alpha", "inf"])


@pytest.mark.parametrize("mode", [["--async"], ["--fully-async"], ["--update-weights-interval", "2"]])
def test_an_error_names_offload_when_that_is_the_flag_given(base, mode):
    msg = err(base + mode + ["--offload"])
    assert "--offload " in msg and "--offload-rollout" not in msg


@pytest.mark.parametrize("flag, value", [("--moe-aux-loss-coeff", "0.01"), ("--moe-z-loss-coeff", "0.001"),
                                         ("--moe-router-dtype", "fp32")])
def test_router_flags_on_a_dense_model_are_refused(base, flag, value):
    assert f"{flag} {value}: the model (qwen2) has no experts, so no router" in err(base + [flag, value])


def test_the_context_length_bounds_the_prompt_length_as_slime(base):
    """slime: --rollout-max-prompt-len defaults to --rollout-max-context-len - 1 (room for one response token), and
    a larger one is refused."""
    assert parse_args(base + ["--rollout-max-context-len", "64"]).rollout_max_prompt_len == 63
    assert parse_args(base + ["--rollout-max-context-len", "64", "--rollout-max-prompt-len", "20"]) \
        .rollout_max_prompt_len == 20
    assert "--rollout-max-prompt-len 64 leaves no room" in err(base + ["--rollout-max-context-len", "64",
                                                                      "--rollout-max-prompt-len", "64"])
