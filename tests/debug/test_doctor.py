"""``slime-lite doctor``: a healthy run passes every check; each injected fault fails the right check with its cause.

The slow tests share one small warm-started model (built once, ~15 s) and run the doctor once per fault (~30 s
each on 2 cores). Run them with ``-s`` to see the doctor's tables.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from slime_lite.debug import doctor
from slime_lite.errors import SlimeLiteError
from slime_lite.types import Sample


# ------------------------------------------------------------------------------------------ flags (fast)
def test_the_doctor_forces_its_short_run_and_keeps_the_users_other_flags(tmp_path):
    user = ["--hf-checkpoint", "M", "--num-rollout", "100", "--ci-test", "--save", "ckpt", "--eval-interval", "5",
            "--global-batch-size=8", "--rollout-batch-size", "8", "--rollout-stop", "a", "b", "--lr", "1e-4"]
    argv = doctor.train_argv(user, str(tmp_path))
    joined = " ".join(argv)
    assert "--ci-test" not in argv and "--save" not in argv and "--eval-interval" not in argv
    assert "--global-batch-size" not in joined and "100" not in argv
    assert "--num-rollout 2" in joined and "--num-steps-per-rollout 1" in joined
    assert "--rollout-batch-size 8" in joined and "--n-samples-per-prompt 4" in joined  # user's kept, default added
    assert "--rollout-stop a b --lr 1e-4" in joined
    assert f"--dump-details {tmp_path}" in joined and f"--metrics-path {tmp_path / 'metrics.jsonl'}" in joined
    assert "--check-weight-update-equal" in argv and "--debug-scramble-engine-weights" in argv
    assert argv.count("--get-mismatch-metrics") == 1  # the mismatch rows and worst tokens
    assert doctor.train_argv(user + ["--get-mismatch-metrics"], str(tmp_path)).count("--get-mismatch-metrics") == 1
    rerun = doctor.train_argv(user, str(tmp_path), weight_check=False)
    assert "--check-weight-update-equal" not in rerun and "--debug-scramble-engine-weights" not in rerun


def test_the_doctor_runs_a_fully_async_users_flags_synchronously(tmp_path):
    """Its iteration-2 check needs rollout 1 generated from the trained weights, and each rollout's served version
    is then the number of pushes: no false alarm from the mode's lag, and a skipped push is still caught."""
    user = ["--hf-checkpoint", "M", "--fully-async", "--max-policy-version-lag", "2",
            "--max-weight-staleness-mode", "mask", "--lr", "1e-4"]
    argv = doctor.train_argv(user, str(tmp_path))
    assert not [a for a in argv if "async" in a or "staleness" in a or "lag" in a]
    assert "--lr 1e-4" in " ".join(argv)
    # --partial-rollout trains samples carried from the weights before the push (rollout/async/newest_lag 1):
    # iteration 2 would blame the push; over-sampling without it stays (its samples are of this rollout)
    user = ["--hf-checkpoint", "M", "--over-sampling-batch-size", "12", "--partial-rollout",
            "--mask-offpolicy-in-partial-rollout", "--lr", "1e-2"]
    argv = " ".join(doctor.train_argv(user, str(tmp_path)))
    assert "partial" not in argv and "--over-sampling-batch-size 12" in argv


def test_the_doctor_adds_no_scramble_to_a_lora_run(tiny_model_dir, tmp_path):
    """--lora-rank refuses --debug-scramble-engine-weights (an adapter-only push never restores the scrambled base):
    the doctor keeps the weight check but adds no scramble, so a LoRA run's flags still parse."""
    from slime_lite.args import parse_args
    from slime_lite.tasks import make_data

    data = tmp_path / "addition.jsonl"
    make_data("addition", str(data), n_train=16, n_eval=4, seed=0)
    user = ["--hf-checkpoint", str(tiny_model_dir), "--prompt-data", str(data), "--rm-type", "addition",
            "--lora-rank", "4", "--debug-scramble-engine-weights"]
    argv = doctor.train_argv(user, str(tmp_path / "out"))
    assert "--check-weight-update-equal" in argv and "--debug-scramble-engine-weights" not in argv
    parse_args(argv)  # no "--lora-rank cannot be used with --debug-scramble-engine-weights"


def test_the_doctor_refuses_half_a_loop(tmp_path):
    with pytest.raises(SlimeLiteError, match="--debug-rollout-only"):
        doctor.train_argv(["--debug-rollout-only"], str(tmp_path))


