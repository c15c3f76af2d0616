"""``slime-lite doctor``: a healthy run passes every check; each injected fault fails the right check with its cause.

The slow tests share one small warm-started model (built once, ~15 s) and run the doctor once per fault (~30 s
each on 2 cores). Run them with ``-s`` to see the doctor's tables. The fast tests are in ``test_doctor_fast.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slime_lite.debug import doctor

# ------------------------------------------------------------------------------------------ doctor runs (slow)
@pytest.fixture(scope="module")
def warm(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """A small on-task model (raw-text prompts, no chat template in its warm start) and addition prompts."""
    from slime_lite.tasks import make_data
    from slime_lite.tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("doctor_model")
    make_tiny_model(root / "model", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                    warm_start_steps=800, warm_start_target=None)
    make_data("addition", root / "data.jsonl", n_train=200, n_eval=20)
    return str(root / "model"), str(root / "data.jsonl")


def run_doctor(warm, out: Path, *extra: str, expect_rc: int) -> dict[str, dict]:
    model, data = warm
    argv = ["--hf-checkpoint", model, "--prompt-data", data, "--rm-type", "addition", "--rollout-max-response-len",
            "6", "--use-kl-loss", "--kl-loss-coef", "0.01", "--lr", "1e-4", "--out", str(out), *extra]
    rc = doctor.main(argv)  # prints the table (pytest -s shows it)
    report = json.loads((out / "doctor.json").read_text())
    assert rc == expect_rc, report
    return {c["name"]: c for c in report["checks"]} | {"_report": report}


def failed(checks: dict) -> set[str]:
    return {n for n, c in checks.items() if not n.startswith("_") and not c["passed"]}


@pytest.mark.slow
def test_a_healthy_run_passes_every_check_and_keeps_its_dumps(warm, tmp_path):
    checks = run_doctor(warm, tmp_path, expect_rc=0)
    assert failed(checks) == set()
    assert {"on_task_nll", "on_task_repetition", "on_task_valid_chars", "on_task_prompt_format", "step1_kl_zero",
            "first_step_ppo_kl_zero", "train_rollout_logprob_diff", "grad_norm_finite", "weights_equal_after_push",
            "weight_version_served", "iteration2_reload", "memory_headroom", "peak_memory/actor",
            "peak_memory/engine"} <= set(checks)
    assert checks["train_rollout_logprob_diff"]["value"] < 1e-4 and checks["step1_kl_zero"]["value"] == 0.0
    for path in ("rollout_data/0.pt", "rollout_data/1.pt", "train_data/0.pt", "args.json", "metrics.jsonl"):
        assert (tmp_path / path).is_file(), path
    assert "localization" not in checks["_report"]
    assert checks["mismatch_token_ratio_max"]["value"] == pytest.approx(1.0, abs=1e-4)  # float32: they agree
    assert checks["mismatch_token_ratio_outside_frac"]["value"] == 0.0 and checks["mismatch_k3_kl"]["passed"]
    worst = [json.loads(line) for line in (tmp_path / "mismatch" / "0.jsonl").read_text().splitlines()]
    assert len(worst) == 10 and all(w["rollout_id"] == 0 and isinstance(w["token"], str) for w in worst)


@pytest.mark.slow
def test_an_engine_that_never_receives_weights_fails_the_weight_and_iteration2_checks(warm, tmp_path):
    checks = run_doctor(warm, tmp_path, "--debug-inject-fault", "skip-weight-push", "--lr", "1e-3",
                        "--entropy-coef", "0.01", expect_rc=1)
    assert {"weights_equal_after_push", "weight_version_served", "iteration2_reload"} <= failed(checks)
    assert "never received the pushed weights" in checks["weights_equal_after_push"]["cause"]
    assert checks["train_rollout_logprob_diff"]["passed"]  # iteration 1 still ran on the checkpoint's weights
    assert checks["iteration2_reload"]["value"] > 1e-3 and "did not reload" in checks["iteration2_reload"]["cause"]
    assert len(checks["_report"]["runs"]) == 2  # the stopped run, then the run without the weight check
    # the rerun is a plain `slime-lite train ... --debug-inject-fault skip-weight-push` of 2 rollouts: it ends
    # normally, and the skipped push shows in its own metrics as rollout 1's train/rollout log-prob diff
    rerun = checks["_report"]["runs"][1]
    assert rerun["returncode"] == 0 and not rerun["error"], rerun
    rows = [json.loads(line) for line in (Path(rerun["out"]) / "metrics.jsonl").read_text().splitlines()]
    assert [r["train/train_rollout_logprob_abs_diff"] > 1e-3 for r in rows if r["rollout_id"] >= 0] == [False, True]


NO_VERSION_HOOK = """
from slime_lite.types import Status


