"""checks/ci.py and debug/run_checks.py: the seed's checks as data, what --ci-test enforces and what the doctor reads
from a run."""

from __future__ import annotations

import argparse
import math

import pytest

from slime_lite.args import parser_defaults
from slime_lite.config import CiConfig
from slime_lite.checks import ci as cc
from slime_lite.debug import run_checks as rc

HEALTHY = {
    "rollout/log_probs": -0.7, "rollout/log_probs_ref_max_abs_diff": 0.0, "train/first_step/ppo_kl": 0.0,
    "train/train_rollout_logprob_abs_diff": 4e-7, "train/first_step/grad_norm": 3.0, "rollout/weight_version": 0.0,
    "perf/memory/actor/peak_rss_mb": 500.0, "perf/memory/engine/peak_rss_mb": 450.0,
    "perf/memory/rollout_manager/peak_rss_mb": 300.0,
}
# the message checks/weight_check.py check_weights_equal raises, as the doctor reads it from the run's stderr
WEIGHT_ERROR = (
    "--check-weight-update-equal: engine http://127.0.0.1:1 holds weights that differ from the trainer's: "
    "{n} differ {names}; 0 never pushed []. Likely causes: a name or layer-id mapping error under PP"
)


def make_args(**kw) -> argparse.Namespace:
    base = dict(ci_logprob_diff_threshold=1e-3, ci_grad_norm_threshold=100.0, engine_dtype="auto", bf16=False,
                rollout_device="cpu", hf_checkpoint=None, pipeline_model_parallel_size=1, actor_num_nodes=1,
                actor_num_gpus_per_node=1, critic_num_nodes=1, critic_num_gpus_per_node=1, rollout_num_gpus=1,
                rollout_num_gpus_per_engine=1, colocate=False)
    base.update(kw)
    return parser_defaults(**base)


def ci(**kw) -> CiConfig:
    return CiConfig.from_args(make_args(**kw))


def by_name(checks):
    return {c.name: c for c in checks}


def test_a_healthy_first_record_passes_every_check():
    checks = by_name(cc.rollout_checks(ci(), HEALTHY, first=True))
    assert set(checks) >= {"step1_kl_zero", "first_step_ppo_kl_zero", "train_rollout_logprob_diff", "grad_norm_finite"}
    assert all(c.passed and c.cause == "" for c in checks.values())


def test_ci_test_stops_at_a_failure_naming_check_value_and_causes():
    record = dict(HEALTHY, **{"rollout/log_probs_ref_max_abs_diff": 0.02})
    with pytest.raises(cc.CiCheckFailed, match=r"step1_kl_zero failed at rollout 0: value 0.02.*non-deterministic"):
        cc.enforce(ci(), record, 0, first=True)
    cc.enforce(ci(), dict(record, **{"rollout/weight_version": 1.0}), 1, first=False)  # step-1 KL: first rollout only


def test_a_nan_or_large_grad_norm_fails_and_the_nll_heuristic_is_only_advisory():
    for bad in (math.nan, 1e4):
        check = by_name(cc.rollout_checks(ci(), dict(HEALTHY, **{"train/first_step/grad_norm": bad}), True))
        assert not check["grad_norm_finite"].passed and "KL coefficient" in check["grad_norm_finite"].cause
    cc.enforce(ci(), dict(HEALTHY, **{"rollout/log_probs": -5.0}), 0, first=True)  # no raise


def test_the_weight_check_names_a_pp_layer_mapping_error(tiny_model_dir):
    names = "['model.layers.0.self_attn.q_proj.weight', 'model.layers.0.self_attn.q_proj.bias']"
    run = rc.TrainRun("/x", 2, 1.0, error=WEIGHT_ERROR.format(n=48, names=names))
    check = rc.weight_check(run, make_args(hf_checkpoint=str(tiny_model_dir), pipeline_model_parallel_size=2))
    assert not check.passed and check.value == 48.0
    assert "layer-id mapping" in check.cause and "--pipeline-model-parallel-size 2" in check.cause


def test_the_weight_check_names_a_push_that_never_arrived(tiny_model_dir):
    from safetensors import safe_open

    total = len(list(safe_open(str(tiny_model_dir / "model.safetensors"), framework="pt").keys()))
    run = rc.TrainRun("/x", 2, 1.0, error=WEIGHT_ERROR.format(n=total, names="['model.embed_tokens.weight']"))
    check = rc.weight_check(run, make_args(hf_checkpoint=str(tiny_model_dir)))
    assert not check.passed and "never received the pushed weights" in check.cause
    assert rc.weight_check(rc.TrainRun("/x", 0, 1.0), make_args()).passed
    other = rc.weight_check(rc.TrainRun("/x", 2, 1.0, error="--prompt-data x: no such file"), make_args())
    assert not other.passed and "never ran" in other.cause


