"""ima-bisect: flag surgery per toggle, classification of a job, the minimal toggle set, process cleanup, and whole
runs against the FAKE SGLang server (tests/fakes/fake_sglang_server.py) that crashes or hangs only while CUDA graph
is on (SGLang cannot be installed here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from slime_lite.args import parse_args
from slime_lite.debug.ima_bisect import (
    ComboResult,
    classify,
    combination_argv,
    combinations,
    coredump_env,
    detect_toggles,
    main,
    marked_pids,
    minimal_off_sets,
    parse_bisect_args,
    run_job,
)
from slime_lite.errors import SlimeLiteError

REPO = Path(__file__).resolve().parents[2]

SPEC = ["--sglang-speculative-algorithm", "EAGLE", "--sglang-speculative-num-steps", "3"]
DEEPEP = ["--sglang-moe-a2a-backend", "deepep", "--sglang-deepep-mode", "auto"]
OTHER = ["--rollout-batch-size", "4", "--sglang-some-offset", "-1", "--sglang-mem-fraction-static=0.7"]


# ---- flag surgery ----------------------------------------------------------------------------------------------
def test_all_on_keeps_flags_and_adds_rollout_only_one_rollout():
    argv = OTHER + SPEC + DEEPEP
    assert combination_argv(argv, frozenset()) == argv + ["--debug-rollout-only", "--num-rollout", "1"]


def test_each_toggle_off_maps_to_sglang_flags():
    argv = OTHER + SPEC + DEEPEP
    assert combination_argv(argv, {"cuda-graph"})[:len(argv) + 1] == argv + ["--sglang-disable-cuda-graph"]
    assert combination_argv(argv, {"spec"})[:len(OTHER + DEEPEP)] == OTHER + DEEPEP
    assert combination_argv(argv, {"deepep"})[:len(OTHER + SPEC)] == OTHER + SPEC
    everything = combination_argv(argv, {"cuda-graph", "spec", "deepep"})
    assert everything == OTHER + ["--sglang-disable-cuda-graph", "--debug-rollout-only", "--num-rollout", "1"]


def test_cuda_graph_toggle_of_the_embedded_engine():
    argv = ["--rollout-batch-size", "4", "--engine-dtype", "bfloat16"]
    assert combination_argv(argv, {"cuda-graph"}) == argv + ["--engine-disable-cuda-graph", "--debug-rollout-only",
                                                             "--num-rollout", "1"]
    sglang = ["--rollout-backend", "sglang"]
    assert "--sglang-disable-cuda-graph" in combination_argv(sglang, {"cuda-graph"})
    toggles, notes = detect_toggles(argv + ["--engine-disable-cuda-graph"], ["cuda-graph"])
    assert toggles == [] and "--engine-disable-cuda-graph" in notes[0]


def test_users_num_rollout_wins():
    assert combination_argv(["--num-rollout", "5"], frozenset()) == ["--num-rollout", "5", "--debug-rollout-only"]


def test_toggles_apply_only_when_configured():
    toggles, notes = detect_toggles(OTHER, ["cuda-graph", "spec", "deepep"])
    assert toggles == ["cuda-graph"] and len(notes) == 2
    toggles, _ = detect_toggles(OTHER + SPEC + DEEPEP, ["cuda-graph", "spec", "deepep"])
    assert toggles == ["cuda-graph", "spec", "deepep"]
    toggles, notes = detect_toggles(["--sglang-disable-cuda-graph"] + SPEC, ["cuda-graph", "spec"])
    assert toggles == ["spec"] and "already off" in notes[0]
    assert detect_toggles(["--sglang-moe-a2a-backend", "none"], ["deepep"])[0] == []


def test_combinations_start_with_everything_on():
    combos = combinations(["cuda-graph", "spec"])
    assert combos == [frozenset(), {"cuda-graph"}, {"spec"}, {"cuda-graph", "spec"}]
    assert len(combinations(["cuda-graph", "spec", "deepep"])) == 8


def test_own_flags_are_separated_from_train_flags():
    opts, train = parse_bisect_args(["--lr", "1e-6", "--toggles", "cuda-graph", "--timeout", "30"] + OTHER)
    assert opts.toggles == ["cuda-graph"] and opts.timeout == 30 and train == ["--lr", "1e-6"] + OTHER
    assert opts.stall_timeout is None
    assert parse_bisect_args(["--stall-timeout", "120"] + OTHER)[0].stall_timeout == 120
    twice = parse_bisect_args(["--toggles", "cuda-graph,spec,cuda-graph"] + OTHER)[0].toggles  # each job once
    assert twice == ["cuda-graph", "spec"] and len(combinations(twice)) == 4
    with pytest.raises(SlimeLiteError, match="unknown flash"):
        parse_bisect_args(["--toggles", "cuda-graph,flash"])
    with pytest.raises(SlimeLiteError, match=r"--stall-timeout -5.0 must be > 0 seconds \(leave it out"):
        parse_bisect_args(["--stall-timeout", "-5"] + OTHER)


def test_coredump_variables():
    env = coredump_env("/dumps")
    assert env["CUDA_ENABLE_COREDUMP_ON_EXCEPTION"] == "1" and env["CUDA_COREDUMP_SHOW_PROGRESS"] == "1"
    assert env["CUDA_COREDUMP_GENERATION_FLAGS"] == (
        "skip_nonrelocated_elf_images,skip_global_memory,skip_shared_memory,skip_local_memory")
    assert env["CUDA_COREDUMP_FILE"] == "/dumps/core_%h_%p_%t" and env["SGLANG_CUDA_COREDUMP"] == "1"


def test_debug_env_flag(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    data = tmp_path / "d.jsonl"
    data.write_text("{}\n")
    base = ["--hf-checkpoint", str(model), "--prompt-data", str(data), "--rm-type", "addition", "--debug-rollout-only"]
    args = parse_args(base + ["--debug-env", "CUDA_LAUNCH_BLOCKING=1", "--debug-env", "X_FLAGS=a=b,c"])
    assert args.debug_env == ["CUDA_LAUNCH_BLOCKING=1", "X_FLAGS=a=b,c"]
    with pytest.raises(SystemExit):
        parse_args(base + ["--debug-env", "NO_VALUE"])


# ---- classification ----------------------------------------------------------------------------------------------
CRASH_LOG = """[fake] loading
Traceback (most recent call last):
RuntimeError: CUDA error: an illegal memory access was encountered
CUDA kernel errors might be asynchronously reported at some other API call.
failing kernel: fused_moe_kernel<64>
"""


def test_classify_crash_hang_failure_ok():
    status, detail, kernel = classify(1, "", [CRASH_LOG, "error: all engines failed"])
    assert status == "crashed" and detail == "RuntimeError: CUDA error: an illegal memory access was encountered"
    assert kernel == "fused_moe_kernel<64>"
    status, detail, _ = classify(None, "killed at the timeout", ["", "starting"])
    assert status == "hung" and "timeout" in detail
    status, detail, kernel = classify(2, "", ["", "x\nerror: --hf-checkpoint /m: no such file or folder.\n"])
    assert status == "crashed" and "no CUDA error line" in detail and "--hf-checkpoint" in detail and kernel is None
    assert classify(0, "", ["CUDA_LAUNCH_BLOCKING=1 all fine", "done"])[0] == "ok"
    assert classify(0, "", [CRASH_LOG, "done"])[0] == "crashed"  # an engine died even if the run got through


def test_core_dump_abort_counts_as_a_gpu_crash():
    """With core dumps on, the driver aborts the process before PyTorch prints an error (seen on an H200)."""
    log = "[22:09:05.856201] coredump: Starting GPU coredump generation\n[22:09:05] coredump: All done (took 00s)\n"
    status, detail, _ = classify(-6, "", [log])
    assert status == "crashed" and detail.startswith("GPU exception")


def test_kernel_from_cuda_gdb_output():
    from slime_lite.debug.ima_bisect import GDB_EXCEPTION_RE, GDB_KERNEL_RE

    text = ("\nCUDA Exception: Warp Illegal Address\n"
            "The exception was triggered at PC 0x7fdf737a0fc0  bad_store_kernel  (crash_kernel.py:7)\n")
    assert GDB_EXCEPTION_RE.search(text).group(1) == "Warp Illegal Address"
    m = GDB_KERNEL_RE.search(text)
    assert (m.group(1), m.group(2)) == ("bad_store_kernel", "crash_kernel.py:7")


def r(off, status):
    return ComboResult(off=off, status=status, returncode=0, seconds=1.0)


def test_minimal_off_sets():
    results = [r([], "crashed"), r(["cuda-graph"], "ok"), r(["spec"], "crashed"), r(["cuda-graph", "spec"], "ok")]
    assert minimal_off_sets(results) == [["cuda-graph"]]
    results = [r([], "crashed"), r(["cuda-graph"], "ok"), r(["spec"], "ok"), r(["cuda-graph", "spec"], "ok")]
    assert minimal_off_sets(results) == [["cuda-graph"], ["spec"]]
    assert minimal_off_sets([r([], "crashed"), r(["spec"], "hung")]) == []


# ---- process cleanup ---------------------------------------------------------------------------------------------
def test_timeout_kills_the_job_and_everything_it_started(tmp_path):
    """The job ignores SIGINT and leaves a detached grandchild (own session): both are gone afterwards."""
    code = ("import signal, subprocess, sys, time\n"
            "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True)\n"
            "print('started', flush=True)\n"
            "time.sleep(600)\n")
    import slime_lite.debug.ima_bisect as ib

    marker = uuid.uuid4().hex
    old, ib.INTERRUPT_GRACE_S = ib.INTERRUPT_GRACE_S, 0.5
    try:
        t0 = time.monotonic()
        rc, timed_out, secs = run_job([sys.executable, "-c", code], {**os.environ, "TEST_MARK": marker}, 8.0,
                                      str(tmp_path / "log"))
    finally:
        ib.INTERRUPT_GRACE_S = old
    assert timed_out == "killed at the timeout" and rc is None and 8.0 <= secs < 20 and time.monotonic() - t0 < 25
    assert (tmp_path / "log").read_text().startswith("started")
    assert not marked_by_test(marker)


def test_stall_timeout_kills_a_job_whose_logs_stop_growing_and_spares_one_that_writes(tmp_path):
    """--stall-timeout: output to the driver log, then to a file in a watched folder (an engine log), keeps the job
    alive; once both stop growing for the stall time it is killed (long before --timeout). A job that keeps writing
    and exits is left alone."""
    engine_logs = tmp_path / "engine_logs"
    engine_logs.mkdir()
    code = ("import sys, time\n"
            "for _ in range(8): print('tick', flush=True); time.sleep(0.3)\n"
            "with open(sys.argv[1], 'a') as f:\n"
            "    for _ in range(10): f.write('engine tick\\n'); f.flush(); time.sleep(0.3)\n"
            "time.sleep(600)\n")
    t0 = time.monotonic()
    rc, killed, secs = run_job([sys.executable, "-c", code, str(engine_logs / "e.log")], dict(os.environ), 120.0,
                               str(tmp_path / "log"), stall_timeout=2.0, watch=(str(engine_logs),))
    assert rc is None and killed == "killed after 2 s without output (--stall-timeout)"
    # the last engine line is written 5.1 s in: without the watched folder the kill would come at ~4 s
    assert 7.0 <= secs < 30 and time.monotonic() - t0 < 40
    assert classify(rc, killed, ["", "tick"])[:2] == ("hung", killed)
    alive = "import time\nfor _ in range(12): print('tick', flush=True); time.sleep(0.3)\n"
    rc, killed, secs = run_job([sys.executable, "-c", alive], dict(os.environ), 120.0, str(tmp_path / "log2"),
                               stall_timeout=2.0)
    assert rc == 0 and killed == "" and secs >= 3.6


def marked_by_test(mark: str) -> list[int]:
    """pids whose environment has TEST_MARK=mark: whatever a test's subprocess started, however detached."""
    needle = f"TEST_MARK={mark}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if needle in f.read().split(b"\0"):
                        found.append(int(entry))
            except OSError:
                pass
    return found


