"""Requests are isolated: a bad value gets HTTP 400 naming its field before anything is admitted, a request that
fails while decoding ends alone, big bodies are refused, and a client that leaves cancels its work."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
from engine_helpers import generate, http, in_thread, stream_started

from tests import sglang_oracle as oracle

GREEDY = {"temperature": 0.0, "ignore_eos": True}
NAN, INF = float("nan"), float("inf")

BAD_GENERATE = [  # (body, the field the error names)
    ({"input_ids": [1, 2], "sampling_params": {"temperature": NAN}}, "temperature"),
    ({"input_ids": [1, 2], "sampling_params": {"temperature": INF}}, "temperature"),
    ({"input_ids": [1, 2], "sampling_params": {"temperature": "0.5"}}, "temperature"),
    ({"input_ids": [1, 2], "sampling_params": {"temperature": -1}}, "temperature"),
    ({"input_ids": [1, 2], "sampling_params": {"top_p": NAN}}, "top_p"),
    ({"input_ids": [1, 2], "sampling_params": {"min_p": 2}}, "min_p"),
    ({"input_ids": [1, 2], "sampling_params": {"top_k": 2**70}}, "top_k"),
    ({"input_ids": [1, 2], "sampling_params": {"top_k": 0}}, "top_k"),
    ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2**64}}, "max_new_tokens"),
    ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1.5}}, "max_new_tokens"),
    ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": True}}, "max_new_tokens"),
    ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
    ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 511}}, "max_new_tokens"),  # 2 + 511 >= 512
    ({"input_ids": [1, 2], "sampling_params": {"min_new_tokens": "3"}}, "min_new_tokens"),
    ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2, "min_new_tokens": 3}}, "min_new_tokens"),
    ({"input_ids": [1, 2], "sampling_params": {"min_new_tokens": 129}}, "min_new_tokens"),  # over the default 128
    ({"input_ids": [1, 2], "sampling_params": {"sampling_seed": -(2**64)}}, "sampling_seed"),
    ({"input_ids": [1, 2], "sampling_params": {"sampling_seed": 2**64}}, "sampling_seed"),
    ({"input_ids": [1, 2], "sampling_params": {"sampling_seed": 2**63}}, "sampling_seed"),  # SGLang's: int64
    ({"input_ids": [1, 2], "sampling_params": {"n": 0}}, "sampling_params.n"),
    ({"input_ids": [1, 2], "sampling_params": {"n": 10**6}}, "sampling_params.n"),
    ({"input_ids": [[1, 2]] * 20, "sampling_params": {"n": 256}}, "sequences"),
    ({"input_ids": [1, 2], "sampling_params": {"stop": [1]}}, "stop"),
    ({"input_ids": [1, 2], "sampling_params": {"stop": ""}}, "stop"),
    ({"input_ids": [1, 2], "sampling_params": {"stop_token_ids": [-1]}}, "stop_token_ids"),
    ({"input_ids": [1, 2], "sampling_params": {"stop_token_ids": 5}}, "stop_token_ids"),
    ({"input_ids": [1, 2], "sampling_params": {"stop_token_ids": [128]}}, "stop_token_ids"),  # past the vocabulary
    ({"input_ids": [1, 2], "sampling_params": {"ignore_eos": "yes"}}, "ignore_eos"),
    ({"input_ids": [1, 2], "sampling_params": {"frequency_penalty": NAN}}, "frequency_penalty"),
    ({"input_ids": [1, 2], "sampling_params": "greedy"}, "sampling_params"),
    ({"input_ids": [1, 2], "sampling_params": [{}, {}]}, "sampling_params"),
    ({"input_ids": [1, 2], "return_logprob": "yes"}, "return_logprob"),
    ({"input_ids": [1, 2], "logprob_start_len": -2}, "logprob_start_len"),
    ({"input_ids": [1, 2], "logprob_start_len": 2**63}, "logprob_start_len"),
    ({"input_ids": [1, 2], "stream": "no"}, "stream"),
    ({"input_ids": [1, 2], "rid": {"a": 1}}, "rid"),
    ({"input_ids": [True, 2]}, "input_ids"),
    ({"input_ids": [1, 2.0]}, "input_ids"),
    ({"input_ids": [1, 2**64]}, "input_ids"),
    ({"input_ids": [[1], []]}, "input_ids[1]"),
    ({"text": {"a": 1}}, "text"),
    ({"text": ["a", 1]}, "text"),
    ({"text": ["a", "b" * 40_000]}, "text[1]"),  # refused before the whole text is tokenized
    ({"text": ["a", "b"], "sampling_params": [{"max_new_tokens": 1}, None]}, "sampling_params[1]"),
    ({"input_ids": [[1], [2]], "sampling_params": [{}, 5]}, "sampling_params[1]"),
    ({"input_ids": [1, 2], "return_logprob": True, "top_logprobs_num": 21}, "top_logprobs_num"),  # over 20
    ({"input_ids": [1, 2], "return_logprob": True, "token_ids_logprob": [1] * 1025}, "token_ids_logprob"),
    ({"input_ids": [1] * 300, "return_logprob": True, "logprob_start_len": 0, "token_ids_logprob": [1] * 1024,
      "sampling_params": {"max_new_tokens": 1}}, "token_ids_logprob"),  # 301 positions x 1024 ids
    ({"input_ids": [1, 2], "sampling_params": {"logit_bias": {"9": 1e39}}}, "logit_bias"),  # NaN log-probs
    ({"input_ids": [1, 2], "sampling_params": {"logit_bias": {"9": -2e9}}}, "logit_bias"),
    ({"input_ids": [1, 2], "cache_salt": 5}, "cache_salt"),
    ({"input_ids": [[1], [2]], "extra_key": ["a"]}, "extra_key"),  # one per prompt
]


@pytest.mark.parametrize("body,field", BAD_GENERATE, ids=[f"{f}-{i}" for i, (_, f) in enumerate(BAD_GENERATE)])
def test_bad_generate_values_answer_400_naming_the_field(engine, body, field):
    status, out = http(engine.url, "/generate", body)
    assert status == 400, out
    assert field in out["error"]["message"]


@pytest.mark.parametrize("route,body,field", [
    ("/v1/completions", {"prompt": "ab", "max_tokens": NAN}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "ab", "n": 1000}, "n="),
    ("/v1/completions", {"prompt": "ab", "stream_options": "x", "stream": True}, "stream_options"),
    ("/v1/completions", {"max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": "ab", "seed": 1.5}, "seed"),
    ("/v1/completions", {"prompt": "ab", "logprobs": 21}, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "logprobs": True, "top_logprobs": 21},
     "top_logprobs"),
    ("/v1/completions", {"prompt": "ab", "logit_bias": {"1": 1e39}}, "logit_bias"),
    ("/v1/completions", {"prompt": "ab", "cache_salt": ["a", "b"]}, "cache_salt"),
    # booleans are JSON booleans: "false" is not read as true
    ("/v1/completions", {"prompt": "ab", "echo": "false"}, "echo"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "logprobs": "false"}, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "stream": True,
                              "stream_options": {"include_usage": "false"}}, "include_usage"),
    ("/tokenize", {"messages": [{"role": "user", "content": "a"}], "add_generation_prompt": "false"},
     "add_generation_prompt"),
    # fields the OpenAI routes do not implement, away from their defaults
    ("/v1/completions", {"prompt": "ab", "stop_regex": "x"}, "stop_regex"),
    ("/v1/completions", {"prompt": "ab", "return_token_ids": True}, "return_token_ids"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "custom_logit_processor": "x"},
     "custom_logit_processor"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "session_params": {"id": "s"}},
     "session_params"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "custom_params": {"a": 1}},
     "custom_params"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "watermark": {"key": "k"}}, "watermark"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "tool_choice": "required"},
     "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "add_generation_prompt": False},
     "add_generation_prompt"),
    ("/v1/completions", {"prompt": "ab", "top_logprobs": 2}, "top_logprobs"),  # a chat field
    ("/abort_request", {"rid": ["a"]}, "rid"),
    ("/pause_generation", {"mode": ["abort"]}, "mode"),
    ("/update_weights_from_disk", {"model_path": 5}, "model_path"),
    ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 70000, "world_size": 2},
     "master_port"),
    ("/update_weights_from_distributed", {"names": ["a"], "dtypes": ["float32"], "shapes": [[-1]]}, "shapes"),
    ("/get_weights_by_name", {"name": "model.norm.weight", "truncate_size": "abc"}, "truncate_size"),
    ("/get_weights_checksum", {"names": [["x"]]}, "names"),
    ("/release_memory_occupation", {"tags": 5}, "tags"),
    ("/resume_memory_occupation", {"tags": [None]}, "tags"),
])
def test_bad_values_on_other_routes_answer_400_naming_the_field(engine, route, body, field):
    status, out = http(engine.url, route, body)
    assert status == 400, out
    assert field in out["error"]["message"]


def test_log_prob_and_logit_bias_limits_are_named_and_values_at_them_accepted(engine):
    """top_logprobs_num, token_ids_logprob and their product with the scored positions are bounded (else one small
    body makes a 100 MB answer and stalls everyone for seconds), and so is |logit_bias| (far above it float32
    logits overflow into NaN log-probs): each refusal names the bound; the bound itself is served."""
    from slime_lite.engine import validate

    lp = {"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 0, "sampling_params": {"max_new_tokens": 2}}
    for extra, bound in (({"top_logprobs_num": validate.MAX_TOP_LOGPROBS + 1}, validate.MAX_TOP_LOGPROBS),
                         ({"token_ids_logprob": [3] * (validate.MAX_TOKEN_IDS_LOGPROB + 1)},
                          validate.MAX_TOKEN_IDS_LOGPROB),
                         ({"input_ids": [1] * 400, "token_ids_logprob": [3] * 1000}, validate.MAX_LOGPROB_ENTRIES),
                         ({"sampling_params": {"logit_bias": {"3": 1e39}}}, validate.MAX_LOGIT_BIAS)):
        status, out = http(engine.url, "/generate", {**lp, **extra})
        assert status == 400 and str(bound) in out["error"]["message"], out
    out = generate(engine.url, **lp, top_logprobs_num=validate.MAX_TOP_LOGPROBS,
                   token_ids_logprob=[3, 4, 3] * (validate.MAX_TOKEN_IDS_LOGPROB // 3))
    rows = out["meta_info"]["output_token_ids_logprobs"]
    assert [len(r) for r in rows] == [validate.MAX_TOKEN_IDS_LOGPROB // 3 * 3] * 2  # a repeated id: its own entry
    assert [t[1] for t in rows[0][:4]] == [3, 4, 3, 3] and rows[0][0] == rows[0][2]
    assert len(out["meta_info"]["output_top_logprobs"][0]) == validate.MAX_TOP_LOGPROBS
    biased = generate(engine.url, input_ids=[1, 2], return_logprob=True,
                      sampling_params={"max_new_tokens": 1, "logit_bias": {"3": validate.MAX_LOGIT_BIAS}})
    assert biased["output_ids"] == [3]


def test_json_answers_write_non_finite_numbers_as_null():
    """NaN weights make NaN log-probs: answers carry null there (as SGLang's orjson writes it), never the NaN or
    Infinity that standard JSON parsers refuse."""
    from slime_lite.engine.http_json import dumps, json_response

    data = {"a": float("nan"), "b": [1.5, float("inf"), (float("-inf"), 2)], "c": {"d": [[float("nan")]]}}
    assert json.loads(dumps(data)) == {"a": None, "b": [1.5, None, [None, 2]], "c": {"d": [[None]]}}
    assert "NaN" not in json_response(data).text and dumps({"x": 1.0}) == '{"x": 1.0}'


def test_values_at_the_limits_are_still_accepted(engine):
    sp = {"max_new_tokens": 4, "temperature": 0, "top_p": 1, "top_k": 2**63 - 1, "min_p": 0,
          "sampling_seed": 2**63 - 1, "n": 2, "stop_token_ids": [engine.scheduler.lm.vocab_size - 1],
          "ignore_eos": True}
    outs = generate(engine.url, input_ids=[1, 2], sampling_params=sp, return_logprob=None, stream=None)
    assert [len(o["output_ids"]) for o in outs] == [4, 4]
    assert generate(engine.url, input_ids=[1] * 500, sampling_params={"max_new_tokens": 11})  # 511 < 512


@pytest.mark.parametrize("flags", [{}, {"deterministic_mode": True, "rollout_batch_size": 4}])
def test_under_train_the_engines_body_limit_holds_a_call_of_the_runs_longest_requests(flags):
    """`slime-lite train` sizes its embedded engines' limit (it has no --max-request-bytes): a group of 16 requests
    of --rollout-max-context-len 65,536 six-digit token ids is over the 8 MiB default; under --deterministic-mode
    one call holds a whole wave."""
    from slime_lite.args import parser_defaults
    from slime_lite.config import EngineConfig

    c = EngineConfig.from_args(parser_defaults(n_samples_per_prompt=16, rollout_max_context_len=65536, **flags))
    calls = 64 if flags else 16
    body = {"input_ids": [[999_999] * 65_535] * calls, "sampling_params": [{"max_new_tokens": 1}] * calls,
            "return_logprob": True}
    assert 8 << 20 < len(json.dumps(body)) <= c.request_body_bytes


def test_a_body_over_the_limit_gets_413_and_the_server_keeps_serving(engine):
    big = {"text": "a" * (9 << 20)}  # over the 8 MiB default of the generate routes
    status, out = http(engine.url, "/generate", big)
    assert status == 413 and "--max-request-bytes" in out["error"]["message"]
    assert generate(engine.url, input_ids=[1, 2], sampling_params={"max_new_tokens": 2})


NOT_UTF8 = [  # (route, raw body): a lone surrogate encoded as UTF-8 bytes, which JSON parsers on bytes let through
    ("/generate", b'{"input_ids": [1, 2], "sampling_params": {"stop": ["\xed\xa0\x80"]}}'),
    ("/generate", b'{"text": "a\xed\xa0\x80"}'),
    ("/tokenize", b'{"prompt": "a\xed\xa0\x80"}'),
    ("/update_weight_version", b'{"new_version": "\xed\xa0\x80"}'),
    ("/generate", b'{"text": "a\xff"}'),
]


@pytest.mark.parametrize("route, raw", NOT_UTF8)
def test_a_body_that_is_not_utf8_gets_400_before_anything_runs(engine, route, raw):
    status, out = http(engine.url, route, raw)
    assert status == 400 and "not UTF-8" in out["error"]["message"]
    bom = b'\xef\xbb\xbf{"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}'  # a BOM is still fine
    status, out = http(engine.url, "/generate", bom)
    assert status == 200 and len(out["output_ids"]) == 2


@pytest.mark.parametrize("poison", ["top_k", "stop"])
def test_a_request_that_fails_while_decoding_ends_alone(engine, poison):
    """A request that makes the sampler raise, or its finish check (here: one put in the scheduler without the
    server's checks, with a stop string no encoder takes) ends with an abort naming the error; the request decoding
    next to it finishes exactly as it does alone."""
    from slime_lite.engine.request import Request
    from slime_lite.engine.sampling import SamplingParams

    witness = {"input_ids": [5, 6, 7], "return_logprob": True, "sampling_params": {"max_new_tokens": 40, **GREEDY}}
    alone = generate(engine.url, **witness)
    done = threading.Event()
    bad_out: list = []
    params = SamplingParams(top_k=2**70, max_new_tokens=400) if poison == "top_k" else \
        SamplingParams(stop=["\ud800"], max_new_tokens=400)
    bad = Request(rid="poisoned", input_ids=[1, 2], params=params, seed=1,
                  on_output=lambda o: (bad_out.append(o), done.set()))
    engine.scheduler.prepare(bad)
    t, box = in_thread(generate, engine.url, **witness)
    deadline = time.monotonic() + 10
    while not engine.scheduler.num_running:
        assert time.monotonic() < deadline, "request never started"
        time.sleep(0.005)
    engine.scheduler.submit(bad)
    t.join(60)
    assert done.wait(10)
    # its own error, which the client does not send again (an engine error it would)
    assert bad_out[-1].finish_reason["type"] == "abort" and bad_out[-1].finish_reason["message"].startswith(
        "request error: ")
    out = box["result"]
    assert out["output_ids"] == alone["output_ids"]
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 40}
    assert http(engine.url, "/health_generate")[0] == 200


def test_client_disconnect_aborts_non_streaming_request(engine):
    body = json.dumps({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 500, **GREEDY}})
    host, port = engine.url.removeprefix("http://").split(":")
    before = http(engine.url, "/get_server_info")[1]["num_generated_tokens"]
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(f"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
        deadline = time.monotonic() + 10
        while not http(engine.url, "/get_server_info")[1]["num_running_reqs"]:
            assert time.monotonic() < deadline, "request never started"
            time.sleep(0.01)
    deadline = time.monotonic() + 10
    while http(engine.url, "/get_server_info")[1]["num_running_reqs"]:
        assert time.monotonic() < deadline, "the request kept running after its client left"
        time.sleep(0.02)
    assert http(engine.url, "/get_server_info")[1]["num_generated_tokens"] - before < 500


def _wait_running(url: str, n: int) -> None:
    deadline = time.monotonic() + 10
    while http(url, "/get_server_info")[1]["num_running_reqs"] != n:
        assert time.monotonic() < deadline, f"never {n} running"
        time.sleep(0.01)


def test_a_rid_already_in_flight_is_a_400_and_the_first_request_goes_on(engine):
    """SGLang refuses a request whose rid (or one of a batch's) is live, or repeated in the batch: otherwise an abort
    by that rid, or one client's disconnect, would end the other client's request too."""
    long = {"max_new_tokens": 500, **GREEDY}
    t, box = in_thread(generate, engine.url, input_ids=[1, 2], rid="dup", sampling_params=long)
    _wait_running(engine.url, 1)
    for body in ({"input_ids": [3, 4], "rid": "dup"}, {"input_ids": [[3, 4], [5]], "rid": ["x", "dup"]}):
        status, out = http(engine.url, "/generate", {**body, "sampling_params": {"max_new_tokens": 2}})
        assert status == 400 and "dup" in out["error"]["message"] and "rid" in out["error"]["message"], out
    status, out = http(engine.url, "/generate", {"input_ids": [[3, 4], [5]], "rid": ["y", "y"]})
    assert status == 400 and "'y'" in out["error"]["message"], out
    assert t.is_alive()
    http(engine.url, "/abort_request", {"rid": "dup"})
    t.join(30)
    assert box["result"]["meta_info"]["finish_reason"]["type"] == "abort"
    assert generate(engine.url, input_ids=[3, 4], rid="dup", sampling_params={"max_new_tokens": 2})  # free again


def test_a_client_that_leaves_cancels_only_its_own_requests(engine):
    """A client's disconnect ends its requests, not another client's whose rid starts the same way."""
    long = {"max_new_tokens": 500, **GREEDY}
    t, box = in_thread(generate, engine.url, input_ids=[1, 2], rid="job_1", sampling_params=long)
    _wait_running(engine.url, 1)
    with stream_started(engine.url, {"input_ids": [3, 4], "rid": "job", "sampling_params": long}):
        pass
    _wait_running(engine.url, 1)  # the stream's request ended
    time.sleep(0.2)  # an abort by the prefix "job" would have reached job_1 by now
    assert t.is_alive()
    http(engine.url, "/abort_request", {"rid": "job_1"})
    t.join(30)
    reason = box["result"]["meta_info"]["finish_reason"]
    assert reason == {"type": "abort", "message": "aborted by /abort_request", "status_code": None, "err_type": None}
    if oracle.sglang_available():  # SGLang's own abort finish reason has this shape
        sglang_abort = oracle.sglang_module("sglang.srt.managers.schedule_batch").FINISH_ABORT
        assert reason == sglang_abort("aborted by /abort_request").to_json()


def test_a_big_batch_takes_turns_with_a_later_small_request(tiny_model_dir):
    """Admission by token budget: a batch larger than the KV cache (12 x 63 tokens for 2 x 128) is submitted a
    cache-full at a time, so a request sent after it starts finishes long before the batch does."""
    from engine_helpers import start_engine

    server = start_engine(tiny_model_dir, max_running_requests=2, kv_cache_tokens=256)
    try:
        url = server.url
        big_sp = {"max_new_tokens": 60, **GREEDY}
        t_big, big = in_thread(generate, url, input_ids=[[1, 2, 3]] * 12, sampling_params=big_sp)
        deadline = time.monotonic() + 10
        while not server.scheduler.num_running:
            assert time.monotonic() < deadline, "batch never started"
            time.sleep(0.005)
        assert server.scheduler.num_waiting <= 2  # 4 of the 12 submitted: 2 running, 2 queued
        small = generate(url, input_ids=[4, 5], sampling_params={"max_new_tokens": 5, **GREEDY})
        assert len(small["output_ids"]) == 5
        assert t_big.is_alive()
        t_big.join(60)
        assert [len(o["output_ids"]) for o in big["result"]] == [60] * 12
    finally:
        server.stop()


def test_abort_all_ends_the_rest_of_a_batch_that_waits_for_its_turn(tiny_model_dir, monkeypatch):
    """A batch bigger than the KV cache enters the engine a part at a time. An abort_all that comes between two parts
    (the first one done, the next not in yet) ends the rest, as it does where SGLang holds the whole batch."""
    from engine_helpers import start_engine

    server = start_engine(tiny_model_dir, max_running_requests=2, kv_cache_tokens=256)
    try:
        submit = server.scheduler.submit

        def abort_in_the_gap(req):
            if req.rid == "gap_1":  # gap_0 has finished; the abort is done before gap_1 comes in
                server.scheduler.abort(None)
                server.scheduler.call(lambda: None).result(10)
            submit(req)

        monkeypatch.setattr(server.scheduler, "submit", abort_in_the_gap)
        outs = generate(server.url, input_ids=[[1] * 30] * 3, rid="gap",  # 30 + 99 tokens each: one at a time
                        sampling_params={"max_new_tokens": 99, **GREEDY})
        assert [o["meta_info"]["finish_reason"]["type"] for o in outs] == ["length", "abort", "abort"]
        assert outs[1]["meta_info"]["finish_reason"]["message"] == "aborted by /abort_request"
        assert server.scheduler.num_waiting == server.scheduler.num_running == 0
    finally:
        server.stop()


def test_an_abort_by_rid_ends_that_item_of_a_batch_whether_it_waits_for_its_turn_or_not(tiny_model_dir):
    """A batch bigger than the KV cache enters the engine a part at a time. An abort by one item's rid ends that item
    (finish reason abort) also while it waits for its turn (not submitted yet), and only that item: the others
    complete, as where SGLang holds the whole batch."""
    from engine_helpers import start_engine

    server = start_engine(tiny_model_dir, max_running_requests=2, kv_cache_tokens=256)
    try:
        sp = {"max_new_tokens": 99, **GREEDY}  # 30 + 99 tokens each: one item at a time
        for batch, aborted in (("held", ["held_2"]), ("queued", ["queued_0"])):
            assert http(server.url, "/pause_generation", {"mode": "in_place"})[0] == 200
            t, box = in_thread(http, server.url, "/generate", {"input_ids": [[1] * 30] * 3, "rid": batch,
                                                                "sampling_params": sp})
            deadline = time.monotonic() + 10
            while server.scheduler.num_waiting < 1:  # item 0 in the engine's queue, items 1 and 2 held back
                assert time.monotonic() < deadline, "the batch never came in"
                time.sleep(0.005)
            for rid in aborted:
                assert http(server.url, "/abort_request", {"rid": rid})[0] == 200
            assert http(server.url, "/continue_generation", {})[0] == 200
            t.join(60)
            status, outs = box["result"]
            assert status == 200, outs
            reasons = {o["meta_info"]["id"]: o["meta_info"]["finish_reason"]["type"] for o in outs}
            assert reasons == {f"{batch}_{i}": "abort" if f"{batch}_{i}" in aborted else "length" for i in range(3)}
            assert all(len(o["output_ids"]) == 99 for o in outs if o["meta_info"]["id"] not in aborted)
            assert server.scheduler.num_waiting == server.scheduler.num_running == 0
        assert generate(server.url, input_ids=[1, 2], rid="held_2", sampling_params={"max_new_tokens": 2})  # freed
    finally:
        server.stop()


def test_a_request_sent_after_abort_all_returned_is_not_aborted(engine):
    """An abort_all ends the requests received before it, not one sent after it returned, even while the model
    thread has not reached the abort yet (busy here)."""
    busy = engine.scheduler.call(time.sleep, 0.5)
    assert http(engine.url, "/abort_request", {"abort_all": True})[0] == 200
    out = generate(engine.url, input_ids=[1, 2], sampling_params={"max_new_tokens": 3, **GREEDY})
    busy.result(10)
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 3}


# (field path, value) pairs of /generate whose JSON type SGLang's generate contract decides: ours must agree
TYPE_CASES = [(("sampling_params", k), v) for k, vs in {
    "max_new_tokens": [2, 2.0, True], "min_new_tokens": [1, 1.0], "top_k": [2, 2.0, True], "temperature": [1, True],
    "sampling_seed": [1, 1.0, True], "n": [1, 1.0, True], "ignore_eos": [True, 1, 0], "skip_special_tokens": [False, 1],
    "no_stop_trim": [True, 1], "stop_token_ids": [[1], [1.0], [True]], "logit_bias": [{"1": 1}, {"1": True}]}.items()
    for v in vs] + [((k,), v) for k, vs in {
    "rid": ["a", 5, ["a"]], "return_logprob": [True, 1], "logprob_start_len": [-1, -1.0, True],
    "top_logprobs_num": [1, 1.0], "token_ids_logprob": [[1], [1.0]], "return_text_in_logprobs": [True, 1],
    "stream": [False, 0], "input_ids": [[1.0], [True]]}.items() for v in vs]


@pytest.mark.parametrize("path,value", TYPE_CASES, ids=[f"{'.'.join(p)}={v!r}" for p, v in TYPE_CASES])
def test_generate_field_types_are_what_sglang_accepts(engine, path, value):
    """SGLang's own /generate check (tests/sglang_oracle.py) and the engine agree on each JSON type: a 2.0 where an
    integer goes, a 0/1 where a boolean goes, a number as rid are refused by both (naming the field), the rest pass."""
    from tests import sglang_oracle as oracle

    oracle.require_sglang()
    body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}
    target = body
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    if path[-1] in ("rid", "return_logprob") and isinstance(value, list):
        body["input_ids"] = [[1, 2]]
    try:
        oracle.validate_generate(json.loads(json.dumps(body)))
        sglang_ok = True
    except Exception:  # noqa: BLE001 - SGLang's refusal, of whichever kind
        sglang_ok = False
    status, out = http(engine.url, "/generate", body)
    assert (status == 200) == sglang_ok, (body, sglang_ok, out)
    if not sglang_ok:
        assert status == 400 and path[-1] in out["error"]["message"], out


def test_openai_and_control_fields_take_sglangs_types(engine):
    """OpenAI's model is a string and a bad prompt is named as prompt (SGLang's CompletionRequest refuses both; its
    pydantic reading takes n: 1.0 and skip_special_tokens: 1, as here); rid is a string on /generate as on
    /abort_request; weight versions are strings; /end_weight_update without a begin is a 400."""
    from tests import sglang_oracle as oracle

    url = engine.url
    for route, body, field in (
            ("/v1/completions", {"model": 5, "prompt": "ab"}, "model"),
            ("/v1/chat/completions", {"model": 5, "messages": [{"role": "user", "content": "hi"}]}, "model"),
            ("/v1/completions", {"prompt": 5}, "prompt"), ("/v1/completions", {"prompt": [[1], ["x"]]}, "prompt[1]"),
            ("/generate", {"input_ids": [1], "rid": 5}, "rid"), ("/abort_request", {"rid": 5}, "rid"),
            ("/update_weight_version", {"new_version": 5}, "new_version"),
            ("/update_weights_from_disk", {"model_path": "/x", "weight_version": 5}, "weight_version"),
            ("/end_weight_update", {}, "begin_weight_update")):
        status, out = http(url, route, body)
        assert status == 400 and field in json.dumps(out), (route, body, out)
    lax = {"model": "m", "prompt": "ab", "max_tokens": 2, "n": 1.0, "skip_special_tokens": 1}
    assert http(url, "/v1/completions", lax)[0] == 200
    if oracle.sglang_available():
        proto = oracle.openai_protocol()
        proto.CompletionRequest.model_validate(lax)
        for bad in ({"model": 5, "prompt": "ab"}, {"model": "m", "prompt": 5}):
            with pytest.raises(Exception, match="validation error"):
                proto.CompletionRequest.model_validate(bad)
