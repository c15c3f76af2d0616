"""/generate of the embedded engine: SGLang's response shape, log-probs equal to a full HF forward, finish reasons,
seeds, streaming, continuous batching."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

from engine_helpers import (assert_greedy_run_matches_hf, generate, hf_logprobs, http, in_thread, one_chunk_per_token,
                            start_engine, stream_started)

GREEDY = {"temperature": 0.0, "ignore_eos": True}


def test_single_text_prompt_returns_sglang_fields(engine):
    assert http(engine.url, "/flush_cache", {})[0] == 200
    out = generate(engine.url, text="12+34=", sampling_params={"max_new_tokens": 6, **GREEDY})
    meta = out["meta_info"]
    assert len(out["output_ids"]) == 6 and meta["completion_tokens"] == 6
    assert meta["prompt_tokens"] == 6 and meta["cached_tokens"] == 0
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["weight_version"] == "default" and meta["e2e_latency"] > 0 and meta["id"]
    assert out["text"] == engine.scheduler.decode(out["output_ids"])
    assert "output_token_logprobs" not in meta


def test_batch_returns_list_in_order_and_each_result_is_its_own_greedy_run(engine, hf_model):
    prompts = [[5, 6, 7], [8] * 20, [30, 31], [40, 41, 42, 43, 44, 45, 46]]
    batch = generate(engine.url, input_ids=prompts, return_logprob=True,
                     sampling_params={"max_new_tokens": 12, **GREEDY})
    assert isinstance(batch, list) and len(batch) == 4
    assert [b["meta_info"]["prompt_tokens"] for b in batch] == [3, 20, 2, 7]
    for p, out in zip(prompts, batch):
        assert len(out["output_ids"]) == 12
        assert_greedy_run_matches_hf(hf_model, p, out)


@pytest.mark.parametrize("sampling", [
    {"temperature": 0.0},
    {"temperature": 1.0},
    {"temperature": 0.7, "top_p": 0.9, "top_k": 20},
])
def test_output_logprobs_equal_full_hf_forward(engine, hf_model, sampling):
    prompts = [[12, 13, 14, 15, 16], [20] * 17, [50, 3]]
    outs = generate(engine.url, input_ids=prompts, return_logprob=True, return_text_in_logprobs=True,
                    sampling_params={"max_new_tokens": 24, "ignore_eos": True, "sampling_seed": 7, **sampling})
    temperature = sampling["temperature"] or 1.0
    for prompt, out in zip(prompts, outs):
        triples = out["meta_info"]["output_token_logprobs"]
        assert len(triples) == 24 and [t[1] for t in triples] == out["output_ids"]
        assert [t[2] for t in triples] == [engine.scheduler.decode([i], False) for i in out["output_ids"]]
        ref = hf_logprobs(hf_model, prompt, out["output_ids"], temperature)
        assert max(abs(a[0] - b) for a, b in zip(triples, ref)) < 1e-5


def test_input_token_logprobs_equal_hf_forward(engine, hf_model):
    prompt = [9, 10, 11, 12, 13, 14, 15]
    out = generate(engine.url, input_ids=prompt, return_logprob=True, logprob_start_len=2,
                   sampling_params={"max_new_tokens": 0})
    meta = out["meta_info"]
    assert out["output_ids"] == [] and meta["finish_reason"] == {"type": "length", "length": 0}
    triples = meta["input_token_logprobs"]
    assert [t[1] for t in triples] == prompt[2:]
    assert triples[0][0] is None  # SGLang: the first entry has no log-prob, whatever logprob_start_len is
    ref = hf_logprobs(hf_model, prompt[:3], prompt[3:])
    assert max(abs(a[0] - b) for a, b in zip(triples[1:], ref)) < 1e-5
    first = generate(engine.url, input_ids=prompt, return_logprob=True, logprob_start_len=0,
                     sampling_params={"max_new_tokens": 1})["meta_info"]["input_token_logprobs"]
    assert first[0][0] is None and len(first) == len(prompt)


def test_stop_token_ids_and_stop_strings(engine):
    base = generate(engine.url, text="hello", sampling_params={"max_new_tokens": 12, **GREEDY})
    ids = base["output_ids"]
    stop_id = ids[3]
    k = ids.index(stop_id)
    assert engine.scheduler.eos_ids.isdisjoint(ids[: k + 1])
    # without ignore_eos: SGLang ignores stop_token_ids under it, as it ignores eos
    out = generate(engine.url, text="hello", sampling_params={"max_new_tokens": 12, "stop_token_ids": [stop_id],
                                                               "temperature": 0.0})
    assert out["output_ids"] == ids[: k + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    assert out["text"] == engine.scheduler.decode(ids[:k])  # the stop token is trimmed from the text

    text = base["text"]
    stop = text[4:6]
    assert stop and stop in text
    cut = text.index(stop)
    out = generate(engine.url, text="hello", sampling_params={"max_new_tokens": 12, "stop": stop, **GREEDY})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == text[:cut]
    kept = generate(engine.url, text="hello", sampling_params={"max_new_tokens": 12, "stop": [stop],
                                                                "no_stop_trim": True, **GREEDY})
    assert kept["text"] == text[: cut + len(stop)]


def test_min_new_tokens_bans_stop_tokens_until_reached(engine):
    first = generate(engine.url, input_ids=[7, 8], sampling_params={"max_new_tokens": 1, **GREEDY})["output_ids"][0]
    out = generate(engine.url, input_ids=[7, 8], sampling_params={
        "max_new_tokens": 5, "min_new_tokens": 3, "stop_token_ids": [first], **GREEDY})
    assert first not in out["output_ids"][:2]
    assert len(out["output_ids"]) >= 3


def test_sampling_seed_reproduces_and_rid_derives_seed(engine):
    sp = {"max_new_tokens": 16, "temperature": 1.0, "ignore_eos": True}
    a = generate(engine.url, input_ids=[4, 5, 6], sampling_params={**sp, "sampling_seed": 123})
    b = generate(engine.url, input_ids=[4, 5, 6], sampling_params={**sp, "sampling_seed": 123})
    c = generate(engine.url, input_ids=[4, 5, 6], sampling_params={**sp, "sampling_seed": 124})
    assert a["output_ids"] == b["output_ids"] != c["output_ids"]
    # A seeded request samples the same tokens whether it runs alone or inside a batch.
    batch = generate(engine.url, input_ids=[[9, 9], [4, 5, 6], [1] * 30],
                     sampling_params=[{**sp, "sampling_seed": 5}, {**sp, "sampling_seed": 123}, sp])
    assert batch[1]["output_ids"] == a["output_ids"]
    r1 = generate(engine.url, input_ids=[4, 5, 6], rid="fixed-rid", sampling_params=sp)
    r2 = generate(engine.url, input_ids=[4, 5, 6], rid="fixed-rid", sampling_params=sp)
    assert r1["output_ids"] == r2["output_ids"] and r1["meta_info"]["id"] == "fixed-rid"
    n = generate(engine.url, input_ids=[4, 5, 6], rid="multi", sampling_params={**sp, "n": 3})
    assert [o["meta_info"]["id"] for o in n] == ["multi_0", "multi_1", "multi_2"]
    assert len({tuple(o["output_ids"]) for o in n}) == 3


def test_stream_sends_cumulative_chunks_then_done(engine, monkeypatch):
    one_chunk_per_token(monkeypatch, engine)
    body = {"input_ids": [3, 4, 5], "stream": True, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 5, **GREEDY}}
    req = urllib.request.Request(engine.url + "/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        lines = [ln.decode().strip() for ln in resp if ln.strip()]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[len("data: "):]) for ln in lines[:-1]]
    assert [len(c["output_ids"]) for c in chunks] == [1, 2, 3, 4, 5]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert len(chunks[-1]["meta_info"]["output_token_logprobs"]) == 5
    assert chunks[-1]["output_ids"][:3] == chunks[2]["output_ids"]


def test_bad_requests_answer_400_with_message(engine):
    cases = [
        {"text": "a", "input_ids": [1]},
        {"input_ids": []},
        {"input_ids": [1, 2], "sampling_params": {"top_p": 0}},
        {"input_ids": [1, 2], "sampling_params": {"regex": "a+"}},
        {"input_ids": [1, 100000]},
        {"input_ids": [1] * 600},
        {"input_ids": [[1], [2]], "sampling_params": [{}]},
    ]
    for body in cases:
        status, out = http(engine.url, "/generate", body)
        assert status == 400 and out["error"]["message"], body


def _wait_running(url: str, n: int = 1, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while http(url, "/get_server_info")[1]["num_running_reqs"] < n:
        assert time.monotonic() < deadline, "request never started"
        time.sleep(0.01)


def test_abort_running_request_returns_partial_output(engine):
    long = {"max_new_tokens": 500, **GREEDY}
    t, box = in_thread(generate, engine.url, input_ids=[1, 2], rid="to-abort", sampling_params=long)
    _wait_running(engine.url)
    assert http(engine.url, "/abort_request", {"rid": "to-abort"})[0] == 200
    t.join(30)
    out = box["result"]
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(out["output_ids"]) < 500
    t2, box2 = in_thread(generate, engine.url, input_ids=[[1, 2], [3, 4]], sampling_params=long)
    _wait_running(engine.url, 2)
    http(engine.url, "/abort_request", {"abort_all": True})
    t2.join(30)
    assert [o["meta_info"]["finish_reason"]["type"] for o in box2["result"]] == ["abort", "abort"]


def test_flush_cache_refused_while_running(engine):
    t, box = in_thread(generate, engine.url, input_ids=[1, 2], rid="busy", sampling_params={"max_new_tokens": 500,
                                                                                            **GREEDY})
    _wait_running(engine.url)
    status, out = http(engine.url, "/flush_cache", {})
    http(engine.url, "/abort_request", {"rid": "busy"})
    t.join(30)
    assert status == 400 and "running" in out["error"]["message"]
    assert http(engine.url, "/flush_cache", {})[0] == 200


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_pause_holds_requests_and_continue_finishes_them_correctly(engine, hf_model, mode):
    sp = {"max_new_tokens": 400, **GREEDY}  # still running after the pause's HTTP round trips on a busy machine
    t, box = in_thread(generate, engine.url, input_ids=[11, 12], return_logprob=True, sampling_params=sp)
    _wait_running(engine.url)
    assert http(engine.url, "/pause_generation", {"mode": mode})[0] == 200
    before = http(engine.url, "/get_server_info")[1]["num_generated_tokens"]
    time.sleep(0.3)
    assert http(engine.url, "/get_server_info")[1]["num_generated_tokens"] == before
    assert t.is_alive()
    assert http(engine.url, "/continue_generation", {})[0] == 200
    t.join(30)
    assert box["result"]["meta_info"]["finish_reason"] == {"type": "length", "length": 400}
    assert_greedy_run_matches_hf(hf_model, [11, 12], box["result"])


def test_pause_abort_mode_aborts_running_requests(engine):
    t, box = in_thread(generate, engine.url, input_ids=[1, 2], sampling_params={"max_new_tokens": 500, **GREEDY})
    _wait_running(engine.url)
    http(engine.url, "/pause_generation", {"mode": "abort"})
    t.join(30)
    http(engine.url, "/continue_generation", {})
    assert box["result"]["meta_info"]["finish_reason"]["type"] == "abort"


def test_a_request_made_after_an_abort_pause_was_asked_waits_for_continue(tiny_model_dir):
    """The pause's abort was counted when the model thread ran it: a /generate made after /pause_generation
    (mode abort) arrived, but handled after the pause, was aborted too (the engine's step slowed, as a large batch's
    is, so the pause waits for it)."""
    server = start_engine(tiny_model_dir, max_running_requests=4)
    sch, decode = server.scheduler, server.scheduler._decode
    sch._decode = lambda: (time.sleep(0.05), decode())
    try:
        t_busy, busy = in_thread(generate, server.url, input_ids=[1, 2, 3],
                                 sampling_params={"max_new_tokens": 400, "ignore_eos": True})
        _wait_running(server.url)
        t_pause, _ = in_thread(http, server.url, "/pause_generation", {"mode": "abort"})
        deadline = time.monotonic() + 10
        while sch._inbox.qsize() == 0 and not sch.paused:  # the pause's call is queued (or has run)
            assert time.monotonic() < deadline
            time.sleep(0.001)
        t_late, late = in_thread(generate, server.url, input_ids=[4, 5],
                                 sampling_params={"max_new_tokens": 3, "ignore_eos": True})
        t_pause.join(30)
        time.sleep(0.1)
        assert t_late.is_alive()  # queued until continue
        assert http(server.url, "/continue_generation", {})[0] == 200
        t_late.join(30)
        t_busy.join(30)
        assert busy["result"]["meta_info"]["finish_reason"]["type"] == "abort"
        assert late["result"]["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
    finally:
        server.stop()


def test_continuous_batching_refills_slots_and_late_requests_join(tiny_model_dir, hf_model):
    server = start_engine(tiny_model_dir, max_running_requests=2)
    try:
        url = server.url
        n_long = 480  # outlasts the 4 short requests and their HF checks on a busy machine
        long = {"max_new_tokens": n_long, **GREEDY}
        t_long, long_box = in_thread(generate, url, input_ids=[1, 2, 3], return_logprob=True, sampling_params=long)
        _wait_running(url)
        shorts = [[5, 6], [7, 8, 9], [10], [11, 12, 13, 14]]
        for p in shorts:  # each joins the running long request and leaves before it ends
            out = generate(url, input_ids=p, return_logprob=True, sampling_params={"max_new_tokens": 4, **GREEDY})
            assert_greedy_run_matches_hf(hf_model, p, out)
        assert t_long.is_alive()
        batch = generate(url, input_ids=shorts, return_logprob=True, sampling_params={"max_new_tokens": 4, **GREEDY})
        for p, out in zip(shorts, batch):  # 4 requests through the 1 free slot, in turn
            assert len(out["output_ids"]) == 4
            assert_greedy_run_matches_hf(hf_model, p, out)
        t_long.join(60)
        assert len(long_box["result"]["output_ids"]) == n_long
        assert_greedy_run_matches_hf(hf_model, [1, 2, 3], long_box["result"])
    finally:
        server.stop()


def test_health_info_and_weight_version_routes(engine):
    assert http(engine.url, "/health")[0] == 200
    assert http(engine.url, "/health_generate")[0] == 200
    for route in ("/get_model_info", "/model_info"):
        status, info = http(engine.url, route)
        assert status == 200 and info["is_generation"] is True and info["model_path"] == engine.scheduler.model_path
    for route in ("/get_server_info", "/server_info"):
        status, info = http(engine.url, route)
        assert status == 200 and info["max_running_requests"] == 8
        assert info["disable_cuda_graph"] is True and info["num_cuda_graphs"] == 0  # CPU: nothing to capture
    assert http(engine.url, "/get_weight_version")[1] == {"weight_version": "default"}


def test_model_info_carries_sglangs_model_keys(engine):
    """The keys SGLang's /model_info has that clients read: the HF config's model_type and architectures, the
    served name, and that the model takes no images or audio."""
    status, info = http(engine.url, "/model_info")
    config = engine.scheduler.hf.config
    assert status == 200 and info["model_type"] == config.model_type == "qwen2"
    assert info["architectures"] == config.architectures == ["Qwen2ForCausalLM"]
    assert info["served_model_name"] == engine.served_model_name
    assert info["has_image_understanding"] is False and info["has_audio_understanding"] is False


def test_prefix_cache_is_shared_only_within_one_cache_salt_and_extra_key(engine):
    """SGLang's cache_salt and extra_key namespace the prefix cache: a prompt reuses no K/V of another namespace's
    identical prompt, so cached_tokens tells no other client how a salted prompt begins; within the namespace it
    is reused as before ("" is no key). The OpenAI routes take both fields too."""
    prompt = "tenant secret: key=sk-12345; please summarise"

    def cached(**namespace) -> int:
        out = generate(engine.url, text=prompt, sampling_params={"max_new_tokens": 1}, **namespace)
        return out["meta_info"]["cached_tokens"]

    assert cached(cache_salt="A") == 0
    assert cached(cache_salt="B") == 0 and cached(extra_key="A") == 0 and cached() == 0
    assert cached(cache_salt="A") == cached(cache_salt="A", extra_key="") == len(prompt) - 1
    assert cached(extra_key="A", cache_salt=None) == len(prompt) - 1
    outs = generate(engine.url, text=[prompt, prompt], cache_salt=["B", "C"], sampling_params={"max_new_tokens": 1})
    assert [o["meta_info"]["cached_tokens"] for o in outs] == [len(prompt) - 1, 0]

    def hit_tokens() -> int:
        return http(engine.url, "/get_server_info")[1]["prefix_cache"]["hit_tokens"]

    chat = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 1}
    before = hit_tokens()
    for salt in ("D", "E"):
        assert http(engine.url, "/v1/chat/completions", {**chat, "cache_salt": salt})[0] == 200
    assert hit_tokens() == before
    assert http(engine.url, "/v1/chat/completions", {**chat, "cache_salt": "D"})[0] == 200
    assert hit_tokens() > before


def test_kv_cache_is_freed_when_idle_and_flushed(engine):
    generate(engine.url, input_ids=[[1, 2, 3]] * 3, sampling_params={"max_new_tokens": 20, **GREEDY})
    assert http(engine.url, "/get_server_info")[1]["prefix_cache"]["entries"] > 0  # the prefix cache holds it
    assert http(engine.url, "/flush_cache")[0] == 200  # GET, as slime sends it
    info = http(engine.url, "/get_server_info")[1]
    assert info["kv_cache_allocated"] == [0, 0] and info["prefix_cache"]["entries"] == 0


def test_client_disconnect_aborts_streaming_request(engine):
    before = http(engine.url, "/get_server_info")[1]["num_generated_tokens"]
    with stream_started(engine.url, {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 500, **GREEDY}}):
        pass
    deadline = time.monotonic() + 10
    while http(engine.url, "/get_server_info")[1]["num_running_reqs"]:
        assert time.monotonic() < deadline, "the request kept running after its client left"
        time.sleep(0.02)
    assert http(engine.url, "/get_server_info")[1]["num_generated_tokens"] - before < 500
