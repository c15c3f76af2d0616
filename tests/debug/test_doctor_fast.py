"""``slime-lite doctor`` without a run of its own: how it builds the train run's flags, its tables and the scores
it shows, and how it ends a run it started. The doctor's runs are in ``test_doctor.py``.
"""

from __future__ import annotations

import argparse

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
    for backend in (["--rollout-backend", "sglang"], ["--rollout-backend=sglang"]):  # which train refuses it with
        sglang = doctor.train_argv(user + backend, str(tmp_path))
        assert "--check-weight-update-equal" not in sglang and "--debug-scramble-engine-weights" not in sglang


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
                                     "lora_adapter_path": None, "ci_disable_kl_checker": False, "lora_dropout": 0.0,
                                     **kw})

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


def test_a_lora_dropout_run_is_not_failed_for_its_ppo_kl():
    """--lora-dropout: the train step's forward drops other activations than the old log-probs' forward, so ppo_kl
    is not zero by design (the run's own --ci-test skips that check): the doctor's rows skip it too."""
    from slime_lite.args import parser_defaults
    from slime_lite.config import CiConfig
    from slime_lite.debug.run_checks import TrainRun, iteration2, skipped_rows

    args = parser_defaults(lora_rank=8, lora_dropout=0.1, use_kl_loss=True)
    first = {"rollout_id": 0, "rollout/log_probs_ref_max_abs_diff": 0.0, "train/first_step/ppo_kl": 2e-4,
             "train/train_rollout_logprob_abs_diff": 1e-5, "train/first_step/grad_norm": 1.0}
    second = {"rollout_id": 1, "train/train_rollout_logprob_abs_diff": 1e-5, "train/first_step/ppo_kl": 3e-4}
    run = TrainRun(out="/x", returncode=0, seconds=1.0, records={0: first, 1: second})
    cfg = CiConfig.from_args(args)
    checks = doctor.first_iteration_checks(args, cfg, first)
    checks += skipped_rows(args, {c.name for c in checks}, run) + [iteration2(run, cfg)]
    assert all(c.passed is True for c in checks), [(c.name, c.cause) for c in checks if c.passed is not True]
    assert next(c for c in checks if c.name == "first_step_ppo_kl_zero").cause.startswith("skipped: --lora-dropout")
    stale = dict(second, **{"train/train_rollout_logprob_abs_diff": 0.5})  # a reload fault still fails
    assert not iteration2(TrainRun(out="/x", returncode=0, seconds=1.0, records={0: first, 1: stale}), cfg).passed


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


def test_the_doctor_never_clears_a_folder_it_did_not_write(tmp_path, monkeypatch):
    """--out pointing at a real run's --dump-details folder (the same file names) is refused with nothing deleted;
    a folder the doctor ran in before is cleared for the next run."""
    real = tmp_path / "real_run"
    (real / "rollout_data").mkdir(parents=True)
    (real / "metrics.jsonl").write_text("{}\n")
    (real / "rollout_data" / "0.pt").write_bytes(b"x")
    with pytest.raises(SlimeLiteError, match=r"--out .*real_run holds files the doctor did not write \(metrics.jsonl, "
                                             r"rollout_data\).*empty or new folder"):
        doctor.run_train([], str(real), 600)
    assert (real / "metrics.jsonl").exists() and (real / "rollout_data" / "0.pt").exists()
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(SlimeLiteError, match="is a file"):
        doctor.run_train([], str(tmp_path / "a_file"), 600)
    monkeypatch.setattr(doctor.subprocess, "Popen", _FakeTrainRun("print('done')"))
    mine = tmp_path / "doctor_out"
    doctor.run_train([], str(mine), 600)
    (mine / "metrics.jsonl").write_text("{}\n")  # as that run would have written
    (mine / "metrics.train_steps.jsonl").write_text("{}\n")
    doctor.run_train([], str(mine), 600)  # the doctor's own folder: cleared and used again
    assert not (mine / "metrics.jsonl").exists() and (mine / "train.log").exists()
    assert not (mine / "metrics.train_steps.jsonl").exists()