# ------------------------------------------------------------------------------------------ mismatch rows (fast)
WORST = [{"sample": 5, "position": 2, "token_id": 7, "token": "4", "train_log_prob": -0.1, "rollout_log_prob": -2.5,
          "abs_diff": 2.4}, {"sample": 1, "position": 0, "token_id": 3, "token": None, "train_log_prob": -1.0,
                             "rollout_log_prob": -0.2, "abs_diff": 0.8}]


def test_routing_agreement_is_shown_under_replay_and_named_when_log_probs_disagree():
    from slime_lite.debug.run_checks import routing_check

    assert routing_check({"train/loss": 1.0}, False) == []  # no routing replay: no row
    (ok,) = routing_check({"train/routing_mismatch": 0.0, "train/routing_mismatch/layer_0": 0.0}, False)
    assert ok.name == "routing_agreement" and ok.passed and ok.value == 0.0
    assert routing_check({"train/routing_mismatch": 0.02}, True)[0].passed  # log-probs agree: information only
    (bad,) = routing_check({"train/routing_mismatch": 0.3, "train/routing_mismatch/layer_0": 0.1,
                            "train/routing_mismatch/layer_1": 0.5}, False)
    assert not bad.passed and "30.0%" in bad.cause and "layer 1, 50.0%" in bad.cause and "likely cause" in bad.cause


def test_a_failed_logprob_check_names_the_worst_tokens_and_the_table_shows_them(capsys):
    from slime_lite.checks.ci import Check
    from slime_lite.debug.run_checks import mismatch_checks

    rows = mismatch_checks({"mismatch/token_ratio_max": 11.0, "mismatch/k3_kl": 0.3, "rollout/kl": 0.0})
    assert [(c.name, c.value, c.passed) for c in rows] == [("mismatch_token_ratio_max", 11.0, True),
                                                             ("mismatch_k3_kl", 0.3, True)]
    by = {n: Check(n, 1.0, "", True) for n in ("weights_equal_after_push", "precision_match", "on_task_nll",
                                               "on_task_repetition", "on_task_valid_chars")}
    by["train_rollout_logprob_diff"] = Check("train_rollout_logprob_diff", 0.4, "< 0.001", False, "some cause")
    doctor._refine(by, None, WORST)
    cause = by["train_rollout_logprob_diff"].cause
    assert "'4' (sample 5, position 2): train -0.1 vs rollout -2.5" in cause and "'id 3' (sample 1" in cause
    doctor.print_report({"out": "/x", "worst_tokens": WORST, "checks": [c.as_dict() for c in [*by.values(), *rows]]})
    table = capsys.readouterr().out
    assert "worst tokens of rollout 0" in table and "-2.5" in table
    assert next(line for line in table.splitlines() if "mismatch_token_ratio_max" in line).count("info") == 2


def test_every_check_row_shows_and_a_skipped_one_says_why(capsys):
    """Without a reference model the step-1 KL row is there, marked skip with the flag that turns it on; a row the
    run did not reach says why it was not measured (and fails); measured rows are left alone."""
    from slime_lite.debug.run_checks import TrainRun, skipped_rows

    def flags(**kw):
        return argparse.Namespace(**{"use_kl_loss": False, "kl_coef": 0.0, "ref_load": None,
                                     "lora_adapter_path": None, "ci_disable_kl_checker": False, **kw})

    stopped = TrainRun(out="/x", returncode=1, seconds=1.0, error="engine 0 died")
    rows = skipped_rows(flags(), {"grad_norm_finite"}, stopped)
    assert [(c.name, c.passed) for c in rows] == [("step1_kl_zero", True), ("first_step_ppo_kl_zero", False)]
    assert "skipped: no reference model" in rows[0].cause and "--use-kl-loss" in rows[0].cause
    assert rows[1].cause == "not measured: the run stopped: engine 0 died"
    with_kl = skipped_rows(flags(use_kl_loss=True), {"grad_norm_finite", "first_step_ppo_kl_zero"},
                           stopped)
    assert [(c.name, c.passed, c.cause) for c in with_kl] == [("step1_kl_zero", False, "not measured: the run "
                                                                                       "stopped: engine 0 died")]
    doctor.print_report({"out": "/x", "checks": [c.as_dict() for c in rows]})
    line = next(line for line in capsys.readouterr().out.splitlines() if "step1_kl_zero" in line)
    assert "skip" in line and "PASS" not in line
    adapters = skipped_rows(flags(use_kl_loss=True, lora_adapter_path="/a"), {"first_step_ppo_kl_zero",
                                                                             "grad_norm_finite"}, stopped)
    assert [(c.name, c.passed) for c in adapters] == [("step1_kl_zero", True)]  # KL > 0 from the start, by design
    assert adapters[0].cause.startswith("skipped: --lora-adapter-path")
    off = skipped_rows(flags(use_kl_loss=True, ci_disable_kl_checker=True), {"grad_norm_finite"}, stopped)
    assert [(c.name, c.passed) for c in off] == [("step1_kl_zero", True), ("first_step_ppo_kl_zero", True)]
    assert all(c.cause.startswith("skipped: --ci-disable-kl-checker") for c in off)


