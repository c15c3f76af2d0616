"""The built-in tool task: multi-step arithmetic with a calculator the model calls.

A problem is two operations over three numbers (``"12+34*5="``, label ``"182"``). The calculator, ``calc``, works
out one operation of two integers per call (``{"expr": "34*5"}`` -> ``"170"``), so a problem takes two calls in
the order of precedence, then the answer. The conversation uses the tokenizer's chat template (run with
``--apply-chat-template``); calls are Qwen/Hermes ``<tool_call>`` blocks, each result a ``tool`` message:

    <|im_start|>user\\n12+34*5=<|im_end|>\\n<|im_start|>assistant\\n
    <tool_call>{"name": "calc", "arguments": {"expr": "34*5"}}</tool_call><|im_end|>   model, loss_mask 1
    \\n<|im_start|>tool\\n170<|im_end|>\\n<|im_start|>assistant\\n                          tool, loss_mask 0
    <tool_call>{"name": "calc", "arguments": {"expr": "12+170"}}</tool_call><|im_end|>  model
    \\n<|im_start|>tool\\n182<|im_end|>\\n<|im_start|>assistant\\n                          tool
    182<|im_end|>                                                                       model

``generate`` is the rollout hook (``--custom-generate-function-path slime_lite.rollout.calc_task.generate``): each
model turn is sent to the engine as token ids and kept as the engine's ids and log-probs, each tool turn is the
chat template's text for the result, tokenized, at loss_mask 0. ``--rollout-max-response-len`` bounds the whole
response (all turns); a sample that reaches it is TRUNCATED. ``reward`` (``--custom-rm-path
slime_lite.rollout.calc_task.reward``) is 1 when the last model turn is exactly the label. ``transcript`` is the
right conversation for a problem, which ``make-tiny-model --task tool_math`` warm-starts on (loss on the model
turns only).
"""

from __future__ import annotations

import functools
import re
from typing import Any

from slime_lite.rollout.rewards import addition_reward
from slime_lite.rollout.tool_calls import format_tool_call, inserted_text, parse_tool_calls
from slime_lite.rollout.turns import append_turn, turns
from slime_lite.tokenizer import EOS, load_tokenizer
from slime_lite.types import Sample, Status

TOOL = "calc"
END_OF_TURN = "<|im_end|>"
MAX_CALLS = 4  # calls per sample; a model still calling after them has no answer (reward 0)
_PROBLEM = re.compile(r"^(\d+)([-+*])(\d+)([-+*])(\d+)=$")
_ONE_OP = re.compile(r"^\s*(-?\d{1,12})\s*([-+*])\s*(-?\d{1,12})\s*$")
_APPLY = {"+": lambda x, y: x + y, "-": lambda x, y: x - y, "*": lambda x, y: x * y}


def calc(arguments: dict[str, Any]) -> tuple[str, bool]:
    """The calculator: ``{"expr": "a op b"}`` (integers, one of + - *) -> (result text, ok). Anything else gets an
    error text the model sees in its tool turn."""
    expr = arguments.get("expr")
    m = _ONE_OP.match(expr) if isinstance(expr, str) else None
    if m is None:
        return "error: expr must be one operation of two integers, e.g. 12*34", False
    return str(_APPLY[m.group(2)](int(m.group(1)), int(m.group(3)))), True


def solve(prompt: str) -> tuple[list[str], str]:
    """The calls a problem takes, in order of precedence, and its answer: ``"12+34*5="`` ->
    ``(["34*5", "12+170"], "182")``."""
    m = _PROBLEM.match(prompt)
    if m is None:
        raise ValueError(f"not a tool_math problem: {prompt!r}")
    a, op1, b, op2, c = m.groups()
    if op2 == "*" and op1 != "*":
        first = f"{b}*{c}"
        inner = calc({"expr": first})[0]
        steps = [first, f"{a}{op1}{inner}"]
    else:
        first = f"{a}{op1}{b}"
        inner = calc({"expr": first})[0]
        steps = [first, f"{inner}{op2}{c}"]
    return steps, calc({"expr": steps[1]})[0]


@functools.lru_cache(maxsize=4)
def _frames(tokenizer: Any) -> tuple[str, str, str, str]:
    """The chat template's text before and after a user prompt (with the generation prompt) and a tool result
    (after the model's turn), rendered once around placeholders: the warm start builds thousands of transcripts."""
    user, result = "\x00user\x00", "\x00result\x00"
    history: list[dict[str, Any]] = [{"role": "user", "content": user}]
    before, after = tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True).split(user)
    history.append({"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": TOOL, "arguments": {"expr": "1+1"}}}]})
    tool_before, tool_after = inserted_text(tokenizer, history, [{"role": "tool", "content": result}],
                                            END_OF_TURN).split(result)
    return before, after, tool_before, tool_after