def test_the_weight_check_is_skipped_where_the_engines_cannot_be_checked():
    """SGLang servers have no /get_weights_checksum: the row says so (skipped), it does not fail the run's push."""
    check = rc.weight_check(rc.TrainRun("/x", 0, 1.0), make_args(rollout_backend="sglang"))
    assert check.passed and check.cause.startswith("skipped") and "--rollout-backend embedded" in check.cause
    external = "--check-weight-update-equal: engine http://h:1 has no /get_weights_checksum: it is not slime-lite's"
    check = rc.weight_check(rc.TrainRun("/x", 2, 1.0, error=external), make_args())  # external engines
    assert check.passed and check.cause.startswith("skipped")


def test_weight_versions_must_follow_the_rollouts():
    ok = rc.TrainRun("/x", 0, 1.0, records={0: {"rollout/weight_version": 0.0}, 1: {"rollout/weight_version": 1.0}})
    assert rc.version_check(ok).passed
    stale = rc.TrainRun("/x", 0, 1.0, records={0: {"rollout/weight_version": 0.0}, 1: {"rollout/weight_version": 0.0}})
    check = rc.version_check(stale)
    assert not check.passed and "rollout 1: 0" in check.cause and "never received" in check.cause


def test_iteration2_tells_a_missed_reload_from_a_mismatch_from_the_start():
    lp = "train/train_rollout_logprob_abs_diff"
    missed = rc.TrainRun("/x", 0, 1.0, records={0: {lp: 1e-7}, 1: {lp: 0.05}})
    check = rc.iteration2(missed, ci())
    assert not check.passed and check.value == 0.05 and "did not reload" in check.cause
    always = rc.iteration2(rc.TrainRun("/x", 0, 1.0, records={0: {lp: 0.2}, 1: {lp: 0.2}}), ci())
    assert not always.passed and "from the first iteration" in always.cause
    stopped = rc.iteration2(rc.TrainRun("/x", 2, 1.0, error="boom", records={0: {lp: 1e-7}}), ci())
    assert not stopped.passed and stopped.name == "iteration2_ran" and "boom" in stopped.cause
    assert rc.iteration2(rc.TrainRun("/x", 0, 1.0, records={0: {lp: 1e-7}, 1: {lp: 2e-7}}), ci()).passed
    kl = "train/first_step/ppo_kl"  # (LoRA dropout: 0 at the first step, not at the second)
    second_kl = rc.TrainRun("/x", 0, 1.0, records={0: {lp: 1e-7, kl: 0.0}, 1: {lp: 2e-7, kl: 3e-4}})
    assert not rc.iteration2(second_kl, ci()).passed
    assert rc.iteration2(second_kl, ci(ci_disable_kl_checker=True)).passed  # as first_step_ppo_kl_zero: skipped


def test_memory_rows_per_process_group_and_headroom():
    run = rc.TrainRun("/x", 0, 1.0, records={0: HEALTHY, 1: dict(HEALTHY, **{"perf/memory/actor/peak_rss_mb": 600.0})})
    checks = by_name(rc.memory_checks(run, make_args(actor_num_gpus_per_node=2)))
    assert checks["peak_memory/actor"].value == 600.0 and "(x2)" in checks["peak_memory/actor"].threshold
    assert checks["memory_headroom"].passed and 0 < checks["memory_headroom"].value < 1
    huge = rc.TrainRun("/x", 0, 1.0, records={0: {"perf/memory/actor/peak_rss_mb": 1e9}})
    low = by_name(rc.memory_checks(huge, make_args()))["memory_headroom"]
    assert not low.passed and "--offload-train" in low.cause


