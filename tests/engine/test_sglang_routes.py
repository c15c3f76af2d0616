"""The embedded engine's HTTP routes against SGLang's own route table (the pinned release, read from its FastAPI app
by tests/sglang_oracle.py): every SGLang route is served with the same method, or is listed below as absent by
design (with the reason) or as missing (not done yet). The README's Compatibility section states the counts.

Adding a route to the engine: delete its line from MISSING (or ABSENT_BY_DESIGN); the test says which."""
from __future__ import annotations

import re
from pathlib import Path

from tests import sglang_oracle as oracle
from tests.engine.engine_helpers import http

# SGLang routes the embedded engine leaves out on purpose, by reason ("METHOD /path", path parameters as {}).
ABSENT_BY_DESIGN = {
    "FastAPI's generated API docs": [
        "GET /docs", "GET /docs/oauth2-redirect", "GET /openapi.json", "GET /redoc"],
    "non-generative models (embeddings, classification, reranking, scoring, speech)": [
        "POST /v1/embeddings", "POST /encode", "PUT /encode", "POST /classify", "PUT /classify",
        "POST /v1/classify", "POST /v1/rerank", "PUT /v1/rerank", "POST /v1/score", "POST /v1/decisions",
        "POST /v1/systemone", "POST /v1/audio/transcriptions"],
    "API dialects other than SGLang's native one and OpenAI completions/chat (Ollama, Anthropic, OpenAI "
    "Responses, SageMaker, Vertex AI)": [
        "GET /api/tags", "POST /api/chat", "POST /api/generate", "POST /api/show", "POST /v1/messages",
        "POST /v1/messages/count_tokens", "POST /v1/responses", "GET /v1/responses/{}",
        "POST /v1/responses/{}/cancel", "POST /invocations", "GET /ping", "POST /vertex_generate"],
    "LoRA adapters (slime trains full parameters)": [
        "POST /load_lora_adapter", "POST /load_lora_adapter_from_tensors", "POST /unload_lora_adapter"],
    "multi-node serving machinery (PD disaggregation, hierarchical cache, remote-instance weight transfer, "
    "elastic EP, expert-distribution recording)": [
        "POST /pd_role_switch", "GET /hicache/storage-backend", "PUT /hicache/storage-backend",
        "DELETE /hicache/storage-backend", "POST /hicache/storage-backend/clear", "GET /get_hicache_l3_cache_layout",
        "POST /init_weights_send_group_for_remote_instance", "POST /send_weights_to_remote_instance",
        "GET /get_remote_instance_transfer_engine_info", "GET /remote_instance_transfer_engine_info",
        "POST /scale_elastic_ep", "GET /is_scaling_elastic_ep", "POST /start_expert_distribution_record",
        "GET /start_expert_distribution_record", "POST /stop_expert_distribution_record",
        "GET /stop_expert_distribution_record", "POST /dump_expert_distribution_record",
        "GET /dump_expert_distribution_record"],
    "chat-serving helpers (tool-call and reasoning parsers, retrieval corpora, sessions)": [
        "POST /parse_function_call", "POST /separate_reasoning", "POST /add_external_corpus",
        "POST /remove_external_corpus", "GET /list_external_corpora", "POST /open_session", "GET /open_session",
        "POST /close_session", "GET /close_session"],
    "SGLang's internal tuning and debugging knobs": [
        "POST /set_internal_state", "PUT /set_internal_state", "POST /slow_down", "GET /slow_down",
        "POST /freeze_gc", "GET /freeze_gc", "POST /configure_logging", "GET /configure_logging",
        "POST /set_trace_level", "GET /set_trace_level"],
    "checkpoint-engine's push (ZMQ sockets per GPU UUID handing over CUDA IPC buffers; slime pushes through "
    "/update_weights_from_tensor, which takes CUDA IPC handles too, or /update_weights_from_distributed)": [
        "POST /update_weights_from_ipc"],
}

# SGLang routes a slime user could reach that the embedded engine does not serve yet.
MISSING: list[str] = []


def _norm(method: str, path: str) -> str:
    return f"{method} {re.sub(r'{[^}]*}', '{}', path)}"


