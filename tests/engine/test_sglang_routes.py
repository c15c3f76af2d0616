"""The embedded engine's HTTP routes against SGLang's own route table (the pinned release, read from its FastAPI app
by tests/sglang_oracle.py): every SGLang route is served with the same method, or is listed below as absent by
design (with the reason) or as missing (not done yet). The README's Compatibility section states the counts.

Adding a route to the engine: delete its line from MISSING (or ABSENT_BY_DESIGN); the test says which."""
from __future__ import annotations

import re
from pathlib import Path

from tests import sglang_oracle as oracle

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
}

# SGLang routes a slime user could reach that the embedded engine does not serve yet.
MISSING = [
    "GET /", "GET /ready", "POST /tokenize", "POST /detokenize", "POST /v1/tokenize", "POST /v1/detokenize",
    "GET /release_memory_occupation", "GET /resume_memory_occupation", "GET /start_profile", "GET /stop_profile",
    "GET /weights_checker", "POST /weights_checker", "POST /update_weights_from_ipc",
]


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