def test_marked_pids_finds_a_job_process():
    from slime_lite.debug.ima_bisect import JOB_MARKER

    mark = uuid.uuid4().hex
    # the environment shows in /proc only once exec has set the new program up, a moment after Popen returns
    child = subprocess.Popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"],
                             env={**os.environ, JOB_MARKER: mark}, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "up"
        assert marked_pids(mark) == [child.pid] and marked_pids(uuid.uuid4().hex) == []
    finally:
        child.kill()
        child.wait()


def test_embedded_backend_is_refused(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    data = tmp_path / "d.jsonl"
    data.write_text("{}\n")
    with pytest.raises(SlimeLiteError, match="--rollout-backend sglang"):
        main(["--hf-checkpoint", str(model), "--prompt-data", str(data), "--rm-type", "addition"])


# ---- whole runs against the fake server ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def task_data(tmp_path_factory) -> Path:
    from slime_lite.tasks import make_data

    out = tmp_path_factory.mktemp("data") / "addition.jsonl"
    make_data("addition", out, n_train=32, n_eval=8)
    return out


def run_bisect(model, data, out: Path, fault: str, *extra: str) -> tuple[subprocess.CompletedProcess, dict, str]:
    mark = uuid.uuid4().hex
    argv = ["--hf-checkpoint", str(model), "--prompt-data", str(data), "--rm-type", "addition",
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "3",
            "--rollout-backend", "sglang", "--sglang-server-module", "tests.fakes.fake_sglang_server",
            "--sglang-fake-fault", fault, "--out", str(out), *extra]
    env = {**os.environ, "PYTHONPATH": str(REPO), "TEST_MARK": mark, "COLUMNS": "200",
           "SLIME_LITE_ENGINE_START_TIMEOUT": "120"}
    proc = subprocess.run([sys.executable, "-m", "slime_lite.cli", "ima-bisect", *argv], cwd=REPO, env=env, check=False,
                          capture_output=True, text=True, timeout=900)
    results = json.loads((out / "results.json").read_text()) if (out / "results.json").exists() else {}
    return proc, results, mark


@pytest.mark.slow
def test_crash_only_with_cuda_graph_fake(tiny_model_dir, task_data, tmp_path):
    dumps = tmp_path / "dumps"
    proc, res, mark = run_bisect(tiny_model_dir, task_data, tmp_path / "out", "crash:cuda-graph",
                                 "--core-dump", str(dumps), "--timeout", "300")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert res["toggles"] == ["cuda-graph"]
    (on, off) = res["results"]
    assert on["off"] == [] and on["status"] == "crashed" and "illegal memory access" in on["detail"]
    assert on["kernel"] == "fake_paged_attention_kernel<128>"
    assert off["off"] == ["cuda-graph"] and off["status"] == "ok"
    assert res["minimal_off"] == [["cuda-graph"]]
    assert "Smallest set of toggles to turn off that avoids the crash: {cuda-graph}" in proc.stdout
    # CUDA_LAUNCH_BLOCKING and the core-dump variables reached the engine through Ray (--debug-env)
    engine_log = next((tmp_path / "out").glob("00_all-on/engine_logs/*.log")).read_text()
    assert "CUDA_LAUNCH_BLOCKING=1 SGLANG_CUDA_COREDUMP=1" in engine_log
    assert len(on["core_dumps"]) == 1 and off["core_dumps"] == []
    core = Path(on["core_dumps"][0])
    assert core.parent == dumps and core.name.startswith("core_") and "%" not in core.name
    assert "skip_nonrelocated_elf_images,skip_global_memory" in core.read_text()
    assert f"target cudacore {core}" in proc.stdout
    assert not marked_by_test(mark)


@pytest.mark.slow
def test_hang_only_with_cuda_graph_is_killed_at_the_stall_timeout_fake(tiny_model_dir, task_data, tmp_path):
    # the hung job's logs stop growing once /generate stops answering: --stall-timeout kills it that long after,
    # not at --timeout (a kill at --timeout is test_timeout_kills_the_job_and_everything_it_started's); the job
    # without CUDA graph writes all along and finishes (~28 s on 2 idle cores, ~50 s on 2 busy ones)
    stall = 40  # the job without CUDA graph may be silent for ~25 s while it starts on 2 busy cores
    proc, res, mark = run_bisect(tiny_model_dir, task_data, tmp_path / "out", "hang:cuda-graph",
                                 "--timeout", "400", "--stall-timeout", str(stall))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    (on, off) = res["results"]
    assert on["status"] == "hung" and on["returncode"] is None
    assert on["detail"].startswith(f"killed after {stall} s without output") and stall <= on["seconds"] < 300
    assert off["status"] == "ok" and res["minimal_off"] == [["cuda-graph"]]
    assert "hung" in proc.stdout and "Smallest set" in proc.stdout
    assert not marked_by_test(mark)


@pytest.mark.slow
def test_no_working_combination_exits_nonzero_fake(tiny_model_dir, task_data, tmp_path):
    proc, res, mark = run_bisect(tiny_model_dir, task_data, tmp_path / "out", "crash-at-start:always",
                                 "--timeout", "120")
    assert proc.returncode == 1
    assert [r["status"] for r in res["results"]] == ["crashed", "crashed"] and res["minimal_off"] == []
    assert "does not depend on these toggles" in proc.stdout
    assert not marked_by_test(mark)


def test_rerun_into_the_same_out_folder_ignores_the_last_runs_engine_logs(tmp_path, monkeypatch):
    """A second ima-bisect into the same --out: the engine log a crashed job of the first one left in
    00_all-on/engine_logs must not make the new, clean job count as crashed. The job itself is a FAKE (run_job
    stubbed: it exits 0 and writes no log), so only the classification of what the folder holds is tested."""
    import slime_lite.debug.ima_bisect as ib

    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    data = tmp_path / "d.jsonl"
    data.write_text("{}\n")
    out = tmp_path / "out"
    stale = out / "00_all-on" / "engine_logs"
    stale.mkdir(parents=True)
    (stale / "sglang_engine0_41234.log").write_text(CRASH_LOG)  # the first run's crash
    monkeypatch.setattr(ib, "run_job", lambda cmd, env, timeout, log_path, *rest: (0, "", 0.1))
    opts, train = parse_bisect_args(["--hf-checkpoint", str(model), "--prompt-data", str(data), "--rm-type",
                                     "addition", "--rollout-backend", "sglang", "--sglang-server-module",
                                     "tests.fakes.fake_sglang_server", "--out", str(out)])
    results = ib.run_bisect(opts, train)
    assert [(x.off, x.status) for x in results] == [([], "ok"), (["cuda-graph"], "ok")]
