"""Multi-turn rollouts against the engines, token in and token out: the building blocks of a generate hook (or the
agent endpoint, or the tool task) that alternates model turns with tool or environment output.

- ``model_turn`` sends the sample's tokens so far as ``input_ids`` (never text: training tokens are the engine's own
  ids) and appends the engine's ids and log-probs as a model turn (with --use-rollout-routing-replay, its table of
  routed experts, which covers every token so far, becomes the sample's). The engine's prefix cache holds the KV of the
  conversation so far, so a turn prefills only its new tokens: each turn record keeps the engine's
  ``cached_tokens`` and ``prompt_tokens``.
- ``insert_turn`` appends tool or environment text (tokenised once, mask 0), cut to ``--max-inserted-tokens-per-turn``
  (its ``suffix``, the chat template's text after the output, is never cut).
- ``call_tool`` runs one tool call under ``--tool-call-timeout`` and counts calls and errors in the metadata.
- ``restart`` (``turns``'): a sample ``--partial-rollout`` carried aborted (status ABORTED, in the middle of a
  trajectory a hook cannot resume) back to its prompt, to be generated again; the tokens dropped count as wasted.
- The limits: ``--max-turns`` model turns, and ``--rollout-max-context-len`` tokens in all (prompt included; at most
  the model's ``max_position_embeddings`` - 1, what the engine serves): a sample that would overflow it ends
  TRUNCATED. A tool that raises or hangs ends its sample FAILED with the reason in ``metadata["failure"]``; the
  rollout goes on.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable

from slime_lite.rollout.turns import routed_experts
from slime_lite.rollout.turns import INSERTED_CUT, append_turn, restart  # noqa: F401  (restart: the hooks' name)
from slime_lite.types import Sample, Status, version_number


class ToolError(RuntimeError):
    """A tool call that raised or ran past its timeout (the message is the reason kept in the sample)."""


class ExitCalled(RuntimeError):
    """sys.exit() called by a tool or an agent (argparse does on bad arguments), as an ordinary error: a SystemExit
    let out of a task stops the rollout's whole event loop (asyncio raises it out of the loop), not only its sample."""


async def no_exit(awaitable: Any, who: str) -> Any:
    """``await awaitable``, a SystemExit out of it raised as ExitCalled naming ``who`` (KeyboardInterrupt goes on)."""
    try:
        return await awaitable
    except SystemExit as exc:
        raise ExitCalled(f"{who} called sys.exit({exc.code!r})") from exc


@functools.lru_cache(maxsize=None)
def _model_context(hf_checkpoint: str) -> int | None:
    with open(os.path.join(hf_checkpoint, "config.json"), encoding="utf-8") as f:
        value = json.load(f).get("max_position_embeddings")
    return value if isinstance(value, int) and value > 0 else None


@dataclass(frozen=True)
class TurnLimits:
    max_turns: int
    max_inserted_tokens: int
    max_context_len: int | None
    tool_timeout: float

    @classmethod
    def from_args(cls, args: Any, evaluation: bool = False) -> "TurnLimits":
        return cls(args.max_turns, args.max_inserted_tokens_per_turn, context_bound(args, evaluation),
                   args.tool_call_timeout)


def context_bound(args: Any, evaluation: bool = False) -> int | None:
    """Tokens a multi-turn sample may hold, prompt included: ``--rollout-max-context-len`` (an eval sample's:
    ``--eval-max-context-len``, else that), and below the model's context: the engine (as SGLang) refuses a request
    whose input + max_new_tokens reach ``max_position_embeddings``, so a sample holds one token less."""
    limit = args.rollout_max_context_len
    if evaluation and args.eval_max_context_len is not None:
        limit = args.eval_max_context_len
    try:
        model = _model_context(args.hf_checkpoint)
    except OSError:
        if limit is None:
            raise
        model = None
    bounds = [b for b in (limit, None if model is None else model - 1) if b is not None]
    return min(bounds) if bounds else None


def model_turns(sample: Sample) -> int:
    return sum(1 for t in sample.metadata.get("turns", []) if t["source"] == "model")


CONTEXT_FULL = "--rollout-max-context-len"  # metadata["truncated_by"] of a sample whose context is full


def can_continue(sample: Sample, limits: TurnLimits) -> bool:
    """Another model turn is allowed: the sample has not failed or been aborted, its context is not full, and it
    has fewer than ``--max-turns`` model turns. (A turn that stopped at its own ``max_new_tokens`` leaves the sample
    TRUNCATED until the next turn: the status is always the last turn's.)"""
    return (sample.status not in (Status.FAILED, Status.ABORTED) and "truncated_by" not in sample.metadata
            and model_turns(sample) < limits.max_turns)