def test_the_doctor_does_not_hold_a_run_from_trained_adapters_to_a_zero_step1_kl():
    from slime_lite.args import parser_defaults
    from slime_lite.checks.ci import rollout_checks
    from slime_lite.config import CiConfig

    args = parser_defaults(use_kl_loss=True, lora_adapter_path="/a")
    first = {"rollout/log_probs_ref_max_abs_diff": 0.3, "train/first_step/ppo_kl": 0.0}
    names = [c.name for c in doctor.first_iteration_checks(args, CiConfig.from_args(args), first)]
    assert "step1_kl_zero" not in names and "first_step_ppo_kl_zero" in names
    assert "step1_kl_zero" in [c.name for c in rollout_checks(CiConfig.from_args(args), first, first=True)]


# ------------------------------------------------------------------------------------------ gibberish score (fast)
def _samples(tok, responses: list[str], lp: float) -> tuple[list[Sample], list[list[float]]]:
    out, lps = [], []
    for r in responses:
        ids = tok("12+3=", add_special_tokens=False)["input_ids"]
        resp = tok(r, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        out.append(Sample(tokens=ids + resp, response_length=len(resp), response=r, rollout_log_probs=[lp] * len(resp)))
        lps.append([lp] * len(resp))
    return out, lps


def test_memory_after_a_release_or_offload_is_not_counted_as_more_processes():
    """A colocated run also reports engine_released / actor_offloaded: the same processes (their lifetime RSS peaks
    again). Actor and engine at 40% of RAM each and the manager at 2% leave 18% free: the headroom check passes."""
    from types import SimpleNamespace

    from slime_lite.debug.run_checks import TrainRun, _total_ram_mb, memory_checks

    total = _total_ram_mb()
    rec = {"perf/memory/actor/peak_rss_mb": 0.4 * total, "perf/memory/engine/peak_rss_mb": 0.4 * total,
           "perf/memory/rollout_manager/peak_rss_mb": 0.02 * total,
           "perf/memory/engine_released/peak_rss_mb": 0.4 * total,
           "perf/memory/actor_offloaded/peak_rss_mb": 0.4 * total}
    args = SimpleNamespace(actor_num_nodes=1, actor_num_gpus_per_node=1, critic_num_nodes=0, critic_num_gpus_per_node=0,
                           rollout_num_gpus=1, rollout_num_gpus_per_engine=1, colocate=True, offload_train=True,
                           offload_rollout=True)
    checks = {c.name: c for c in memory_checks(TrainRun("/tmp", 0, 1.0, records={0: rec}), args)}
    assert checks["memory_headroom"].passed and abs(checks["memory_headroom"].value - 0.18) < 1e-6
    assert set(checks) == {"peak_memory/actor", "peak_memory/engine", "peak_memory/rollout_manager", "memory_headroom"}
    rec["perf/memory/engine/peak_rss_mb"] = 0.6 * total  # 2% free: still caught
    assert not {c.name: c for c in memory_checks(TrainRun("/tmp", 0, 1.0, records={0: rec}), args)}[
        "memory_headroom"].passed


def test_the_gibberish_score_separates_answers_from_noise(tiny_model_dir):
    from slime_lite.debug.on_task import repetition_rate
    from slime_lite.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_model_dir)
    args = argparse.Namespace(hf_checkpoint=str(tiny_model_dir), rm_type="addition")
    good = {c.name: c for c in doctor.on_task_checks(args, *_samples(tok, ["15", "105", "7"], -0.4), 1.5)}
    assert all(c.passed for c in good.values()) and good["on_task_nll"].value == pytest.approx(0.4)
    noise = _samples(tok, ["1212121212", "abababab", "x#x#x#x#"], -4.0)
    bad = {c.name: c for c in doctor.on_task_checks(args, *noise, 1.5)}
    assert not bad["on_task_nll"].passed and "weights not loaded" in bad["on_task_nll"].cause
    assert not bad["on_task_valid_chars"].passed and bad["on_task_valid_chars"].value == pytest.approx(10 / 26)
    assert not bad["on_task_repetition"].passed    # each response repeats its bigrams
    assert repetition_rate([1, 2, 1, 2, 1, 2]) == pytest.approx(0.6) and repetition_rate([1, 2, 3]) == 0


