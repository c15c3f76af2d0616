"""Fixtures for the embedded engine tests: an in-process engine on a free port and an HF reference model."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # test files import engine_helpers in any pytest import mode

from engine_helpers import start_engine  # noqa: E402


@pytest.fixture(scope="session")
def engine(tiny_model_dir):
    """A shared engine for tests that do not change its weights or settings."""
    server = start_engine(tiny_model_dir, max_running_requests=8)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def hf_model(tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
