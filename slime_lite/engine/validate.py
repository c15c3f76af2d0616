"""Checks on the values a client sends, made before a request is admitted.

Each check returns the value in the type the engine uses, or raises ``ValueError`` whose message starts with the
field's name (the routes answer it as HTTP 400). JSON brings arbitrary-size integers, NaN and Infinity (Python's
``json`` accepts them) and ``true``/``false`` where numbers are expected: numbers must be finite, integers must fit
a machine integer (int64), and booleans are not numbers.
"""

from __future__ import annotations

import math
from typing import Any, Callable

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
MAX_N = 256  # samples per prompt (sampling_params.n)
MAX_SEQUENCES = 4096  # prompts x n in one HTTP request
MAX_STOP = 256  # stop strings per request (each one is searched for after every token)
# Log-probs besides the sampled token's, per scored position (each one is computed, held and sent as JSON):
MAX_TOP_LOGPROBS = 20  # top_logprobs_num (/generate), logprobs (completions), top_logprobs (chat); OpenAI's cap
MAX_TOKEN_IDS_LOGPROB = 1024  # entries of token_ids_logprob per prompt
MAX_LOGPROB_ENTRIES = 1 << 18  # per prompt: scored positions x (top_logprobs_num + entries of token_ids_logprob)
# |bias| of a logit_bias entry: past any ban (-1e9 is a common one); divided by the smallest sampling temperature
# (sampling.GREEDY_EPS) it stays far inside float32, whose overflow (1e39 is inf) made NaN log-probs
MAX_LOGIT_BIAS = 1e9


def integer(value: Any, name: str, lo: int = INT64_MIN, hi: int = INT64_MAX) -> int:
    """An integer in ``[lo, hi]`` (a float with an integral value, like 16.0, counts)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name}={value!r} must be an integer")
    if isinstance(value, float) and not value.is_integer():
        raise ValueError(f"{name}={value!r} must be an integer")
    if not lo <= value <= hi:
        raise ValueError(f"{name}={value!r} must be in [{lo}, {hi}]")
    return int(value)


def number(value: Any, name: str, lo: float = -math.inf, hi: float = math.inf, *, lo_open: bool = False) -> float:
    """A finite number in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name}={value!r} must be a number")
    try:
        x = float(value)
    except OverflowError:  # an integer too large for a float
        x = math.inf
    if not math.isfinite(x):
        raise ValueError(f"{name}={value!r} must be a finite number")
    if not (lo < x if lo_open else lo <= x) or x > hi:
        raise ValueError(f"{name}={value!r} must be in {'(' if lo_open else '['}{lo}, {hi}]")
    return x


def boolean(value: Any, name: str) -> bool:
    """``true``/``false`` (or 0/1)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise ValueError(f"{name}={value!r} must be true or false")


def string(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{name}={value!r} must be a string")
    return value


def string_list(value: Any, name: str) -> list[str]:
    """A string or a list of strings -> a list of strings."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise ValueError(f"{name} must be a string or a list of strings")
    return value


def token_ids(value: Any, name: str, vocab_size: int) -> list[int]:
    """A non-empty list of token ids in ``[0, vocab_size)``."""
    if not isinstance(value, list) or not value:
        raise ValueError(f"{name} must be a non-empty list of token ids")
    for t in value:
        if isinstance(t, bool) or not isinstance(t, int):
            raise ValueError(f"{name} must hold integers (got {t!r})")
        if not 0 <= t < vocab_size:
            raise ValueError(f"{name}: token id {t} outside the vocabulary [0, {vocab_size})")
    return value


def fits_context(prompt_tokens: int, max_new_tokens: int | None, context: int) -> None:
    """SGLang's check: with an explicit ``max_new_tokens``, input plus output stay below the model's context."""
    if max_new_tokens is not None and prompt_tokens + max_new_tokens >= context:
        raise ValueError(f"sampling_params.max_new_tokens: {prompt_tokens} input tokens + max_new_tokens "
                         f"{max_new_tokens} = {prompt_tokens + max_new_tokens} tokens exceeds the model's context "
                         f"length ({context} tokens); lower max_new_tokens or shorten the input")


