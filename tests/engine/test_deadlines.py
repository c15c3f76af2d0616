"""Nothing holds the model thread without a deadline: /health tells a stuck or paused generator from a working one,
and a weight update group that never forms, or never sends, ends in an error while the engine keeps serving."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from engine_helpers import generate, http, in_thread

from slime_lite.io import free_port
from slime_lite.weight_transport import WeightUpdateGroup

GREEDY = {"temperature": 0.0, "ignore_eos": True}


def test_health_is_503_at_once_while_paused_and_200_after_continue(engine):
    assert http(engine.url, "/pause_generation", {"mode": "in_place"})[0] == 200
    try:
        start = time.monotonic()
        assert http(engine.url, "/health")[0] == 503
        assert http(engine.url, "/health_generate") == (503, "generation is paused")
        assert time.monotonic() - start < 5
    finally:
        assert http(engine.url, "/continue_generation", {})[0] == 200
    assert http(engine.url, "/health")[0] == 200


def test_health_is_503_while_the_model_thread_is_stuck(engine, monkeypatch):
    from slime_lite.engine import info_routes

    monkeypatch.setattr(info_routes, "HEALTH_GENERATE_TIMEOUT_S", 1.0)
    release = threading.Event()
    stuck = engine.scheduler.call(release.wait, 30)  # a call that holds the model thread
    try:
        status, text = http(engine.url, "/health_generate")
        assert status == 503 and "did not answer" in text
    finally:
        release.set()
        stuck.result(30)
    assert http(engine.url, "/health")[0] == 200
    assert engine.scheduler.num_waiting == 0  # the failed check's request was aborted, not left queued


def test_health_is_200_while_the_engine_is_busy(engine):
    t, _ = in_thread(generate, engine.url, input_ids=[[1, 2]] * 8, sampling_params={"max_new_tokens": 300, **GREEDY})
    deadline = time.monotonic() + 10
    while engine.scheduler.num_running < 8:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    assert http(engine.url, "/health")[0] == 200  # every slot taken: tokens flowing count as an answer
    http(engine.url, "/abort_request", {"abort_all": True})
    t.join(30)


def test_a_weight_group_that_never_forms_times_out_while_generation_goes_on(engine, monkeypatch):
    from slime_lite.engine import weights

    monkeypatch.setattr(weights, "GROUP_TIMEOUT_S", 3.0)
    init = {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1, "world_size": 2,
            "group_name": "never", "backend": "gloo"}  # no trainer (rank 0) ever comes
    t, box = in_thread(http, engine.url, "/init_weights_update_group", init)
    time.sleep(0.3)
    assert t.is_alive()
    generate(engine.url, input_ids=[1, 2], sampling_params={"max_new_tokens": 3, **GREEDY})  # not blocked
    t.join(30)
    status, out = box["result"]
    assert status == 400 and out["success"] is False and "could not join" in out["message"]
    assert http(engine.url, "/destroy_weights_update_group", {"group_name": "never"})[0] == 400  # nothing left


def test_a_receive_that_never_comes_times_out_and_destroys_the_group(engine, monkeypatch):
    from slime_lite.engine import weights

    monkeypatch.setattr(weights, "GROUP_TIMEOUT_S", 5.0)  # also bounds the join, on a busy machine
    port = free_port()
    init = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": "silent", "backend": "gloo"}
    t, box = in_thread(http, engine.url, "/init_weights_update_group", init)
    trainer = WeightUpdateGroup("127.0.0.1", port, rank=0, world_size=2, backend="gloo", group_name="silent",
                                timeout_s=30)
    t.join(30)
    assert box["result"][0] == 200
    try:
        before = http(engine.url, "/get_weights_checksum", {"names": ["model.norm.weight"]})[1]
        body = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[128]], "group_name": "silent"}
        status, out = http(engine.url, "/update_weights_from_distributed", body)  # the trainer sends nothing
        assert status == 400 and out["success"] is False and "destroyed" in out["message"]
        assert http(engine.url, "/get_weights_checksum", {"names": ["model.norm.weight"]})[1] == before
        assert http(engine.url, "/health")[0] == 200
        assert http(engine.url, "/destroy_weights_update_group", {"group_name": "silent"})[0] == 400
    finally:
        trainer.destroy()


class FakeRefusingEngine(ThreadingHTTPServer):
    """FAKE engine: answers every POST with a 400, as an SGLang server refusing /init_weights_update_group does
    (a group already there, a backend it cannot use); ``asked`` lists the routes it got."""

    def __init__(self) -> None:
        asked = self.asked = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                asked.append(self.path)
                body = json.dumps({"success": False, "message": "FAKE: group 'weight_update_group' exists"}).encode()
                self.send_response(400)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        threading.Thread(target=self.serve_forever, daemon=True).start()


@pytest.mark.timeout(60, method="thread")  # the group's timeout is 300 s: only noticing the refusal ends in time
def test_an_engine_refusing_the_group_stops_the_push_at_once_and_the_others_leave(engine):
    """One engine refuses to join (a 400) while another joins: the push fails at once naming the refusing engine
    and its answer, and the engine that was joining is not left waiting for the group (it can join a new one)."""
    import torch

    from slime_lite.backends.megatron import weight_broadcast
    from slime_lite.errors import EngineError

    fake = FakeRefusingEngine()
    try:
        with pytest.raises(EngineError, match=rf"{fake.url}/init_weights_update_group.*400.*FAKE: group"):
            weight_broadcast.push_distributed({"model.norm.weight": torch.ones(128)}, [engine.url, fake.url], 1)
    finally:
        fake.shutdown()
    assert fake.asked == ["/init_weights_update_group"]  # the refusing engine is not asked to destroy anything
    weights = engine.scheduler.weights
    deadline = time.monotonic() + 30
    while weights.joining or "weight_update_group" in weights.groups:
        assert time.monotonic() < deadline, "the engine was left in the failed group"
        time.sleep(0.05)
    assert not weight_broadcast._groups
    weight_broadcast._group([engine.url], "gloo")  # the engine can join the next one
    weight_broadcast._drop_group((engine.url,))


@pytest.mark.timeout(60, method="thread")
def test_destroying_a_group_being_joined_calls_the_join_off(engine):
    init = {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1, "world_size": 2,
            "group_name": "off", "backend": "gloo"}  # no trainer (rank 0) comes
    t, box = in_thread(http, engine.url, "/init_weights_update_group", init)
    while "off" not in engine.scheduler.weights.joining:
        assert t.is_alive()
        time.sleep(0.01)
    assert http(engine.url, "/init_weights_update_group", init)[0] == 400  # one join of a name at a time
    assert http(engine.url, "/destroy_weights_update_group", {"group_name": "off"})[0] == 200
    t.join(30)
    status, out = box["result"]
    assert status == 400 and "called off" in out["message"]
    assert http(engine.url, "/destroy_weights_update_group", {"group_name": "off"})[0] == 400  # nothing left


def test_a_join_whose_store_closes_before_it_connects_is_still_called_off(monkeypatch):
    """The trainer's store closes between the member's check that it listens and the member's connect (the push
    gave up on the group): torch's connect would then retry for the whole group timeout, deaf to the call-off. The
    join must end soon after it is called off."""
    import threading

    from slime_lite import weight_transport as wt

    monkeypatch.setattr(wt, "_wait_listening", lambda *a: None)  # "it listened": then it closed
    monkeypatch.setattr(wt, "CONNECT_TRY_S", 1.0)
    called_off = threading.Event()
    threading.Timer(0.5, called_off.set).start()
    t0 = time.monotonic()
    with pytest.raises(wt.GroupJoinCancelled, match="called off while connecting"):
        wt.WeightUpdateGroup("127.0.0.1", free_port(), 1, 2, "gloo", "gone", timeout_s=120, cancelled=called_off.is_set)
    assert time.monotonic() - t0 < 20  # not the group's 120 s