def test_the_gibberish_score_reads_model_turns_only_and_counts_whitespace_valid(tiny_model_dir):
    """A tool-using sample: the tool's tokens (loss_mask 0, a log-prob the trainer gives them anyway) are no sign
    of the model; a model answering in words and newlines under a non-addition task is on task."""
    from slime_lite.rollout.turns import append_turn
    from slime_lite.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_model_dir)
    enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    samples, lps = [], []
    for _ in range(4):
        s = Sample(tokens=enc("12+3="), response_length=0)
        model1, tool, model2 = enc("First 3*4 = 12,\nthen"), enc("#~#~#~#~#~#~#~#~"), enc(" 12+5 = 17.")
        append_turn(s, model1, [-0.2] * len(model1))
        append_turn(s, tool, source="tool")
        append_turn(s, model2, [-0.2] * len(model2))
        samples.append(s)
        lps.append([-0.2] * len(model1) + [-6.0] * len(tool) + [-0.2] * len(model2))  # the trainer scores all
    args = argparse.Namespace(hf_checkpoint=str(tiny_model_dir), rm_type="math")
    rows = {c.name: c for c in doctor.on_task_checks(args, samples, lps, 1.5)}
    assert rows["on_task_nll"].value == pytest.approx(0.2) and rows["on_task_nll"].passed
    assert rows["on_task_valid_chars"].value == 1.0 and rows["on_task_repetition"].passed
    assert rows["on_task_repetition"].value < 0.2  # the tool's repeated "#~" is not the model's


class _FakeTrainRun:
    """FAKE ``slime-lite train`` process for run_train: the same Popen call, running ``code`` instead."""

    def __init__(self, code: str, interrupt_wait: bool = False) -> None:
        import subprocess

        self.code, self.interrupt_wait, self.procs = code, interrupt_wait, []
        self.popen = subprocess.Popen  # the real one (the test patches the module's attribute)

    def __call__(self, cmd, **kwargs):
        import sys

        proc = self.popen([sys.executable, "-c", self.code], **kwargs)
        self.procs.append(proc)
        if self.interrupt_wait:  # Ctrl-C while the doctor waits for the run (the first wait only)
            real_wait = proc.wait

            def wait(timeout=None):
                proc.wait = real_wait
                raise KeyboardInterrupt

            proc.wait = wait
        return proc


def test_an_interrupted_doctor_ends_its_train_run(tmp_path, monkeypatch):
    """Ctrl-C reaches the doctor only (the run is in a session of its own): the run must not go on without it."""
    fake = _FakeTrainRun("import time; print('training', flush=True); time.sleep(600)", interrupt_wait=True)
    monkeypatch.setattr(doctor.subprocess, "Popen", fake)
    try:
        with pytest.raises(KeyboardInterrupt):
            doctor.run_train([], str(tmp_path), 600)
        assert fake.procs and fake.procs[0].poll() is not None  # ended and reaped, not left running
    finally:
        for proc in fake.procs:  # the test's own cleanup when the doctor left it running
            proc.kill()
            proc.wait()


def test_a_run_killed_from_outside_is_not_reported_as_a_timeout(tmp_path, monkeypatch):
    """A run SIGKILLed by something else (the kernel's OOM killer) ends with -9 like one the doctor killed at
    --run-timeout: the error must say it was killed, not that it ran too long."""
    monkeypatch.setattr(doctor.subprocess, "Popen", _FakeTrainRun("import os, signal; os.kill(os.getpid(), "
                                                                  "signal.SIGKILL)"))
    run = doctor.run_train([], str(tmp_path), 600)
    assert run.returncode == -9 and "did not finish within" not in run.error
    assert "SIGKILL" in run.error and "out of memory" in run.error and "train.log" in run.error


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
                           "--debug-inject-fault", "skip-weight-push"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stderr[-3000:]
    # the skipped pushes leave the engine on the weights it loaded itself (version "default", read as -1)
    assert "weight_version_served failed at rollout 0: value -1.0, expected == 0" in proc.stderr, proc.stderr[-3000:]


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
