"""Checks on the values a client sends, made before a request is admitted.

Each check returns the value in the type the engine uses, or raises ``ValueError`` whose message starts with the
field's name (the routes answer it as HTTP 400). JSON brings arbitrary-size integers, NaN and Infinity (Python's
``json`` accepts them) and ``true``/``false`` where numbers are expected: numbers must be finite, integers must fit
a machine integer (int64, seeds uint64), and booleans are not numbers.
"""

from __future__ import annotations

import math
from typing import Any

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
UINT64_MAX = (1 << 64) - 1
MAX_N = 256  # samples per prompt (sampling_params.n)
MAX_SEQUENCES = 4096  # prompts x n in one HTTP request
MAX_STOP = 256  # stop strings per request (each one is searched for after every token)


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