def transcript(tokenizer: Any, prompt: str) -> list[tuple[str, bool]]:
    """The right conversation for a problem as the rollout builds it: (text, is a model turn) pieces, from the
    rendered prompt to the answer; joined, they are the chat template's rendering of the conversation."""
    steps, answer = solve(prompt)
    before, after, tool_before, tool_after = _frames(tokenizer)
    pieces = [(before + prompt + after, False)]
    for expr in steps:
        pieces.append((format_tool_call(TOOL, {"expr": expr}) + END_OF_TURN, True))
        pieces.append((tool_before + calc({"expr": expr})[0] + tool_after, False))
    pieces.append((answer + END_OF_TURN, True))
    return pieces


def tool_results(parsed: Any) -> tuple[list[dict[str, Any]], int]:
    """The tool messages answering one model turn's calls (a malformed call gets an error), and the errors."""
    out, errors = [], 0
    for call in parsed.calls:
        if call["name"] != TOOL:
            text, ok = f"error: unknown tool {call['name']!r}; the tool is {TOOL}", False
        else:
            text, ok = calc(call["arguments"])
        errors += not ok
        out.append({"role": "tool", "content": text})
    for _ in range(parsed.malformed):
        out.append({"role": "tool", "content": "error: malformed tool call; write " +
                    format_tool_call(TOOL, {"expr": "12*34"})})
        errors += 1
    return out, errors


@functools.lru_cache(maxsize=4)
def _tokenizer(path: str) -> Any:
    return load_tokenizer(path)


async def generate(args: Any, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    """One problem as a multi-turn sample: model turns from the engine, tool turns from ``calc``."""
    tok = _tokenizer(args.hf_checkpoint)
    end_id = tok.convert_tokens_to_ids(END_OF_TURN)
    budget = int(sampling_params["max_new_tokens"])
    messages: list[dict[str, Any]] = [{"role": "user", "content": sample.prompt}]
    calls = errors = malformed = cached = prompt_tokens = 0
    sample.status = Status.COMPLETED
    for turn in range(MAX_CALLS + 1):
        params = dict(sampling_params, max_new_tokens=budget - sample.response_length, no_stop_trim=True,
                      skip_special_tokens=False, stop_token_ids=[end_id])
        if params.get("sampling_seed") is not None:
            params["sampling_seed"] = int(params["sampling_seed"]) + 7919 * turn
        out = await args.engine_client.generate(
            {"input_ids": sample.tokens, "sampling_params": params, "return_logprob": True})
        meta = out["meta_info"]
        append_turn(sample, out["output_ids"], [float(t[0]) for t in meta["output_token_logprobs"]],
                    source="model", text=out["text"])
        if meta.get("weight_version") is not None:
            sample.weight_versions.append(str(meta["weight_version"]))
        cached += int(meta.get("cached_tokens") or 0)
        prompt_tokens += int(meta.get("prompt_tokens") or 0)
        sample.status = Status.from_finish_reason((meta.get("finish_reason") or {}).get("type"))
        parsed = parse_tool_calls(out["text"], strip=(END_OF_TURN, EOS))
        malformed += parsed.malformed
        if sample.status != Status.COMPLETED or not (parsed.calls or parsed.malformed) or turn == MAX_CALLS:
            break
        results, n_errors = tool_results(parsed)
        calls, errors = calls + len(parsed.calls), errors + n_errors
        messages.append({"role": "assistant", "content": parsed.content,
                         "tool_calls": [{"type": "function", "function": c} for c in parsed.calls]})
        text = inserted_text(tok, messages, results, END_OF_TURN)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        if sample.response_length + len(ids) >= budget:  # no room for the next model turn
            sample.status = Status.TRUNCATED
            break
        append_turn(sample, ids, source="tool", text=text)
        messages += results
    sample.prefix_cache_info.cached_tokens = cached
    sample.prefix_cache_info.total_prompt_tokens = prompt_tokens
    sample.metadata.update(tool_calls=calls, tool_errors=errors, malformed_tool_calls=malformed)
    return sample


def final_answer(sample: Sample) -> str | None:
    """The text of the sample's last model turn when it makes no call, else None."""
    model_turns = [t for t in turns(sample) if t["source"] == "model"]
    if not model_turns:
        return None
    parsed = parse_tool_calls(model_turns[-1]["text"] or "", strip=(END_OF_TURN, EOS))
    return None if parsed.calls or parsed.malformed else parsed.content


def reward(args: Any, sample: Sample, **kwargs: Any) -> float:
    """1.0 when the last model turn answers exactly the label (and makes no call), else 0.0."""
    answer = final_answer(sample)
    return 0.0 if answer is None or sample.label is None else addition_reward(answer, str(sample.label))
