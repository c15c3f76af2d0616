"""API key of the embedded engine (issue 15 item 5): with a key set, every route but the health probes needs
``Authorization: Bearer KEY``; the project's clients send the key they find in the environment or a key file."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from engine_helpers import http, start_engine

from slime_lite.engine_client import API_KEY_ENV, API_KEY_FILE_ENV, SentRequest, request_json
from slime_lite.errors import EngineError


def _status(url: str, route: str, key: str | None, body: dict | None = None) -> int:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(url + route, data=None if body is None else json.dumps(body).encode(),
                                 headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


@pytest.fixture(scope="module")
def keyed_engine(tiny_model_dir):
    server = start_engine(tiny_model_dir, max_running_requests=2, api_key="s3cret")
    yield server
    server.stop()


def test_every_route_but_health_needs_the_key(keyed_engine):
    url = keyed_engine.url
    gen = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}
    assert _status(url, "/health", None) == 200 and _status(url, "/health_generate", None) == 200
    for route, body in [("/generate", gen), ("/get_model_info", None), ("/v1/models", None),
                        ("/get_weights_checksum", {}), ("/update_weights_from_disk", {"model_path": "/"}),
                        ("/init_weights_update_group", {})]:
        assert _status(url, route, None, body) == 401, route
        assert _status(url, route, "wrong", body) == 401, route
    assert _status(url, "/generate", "s3cret", gen) == 200
    assert http(url, "/generate", gen)[1]["error"]["message"].startswith("missing or wrong API key")


def test_clients_send_the_key_from_the_environment_or_a_file(keyed_engine, monkeypatch, tmp_path):
    url = keyed_engine.url
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    monkeypatch.delenv(API_KEY_FILE_ENV, raising=False)
    with pytest.raises(EngineError, match="401"):
        request_json(url, "/get_model_info")
    monkeypatch.setenv(API_KEY_ENV, "s3cret")
    assert "model_path" in request_json(url, "/get_model_info")
    monkeypatch.delenv(API_KEY_ENV)
    key_file = tmp_path / "key"
    key_file.write_text("s3cret\n")
    monkeypatch.setenv(API_KEY_FILE_ENV, str(key_file))
    assert "model_path" in request_json(url, "/get_model_info")


def test_a_sent_request_answers_and_fails_as_request_json(keyed_engine, monkeypatch):
    """``SentRequest`` (the weight check's request, read after the trainer hashed its tensors): the key from the
    environment, the parsed answer, an HTTP error and an engine that is not there, each as ``request_json`` says."""
    from slime_lite.io import free_port

    url = keyed_engine.url
    monkeypatch.setenv(API_KEY_ENV, "s3cret")
    sent = SentRequest(url, "/get_weights_checksum", {})
    assert sent.result() == request_json(url, "/get_weights_checksum", {})
    with pytest.raises(EngineError, match=r"/get_weights_checksum answered HTTP 400: .*unknown parameter name"):
        SentRequest(url, "/get_weights_checksum", {"names": ["nope"]}).result()
    monkeypatch.setenv(API_KEY_ENV, "wrong")
    with pytest.raises(EngineError, match="answered HTTP 401"):
        SentRequest(url, "/get_weights_checksum", {}).result()
    gone = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(EngineError, match=rf"engine {gone}/get_weights_checksum did not answer"):
        SentRequest(gone, "/get_weights_checksum", {}).result()
    with pytest.raises(EngineError, match="did not answer .*Port out of range"):
        SentRequest("http://127.0.0.1:99999", "/get_weights_checksum", {})
