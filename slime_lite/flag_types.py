"""The argparse types of the flags: a number in the range the run can use, else a message argparse prints naming
the flag."""

from __future__ import annotations

import argparse
import math


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def nonneg_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {value}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {value}")
    return value


def unit_float(text: str) -> float:
    """In [0, 1) (Adam's betas)."""
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {value}")
    return value


def fraction(text: str) -> float:
    """In [0, 1] (a discount, GAE's lambda)."""
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {value}")
    return value


def nonneg_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def top_k(text: str) -> int:
    """SGLang's top_k: -1 (off) or at least 1."""
    value = int(text)
    if value != -1 and value < 1:
        raise argparse.ArgumentTypeError(f"must be -1 (off) or >= 1, got {value}")
    return value


def nonempty(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("must not be empty")
    return text
