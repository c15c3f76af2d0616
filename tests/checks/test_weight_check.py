"""checks/weight_check.py against an engine that cannot be checked: a real SGLang server has no
/get_weights_checksum (its /weights_checker hashes its own fused, TP-sharded tensors). Asked for by the flag, the
check stops naming the flag and the fix; forced on a restarted engine (--use-fault-tolerance), it is skipped with a
warning instead of stopping the run that fault tolerance is keeping alive."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest
import torch

from slime_lite.backends.megatron import weight_push
from slime_lite.checks import weight_check
from slime_lite.errors import SlimeLiteError


@pytest.fixture
def sglang_like():
    """An engine without /get_weights_checksum (every route answers 404, as SGLang 0.5.23 does for that one)."""

    class NotFound(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            body = b'{"detail":"Not Found"}'
            self.send_response(404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def push_args(**kw):
    return SimpleNamespace(**{"debug_scramble_engine_weights": False, "debug_inject_fault": None,
                              "check_weight_update_equal": False, "rollout_backend": "sglang", **kw})


def test_an_engine_without_checksums_is_named_with_the_flag_and_the_fix(sglang_like):
    with pytest.raises(weight_check.WeightCheckUnavailable, match=r"has no /get_weights_checksum.*"
                                                                  r"--rollout-backend embedded"):
        weight_check.check_weights_equal({"w": torch.ones(2)}, [sglang_like])


def test_the_check_forced_on_a_restarted_engine_is_skipped_where_it_cannot_run(sglang_like, monkeypatch, caplog):
    monkeypatch.setattr(weight_push, "_transport", lambda *a, **k: None)
    named = {"w": torch.ones(2)}
    with caplog.at_level("WARNING", logger=weight_push.__name__):
        times = weight_push.push(push_args(), named, [sglang_like], 4, check=True)  # fault tolerance's check
    assert "perf/update_weights/check_time" not in times and "not checked" in caplog.text
    with pytest.raises(SlimeLiteError, match="--check-weight-update-equal"):  # asked for: it stops the run
        weight_push.push(push_args(check_weight_update_equal=True), named, [sglang_like], 4)
