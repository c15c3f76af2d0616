"""The doctor and --ci-test on multi-turn samples (a generate hook with model and tool turns): a healthy hook
passes the train/rollout log-prob check over model tokens only; a hook whose loss mask trains the tool tokens
fails, and the failure names the loss mask and the inserted tokens as the cause."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tests.debug.test_doctor import failed, run_doctor, warm  # noqa: F401 - warm is a fixture

pytestmark = pytest.mark.slow

HOOK = """
from slime_lite.rollout import multi_turn as mt
from slime_lite.tokenizer import load_tokenizer


async def generate(args, sample, sampling_params):
    tok = load_tokenizer(args.hf_checkpoint)
    limits = mt.TurnLimits.from_args(args)
    await mt.model_turn(args, sample, dict(sampling_params, max_new_tokens=3), limits)
    mt.insert_turn(sample, tok, "1", limits)
    await mt.model_turn(args, sample, dict(sampling_params, max_new_tokens=3), limits)
    if TRAIN_TOOL_TOKENS:
        sample.loss_mask = [1] * sample.response_length
    return sample
"""


@pytest.fixture
def hooks(tmp_path, monkeypatch):
    for name, trains in (("mt_ok", False), ("mt_trains_tool", True)):
        (tmp_path / f"{name}.py").write_text(f"TRAIN_TOOL_TOKENS = {trains}\n" + textwrap.dedent(HOOK))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.syspath_prepend(str(tmp_path))


def _train(warm, *extra):  # noqa: F811
    model, data = warm
    return subprocess.run([sys.executable, "-m", "slime_lite.cli", "train", "--hf-checkpoint", model, "--prompt-data",
                           data, "--rm-type", "addition", "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
                           "--num-rollout", "2", "--ci-test", *extra], capture_output=True, text=True, timeout=600)


def test_ci_test_passes_a_healthy_multi_turn_hook_and_names_the_loss_mask_when_tool_tokens_train(warm, hooks):  # noqa: F811
    ok = _train(warm, "--custom-generate-function-path", "mt_ok.generate")
    assert ok.returncode == 0, ok.stderr[-3000:]
    bad = _train(warm, "--custom-generate-function-path", "mt_trains_tool.generate")
    assert bad.returncode == 2, bad.stderr[-3000:]
    assert ("--ci-test: check trained_tokens_without_engine_logprob failed at rollout 0: value 8.0, expected == 0. "
            "Likely causes: the loss mask trains tokens the engine did not generate") in bad.stderr, bad.stderr[-3000:]
    assert "sample 0: 1 tokens from response position 3 in turn 1 (tool)" in bad.stderr


def test_the_doctor_names_the_loss_mask_on_a_multi_turn_hook_that_trains_tool_tokens(warm, hooks, tmp_path):  # noqa: F811
    checks = run_doctor(warm, tmp_path / "doctor", "--custom-generate-function-path", "mt_trains_tool.generate",
                        expect_rc=1)
    assert {"trained_tokens_without_engine_logprob", "train_rollout_logprob_diff"} <= failed(checks)
    cause = checks["train_rollout_logprob_diff"]["cause"]
    assert cause.startswith("the loss mask: ") and "tokens the engine did not generate (inserted turns) are trained" \
        in cause and "in turn 1 (tool)" in cause, cause
    assert checks["token_drift"]["passed"] and checks["masked_model_turns"]["passed"]
