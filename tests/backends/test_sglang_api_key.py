"""An SGLang engine that train launches on a non-loopback address (simulated on loopback) gets the run's API key by
environment, never on its command line, and refuses requests without it (issue 15 item 5). The server is tests/fakes/fake_sglang_server
(a fake: SGLang cannot be installed here) with SGLang's --api-key flag."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from slime_lite.args import parser_defaults
from slime_lite.backends.sglang.launcher import SGLangServer
from slime_lite.engine_client import API_KEY_ENV, API_KEY_FILE_ENV, request_json
from slime_lite.errors import EngineError

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture()
def remote_host(tmp_path, monkeypatch):
    """The launcher treats the engine's address as reachable from other hosts (a stand-in: the test's traffic
    stays on 127.0.0.1, as every test's here must)."""
    from slime_lite.backends.sglang import launcher

    monkeypatch.setenv("SLIME_LITE_ENGINE_LOG_DIR", str(tmp_path / "engine_logs"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("SLIME_LITE_ENGINE_HOST", "127.0.0.1")
    monkeypatch.setattr(launcher, "is_loopback", lambda host: False)
    monkeypatch.delenv(API_KEY_FILE_ENV, raising=False)


def _args(model_dir):
    return parser_defaults(hf_checkpoint=str(model_dir), rollout_num_gpus_per_engine=1, rollout_seed=0,
                           colocate=False, sglang_server_module="tests.fakes.fake_sglang_server", sglang_args=[])


def test_a_non_loopback_engine_needs_the_key_which_is_not_on_its_command_line_fake(tiny_model_dir, remote_host,
                                                                                   monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, "k3y-from-env")
    server = SGLangServer(_args(tiny_model_dir), 0, start_timeout=120)
    url = server.start()
    try:
        with open(f"/proc/{server.proc.pid}/cmdline", "rb") as f:
            cmdline = f.read().decode()
        assert "k3y-from-env" not in cmdline and "k3y-from-env" not in " ".join(server.command)
        assert "k3y-from-env" not in Path(server.log_path).read_text()
        assert request_json(url, "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}})
        monkeypatch.delenv(API_KEY_ENV)
        with pytest.raises(EngineError, match="401"):
            request_json(url, "/get_model_info")
        request_json(url, "/health")  # the liveness probe needs no key
    finally:
        server.stop()


def test_a_non_loopback_engine_without_a_key_is_refused_before_launch(tiny_model_dir, remote_host, monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    server = SGLangServer(_args(tiny_model_dir), 0, start_timeout=120)
    with pytest.raises(EngineError, match=f"without an API key.*{API_KEY_ENV}"):
        server.start()
    assert server.proc is None


def test_a_non_loopback_router_gets_the_key_by_environment_and_checks_it_fake(tiny_model_dir, remote_host,
                                                                               monkeypatch):
    """--use-sglang-router: the router (tests/fakes/fake_sglang_router, a fake taking sglang_router's --api-key) is
    launched like the engines: the key reaches it through the environment, never its command line."""
    from slime_lite.backends.sglang.launcher import SGLangRouter
    from slime_lite.engine.server import EngineServer

    monkeypatch.setenv(API_KEY_ENV, "r0uter-k3y")
    engine = EngineServer(str(tiny_model_dir), device="cpu", cpu_threads=1)
    router = SGLangRouter([engine.start()], module="tests.fakes.fake_sglang_router", start_timeout=60)
    try:
        url = router.start()
        with open(f"/proc/{router.proc.pid}/cmdline", "rb") as f:
            assert "r0uter-k3y" not in f.read().decode() and "r0uter-k3y" not in " ".join(router.command)
        out = request_json(url, "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}})
        assert out["meta_info"]["completion_tokens"] == 2  # sent with the run's key
        monkeypatch.delenv(API_KEY_ENV)
        with pytest.raises(EngineError, match="401"):
            request_json(url, "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}})
    finally:
        router.stop()
        engine.stop()


def test_a_non_loopback_router_without_a_key_is_refused_before_launch(remote_host, monkeypatch):
    from slime_lite.backends.sglang.launcher import SGLangRouter

    monkeypatch.delenv(API_KEY_ENV, raising=False)
    router = SGLangRouter(["http://127.0.0.1:1"], module="tests.fakes.fake_sglang_router")
    with pytest.raises(EngineError, match=f"SGLang router would listen .* without an API key.*{API_KEY_ENV}"):
        router.start()
    assert router.proc is None