def turn_seed(seed: int, turn: int) -> int:
    """The sampling seed of a sample's ``turn``-th model turn (0: the first, which keeps ``seed``)."""
    return seed + 7919 * turn


def cap_min_new_tokens(params: dict[str, Any]) -> None:
    """A turn's min_new_tokens (--eval-min-new-tokens) at most its max_new_tokens, which a turn lowers to the room
    left: the engine (as SGLang) refuses a minimum above the maximum."""
    if params.get("min_new_tokens") and params.get("max_new_tokens") is not None:
        params["min_new_tokens"] = min(int(params["min_new_tokens"]), int(params["max_new_tokens"]))


def _context_full(sample: Sample) -> Sample:
    sample.status = Status.TRUNCATED
    sample.metadata["truncated_by"] = CONTEXT_FULL
    return sample


async def model_turn(args: Any, sample: Sample, sampling_params: dict[str, Any], limits: TurnLimits) -> Sample:
    """One model turn: generate from the sample's tokens, append the engine's ids and log-probs. The sample's status
    is the turn's finish reason (COMPLETED on a stop, TRUNCATED on its length limit); a full context also sets
    ``metadata["truncated_by"]`` and ends the sample. A ``sampling_seed`` is the first turn's: each later turn
    draws from its own (the engine's draws restart with every request, so one seed gave every turn the same)."""
    room = None if limits.max_context_len is None else limits.max_context_len - len(sample.tokens)
    if room is not None and room <= 0:
        return _context_full(sample)
    params = dict(sampling_params)
    if params.get("sampling_seed") is not None:
        params["sampling_seed"] = turn_seed(int(params["sampling_seed"]), model_turns(sample))
    if room is not None:
        asked = params.get("max_new_tokens")  # 0 is 0 tokens (a spent budget), None is up to the context
        params["max_new_tokens"] = room if asked is None else min(int(asked), room)
    cap_min_new_tokens(params)
    routing = bool(args.use_rollout_routing_replay)  # the table of every token so far
    out = await args.engine_client.generate({"input_ids": list(sample.tokens), "sampling_params": params,
                                             "return_logprob": True, "return_routed_experts": routing})
    meta = out["meta_info"]
    ids = [int(t) for t in out["output_ids"]]
    logprobs = [float(t[0]) for t in meta.get("output_token_logprobs") or []]
    version = meta.get("weight_version")
    per_token = meta.get("output_token_weight_versions")  # a request in flight across a push spans two versions
    versions = ([version_number(str(v)) for v in per_token] if per_token is not None and len(per_token) == len(ids)
                else None if version is None else [version_number(str(version))] * len(ids))
    append_turn(sample, ids, logprobs if len(logprobs) == len(ids) else None, text=out["text"], versions=versions)
    turn = sample.metadata["turns"][-1]
    turn["sampling_params"] = params  # what send-to-engine resends this turn with
    turn["cached_tokens"] = int(meta.get("cached_tokens") or 0)
    turn["prompt_tokens"] = int(meta.get("prompt_tokens") or len(sample.tokens) - len(ids))
    sample.prefix_cache_info.add(meta)
    if meta.get("routed_experts") is not None:
        sample.rollout_routed_experts = routed_experts(meta["routed_experts"])
    if version is not None:
        sample.weight_versions.append(str(version))
    sample.status = Status.from_finish_reason((meta.get("finish_reason") or {}).get("type"))
    if room is not None and len(ids) >= room:
        _context_full(sample)
    return sample


def insert_turn(sample: Sample, tokenizer: Any, text: str, limits: TurnLimits, source: str = "tool",
                suffix: str = "") -> Sample:
    """Append inserted text (a tool's or the environment's) then ``suffix``, tokenised once, mask 0, cut to
    ``--max-inserted-tokens-per-turn`` tokens (``cut_inserted``); when it would overflow ``--rollout-max-context-len``
    what fits is appended and the sample ends TRUNCATED. A cut turn keeps the text of the tokens it kept (never half
    a character)."""
    tokens, text, cut = cut_inserted(tokenizer, text, limits.max_inserted_tokens, suffix)
    if limits.max_context_len is not None and len(sample.tokens) + len(tokens) >= limits.max_context_len:
        room = max(0, limits.max_context_len - len(sample.tokens))
        if len(tokens) > room:  # the sample ends here: no next turn needs the suffix
            kept, text = _cut(tokenizer, tokens, room)
            cut, tokens = cut + len(tokens) - len(kept), kept
        _context_full(sample)
    if cut:
        sample.metadata[INSERTED_CUT] = sample.metadata.get(INSERTED_CUT, 0) + cut
    return append_turn(sample, tokens, source=source, text=text)


