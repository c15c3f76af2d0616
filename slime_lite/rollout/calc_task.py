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
chat template's text for the result, tokenized, at loss_mask 0 (one over ``--max-inserted-tokens-per-turn`` is cut in
its results, never in the end of turn and generation prompt after them). ``--rollout-max-response-len`` bounds the
whole response (all turns); a sample that reaches it is TRUNCATED; a model still calling at ``--max-turns`` has no
answer. ``reward`` (``--custom-rm-path slime_lite.rollout.calc_task.reward``) is 1 when the last model turn is
exactly the label. ``transcript`` is the right conversation for a problem, which ``make-tiny-model --task
tool_math`` warm-starts on (loss on the model turns only).
"""

from __future__ import annotations

import functools
import re
from typing import Any

from slime_lite.rollout.multi_turn import (ToolError, TurnLimits, call_tool, can_continue, cut_inserted, fail,
                                           insert_turn, model_turn)
from slime_lite.rollout.rewards import addition_reward
from slime_lite.rollout.tool_calls import format_tool_call, inserted_text, parse_tool_calls
from slime_lite.rollout.turns import restart, turns
from slime_lite.tokenizer import EOS, load_tokenizer
from slime_lite.types import Sample, Status

TOOL = "calc"
END_OF_TURN = "<|im_end|>"
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


def run_calc(call: dict[str, Any]) -> tuple[str, bool]:
    """One parsed call -> (result text, ok): the calculator, or an error naming the one tool there is."""
    if call["name"] != TOOL:
        return f"error: unknown tool {call['name']!r}; the tool is {TOOL}", False
    return calc(call["arguments"])


_MARK = "\x00end of the results\x00"


def _tool_turn(tok: Any, messages: list[dict[str, Any]], results: list[dict[str, Any]], closed: bool,
               template_kwargs: dict[str, Any]) -> tuple[str, str]:
    """The tool turn's text split after the last result: (the results, the template's text after them: the end of
    the turn and the next generation prompt), which --max-inserted-tokens-per-turn never cuts. (text, "") where the
    template does not render a result as it is."""
    text = inserted_text(tok, messages, results, END_OF_TURN, closed=closed, template_kwargs=template_kwargs)
    marked = results[:-1] + [dict(results[-1], content=results[-1]["content"] + _MARK)]
    head, _, end = inserted_text(tok, messages, marked, END_OF_TURN, closed=closed,
                                 template_kwargs=template_kwargs).partition(_MARK)
    return (head, end) if head + end == text else (text, "")


@functools.lru_cache(maxsize=4)
def _tokenizer(path: str) -> Any:
    return load_tokenizer(path)


async def generate(args: Any, sample: Sample, sampling_params: dict[str, Any], evaluation: bool = False) -> Sample:
    """One problem as a multi-turn sample: model turns from the engine, tool turns from ``calc`` (the multi_turn
    helpers: --max-turns, --tool-call-timeout, --rollout-max-context-len apply)."""
    tok = _tokenizer(args.hf_checkpoint)
    limits = TurnLimits.from_args(args, evaluation)  # an eval sample: --eval-max-context-len
    budget = int(sampling_params["max_new_tokens"])
    params = dict(sampling_params, no_stop_trim=True, skip_special_tokens=False,
                  stop_token_ids=sorted({tok.convert_tokens_to_ids(END_OF_TURN),
                                         *(sampling_params.get("stop_token_ids") or [])}))
    if sample.status is Status.ABORTED:  # carried by --partial-rollout mid-trajectory: generated again
        restart(sample)
    messages: list[dict[str, Any]] = [{"role": "user", "content": sample.prompt}]
    sample.metadata.update(tool_calls=0, tool_errors=0, malformed_tool_calls=0)
    while can_continue(sample, limits):
        turn = dict(params, max_new_tokens=budget - sample.response_length)
        await model_turn(args, sample, turn, limits)  # (each turn its own sampling seed)
        parsed = parse_tool_calls(sample.metadata["turns"][-1]["text"] or "", strip=(END_OF_TURN, EOS))
        sample.metadata["malformed_tool_calls"] += parsed.malformed
        if (sample.status != Status.COMPLETED or not (parsed.calls or parsed.malformed)
                or not can_continue(sample, limits)):
            break  # an answer, a turn cut short, or no turn left to answer a tool result in
        results = []
        for call in parsed.calls:
            try:
                text, ok = await call_tool(sample, run_calc, call, timeout=limits.tool_timeout)
            except ToolError as exc:
                return fail(sample, str(exc))
            sample.metadata["tool_errors"] += not ok
            results.append({"role": "tool", "content": text})
        for _ in range(parsed.malformed):
            sample.metadata["tool_errors"] += 1
            results.append({"role": "tool", "content": "error: malformed tool call; write "
                            + format_tool_call(TOOL, {"expr": "12*34"})})
        messages.append({"role": "assistant", "content": parsed.content,
                         "tool_calls": [{"type": "function", "function": c} for c in parsed.calls]})
        # a turn that ended at EOS or a stop string, not at the end of turn, gets it before the tool turn (as the
        # template renders the conversation)
        closed = sample.tokens[-1] == tok.convert_tokens_to_ids(END_OF_TURN)
        text, end = _tool_turn(tok, messages, results, closed, args.apply_chat_template_kwargs)
        kept = len(cut_inserted(tok, text, limits.max_inserted_tokens, end)[0])  # as insert_turn cuts it
        if sample.response_length + kept >= budget:
            sample.status = Status.TRUNCATED  # no room left for the next model turn
            break
        insert_turn(sample, tok, text, limits, source="tool", suffix=end)
        messages += results
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