def our_routes(server) -> set[str]:
    return {_norm(r.method, r.resource.canonical) for r in server._runner.app.router.routes()
            if r.method not in ("HEAD", "*")}


def sglang_routes() -> set[str]:
    return {_norm(m, p) for m, p in oracle.route_table()}


def compat_line(present: int, absent: int, missing: int, total: int) -> str:
    from slime_lite.backends.sglang.launcher import SGLANG_VERSION

    return (f"- SGLang {SGLANG_VERSION}'s HTTP routes ({total}): **{present} served with the same method**, "
            f"{absent} absent by design, {missing} missing")


def test_every_sglang_route_is_served_or_listed(engine):
    oracle.require_sglang()
    theirs, ours = sglang_routes(), our_routes(engine)
    absent = [r for routes in ABSENT_BY_DESIGN.values() for r in routes]
    listed = set(absent) | set(MISSING)
    assert len(listed) == len(absent) + len(MISSING), "a route is listed twice"
    unlisted = sorted(theirs - ours - listed)
    assert not unlisted, f"SGLang routes neither served nor listed in {__file__}: {unlisted}"
    served_but_listed = sorted(listed & ours)
    assert not served_but_listed, f"served now; delete them from ABSENT_BY_DESIGN/MISSING: {served_but_listed}"
    gone = sorted(listed - theirs)
    assert not gone, f"not SGLang routes (any more): {gone}"
    line = compat_line(len(theirs & ours), len(absent), len(MISSING), len(theirs))
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert line in readme, f"README's Compatibility section should say:\n{line}"


def test_routes_slime_calls_are_served_with_slimes_method(engine):
    """The routes slime's own code sends to SGLang servers (GET /flush_cache included: slime sends GET)."""
    ours = our_routes(engine)
    for route in ("POST /generate", "GET /flush_cache", "POST /flush_cache", "GET /health_generate",
                  "GET /get_server_info", "GET /server_info", "POST /abort_request", "POST /pause_generation",
                  "POST /continue_generation", "POST /update_weights_from_tensor",
                  "POST /update_weights_from_distributed", "POST /init_weights_update_group",
                  "POST /release_memory_occupation", "POST /resume_memory_occupation", "GET /v1/loads"):
        assert route in ours, route


def test_tokenize_and_detokenize_speak_sglangs_protocol(engine):
    """/tokenize and /detokenize (and their /v1 spellings): requests and responses SGLang's own protocol models
    accept, token ids the engine's tokenizer gives, and a round trip back to the text."""
    oracle.require_sglang()
    proto = oracle.openai_protocol()
    tok = engine.scheduler.tokenizer
    for prefix in ("", "/v1"):
        for body in ({"prompt": "1+1=2"}, {"prompt": ["ab", "1+1"], "add_special_tokens": False}):
            proto.TokenizeRequest.model_validate(body)
            status, out = http(engine.url, f"{prefix}/tokenize", body)
            assert status == 200, out
            proto.TokenizeResponse.model_validate(out)
            prompts = [body["prompt"]] if isinstance(body["prompt"], str) else body["prompt"]
            ids = [tok.encode(p, add_special_tokens=body.get("add_special_tokens", True)) for p in prompts]
            assert out["tokens"] == (ids[0] if isinstance(body["prompt"], str) else ids)
            assert out["count"] == (len(ids[0]) if isinstance(body["prompt"], str) else [len(x) for x in ids])
            assert out["max_model_len"] == engine.scheduler.slot_len
            back = {"tokens": out["tokens"]}
            proto.DetokenizeRequest.model_validate(back)
            status, text = http(engine.url, f"{prefix}/detokenize", back)
            assert status == 200, text
            proto.DetokenizeResponse.model_validate(text)
            assert text["text"] == (prompts[0] if isinstance(body["prompt"], str) else prompts)
    messages = [{"role": "user", "content": "hi"}]
    proto.TokenizeRequest.model_validate({"messages": messages})
    out = http(engine.url, "/tokenize", {"messages": messages})[1]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert out["tokens"] == tok.encode(rendered, add_special_tokens=False)
    # too many texts, or a text far past the slot (tokenizing it would hold the tokenizer from every other client)
    huge = "1+" * (64 * engine.scheduler.slot_len)
    for route, body, field in (("/tokenize", {"prompt": 5}, "prompt"), ("/tokenize", {}, "prompt"),
                               ("/tokenize", {"prompt": ["a"] * 4097}, "'prompt'"),
                               ("/tokenize", {"prompt": huge}, "prompt: more than"),
                               ("/tokenize", {"prompt": ["a", huge]}, "prompt[1]: more than"),
                               ("/detokenize", {"tokens": [10 ** 9]}, "tokens"),
                               ("/detokenize", {"tokens": [[1]] * 4097}, "'tokens'"),
                               ("/detokenize", {"tokens": [[1], ["x"]]}, "tokens[1]")):
        status, err = http(engine.url, route, body)
        assert status == 400 and field in err["error"]["message"], (route, body, err)
    assert http(engine.url, "/detokenize", {"tokens": []}) == (200, {"text": ""})


