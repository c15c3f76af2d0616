"""The SGLang launcher: its command line, flag checks before anything starts, the server process lifecycle, the
router, GPU assignment under Ray, and rollouts against engines started outside the job.

SGLang's server cannot run here (no GPU): process tests run the FAKE server ``tests.fakes.fake_sglang_server`` (the
embedded engine behind SGLang's flags) or the embedded engine's own CLI through the same launcher path. SGLang's own
code checks the flags and payloads in test_sglang_contract.py.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from slime_lite.args import parse_args, parser_defaults
from slime_lite.backends.sglang import launcher
from slime_lite.backends.sglang.launcher import (
    SGLangRouter, SGLangServer, build_command, build_router_command, check_sglang_args,
)
from slime_lite.config import EngineConfig
from tests import sglang_oracle as oracle
from slime_lite.errors import EngineError, SlimeLiteError

REPO = Path(__file__).resolve().parents[2]
FAKE_SERVER = "tests.fakes.fake_sglang_server"


@pytest.fixture()
def flags(tmp_path, monkeypatch):
    # validate_args runs check_sglang_args, which (rightly) refuses --rollout-backend sglang without SGLang; these
    # tests build command lines only, so parse_args skips that check here (it is tested on its own below).
    monkeypatch.setattr(launcher, "check_sglang_args", lambda args: None)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "1+1=", "label": "2"}\n')
    return ["--hf-checkpoint", str(model), "--prompt-data", str(data), "--rm-type", "addition",
            "--rollout-backend", "sglang", "--debug-rollout-only"]


def tail_after_seed(cmd: list[str]) -> list[str]:
    return cmd[cmd.index("--random-seed") + 2:]


def engine(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig.from_args(args)


# ---- command line -------------------------------------------------------------------------------------------
def test_command_has_model_address_tp_and_per_engine_seed(flags):
    args = parse_args(flags + ["--rollout-num-gpus", "4", "--rollout-num-gpus-per-engine", "2",
                               "--rollout-seed", "7"])
    cmd = build_command(engine(args), rank=1, port=31234)
    assert cmd[:3] == [sys.executable, "-m", "sglang.launch_server"]
    opts = dict(zip(cmd[3::2], cmd[4::2]))
    assert opts["--model-path"] == args.hf_checkpoint and opts["--host"] == "127.0.0.1"
    assert opts["--port"] == "31234" and opts["--tp-size"] == "2" and opts["--random-seed"] == "8"
    assert "--enable-memory-saver" not in cmd and tail_after_seed(cmd) == []


def test_colocate_adds_memory_saver(flags):
    args = parse_args([f for f in flags if f != "--debug-rollout-only"] + ["--colocate"])
    assert tail_after_seed(build_command(engine(args), 0, 1)) == ["--enable-memory-saver"]
    args = parse_args([f for f in flags if f != "--debug-rollout-only"])
    assert "--enable-memory-saver" not in build_command(engine(args), 0, 1)
    # --offload-rollout without --colocate releases the engines' memory too: without the saver SGLang's
    # release/resume do nothing
    args = parse_args([f for f in flags if f != "--debug-rollout-only"] + ["--offload-rollout"])
    assert tail_after_seed(build_command(engine(args), 0, 1)) == ["--enable-memory-saver"]


def test_passthrough_values_booleans_and_negative_values_in_order(flags):
    args = parse_args(flags + [
        "--sglang-mem-fraction-static", "0.7", "--sglang-disable-cuda-graph", "--sglang-some-offset", "-1",
        "--sglang-log-level=debug", "--sglang-server-module", FAKE_SERVER, "--lr", "1e-6",
    ])
    cmd = build_command(engine(args), 0, 4242)
    assert cmd[2] == FAKE_SERVER  # our own flag, not passed to SGLang
    assert tail_after_seed(cmd) == ["--mem-fraction-static", "0.7", "--disable-cuda-graph", "--some-offset", "-1",
                                    "--log-level", "debug"]


def test_fake_server_parses_the_built_command_like_sglang_would(flags):
    import importlib.util

    spec = importlib.util.spec_from_file_location("fake_sglang_server", REPO / "tests/fakes/fake_sglang_server.py")
    fake = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fake)
    build_parser = fake.build_parser
    args = parse_args(flags + ["--sglang-disable-cuda-graph", "--sglang-some-offset", "-1",
                               "--sglang-speculative-algorithm", "EAGLE"])
    parsed = build_parser().parse_args(build_command(engine(args), 3, 5555)[3:])
    assert parsed.some_offset == -1 and parsed.disable_cuda_graph and parsed.speculative_algorithm == "EAGLE"
    assert parsed.port == 5555 and parsed.random_seed == 45 and parsed.tp_size == 1


def test_router_command():
    cmd = build_router_command(["http://a:1", "http://b:2"], 9000)
    assert cmd[1:] == ["-m", "sglang_router.launch_router", "--worker-urls", "http://a:1", "http://b:2",
                       "--host", "127.0.0.1", "--port", "9000"]


# ---- checks before anything starts --------------------------------------------------------------------------
def test_missing_sglang_is_a_clear_error_with_install_hint(flags, monkeypatch):
    monkeypatch.setattr(launcher, "_module_found", lambda name: False)  # a driver node without SGLang
    args = parse_args(flags)
    with pytest.raises(SlimeLiteError) as info:
        check_sglang_args(engine(args))
    assert 'pip install "sglang[all]==' in str(info.value) and "--rollout-backend embedded" in str(info.value)


def test_checks_skip_embedded_and_external_engines(flags, caplog):
    check_sglang_args(engine(parse_args([f for f in flags if f != "sglang" and f != "--rollout-backend"])))
    check_sglang_args(engine(parse_args(flags + ["--rollout-external-engine-addrs", "127.0.0.1:1"])))
    caplog.clear()  # engines started elsewhere: a --sglang-* flag changes nothing, and the run says so
    check_sglang_args(engine(parse_args(flags + ["--rollout-external-engine-addrs", "127.0.0.1:1",
                                                 "--sglang-mem-fraction-static", "0.5"])))
    assert "--sglang-mem-fraction-static change nothing with --rollout-external-engine-addrs" in caplog.text


def test_launcher_owned_flags_are_refused(flags):
    args = parse_args(flags + ["--sglang-tp-size", "2", "--sglang-server-module", FAKE_SERVER])
    with pytest.raises(SlimeLiteError, match="--rollout-num-gpus-per-engine"):
        check_sglang_args(engine(args))


def test_pipeline_or_data_parallel_engines_wanting_more_gpus_than_they_get_are_refused(flags):
    """SGLang places tp x pp ranks per data-parallel replica; a server sees --rollout-num-gpus-per-engine GPUs, all
    its --tp-size. SGLang's own parser reads the flags (on this CPU machine)."""
    oracle.require_sglang()
    oracle.sglang_module("sglang.srt.server_args")  # importable on a CPU machine through the oracle
    gpus = ["--rollout-num-gpus", "2", "--rollout-num-gpus-per-engine", "2"]
    for extra, says in ((["--sglang-pp-size", "2"], "would place its ranks on 4 GPUs of 2"),
                        (["--sglang-dp-size", "2"], "would place its ranks on 4 GPUs of 2")):
        with pytest.raises(SlimeLiteError, match=says):
            check_sglang_args(engine(parse_args(flags + gpus + extra)))
    check_sglang_args(engine(parse_args(flags + gpus + ["--sglang-dp-size", "2", "--sglang-enable-dp-attention"])))