def test_gpu_headroom_adds_the_peaks_only_where_trainer_and_engines_hold_memory_at_once(monkeypatch):
    monkeypatch.setattr(rc, "_gpu_total_mb", lambda: 80_000.0)
    run = rc.TrainRun("/x", 0, 1.0, records={0: {"perf/memory/actor/cuda_peak_mb": 50_000.0,
                                                 "perf/memory/engine/cuda_peak_mb": 45_000.0}})
    offloaded = by_name(rc.memory_checks(run, make_args(colocate=True, offload_train=True, offload_rollout=True)))
    assert offloaded["gpu_memory_headroom"].passed  # the peaks are in different phases
    shared = by_name(rc.memory_checks(run, make_args(colocate=True)))
    assert not shared["gpu_memory_headroom"].passed and shared["gpu_memory_headroom"].value < 0


def test_an_engine_in_lower_precision_than_the_trainer_fails_the_precision_check():
    assert rc.precision_check(make_args()).passed
    check = rc.precision_check(make_args(engine_dtype="bfloat16"))
    assert not check.passed and "bfloat16" in check.cause and "float32" in check.cause
    assert rc.precision_check(make_args(engine_dtype="bfloat16", bf16=True)).passed


# ------------------------------------------------------------------ the log-prob bound follows the precision in use
def test_the_logprob_bound_follows_the_precision_of_engine_and_trainer():
    fp32 = cc.logprob_diff_threshold(ci(ci_logprob_diff_threshold=None))
    bf16 = cc.logprob_diff_threshold(ci(ci_logprob_diff_threshold=None, bf16=True, engine_dtype="bfloat16"))
    mixed = cc.logprob_diff_threshold(ci(ci_logprob_diff_threshold=None, engine_dtype="bfloat16"))
    assert fp32 == (1e-3, "the default for float32 engine and trainer")
    assert bf16[0] == 5e-2 and "bfloat16" in bf16[1]
    assert mixed[0] == 1e-3 and "engine bfloat16, trainer float32" in mixed[1] and "mismatch" in mixed[1]
    assert cc.logprob_diff_threshold(ci(ci_logprob_diff_threshold=0.2, bf16=True)) == (
        0.2, "set by --ci-logprob-diff-threshold")


# values measured on an H200 (bench/gpu_doctor.sh): a healthy bf16 run, an engine at 1.5x the temperature, and a
# float32 trainer with a bfloat16 engine
@pytest.mark.parametrize("diff, bf16, engine, passed", [(0.0091, True, "bfloat16", True),
                                                          (0.113, True, "bfloat16", False),
                                                          (0.0052, False, "bfloat16", False),
                                                          (4e-7, False, "float32", True)])
def test_healthy_bf16_runs_pass_and_faults_still_fail(diff, bf16, engine, passed):
    cfg = ci(ci_logprob_diff_threshold=None, bf16=bf16, engine_dtype=engine)
    record = dict(HEALTHY, **{"train/train_rollout_logprob_abs_diff": diff})
    check = by_name(cc.rollout_checks(cfg, record, first=True))["train_rollout_logprob_diff"]
    assert check.passed is passed
    assert ("bfloat16" in check.threshold) == (engine == "bfloat16")  # the row says which bound applied and why
    if not passed:
        with pytest.raises(cc.CiCheckFailed, match="train_rollout_logprob_diff"):
            cc.enforce(cfg, record, 0, first=True)


def test_ci_test_fails_a_rollout_served_by_stale_weights():
    cc.enforce(ci(), HEALTHY, 0, first=True)
    with pytest.raises(cc.CiCheckFailed, match=r"weight_version_served failed at rollout 1: value 0.0.*push"):
        cc.enforce(ci(), HEALTHY, 1, first=False)