def cut_inserted(tokenizer: Any, text: str, max_tokens: int, suffix: str = "") -> tuple[list[int], str, int]:
    """``text + suffix`` tokenised and cut to ``max_tokens`` (--max-inserted-tokens-per-turn) -> (the tokens kept,
    their text, the tokens cut). Only ``text`` is cut: ``suffix``, the chat template's text after a tool's output (the
    end of the turn, the next generation prompt), is kept whole, so the model's next turn still follows it (the
    suffix alone may be longer than ``max_tokens``)."""
    tokens = tokenizer(text + suffix, add_special_tokens=False)["input_ids"]
    if len(tokens) <= max_tokens:
        return tokens, text + suffix, 0
    if not suffix:
        kept, text = _cut(tokenizer, tokens, max_tokens)
        return kept, text, len(tokens) - len(kept)
    head = tokenizer(text, add_special_tokens=False)["input_ids"]
    tail = tokenizer(suffix, add_special_tokens=False)["input_ids"]
    kept, text = _cut(tokenizer, head, max(0, max_tokens - len(tail)))
    return kept + tail, text + suffix, len(head) - len(kept)


def _cut(tokenizer: Any, tokens: list[int], keep: int) -> tuple[list[int], str]:
    """The first ``keep`` of ``tokens`` and their text; a cut inside a character (byte-level tokens) goes back to its
    start, so the kept text is whole and tokenizes to the kept tokens again."""
    cut = tokens[:keep]
    text = tokenizer.decode(cut)
    for _ in range(3):
        if not (cut and text.endswith("\ufffd")):
            break
        cut = cut[:-1]
        text = tokenizer.decode(cut)
    return cut, text


async def call_tool(sample: Sample, fn: Callable[..., Any], *args: Any, timeout: float) -> Any:
    """Run ``fn(*args)`` (plain or async; a plain one in a thread; what it returns awaited when awaitable: a lambda
    around an async call) under ``timeout`` seconds. Counts ``metadata["tool_calls"]`` and
    ``metadata["tool_errors"]``; a raise (sys.exit() too) or a timeout is a ToolError naming it."""
    sample.metadata["tool_calls"] = sample.metadata.get("tool_calls", 0) + 1
    name = getattr(fn, "__name__", type(fn).__name__)

    async def run() -> Any:
        is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))
        out = fn(*args) if is_async else await _own_thread(fn, *args)
        return await out if inspect.isawaitable(out) else out

    try:
        return await asyncio.wait_for(no_exit(run(), f"tool {name}"), timeout)
    except asyncio.TimeoutError:
        reason = f"tool {name} did not return within --tool-call-timeout {timeout:g} s"
    except ExitCalled as exc:
        reason = str(exc)
    except Exception as exc:  # noqa: BLE001 - any tool failure ends this sample, not the run
        reason = f"tool {name} raised {type(exc).__name__}: {exc}"
    sample.metadata["tool_errors"] = sample.metadata.get("tool_errors", 0) + 1
    raise ToolError(reason)


def _own_thread(fn: Callable[..., Any], *args: Any) -> asyncio.Future:
    """``fn(*args)`` in a daemon thread of its own, as a future of this loop: not asyncio's shared pool, where tools
    that hang past their timeout would keep its few threads and make every later call wait (and time out)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(out: Any, exc: BaseException | None) -> None:
        if not future.done():  # not timed out (cancelled) meanwhile
            future.set_exception(exc) if exc is not None else future.set_result(out)

    def body() -> None:
        try:
            out, exc = fn(*args), None
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
            out, exc = None, e
        try:
            loop.call_soon_threadsafe(settle, out, exc)
        except RuntimeError:  # the loop closed while the tool ran
            pass

    threading.Thread(target=body, name="slime-lite-tool", daemon=True).start()
    return future


def fail(sample: Sample, reason: str) -> Sample:
    """End the sample FAILED with ``reason`` in ``metadata["failure"]`` (its turns so far are kept)."""
    sample.status = Status.FAILED
    sample.metadata["failure"] = reason
    return sample