def test_root_ready_and_get_variants_of_control_routes(engine):
    assert http(engine.url, "/") == (200, "slime_lite embedded engine (SGLang API) is running")
    assert http(engine.url, "/ready")[0] == 200
    # GET with SGLang's JSON body (FastAPI reads a GET's body): release and resume the KV cache
    assert http(engine.url, "/release_memory_occupation", {"tags": ["kv_cache"]}, method="GET")[0] == 200
    assert "kv_cache" in http(engine.url, "/get_server_info")[1]["released_memory"]
    assert http(engine.url, "/ready")[0] == 200  # ready still: /health would say 503 only for released weights
    assert http(engine.url, "/resume_memory_occupation", method="GET")[0] == 200
    assert http(engine.url, "/get_server_info")[1]["released_memory"] == []
    assert http(engine.url, "/stop_profile")[0] == 400  # GET reaches the handler: none is running


def test_weights_checker_checksums_snapshot_and_compare(engine):
    """/weights_checker: SGLang's request object accepts each body; the checksum answer has SGLang's ChecksumInfo
    shape and carries the engine's own per-parameter checksums; snapshot then compare succeeds on unchanged
    weights; a compare against a snapshot that differs names the parameter."""
    import msgspec

    oracle.require_sglang()
    io = oracle.sglang_module("sglang.srt.managers.io_struct")
    for body in ({}, {"action": "checksum", "skip_tensor_list": ["embed"]}, {"action": "snapshot"},
                 {"action": "compare"}):
        io.CheckWeightsReqInput(**body)  # a kw_only struct: an unknown field is a TypeError
    status, out = http(engine.url, "/weights_checker", method="GET")
    assert status == 200 and out["success"], out
    msgspec.convert(out["ranks"][0], io.ChecksumInfo)
    assert out["ranks"][0]["checksums"] == http(engine.url, "/get_weights_checksum", {})[1]
    assert len(out["per_engine_checksum"]) == 64
    skipped = http(engine.url, "/weights_checker", {"skip_tensor_list": ["embed"]})[1]["ranks"][0]["checksums"]
    assert skipped and not any("embed" in n for n in skipped) and len(skipped) < len(out["ranks"][0]["checksums"])
    assert http(engine.url, "/weights_checker", {"action": "compare"})[0] in (200, 400)  # depends on test order
    assert http(engine.url, "/weights_checker", {"action": "snapshot"}) == (200, {"success": True,
                                                                                "message": "Success."})
    assert http(engine.url, "/weights_checker", {"action": "compare"})[0] == 200
    name = next(iter(out["ranks"][0]["checksums"]))
    checker = next(r.handler for r in engine._runner.app.router.routes() if r.resource.canonical == "/weights_checker")
    checker.__self__.weights_snapshot[name] = "0" * 64  # as if the weights had changed since the snapshot
    status, bad = http(engine.url, "/weights_checker", {"action": "compare"})
    assert status == 400 and not bad["success"] and name in bad["message"]
    for body in ({"action": "reset_tensors"}, {"selector": "draft"}):
        status, bad = http(engine.url, "/weights_checker", body)
        assert status == 400 and not bad["success"], bad
