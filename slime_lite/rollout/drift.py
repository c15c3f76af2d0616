"""Token-level truth of multi-turn samples: are the training tokens the tokens the engine generated, and does the
loss mask train exactly the model's tokens?

- Drift: the sample's tokens against its text: the prompt and each inserted turn re-tokenised, each model turn
  decoded (the engine's ids need not be the canonical tokenisation of their text, so they are not re-tokenised; the
  text may end inside the last token, where the engine cut it at a stop string),
  and for chat samples (``metadata["messages"]``, the conversation as OpenAI messages) the tokenizer's chat template
  re-rendered over the conversation. A difference means someone rebuilt tokens from text (a hook that re-tokenised
  a turn, a hand-written template) and the tokens trained are not those generated or those the template gives. Each drifting sample is reported with the first position that differs and the text
  around it on both sides.
- Mask: model turns whose tokens are all masked (never trained), and tokens trained (mask 1) with no engine log-prob:
  inserted turns left trainable, or a sample without rollout log-probs.

Only samples with turns (``metadata["turns"]``) are checked: a single-turn sample is the engine's output as is.
``rollout_metrics`` gives ``rollout/token_drift_samples``, ``rollout/masked_model_turns`` and
``rollout/trained_tokens_without_engine_logprob`` every rollout (``--ci-test`` and the doctor check them), with up
to three examples each.
"""

from __future__ import annotations

from typing import Any

from slime_lite.rollout.turns import AGE_MASKED, turns
from slime_lite.types import Sample

EXAMPLES = 3
AROUND = 12  # tokens of context shown each side of a difference


def _first_difference(a: Any, b: Any) -> int | None:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), None if len(a) == len(b) else n)


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _where(sample: Sample, position: int) -> str:
    start = sample.prompt_length
    if position < start:
        return "the prompt"
    for k, t in enumerate(turns(sample)):
        if position < start + t["start"] + t["length"]:
            return f"turn {k} ({t['source']})"
    return "past the end"


def _token_at_char(tokenizer: Any, tokens: list[int], char: int) -> int:
    """The index of the token whose text holds character ``char`` of ``decode(tokens)``."""
    lo, hi = 0, len(tokens)
    while lo < hi:  # the smallest k with len(decode(tokens[:k + 1])) > char
        mid = (lo + hi) // 2
        if len(tokenizer.decode(tokens[:mid + 1])) > char:
            hi = mid
        else:
            lo = mid + 1
    return min(lo, max(len(tokens) - 1, 0))


def _report(sample: Sample, position: int, check: str, trained: str, expected: str) -> dict[str, Any]:
    return {"sample": sample.index, "position": position, "in": _where(sample, position), "check": check,
            "trained": trained, "retokenized": expected}


def _token_report(sample: Sample, tokenizer: Any, offset: int, got: list[int], want: list[int],
                  check: str) -> dict[str, Any] | None:
    p = _first_difference(got, want)
    if p is None:
        return None
    lo, hi = max(0, p - AROUND), p + AROUND
    return _report(sample, offset + p, check, tokenizer.decode(got[lo:hi]), tokenizer.decode(want[lo:hi]))


def _text_report(sample: Sample, tokenizer: Any, offset: int, tokens: list[int], got: str, want: str,
                 check: str, prefix: bool = False) -> dict[str, Any] | None:
    if prefix:
        got, want = got[:len(want)], want[:len(got)]
    c = _first_difference(got, want)
    if c is None:
        return None
    lo, hi = max(0, c - AROUND), c + AROUND
    return _report(sample, offset + _token_at_char(tokenizer, tokens, c), check, got[lo:hi], want[lo:hi])


