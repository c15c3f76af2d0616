"""Reward functions: ``--rm-type {addition,math,boxed_math,deepscaler}`` or ``--custom-rm-path module.fn`` (slime's
signature). ``deepscaler`` and ``boxed_math`` follow slime's rm_hub rules (the answer after the reasoning, in
``\\boxed{}``), graded by the same number-or-text comparison as ``math``.

A custom reward model is ``async def rm(args, sample, **kwargs) -> float | dict`` (a plain ``def`` works too).
A dict reward is stored whole in ``sample.reward`` and ``--reward-key`` picks the scalar the trainer uses.
"""

from __future__ import annotations

import functools
import numbers
import re
from fractions import Fraction
from typing import Any, Callable

from slime_lite.errors import SlimeLiteError
from slime_lite.hooks import call_maybe_async, load_hook
from slime_lite.types import Sample

RM_TYPES = ("addition", "math", "boxed_math", "deepscaler")
# End-of-text markers an engine may leave in the response text when it does not skip special tokens.
_EOS_STRINGS = ("<|endoftext|>", "<|im_end|>", "</s>", "<|eot_id|>")
_NUMBER = r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+"


def strip_response(text: str) -> str:
    """The response without surrounding whitespace and trailing end-of-text markers."""
    text = text.strip()
    changed = True
    while changed:
        changed = False
        for eos in _EOS_STRINGS:
            if text.endswith(eos):
                text, changed = text[: -len(eos)].rstrip(), True
    return text


def _label(sample: Sample) -> str:
    if sample.label is None:
        raise SlimeLiteError(
            f"sample {sample.index}: no label to score against; set --label-key to the data field holding it."
        )
    return str(sample.label).strip()


def addition_reward(response: str, label: str) -> float:
    """1.0 when the response (eos and whitespace stripped) is exactly the label, else 0.0."""
    return 1.0 if strip_response(response) == label.strip() else 0.0


def extract_final_answer(response: str) -> str | None:
    """The final answer of a math response: the last ``\\boxed{...}``, else a ``#### x`` answer, else the last number."""
    text = strip_response(response)
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    hashes = re.findall(r"####\s*(" + _NUMBER + ")", text)
    if hashes:
        return hashes[-1]
    numbers = re.findall(_NUMBER, text)
    return numbers[-1] if numbers else None


def _last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


_FRAC = re.compile(r"(-?)\\[dt]?frac(?:\{(-?\d+)\}|(\d))(?:\{(\d+)\}|(\d))")  # \frac{1}{2}, -\dfrac12
_THOUSANDS = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")  # 1,234,567.5: the only commas a number has
_LATEX_NOISE = ("$", "\\!", "\\,", "\\;", "\\ ", "\\left", "\\right", "^{\\circ}", "^\\circ", "\\%", "%")


def _to_number(text: str) -> Fraction | None:
    """The number an answer or label writes (a LaTeX fraction, a thousands-separated or signed number, ``$...$``,
    a percent or degree sign, an ``x = `` in front), else None."""
    text = text.strip().replace("\u2212", "-")
    for noise in _LATEX_NOISE:
        text = text.replace(noise, "")
    text = re.sub(r"^[A-Za-z]\w?\s*=\s*", "", text.strip()).rstrip(".,").strip()
    if "," in text:
        if not _THOUSANDS.fullmatch(text):
            return None  # "3,4" is two numbers, not 34
        text = text.replace(",", "")
    frac = _FRAC.fullmatch(text)
    if frac:
        sign, num, den = frac.group(1), frac.group(2) or frac.group(3), frac.group(4) or frac.group(5)
        text = f"{sign}{num}/{den}" if not (sign and num.startswith("-")) else f"{num[1:]}/{den}"
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def math_reward(response: str, label: str) -> float:
    """1.0 when the final answer equals the label as a number (or as text when either is not a number)."""
    answer = extract_final_answer(response)
    if answer is None:
        return 0.0
    got, want = _to_number(answer), _to_number(label)
    if got is None or want is None:
        return 1.0 if answer.strip() == label.strip() else 0.0
    return 1.0 if got == want else 0.0


def _same_answer(answer: str, label: str) -> float:
    got, want = _to_number(answer), _to_number(label)
    if got is None or want is None:
        return 1.0 if answer.strip() == label.strip() else 0.0
    return 1.0 if got == want else 0.0


def boxed_math_reward(response: str, label: str) -> float:
    """slime's ``boxed_math``: only the last ``\\boxed{...}`` of the response counts (none: 0.0)."""
    answer = _last_boxed(strip_response(response))
    return 0.0 if answer is None else _same_answer(answer, label)


def deepscaler_reward(response: str, label: str) -> float:
    """slime's ``deepscaler`` rule: the solution is what follows ``</think>`` (or ``###Response``); 1.0 when its last
    ``\\boxed{...}`` equals the label (itself unboxed if it is boxed), else 0.0; no reasoning end marker is 0.0."""
    if "</think>" in response:
        solution = response.split("</think>")[-1]
    elif "###Response" in response:
        solution = response.split("###Response")[1]
    else:
        return 0.0
    answer = _last_boxed(solution)
    label = _last_boxed(label) or label if "\\boxed" in label else label
    if answer is None or not label.strip():
        return 0.0
    return _same_answer(answer, label)


_BUILTIN: dict[str, Callable[[str, str], float]] = {"addition": addition_reward, "math": math_reward,
                                                    "boxed_math": boxed_math_reward, "deepscaler": deepscaler_reward}


@functools.lru_cache(maxsize=None)
def _custom_rm(path: str) -> Callable[..., Any]:
    return load_hook(path, "--custom-rm-path")


async def compute_reward(args: Any, sample: Sample, **kwargs: Any) -> float | dict:
    """The reward of one sample: ``--custom-rm-path`` when set, else the built-in ``--rm-type``."""
    custom = args.custom_rm_path
    if custom:
        reward = await call_maybe_async(_custom_rm(custom), args, sample, **kwargs)
        if isinstance(reward, dict):
            return reward
        if not isinstance(reward, numbers.Real):
            raise SlimeLiteError(
                f"--custom-rm-path {custom}: returned {type(reward).__name__}; it must return a float or a dict."
            )
        return float(reward)
    rm_type = args.rm_type
    if rm_type not in _BUILTIN:
        raise SlimeLiteError(
            f"--rm-type {rm_type!r}: unknown reward type; choose one of {', '.join(RM_TYPES)} "
            "or give --custom-rm-path module.fn."
        )
    return _BUILTIN[rm_type](sample.response, _label(sample))