def test_the_engine_reported_dtype_replaces_auto():
    """A fake engine (only its /get_server_info route): the driver takes the precision the engine reports."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Info(BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"dtype": "bfloat16"} if self.path == "/get_server_info" else {}).encode()
            self.send_response(200 if self.path == "/get_server_info" else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Info)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        got = cc.with_engine_dtype(ci(ci_logprob_diff_threshold=None, bf16=True), [url])
        assert got.engine_dtype == "bfloat16" and cc.logprob_diff_threshold(got)[0] == 5e-2
        assert cc.with_engine_dtype(ci(engine_dtype="float16"), [url]).engine_dtype == "float16"  # the flag wins
        assert cc.with_engine_dtype(ci(), []).engine_dtype == "auto"
    finally:
        server.shutdown()


# ------------------------------------------------------------------ the step-1 KL check needs policy == reference
def test_step1_kl_is_not_enforced_where_the_policy_starts_away_from_the_reference():
    """A run resumed from a --load checkpoint (trained weights against the untrained reference) or started with
    --lora-adapter-path (trained adapters over the reference base) has KL > 0 at its first rollout by design: --ci-test
    must not stop it there; a fresh run still fails at a non-zero step-1 KL."""
    record = dict(HEALTHY, **{"rollout/log_probs_ref_max_abs_diff": 0.02, "rollout/weight_version": 3.0})
    resumed = cc.RunChecks(make_args(ci_test=True, use_kl_loss=True), [], 3, trains=True)
    resumed.after_rollout(3, record, {}, 3)  # no raise
    adapters = cc.RunChecks(make_args(ci_test=True, use_kl_loss=True, lora_adapter_path="/adapters"), [], 0, True)
    adapters.after_rollout(0, dict(record, **{"rollout/weight_version": 0.0}), {}, 0)  # no raise
    fresh = cc.RunChecks(make_args(ci_test=True, use_kl_loss=True), [], 0, trains=True)
    with pytest.raises(cc.CiCheckFailed, match="step1_kl_zero failed at rollout 0"):
        fresh.after_rollout(0, dict(record, **{"rollout/weight_version": 0.0}), {}, 0)
    assert cc.policy_off_reference(make_args(), 3).startswith("resumed at rollout 3")
    assert "--lora-adapter-path" in cc.policy_off_reference(make_args(lora_adapter_path="/adapters"), 0)
    assert cc.policy_off_reference(make_args(), 0) is None


def test_iteration2_names_a_nan_or_missing_logprob_diff_not_the_ppo_kl():
    """A NaN log-prob diff at iteration 2 (or none measured) fails naming that, not "ppo_kl is 0, not 0"."""
    lp = "train/train_rollout_logprob_abs_diff"
    nan = rc.iteration2(rc.TrainRun("/x", 0, 1.0, records={0: {lp: 1e-7}, 1: {lp: math.nan}}), ci())
    assert not nan.passed and "not 0" not in nan.cause and "nan" in nan.cause and "iteration 2" in nan.cause
    none = rc.iteration2(rc.TrainRun("/x", 0, 1.0, records={0: {lp: 1e-7}, 1: {}}), ci())
    assert not none.passed and "not 0" not in none.cause and "not measured" in none.cause
    kl = rc.iteration2(rc.TrainRun("/x", 0, 1.0, records={0: {lp: 1e-7}, 1: {lp: 1e-7,
                                                                              "train/first_step/ppo_kl": 0.1}}), ci())
    assert not kl.passed and "ppo_kl of iteration 2 is 0.1, not 0" in kl.cause


def test_the_logprob_jump_warning_survives_a_nan_and_names_one(caplog):
    """A NaN log-prob diff is not "the lowest so far": a later jump still warns, and a NaN after a finite value warns
    too."""
    lp = "train/train_rollout_logprob_abs_diff"
    watch = cc.LogprobDiffWatch(10.0)
    with caplog.at_level("WARNING", logger="slime_lite.train"):
        for value in (math.nan, 1e-6, 1e-6):
            watch.update({lp: value})
        assert "jumped" not in caplog.text
        watch.update({lp: 0.5, "rollout/weight_version": 3.0})
        assert "jumped to 0.5 (lowest so far 1e-06) with engine weight version 3.0" in caplog.text
        caplog.clear()
        watch.update({lp: math.nan})
        assert "jumped to nan" in caplog.text


def test_a_replay_whose_dump_records_no_weight_version_is_not_held_on_policy():
    """A replayed dump without weight versions (slime's dumps, a hook that records none, a partial-rollout rollout
    whose samples all finished earlier): after the first rollout the trainer's weights moved and the dump's are
    unknown, so a large train/rollout log-prob gap is not blamed on the weights; the first rollout is still held."""
    unversioned = {k: v for k, v in HEALTHY.items() if k != "rollout/weight_version"}
    gap = dict(unversioned, **{"train/train_rollout_logprob_abs_diff": 0.34})
    run = cc.RunChecks(make_args(ci_test=True, load_debug_rollout_data="/d/{rollout_id}.pt"), [], 0, trains=True)
    run.after_rollout(0, unversioned, {}, 0)
    run.after_rollout(1, gap, {}, 1)  # no raise
    first = cc.RunChecks(make_args(ci_test=True, load_debug_rollout_data="/d/{rollout_id}.pt"), [], 0, trains=True)
    with pytest.raises(cc.CiCheckFailed, match="train_rollout_logprob_diff failed at rollout 0"):
        first.after_rollout(0, gap, {}, 0)
