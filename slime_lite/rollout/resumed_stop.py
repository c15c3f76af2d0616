"""A --partial-rollout resume's text as one uninterrupted request's: a stop string that spans the resume ended where
that request ends it, and the text decoded whole.

A sample aborted mid-response is continued with its prompt and response tokens as input ids (oversample.py). The
engines, embedded or SGLang, match the ``stop`` strings of the sampling params in the text of the tokens the current
request generated only: a stop string whose first characters came before the abort and its last after the resume is
not matched there, and generation runs on. No /generate parameter tells an engine which input ids are response, so
the rollout side matches it, whatever the engine: ``end_at_resumed_stop`` decodes, for each new token in turn, the
tail of the response so far (the tokens before the resume and the new ones), as the embedded engine checks each
token (token_rules.py: the text with special tokens, over the last ``max UTF-8 bytes of a stop string + 8`` tokens).
Only the first tokens need it: once the tail holds new tokens only, the engine checked the same text itself. At the
first match the request's result is ended there as the engine ends a request that matched it: the tokens after it
dropped with their per-token fields (log-probs, weight versions, routed experts), finish reason ``{"type": "stop",
"matched": s}``, and the text the engine returns (the whole response decoded, cut right after the first occurrence of
the stop string with ``no_stop_trim``, else before it, as SGLang's detokenizer). A stop string already in the tail
before the resume is left alone: it ended before the abort, which that request would have matched itself.

Without such a stop, a resumed response's text is still decoded whole, not as the text before the abort plus the
engine's text of the new tokens: the two differ where the abort split a character or a word's leading space.
"""

from __future__ import annotations

import base64
import functools
from typing import Any

from slime_lite.tokenizer import load_tokenizer
from slime_lite.types import Sample, Status


@functools.lru_cache(maxsize=4)
def _tokenizer(path: str) -> Any:
    return load_tokenizer(path)


def stop_strings(params: dict[str, Any]) -> list[str]:
    """The sampling params' ``stop``: a string or a list of them (SGLang takes both); none empty."""
    stop = params.get("stop") or []
    return [s for s in ([stop] if isinstance(stop, str) else stop) if s]


def first_match(before: list[int], new: list[int], stops: list[str], decode: Any) -> tuple[int, str] | None:
    """(new tokens kept, stop string) at the first new token whose tail, ``before`` followed by ``new``, holds one of
    ``stops`` that the tail before the resume does not; None if none does before the tail is all new tokens.
    ``decode``: token ids -> text with special tokens."""
    window = max(len(s.encode("utf-8")) for s in stops) + 8
    ended = decode(before[-window:])
    live = [s for s in stops if s not in ended]
    if not live:
        return None
    for k in range(1, min(len(new), window - 1) + 1):
        tail = decode((before + new[:k])[-window:])
        for s in live:
            if s in tail:
                return k, s
    return None


def joined(tok: Any, before: list[int], ids: list[int], text: Any, skip: bool) -> str | None:
    """The text of a resumed response's tokens, ``before`` the abort and ``ids`` after, decoded as one: the text of
    each part joined is not that where the abort fell inside a character (a byte-level tokenizer's several tokens:
    two U+FFFD) or before a word's leading space (SentencePiece drops it at a text's start). ``text`` is the
    engine's for ``ids``: what it cut at the end (a stop string without ``no_stop_trim``) is cut here too. None
    when ``text`` is not a start of ``ids``' text: the caller keeps the parts joined."""
    new = tok.decode(ids, skip_special_tokens=skip)
    if not isinstance(text, str) or not new.startswith(text):
        return None
    whole = tok.decode(before + ids, skip_special_tokens=skip)
    return whole[: len(whole) - (len(new) - len(text))]


def _cut_routed_experts(b64: str, rows: int, keep: int) -> str:
    """The first ``keep`` of the ``rows`` positions of SGLang's routed-experts table (base64 of int32 ``[rows,
    layers, top_k]``); unchanged when its size is not a multiple of ``rows``."""
    raw = base64.b64decode(b64)
    if rows <= 0 or len(raw) % rows:
        return b64
    return base64.b64encode(raw[: len(raw) // rows * keep]).decode("ascii")


def end_at_resumed_stop(args: Any, sample: Sample, out: dict[str, Any], params: dict[str, Any]) -> str | None:
    """Before ``fill_response(sample, out)``: the whole response's text when ``sample`` was carried aborted
    (continued from its tokens), for the caller to set as the sample's response; None (``out`` unchanged) otherwise.
    When a stop string spans the resume, ``out`` (one /generate result, changed in place but for its ``text``) is
    first cut at the token that completes it, and the text is the engine's for that. Otherwise the text of the tokens
    before the abort is decoded with the new ones (``joined``). The tokenizer is ``args.hf_checkpoint``'s (the
    rollout's)."""
    ids = list(out.get("output_ids") or [])
    if sample.status is not Status.ABORTED or not sample.response_length or not ids:
        return None
    tok = _tokenizer(str(args.hf_checkpoint))
    had = sample.response_length
    before = list(sample.tokens[len(sample.tokens) - had:])
    stops = stop_strings(params)
    found = first_match(before, ids, stops, lambda t: tok.decode(t, skip_special_tokens=False)) if stops else None
    if found is None:
        return joined(tok, before, ids, out.get("text"), params.get("skip_special_tokens", True))
    keep, matched = found
    meta = out.setdefault("meta_info", {})
    for key, value in list(meta.items()):  # SGLang's per-output-token lists: output_token_logprobs, ..._versions
        if key.startswith("output_") and isinstance(value, list) and len(value) == len(ids):
            meta[key] = value[:keep]
    if meta.get("routed_experts") is not None:  # every position the request fed but the last
        prompt = len(sample.tokens)
        meta["routed_experts"] = _cut_routed_experts(meta["routed_experts"], prompt + len(ids) - 1, prompt + keep - 1)
    if "completion_tokens" in meta:
        meta["completion_tokens"] = keep
    versions = meta.get("output_token_weight_versions")
    if versions and "weight_version" in meta:  # the request's version: its last kept token's, not a dropped one's
        meta["weight_version"] = str(versions[-1])
    meta["finish_reason"] = {"type": "stop", "matched": matched}
    out["output_ids"] = ids[:keep]
    text = tok.decode(before + ids[:keep], skip_special_tokens=params.get("skip_special_tokens", True))
    cut = text.find(matched)
    if cut >= 0:
        text = text[: cut + len(matched)] if params.get("no_stop_trim") else text[:cut]
    return text