async def generate(args, sample, sampling_params):
    # a correct slime-style hook that, like many, does not copy meta_info.weight_version into the sample
    out = await args.engine_client.generate({"input_ids": sample.tokens, "sampling_params": sampling_params,
                                             "return_logprob": True})
    ids = list(out["output_ids"])
    sample.tokens = sample.tokens + ids
    sample.response, sample.response_length, sample.loss_mask = out["text"], len(ids), [1] * len(ids)
    sample.rollout_log_probs = [float(t[0]) for t in out["meta_info"]["output_token_logprobs"]]
    sample.status = Status.from_finish_reason(out["meta_info"]["finish_reason"]["type"])
    return sample
"""


@pytest.mark.slow
def test_a_hook_that_records_no_weight_versions_passes_and_a_skipped_push_is_still_caught(warm, tmp_path,
                                                                                         monkeypatch):
    """The weight version is read from the engines when the samples carry none (and the doctor says so): the
    doctor passes a correct hook, as --ci-test does, and --ci-test still stops a run whose push was skipped."""
    import os
    import subprocess
    import sys

    (tmp_path / "no_version_hook.py").write_text(NO_VERSION_HOOK)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    hook = ("--custom-generate-function-path", "no_version_hook.generate")
    checks = run_doctor(warm, tmp_path / "doctor", *hook, expect_rc=0)
    served = checks["weight_version_served"]
    assert served["passed"] and "read from the engines" in served["threshold"], served
    model, data = warm
    proc = subprocess.run([sys.executable, "-m", "slime_lite.cli", "train", "--hf-checkpoint", model, "--prompt-data",
                           data, "--rm-type", "addition", "--rollout-max-response-len", "6", "--rollout-batch-size",
                           "4", "--n-samples-per-prompt", "2", "--num-rollout", "2", "--ci-test", *hook,
                           "--debug-inject-fault", "skip-weight-push", "--use-tensorboard", "--tensorboard-dir",
                           str(tmp_path / "tb"), "--metrics-path", str(tmp_path / "m.jsonl")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stderr[-3000:]
    # the skipped pushes leave the engine on the weights it loaded itself (version "default", read as -1)
    assert "weight_version_served failed at rollout 0: value -1.0, expected == 0" in proc.stderr, proc.stderr[-3000:]
    # the failing rollout's metrics reach TensorBoard's file too, every one (its writer is closed on the way out)
    import json
    import math

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (row,) = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    numbers = {k for k, v in row.items() if k != "rollout_id" and isinstance(v, (int, float)) and math.isfinite(v)}
    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    assert row["rollout_id"] == 0 and len(numbers) > 20 and set(events.Tags()["scalars"]) == numbers


@pytest.mark.slow
def test_a_swapped_pp_layer_mapping_fails_the_weight_check(warm, tmp_path):
    checks = run_doctor(warm, tmp_path, "--debug-inject-fault", "swap-pp-layers", "--actor-num-gpus-per-node", "2",
                        "--pipeline-model-parallel-size", "2", "--no-rerun", expect_rc=1)
    check = checks["weights_equal_after_push"]
    assert not check["passed"] and "layer-id mapping" in check["cause"] and "model.layers." in check["cause"]


@pytest.mark.slow
def test_an_engine_in_lower_precision_fails_the_logprob_check_and_names_the_dtype(warm, tmp_path):
    checks = run_doctor(warm, tmp_path, "--engine-dtype", "bfloat16", expect_rc=1)
    assert {"train_rollout_logprob_diff", "precision_match"} <= failed(checks)
    assert "dtype cast" in checks["train_rollout_logprob_diff"]["cause"]
    assert checks["_report"]["localization"]["first_divergent"] == "embedding"
    assert checks["weights_equal_after_push"]["passed"]


@pytest.mark.slow
def test_a_temperature_mismatch_fails_the_logprob_check_and_is_localised_to_sampling(warm, tmp_path):
    checks = run_doctor(warm, tmp_path, "--debug-inject-fault", "engine-temperature", expect_rc=1)
    assert "train_rollout_logprob_diff" in failed(checks)
    assert "temperature mismatch" in checks["train_rollout_logprob_diff"]["cause"]
    assert "worst tokens: '" in checks["train_rollout_logprob_diff"]["cause"]  # named, with their text
    assert checks["mismatch_token_ratio_max"]["value"] > 1.01 and checks["mismatch_k3_kl"]["value"] > 0
    loc = checks["_report"]["localization"]
    assert loc["first_divergent"] is None and loc["extra"]["fitted_temperature"] == pytest.approx(1.5)
    assert checks["weights_equal_after_push"]["passed"] and checks["precision_match"]["passed"]


@pytest.mark.slow
def test_prompts_formatted_unlike_the_warm_start_fail_the_on_task_check(warm, tmp_path):
    checks = run_doctor(warm, tmp_path, "--apply-chat-template", expect_rc=1)
    check = checks["on_task_prompt_format"]
    assert not check["passed"] and "drop --apply-chat-template" in check["cause"]
    assert failed(checks) <= {"on_task_prompt_format", "on_task_nll", "on_task_valid_chars", "on_task_repetition"}


# ------------------------------------------------------------------------------------------ on a GPU, in bf16 (gpu)
# The checks were calibrated on float32 CPU runs; a healthy bf16 engine and trainer differ by ~1e-2 per token on an
# H200. These run the doctor colocated on one GPU in bf16 (scripts/test-gpu.sh): a healthy run passes, each fault
# still fails with its cause, and the localisation runs on CUDA.
def _cuda_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


gpu = [pytest.mark.gpu, pytest.mark.skipif(_cuda_gpus() == 0, reason="needs CUDA")]
BF16 = ("--colocate", "--bf16", "--engine-dtype", "bfloat16")


@pytest.mark.parametrize("_", [pytest.param(None, marks=gpu)])
def test_a_healthy_bf16_run_on_a_gpu_passes_every_check(warm, tmp_path, _):
    checks = run_doctor(warm, tmp_path, *BF16, expect_rc=0)
    assert failed(checks) == set()
    lp = checks["train_rollout_logprob_diff"]
    assert 0 < lp["value"] < 5e-2 and "default for bfloat16" in lp["threshold"]  # bf16 noise, under its bound
    assert checks["peak_cuda/engine"]["value"] > 0


@pytest.mark.parametrize("_", [pytest.param(None, marks=gpu)])
def test_a_temperature_mismatch_in_bf16_on_a_gpu_is_caught_and_localised_on_cuda(warm, tmp_path, _):
    checks = run_doctor(warm, tmp_path, *BF16, "--debug-inject-fault", "engine-temperature", expect_rc=1)
    assert "train_rollout_logprob_diff" in failed(checks)
    assert "temperature mismatch" in checks["train_rollout_logprob_diff"]["cause"]
    assert "worst tokens: '" in checks["train_rollout_logprob_diff"]["cause"]  # named, with their text
    assert checks["mismatch_token_ratio_max"]["value"] > 1.01 and checks["mismatch_k3_kl"]["value"] > 0
    loc = checks["_report"]["localization"]
    assert loc["first_divergent"] is None and loc["extra"]["fitted_temperature"] == pytest.approx(1.5)


@pytest.mark.parametrize("_", [pytest.param(None, marks=gpu)])
def test_a_skipped_push_in_bf16_on_a_gpu_fails_the_weight_check(warm, tmp_path, _):
    checks = run_doctor(warm, tmp_path, *BF16, "--debug-inject-fault", "skip-weight-push", "--no-rerun",
                        expect_rc=1)
    assert "never received the pushed weights" in checks["weights_equal_after_push"]["cause"]


@pytest.mark.parametrize("_", [pytest.param(None, marks=gpu)])
def test_a_bf16_engine_under_a_float32_trainer_on_a_gpu_is_a_dtype_mismatch(warm, tmp_path, _):
    checks = run_doctor(warm, tmp_path, "--colocate", "--engine-dtype", "bfloat16", expect_rc=1)
    assert {"train_rollout_logprob_diff", "precision_match"} <= failed(checks)
    assert "mismatch" in checks["train_rollout_logprob_diff"]["threshold"]
    assert "dtype cast" in checks["train_rollout_logprob_diff"]["cause"]
    assert checks["_report"]["localization"]["first_divergent"] == "embedding"


@pytest.mark.parametrize("_", [pytest.param(None, marks=[pytest.mark.gpu, pytest.mark.skipif(
    _cuda_gpus() < 2, reason="needs 2 GPUs")])])
def test_a_swapped_pp_layer_mapping_in_bf16_on_two_gpus_fails_the_weight_check(warm, tmp_path, _):
    checks = run_doctor(warm, tmp_path, "--bf16", "--engine-dtype", "bfloat16", "--debug-inject-fault",
                        "swap-pp-layers", "--actor-num-gpus-per-node", "2", "--pipeline-model-parallel-size", "2",
                        "--colocate", "--rollout-num-gpus", "2", "--no-rerun", expect_rc=1)
    check = checks["weights_equal_after_push"]
    assert not check["passed"] and "layer-id mapping" in check["cause"]


@pytest.mark.parametrize("_", [pytest.param(None, marks=gpu)])
def test_ci_test_passes_a_healthy_bf16_run_of_a_half_billion_shape_on_a_gpu(warm, tmp_path, _):
    """The run that failed --ci-test before the bounds followed the dtype: Qwen2.5-0.5B shape (random weights, the
    tiny vocabulary), colocated, bf16 trainer and engine, weights checked after every push."""
    import subprocess
    import sys

    from slime_lite.tiny_model import make_tiny_model

    model = tmp_path / "q05"
    make_tiny_model(model, hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864,
                    warm_start_steps=0, tie_word_embeddings=True)
    metrics = tmp_path / "m.jsonl"
    argv = ["--hf-checkpoint", str(model), "--prompt-data", warm[1], "--rm-type", "addition", "--rollout-batch-size",
            "16", "--n-samples-per-prompt", "8", "--rollout-max-response-len", "32", "--use-kl-loss", "--kl-loss-coef",
            "0.001", "--lr", "1e-6", "--micro-batch-size", "32", "--num-rollout", "2", "--ci-test",
            "--check-weight-update-equal", "--metrics-path", str(metrics), *BF16]
    proc = subprocess.run([sys.executable, "-m", "slime_lite.cli", "train", *argv], capture_output=True, text=True, check=False,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    diffs = [r["train/train_rollout_logprob_abs_diff"] for r in rows if r["rollout_id"] >= 0]
    assert len(diffs) == 2 and all(1e-3 < d < 5e-2 for d in diffs)  # over the float32 bound: bf16 noise is real


@pytest.mark.parametrize("fault, check", [
    pytest.param("engine-temperature", "train_rollout_logprob_diff", marks=gpu),
    pytest.param("skip-weight-push", "weight_version_served", marks=gpu),  # caught whatever the learning rate
])
def test_ci_test_stops_a_bf16_run_on_a_gpu_at_each_fault(warm, tmp_path, fault, check):
    import subprocess
    import sys

    model, data = warm
    argv = ["--hf-checkpoint", model, "--prompt-data", data, "--rm-type", "addition", "--rollout-max-response-len",
            "6", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--use-kl-loss", "--kl-loss-coef",
            "0.01", "--lr", "1e-6", "--num-rollout", "2", "--ci-test", "--debug-inject-fault", fault, *BF16]
    proc = subprocess.run([sys.executable, "-m", "slime_lite.cli", "train", *argv], capture_output=True, text=True, check=False,
                          timeout=600)
    assert proc.returncode != 0 and f"check {check} failed" in proc.stderr, proc.stderr[-3000:]