def test_router_flag_checks(flags):
    embedded = parse_args([f for f in flags if f not in ("sglang", "--rollout-backend")] + ["--use-sglang-router"])
    with pytest.raises(SlimeLiteError, match="--rollout-backend sglang"):
        check_sglang_args(engine(embedded))
    args = parse_args(flags + ["--use-sglang-router", "--sglang-server-module", FAKE_SERVER])
    with pytest.raises(SlimeLiteError, match="pip install sglang-router"):
        check_sglang_args(engine(args))


# the --sglang-* flags checked by the real SGLang parser: tests/backends/test_sglang_contract.py


# ---- the server process ---------------------------------------------------------------------------------------
def fake_args(model_dir, *sglang_args: str, **over) -> argparse.Namespace:
    base = dict(hf_checkpoint=str(model_dir), rollout_num_gpus_per_engine=1, rollout_seed=0, colocate=False,
                sglang_server_module=FAKE_SERVER, sglang_args=list(sglang_args))
    base.update(over)
    return parser_defaults(**base)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture()
def engine_logs(tmp_path, monkeypatch):
    monkeypatch.setenv("SLIME_LITE_ENGINE_LOG_DIR", str(tmp_path / "engine_logs"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    return tmp_path / "engine_logs"


def test_crash_at_start_reports_exit_code_and_log_tail_fake(tmp_path, engine_logs):
    server = SGLangServer(fake_args(tmp_path, "--fake-fault", "crash-at-start:cuda-graph"), 0, start_timeout=60)
    with pytest.raises(EngineError) as info:
        server.start()
    msg = str(info.value)
    assert "exited with code 1" in msg and "illegal memory access" in msg and str(engine_logs) in msg


def test_server_that_never_gets_healthy_is_killed_at_timeout_fake(tmp_path, engine_logs):
    server = SGLangServer(fake_args(tmp_path, "--fake-fault", "hang-at-start:always"), 0, start_timeout=3)
    with pytest.raises(EngineError, match="not healthy after 3s"):
        server.start()
    assert server.proc is None


@pytest.mark.slow
def test_server_starts_serves_and_stops_without_leftovers_fake(tiny_model_dir, engine_logs):
    from slime_lite.engine_client import request_json

    server = SGLangServer(fake_args(tiny_model_dir, "--disable-cuda-graph"), 2, gpu_ids=[3, 5], start_timeout=120)
    url = server.start()
    pid = server.proc.pid
    try:
        out = request_json(url, "/generate", {"text": "1+2=", "sampling_params": {"max_new_tokens": 3}})
        assert out["meta_info"]["completion_tokens"] == 3
        info = request_json(url, "/get_server_info")
        assert info["random_seed"] == 2  # rollout_seed + rank
    finally:
        server.stop()
    assert not alive(pid)
    text = Path(server.log_path).read_text()
    assert "CUDA_VISIBLE_DEVICES=3,5" in text and "--random-seed 2" in text


@pytest.mark.slow
def test_router_in_front_of_engine_fake(tiny_model_dir, engine_logs):
    from slime_lite.engine.server import EngineServer
    from slime_lite.engine_client import request_json

    engine = EngineServer(str(tiny_model_dir), device="cpu", cpu_threads=1)
    worker = engine.start()
    router = SGLangRouter([worker], module="tests.fakes.fake_sglang_router", start_timeout=60)
    try:
        url = router.start()
        assert url != worker
        out = request_json(url, "/generate", {"text": "1+2=", "sampling_params": {"max_new_tokens": 2}})
        assert out["meta_info"]["completion_tokens"] == 2
        assert request_json(url, "/fake_routed") == {worker: 1}
        pid = router.proc.pid
    finally:
        router.stop()
        engine.stop()
    assert not alive(pid)


@pytest.mark.slow
def test_engine_gpu_ids_follow_the_engines_bundles_with_logical_ray_gpus():
    """Ray with 4 logical GPUs (no CUDA needed): engine 1 of TP 2 gets the GPUs of bundles 2 and 3; the engine
    holds its first bundle's GPU whole, as on GPUs of its own (a probe of that bundle would wait forever)."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    args = parser_defaults(debug_rollout_only=True, rollout_num_gpus=4, rollout_num_gpus_per_engine=2)
    ray.init(num_cpus=4, num_gpus=4, include_dashboard=False, logging_level="WARNING")
    try:
        pg = placement_group([{"CPU": 0.5, "GPU": 1} for _ in range(4)], strategy="PACK")
        ray.get(pg.ready())
        probe = ray.remote(launcher.engine_gpu_ids)
        got = {}
        for rank, bundle in ((0, 0), (1, 2)):
            strategy = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=bundle)
            got[rank] = ray.get(probe.options(num_cpus=0.1, num_gpus=1, scheduling_strategy=strategy)
                                .remote(args, rank), timeout=60)
        assert sorted(got[0]) == [0, 1] and sorted(got[1]) == [2, 3]
    finally:
        ray.shutdown()


# ---- whole runs ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def task_data(tmp_path_factory) -> Path:
    from slime_lite.tasks import make_data

    out = tmp_path_factory.mktemp("data") / "addition.jsonl"
    make_data("addition", out, n_train=32, n_eval=8)
    return out


def run_driver(code: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_DEDUP_LOGS": "0"}
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


def rollout_argv(model, data, out) -> list[str]:
    return ["--debug-rollout-only", "--hf-checkpoint", str(model), "--prompt-data", str(data), "--rm-type",
            "addition", "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--rollout-max-response-len",
            "4", "--save-debug-rollout-data", str(out / "data_{rollout_id}.pt")]


@pytest.mark.slow
def test_rollout_only_through_launcher_path_with_embedded_server_module(tiny_model_dir, task_data, tmp_path):
    """--rollout-backend sglang with the embedded engine's CLI as the server module: Ray actors launch it as a
    subprocess through SGLangServer, and two rollouts run through two such engines. Engine 0's server process is
    killed (SIGKILL) while rollout 1 is generated (--debug-inject-fault kill-engine): under --use-fault-tolerance
    its unfinished requests go to engine 1, and engine 0 is launched again the same way (same rank and seed)."""
    from slime_lite.rollout.dumps import load_rollout_dump

    argv = rollout_argv(tiny_model_dir, task_data, tmp_path) + [
        "--rollout-backend", "sglang", "--sglang-server-module", "slime_lite.engine.serve_cli",
        "--rollout-num-gpus", "2", "--debug-env", f"SLIME_LITE_ENGINE_LOG_DIR={tmp_path / 'logs'}",
        "--num-rollout", "2", "--use-fault-tolerance", "--debug-inject-fault", "kill-engine"]
    code = ("from slime_lite.cli import main\n"
            f"raise SystemExit(main(['train', *{argv!r}]))\n")
    proc = run_driver(code)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    for rid in (0, 1):
        dump = load_rollout_dump(str(tmp_path / f"data_{rid}.pt"))
        assert len(dump.samples) == 8 and all(s.response_length > 0 for s in dump.samples)
    assert "engine 0 restarted at http://" in out and "no trainer: it serves --hf-checkpoint's weights" in out
    logs = sorted(os.listdir(tmp_path / "logs"))  # one log per launch: engines 0 and 1, then engine 0 again
    assert len(logs) == 3 and all(name.startswith("sglang_engine") for name in logs)
    cmds = [(tmp_path / "logs" / n).read_text().splitlines()[0] for n in logs]
    assert sorted(c.split("--random-seed ")[1].split()[0] for c in cmds) == ["42", "42", "43"]


@pytest.mark.slow
def test_rollout_only_against_external_engine_places_nothing(tiny_model_dir, task_data, tmp_path):
    """An embedded server started outside the job; the job starts no engine and places no slot."""
    from slime_lite.engine.server import EngineServer
    from slime_lite.engine_client import request_json
    from slime_lite.rollout.dumps import load_rollout_dump

    engine = EngineServer(str(tiny_model_dir), device="cpu", cpu_threads=1)
    url = engine.start()
    try:
        argv = rollout_argv(tiny_model_dir, task_data, tmp_path) + [
            "--rollout-external-engine-addrs", url.removeprefix("http://")]
        code = (
            "import ray\n"
            "from ray._private import state\n"
            "from slime_lite.args import parse_args\n"
            "from slime_lite.train import run\n"
            f"args = parse_args({argv!r})\n"
            "assert run(args) == 0\n"
            "print('PLACEMENT_GROUPS', len(ray.util.placement_group_table()))\n"
            "print('ACTORS', sorted(a['ActorClassName'] for a in state.actors().values()))\n"
            "ray.shutdown()\n"
        )
        proc = run_driver(code)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "PLACEMENT_GROUPS 0" in proc.stdout
        actors = proc.stdout.split("ACTORS ")[1].splitlines()[0]
        assert "EngineActor" not in actors and "RolloutManager" in actors
        dump = load_rollout_dump(str(tmp_path / "data_0.pt"))
        assert len(dump.samples) == 8
        served = request_json(url, "/get_server_info")["num_generated_tokens"]
        assert served >= sum(s.response_length for s in dump.samples)
    finally:
        engine.stop()


def test_health_check_of_a_server_on_this_host_ignores_the_environments_http_proxy(engine_logs, monkeypatch):
    """A cluster node with ``http_proxy`` set (for pip) and no ``no_proxy``: the launcher's health check (and every
    other synchronous request to an engine) must go to the server itself, not through the proxy (here a port where
    nothing listens: a proxied check never succeeds). The server is the FAKE SGLang router in front of a stdlib
    stand-in worker that answers /health."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from slime_lite.io import free_port

    class Health(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    worker = ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=worker.serve_forever, daemon=True).start()
    for name in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    for name in ("http_proxy", "HTTP_PROXY"):
        monkeypatch.setenv(name, f"http://127.0.0.1:{free_port()}")
    router = SGLangRouter([f"http://127.0.0.1:{worker.server_address[1]}"], module="tests.fakes.fake_sglang_router",
                          start_timeout=30)
    try:
        url = router.start()
        assert launcher.request_json(url, "/health") is None
    finally:
        router.stop()
        worker.shutdown()