def token_drift(sample: Sample, tokenizer: Any,
                template_kwargs: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The first place where the sample's tokens differ from its text, as a report dict (None when they agree).

    The prompt and inserted turns were tokenised from their text: their tokens must be what re-tokenising it gives.
    A model turn's tokens are the engine's ids, which need not be the canonical tokenisation of their text: they
    must decode to the turn's text. A chat sample (``metadata["messages"]``) must read as the tokenizer's chat
    template over its conversation, with its tools and the run's ``template_kwargs`` (--apply-chat-template-kwargs)."""
    start = sample.prompt_length
    tokens = list(sample.tokens)
    prompt_text = sample.metadata.get("prompt_text")
    if prompt_text is not None:
        r = _token_report(sample, tokenizer, 0, tokens[:start], _encode(tokenizer, prompt_text), "re-tokenised text")
        if r is not None:
            return r
    for t in turns(sample):
        if t.get("text") is None:
            continue
        lo = start + t["start"]
        piece = tokens[lo:lo + t["length"]]
        if t["source"] == "model":
            decoded, text = tokenizer.decode(piece), t["text"]
            if decoded != text and decoded.startswith(text) and text.startswith(tokenizer.decode(piece[:-1])):
                continue  # the engine's text cut at a stop string that ends inside the turn's last token
            r = _text_report(sample, tokenizer, lo, piece, decoded, text, "decoded model turn")
        else:
            r = _token_report(sample, tokenizer, lo, piece, _encode(tokenizer, t["text"]), "re-tokenised text")
        if r is not None:
            return r
    messages = sample.metadata.get("messages")
    if messages:
        rendered = tokenizer.apply_chat_template(messages, tools=sample.metadata.get("tools"), tokenize=False,
                                                 add_generation_prompt=False, **(template_kwargs or {}))
        return _text_report(sample, tokenizer, 0, tokens, tokenizer.decode(tokens), rendered,
                            "re-rendered chat template", prefix=True)
    return None


def mask_problems(sample: Sample) -> tuple[list[int], list[int]]:
    """(model turns whose tokens are all masked, not for the age of their weights; response positions trained
    without an engine log-prob)."""
    mask = sample.loss_mask if sample.loss_mask is not None else [1] * sample.response_length
    aged = set(sample.metadata.get(AGE_MASKED, ()))  # --max-weight-staleness mask, --mask-offpolicy-in-partial-rollout
    masked_turns, no_logprob = [], []
    for k, t in enumerate(turns(sample)):
        span = range(t["start"], t["start"] + t["length"])
        if (t["source"] == "model" and t["length"] and not any(mask[i] for i in span)
                and not any(i in aged for i in span)):
            masked_turns.append(k)
        if t["source"] != "model":
            no_logprob += [i for i in span if mask[i]]
    if sample.rollout_log_probs is None:
        no_logprob = [i for i, m in enumerate(mask) if m]
    return masked_turns, sorted(set(no_logprob))


def rollout_metrics(samples: list[Sample], tokenizer: Any,
                    template_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    """The two checks over a rollout's multi-turn samples; {} when none has turns. Beside each count,
    ``rollout/<check>/examples``: up to three lines naming the sample and where (read by --ci-test and the
    doctor)."""
    checked = [s for s in samples if s.metadata.get("turns")]
    if not checked:
        return {}
    drift, masked, untrained = [], [], []
    n_masked = n_untrained = 0
    for s in checked:
        r = token_drift(s, tokenizer, template_kwargs)
        if r is not None:
            drift.append(f"sample {r['sample']} token {r['position']} ({r['in']}, {r['check']}): trained "
                         f"{r['trained']!r}, expected {r['retokenized']!r}")
        turns_masked, positions = mask_problems(s)
        n_masked += len(turns_masked)
        n_untrained += len(positions)
        if turns_masked:
            texts = [turns(s)[k].get("text") for k in turns_masked]
            masked.append(f"sample {s.index} model turns {turns_masked} (text {texts[:2]!r})")
        if positions:
            where = sorted({_where(s, s.prompt_length + p) for p in positions})
            untrained.append(f"sample {s.index}: {len(positions)} tokens from response position {positions[0]} "
                             f"in {', '.join(where)}")
    out: dict[str, Any] = {"rollout/token_drift_samples": float(len(drift)),
                           "rollout/masked_model_turns": float(n_masked),
                           "rollout/trained_tokens_without_engine_logprob": float(n_untrained)}
    for key, found in (("token_drift", drift), ("masked_model_turns", masked),
                       ("trained_tokens_without_engine_logprob", untrained)):
        if found:
            out[f"rollout/{key}/examples"] = found[:EXAMPLES]
    return out