def token_id_list(value: Any, name: str) -> list[int]:
    """A list of non-negative token ids (possibly empty; the vocabulary range is the scheduler's check)."""
    if not isinstance(value, list):
        raise ValueError(f"{name} must be a list of token ids")
    return [integer(t, name, 0) for t in value]


def logprob_token_ids(value: Any, name: str = "token_ids_logprob") -> list[int]:
    """``token_ids_logprob``: at most ``MAX_TOKEN_IDS_LOGPROB`` token ids. Each entry, a repeated id too, gets its
    own ``[logprob, token_id, text]`` at every scored position, in the order given (SGLang's shape)."""
    ids = token_id_list(value, name)
    if len(ids) > MAX_TOKEN_IDS_LOGPROB:
        raise ValueError(f"{name}: {len(ids)} token ids; at most {MAX_TOKEN_IDS_LOGPROB} per prompt (each one adds "
                         "a log-prob at every scored position); ask for fewer")
    return ids


def logprob_entries(positions: int, top: int, ids: list[int] | None) -> None:
    """The top / token-id log-probs of one prompt, ``positions`` scored positions (prompt from logprob_start_len,
    plus max_new_tokens) each with ``top + len(ids)`` of them, stay within ``MAX_LOGPROB_ENTRIES``."""
    entries = positions * (top + len(ids or ()))
    if entries > MAX_LOGPROB_ENTRIES:
        raise ValueError(f"top_logprobs_num / token_ids_logprob: {positions} scored positions x {top + len(ids or ())} "
                         f"log-probs each = {entries}; at most {MAX_LOGPROB_ENTRIES} per prompt: ask for fewer, or "
                         "score fewer positions (a later logprob_start_len, a lower max_new_tokens)")


def objects(values: list[Any], name: str) -> None:
    """Each entry of a per-prompt list is an object (``name[i]`` in the error)."""
    for i, value in enumerate(values):
        if not isinstance(value, dict):
            raise ValueError(f"{name}[{i}]={value!r:.40} must be an object (one per prompt; {{}} for the defaults)")


def cache_namespaces(extra_key: Any, cache_salt: Any, n: int) -> list[tuple[str | None, str | None]]:
    """Each prompt's prefix-cache namespace ``(extra_key, cache_salt)``: SGLang's fields, each a string or a list of
    ``n`` strings (one per prompt); null and "" are the default namespace. A prompt reuses cached K/V only from
    prompts of its own namespace."""

    def per_prompt(value: Any, name: str) -> list[str | None]:
        if value is None or isinstance(value, str):
            return [value or None] * n
        if isinstance(value, list) and len(value) == n and all(isinstance(v, str) for v in value):
            return [v or None for v in value]
        raise ValueError(f"{name}={value!r:.80} must be a string (or a list of strings, one for each of the {n} "
                         "prompts)")

    return list(zip(per_prompt(extra_key, "extra_key"), per_prompt(cache_salt, "cache_salt")))


# /generate fields (SGLang's GenerateReqInput) the engine implements.
GENERATE_FIELDS = {"text", "input_ids", "sampling_params", "rid", "return_logprob", "logprob_start_len",
                   "return_routed_experts", "routed_experts_start_len", "extra_key", "cache_salt",
                   "top_logprobs_num", "token_ids_logprob", "return_text_in_logprobs", "stream"}
# Fields that only label, route or log a request: any value is accepted and changes nothing in the output.
GENERATE_LABELS = {"log_metrics", "no_logs", "custom_labels", "received_time", "external_trace_header",
                   "routing_key", "conversation_id", "priority", "http_worker_ipc"}
