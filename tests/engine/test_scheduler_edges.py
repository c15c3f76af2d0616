"""Scheduler edge cases found by review: a stop string of multi-byte characters written byte by byte, a retracted
request whose re-prefill fails, the prefix cache's token count read while the model thread changes it."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from slime_lite.engine.request import Request, abort_reason
from slime_lite.engine.sampling import SamplingParams
from slime_lite.engine.scheduler import Scheduler


@pytest.mark.parametrize("stop", ["🙂🙂🙂", "最终的答案", "答案是", "ab"])
def test_a_stop_string_is_found_however_many_tokens_its_characters_take(stop):
    """With byte-level tokens (Qwen's and Llama's byte fallback) a character takes up to 4 tokens: the tail searched
    for the stop string is sized by its bytes, not its characters (it ran on to max_new_tokens)."""
    fake = SimpleNamespace(eos_ids=set(), decode=lambda ids, skip: bytes(ids).decode("utf-8", errors="replace"))
    text = ("xy" + stop + "tail").encode()
    req = Request(rid="r", input_ids=[1], params=SamplingParams(max_new_tokens=len(text), stop=[stop]), seed=0)
    req.max_new = len(text)
    for n, tok in enumerate(text, 1):  # one byte a token: the stop string's last byte is the first match
        req.output_ids.append(tok)
        finish = Scheduler._check_finished(fake, req, tok)
        if finish is not None:
            break
    assert finish == {"type": "stop", "matched": stop} and n == len(("xy" + stop).encode())


def _submit(sch: Scheduler, ids: list[int], **sp) -> tuple[Request, threading.Event]:
    done = threading.Event()
    params = SamplingParams.from_dict(sp)
    req = Request(rid=f"r{time.monotonic_ns()}", input_ids=list(ids), params=params, seed=0,
                  on_output=lambda out: out.finish_reason is not None and done.set())
    sch.prepare(req)
    sch.submit(req)
    return req, done


def test_a_retracted_request_whose_re_prefill_fails_leaves_nothing_in_the_prefix_cache(tiny_model_dir):
    """pause(retract) frees the request's K/V; when its re-prefill then fails (a CUDA out-of-memory error, injected)
    it is aborted, and its never-written slot must not be cached as holding prompt + output: a later prompt
    starting the same way would reuse garbage K/V."""
    sch = Scheduler(tiny_model_dir, device="cpu", max_running_requests=2, kv_cache_tokens=256)
    sch.start()
    try:
        prompt = list(range(10, 40))
        req, done = _submit(sch, prompt, max_new_tokens=60, temperature=0.0, ignore_eos=True)
        deadline = time.monotonic() + 30
        while len(req.output_ids) < 5 and time.monotonic() < deadline:
            time.sleep(0.001)
        sch.call(sch.pause, "retract").result(10)
        real = sch.lm.prefill, sch.lm.prefill_extend

        def fails(*a, **k):
            raise torch.OutOfMemoryError("injected: out of memory in the re-prefill")

        sch.lm.prefill = sch.lm.prefill_extend = fails
        sch.call(sch.resume).result(10)
        assert done.wait(30) and req.finish_reason["type"] == "abort" and req.output_ids
        sch.lm.prefill, sch.lm.prefill_extend = real
        assert sch.call(lambda: len(sch.prefix)).result(10) == 0
        again, done = _submit(sch, prompt + req.output_ids[:-1] + [5], max_new_tokens=2, temperature=0.0)
        assert done.wait(30) and again.cached_tokens == 0
    finally:
        sch.stop()


def test_the_prefix_caches_token_count_survives_a_concurrent_change():
    """/get_server_info reads cached_tokens from the HTTP thread while the model thread adds and drops slots: the
    count copies the values first (it raised "dictionary changed size during iteration": a 500)."""
    from slime_lite.engine.prefix_cache import PrefixCache

    cache = PrefixCache(lambda: 0)
    stop, errors = threading.Event(), []

    def churn():
        k = 0
        while not stop.is_set():
            cache.release(k % 64, [1, 2, 3], None)
            cache.forget((k + 7) % 64)
            k += 1

    def read():
        try:
            for _ in range(20000):
                cache.cached_tokens
        except RuntimeError as exc:
            errors.append(exc)

    import sys

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        t = threading.Thread(target=churn)
        t.start()
        read()
        stop.set()
        t.join()
    finally:
        sys.setswitchinterval(old)
    assert not errors


def test_batch_slots_hold_a_runs_long_responses_and_a_cap_is_warned(tiny_model_dir, tmp_path, caplog):
    """A slot held min(context, 4,096) tokens unless the cache size was given, so an 8K-token response of a
    long-context model was cut at ~4K with finish "length" and a debug line. The run's longest request now sizes
    the slots; a request capped by its slot anyway is a warning naming the flags."""
    import json
    import logging
    import shutil

    model = tmp_path / "long"
    shutil.copytree(tiny_model_dir, model)
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 16384}))
    for hint, slot in ((None, 4096), (9000, 9000), (40000, 16384)):
        sch = Scheduler(str(model), device="cpu", max_running_requests=2, request_tokens=hint)
        assert sch.slot_len == slot
    req = Request(rid="r", input_ids=[5] * 100, params=SamplingParams(max_new_tokens=20000), seed=0)
    with caplog.at_level(logging.WARNING, logger="slime_lite.engine.scheduler"):
        sch.prepare(req)
        sch.prepare(Request(rid="r2", input_ids=[5] * 100, params=SamplingParams(max_new_tokens=20000), seed=0))
    assert req.max_new == 16384 - 100 + 1
    warned = [r.getMessage() for r in caplog.records if "capped" in r.getMessage()]
    assert len(warned) == 1 and "--engine-kv-cache-tokens" in warned[0] and "logged once" in warned[0]


def test_a_stopped_engine_answers_requests_and_calls_instead_of_leaving_them_waiting(tiny_model_dir):
    sch = Scheduler(tiny_model_dir, device="cpu", max_running_requests=2, kv_cache_tokens=256)
    sch.start()
    sch.stop()
    req, done = _submit(sch, [10, 11, 12], max_new_tokens=4)
    assert done.wait(5) and req.finish_reason == abort_reason("engine shutting down")
    with pytest.raises(RuntimeError, match="the engine has stopped"):
        sch.call(lambda: 1).result(5)


def test_an_engine_whose_every_step_fails_stops_and_says_so(tiny_model_dir):
    """A sticky device error (an illegal memory access, INJECTED: the step raises) fails every step while the model
    thread lives. /health says 503 from the first failed check; after FAILED_STEPS_TO_STOP failed steps in a row the
    model thread stops, so /generate answers 503 naming the error and the trainer's fault tolerance (which asks
    whether the model thread runs) sees a dead engine. A step that works in between resets the count."""
    from engine_helpers import http, start_engine

    from slime_lite.engine import scheduler as scheduler_module
    from slime_lite.engine_client import ENGINE_DOWN

    server = start_engine(tiny_model_dir)
    sch, url = server.scheduler, server.url
    real_step, broken = sch._step, [True]

    def step():
        if broken[0]:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        real_step()

    sch._step = step
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}}
    try:
        assert scheduler_module.FAILED_STEPS_TO_STOP == 3
        status, out = http(url, "/generate", body)  # failed step 1
        assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "abort"
        status, text = http(url, "/health")  # failed step 2: its one-token request failed
        assert status == 503 and "illegal memory access" in str(text) and sch.alive
        broken[0] = False
        status, out = http(url, "/generate", body)  # steps that work: the count starts over
        assert status == 200 and len(out["output_ids"]) == 2
        broken[0] = True
        for _ in range(2):  # failed steps 1 and 2
            assert http(url, "/generate", body)[0] == 200
        assert sch.alive
        status, text = http(url, "/health")  # failed step 3 in a row: the model thread stops
        assert status == 503 and "illegal memory access" in str(text)
        assert not sch.alive and "illegal memory access" in sch.stop_reason
        status, out = http(url, "/generate", body)
        assert status == 503 and "illegal memory access" in out["error"]["message"]
        assert out["error"]["message"].startswith(ENGINE_DOWN)  # what tells the client the engine is dead
        assert http(url, "/health")[0] == 503
    finally:
        server.stop()


def test_a_request_the_sampler_alone_fails_on_never_stops_the_engine(tiny_model_dir):
    """Sent alone, again and again, a request whose own sampling fails (INJECTED: the sampler raises for its rid) is
    every request of its step: the engine ends it with the error and keeps serving, as a neutral request samples
    (three in a row stopped the model thread, as a broken device does)."""
    from engine_helpers import http, start_engine

    server = start_engine(tiny_model_dir)
    sch, url = server.scheduler, server.url
    sample = sch._sample

    def poisoned(reqs, logits):
        if any(r.rid.startswith("poison") for r in reqs):
            raise RuntimeError("a sampler bug this request alone meets")
        return sample(reqs, logits)

    sch._sample = poisoned
    try:
        for i in range(4):
            status, out = http(url, "/generate", {"rid": f"poison{i}", "input_ids": [5, 6],
                                                  "sampling_params": {"max_new_tokens": 2}})
            assert status == 200 and "a sampler bug" in out["meta_info"]["finish_reason"]["message"]
        assert sch.alive
        status, out = http(url, "/generate", {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}})
        assert status == 200 and len(out["output_ids"]) == 2
    finally:
        server.stop()


def test_a_rollout_loses_no_prompt_to_an_engine_whose_steps_fail(tiny_model_dir, tmp_path):
    """Two real engines, one whose every step fails (INJECTED: the step raises, as a sticky illegal memory access
    does): the requests its failed steps aborted go again to the good engine (the client sends a request the engine
    failed again), so each rollout trains the next --rollout-batch-size prompts and uses up no other (four of the
    first eight were lost before)."""
    import json

    from engine_helpers import start_engine

    from slime_lite.args import parser_defaults
    from slime_lite.rollout.manager import RolloutManager

    good, bad = start_engine(tiny_model_dir), start_engine(tiny_model_dir)
    failed_steps = []

    def broken_step():
        failed_steps.append(1)
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    bad.scheduler._step = broken_step
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "label": str(2 * i)}) + "\n" for i in range(40)))
    args = parser_defaults(hf_checkpoint=str(tiny_model_dir), prompt_data=str(prompts), rm_type="addition",
                           rollout_batch_size=4, n_samples_per_prompt=2, rollout_max_response_len=4)
    manager = RolloutManager(args, [bad.url, good.url])
    try:
        for r in range(2):
            samples, _ = manager.generate(r)
            assert sorted({s.metadata["prompt_index"] for s in samples}) == list(range(4 * r, 4 * r + 4))
            assert manager.source.state()["offset"] == 4 * (r + 1)
        assert failed_steps  # the broken engine got requests
    finally:
        manager.close()
        good.stop()
        bad.stop()
