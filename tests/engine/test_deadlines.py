"""Nothing holds the model thread without a deadline: /health tells a stuck or paused generator from a working one,
and a weight update group that never forms, or never sends, ends in an error while the engine keeps serving."""

from __future__ import annotations

import threading
import time

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