# SGLang's other fields: accepted at their default (absent, null, false, 0 or the values listed), else a 400.
GENERATE_DEFAULTS: dict[str, tuple[Any, ...]] = {name: () for name in (
    "session_id", "input_embeds", "image_data", "video_data", "audio_data", "mm_hashes", "mm_content_hashes",
    "use_audio_in_video", "video_config", "watermark", "return_sampling_mask", "sampling_logprobs_mode",
    "return_flat_raw_top_logprobs", "return_flat_raw_output_top_logprobs", "return_flat_raw_top_logprobs_b64",
    "return_hidden_states", "return_indexer_topk",
    "modalities", "session_params", "lora_path", "lora_id", "custom_logit_processor", "positional_embed_overrides",
    "bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_pair_key", "decode_tp_size",
    "routed_dp_rank", "data_parallel_rank", "disagg_prefill_dp_rank", "background", "require_reasoning",
    "max_thinking_tokens", "return_bytes", "return_entropy", "return_prompt_token_ids", "need_wait_for_mm_inputs",
    "num_items_assigned", "encoder_urls", "max_dynamic_patch", "min_dynamic_patch", "image_max_dynamic_patch",
    "video_max_dynamic_patch", "images_config", "mm_processor_kwargs", "multi_item_delimiter_indices",
    "token_indices_to_pool", "kv_hints")}


def _is_default(value: Any, allowed: tuple[Any, ...]) -> bool:
    if value is None or value is False or value in allowed:
        return True
    if isinstance(value, bool):
        return False
    if isinstance(value, (int, float)) and value == 0:
        return True
    return isinstance(value, (list, dict, str)) and not value  # [], {}, ""


def generate_fields(body: dict[str, Any]) -> None:
    """A ``/generate`` body asks only for what the engine does: a field of SGLang's it does not implement, at a value
    other than its default, is a ValueError naming it; so is a field SGLang does not have."""
    for key, value in body.items():
        if key in GENERATE_FIELDS or key in GENERATE_LABELS:
            continue
        if key not in GENERATE_DEFAULTS:
            raise ValueError(f"{key}: not a /generate field (SGLang's GenerateReqInput has no such field)")
        if not _is_default(value, GENERATE_DEFAULTS[key]):
            raise ValueError(f"{key}={value!r:.80}: not supported by the embedded engine (only its default, "
                             "absent or null, is accepted); use --rollout-backend sglang for it")


# OpenAI route fields the engine implements (SGLang's CompletionRequest / ChatCompletionRequest / TokenizeRequest
# names; max_completion_tokens also on completions).
_OPENAI_SAMPLING = {"model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "n",
                    "stop", "seed", "stream", "stream_options", "logprobs", "frequency_penalty", "presence_penalty",
                    "repetition_penalty", "logit_bias", "min_tokens", "stop_token_ids", "no_stop_trim", "ignore_eos",
                    "skip_special_tokens", "rid", "extra_key", "cache_salt"}
