"""Shared fixtures: a tiny random-init model checkpoint, built once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real Hugging Face Qwen2 checkpoint folder (char-level tokenizer, random init, ~1M params)."""
    from slime_lite.tiny_model import make_tiny_model

    out = tmp_path_factory.mktemp("tiny_model")
    make_tiny_model(out, warm_start_steps=0)
    return out