OPENAI_FIELDS = {
    "completions": _OPENAI_SAMPLING | {"prompt", "echo", "best_of"},
    "chat": _OPENAI_SAMPLING | {"messages", "top_logprobs", "chat_template_kwargs"},
    "tokenize": {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt", "chat_template_kwargs"},
}
# Fields that only label or route a request (any value; the answer does not change). separate_reasoning and
# stream_reasoning act only with a reasoning parser, which the engine has none of.
OPENAI_LABELS = {"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier", "priority",
                 "custom_labels", "separate_reasoning", "stream_reasoning"}
# Any other field is accepted only at its default: absent or null, and then the values listed here (what clients
# send when the user set nothing), or for a field not listed false, 0, "", [] or {}.
OPENAI_DEFAULTS: dict[str, tuple[Any, ...]] = {
    "tool_choice": ("auto", "none"), "function_call": ("auto", "none"), "response_format": ({"type": "text"},),
    "parallel_tool_calls": (True, False),
    "add_generation_prompt": (True,), "spaces_between_special_tokens": (True,), "length_penalty": (1, 1.0),
    "return_flat_raw_top_logprobs_b64": (True,), "modalities": (["text"],), "best_of": (1,)}


def _at_default(value: Any, allowed: tuple[Any, ...] | None) -> bool:
    if allowed is None:
        return _is_default(value, ())
    return value is None or any(value == a and type(value) is type(a) for a in allowed)


def openai_fields(body: dict[str, Any], route: str) -> None:
    """An OpenAI-route body (``route``: completions, chat or tokenize) asks only for what the route does: any field
    it does not implement and that is not a label, at a value other than its default, is a ValueError naming it."""
    bad = [f"{key}={value!r:.60}" for key, value in body.items() if not (
        key in OPENAI_FIELDS[route] or key in OPENAI_LABELS or _at_default(value, OPENAI_DEFAULTS.get(key)))]
    if bad:
        raise ValueError(f"{', '.join(bad)}: not supported by the embedded engine's OpenAI {route} route (only the "
                         "default, absent or null, is accepted); drop the field or use --rollout-backend sglang")


# JSON types of /generate fields as SGLang's generate contract checks them (strictly: an integer field takes no
# 2.0, a boolean field no 0/1); floats take integers. The OpenAI routes read their numbers as pydantic does
# (n: 1.0 passes) and their booleans with ``boolean`` (true/false or 0/1; a string such as "false" is refused).
_SP_INTS = ("max_new_tokens", "min_new_tokens", "top_k", "sampling_seed", "n", "stream_interval")
_SP_BOOLS = ("ignore_eos", "skip_special_tokens", "no_stop_trim", "spaces_between_special_tokens")
_TOP_BOOLS = ("return_logprob", "return_text_in_logprobs", "stream")  # return_logprob: or one per prompt
_TOP_INTS = ("logprob_start_len", "top_logprobs_num")  # or one per prompt


def _json_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _typed(value: Any, name: str, ok: Callable[[Any], bool], kind: str, per_prompt: bool = False) -> None:
    if value is None or ok(value) or (per_prompt and isinstance(value, list) and all(map(ok, value))):
        return
    raise ValueError(f"{name}={value!r:.80} must be {kind}" + (" (or a list of them, one per prompt)"
                                                              if per_prompt else ""))


def generate_types(body: dict[str, Any]) -> None:
    """The JSON types of a ``/generate`` body as SGLang accepts them; ValueError naming the first field that is
    not (ranges and the vocabulary are checked later)."""
    for key in _TOP_BOOLS:
        _typed(body.get(key), key, lambda v: isinstance(v, bool), "true or false", key == "return_logprob")
    for key in _TOP_INTS:
        _typed(body.get(key), key, _json_int, "an integer", True)
    ids = body.get("token_ids_logprob")
    if isinstance(ids, list):
        for x in ids:
            _typed(x, "token_ids_logprob", lambda v: _json_int(v) or isinstance(v, list) and all(map(_json_int, v)),
                   "a token id (an integer)")
    rid = body.get("rid")
    _typed(rid, "rid", lambda v: isinstance(v, str), "a string", True)
    sps = body.get("sampling_params")
    for i, sp in enumerate(sps if isinstance(sps, list) else [sps]):
        if not isinstance(sp, dict):
            continue  # SamplingParams.from_dict names it
        where = "sampling_params" if not isinstance(sps, list) else f"sampling_params[{i}]"
        for key in _SP_INTS:
            _typed(sp.get(key), f"{where}.{key}", _json_int, "an integer")
        for key in _SP_BOOLS:
            _typed(sp.get(key), f"{where}.{key}", lambda v: isinstance(v, bool), "true or false")
        stop_ids = sp.get("stop_token_ids")
        if isinstance(stop_ids, list):
            for t in stop_ids:
                _typed(t, f"{where}.stop_token_ids", _json_int, "a list of token ids (integers)")
