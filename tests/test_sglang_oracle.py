"""The SGLang oracle harness (tests/sglang_oracle.py): the real pinned sglang imports on CPU, and its fakes stay
inside it (the same pytest process goes on importing torch/transformers as if SGLang had never been loaded)."""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import sys

import pytest

from tests import sglang_oracle as oracle


def test_the_pinned_sglang_is_the_real_package():
    oracle.require_sglang()
    from slime_lite.backends.sglang.launcher import SGLANG_VERSION

    mod = oracle.sglang_module("sglang.srt.server_args")
    assert importlib.metadata.version("sglang") == SGLANG_VERSION
    assert "site-packages" in mod.__file__ and "sglang_oracle" not in mod.__file__
    args = oracle.parse_server_args(["--model-path", "/nonexistent/model", "--tp", "2"])
    assert args.tp_size == 2  # SGLang's own argparse (prefix matching included) filled its own ServerArgs


def test_the_docker_image_is_built_on_the_pinned_sglang():
    """The GPU image's SGLang is the version whose flags and request objects the CPU tests check against."""
    from pathlib import Path

    from slime_lite.backends.sglang.launcher import SGLANG_VERSION

    dockerfile = (Path(__file__).parents[1] / "docker" / "Dockerfile").read_text()
    assert f"ARG SGLANG_IMAGE=lmsysorg/sglang:v{SGLANG_VERSION}\n" in dockerfile


def test_fakes_do_not_leak_into_the_rest_of_the_process():
    oracle.require_sglang()
    oracle.sglang_module("sglang.srt.managers.io_struct")  # the import that needs the most fakes but xgrammar
    leaked = [m for m in sys.modules if m.split(".", 1)[0] in oracle.FAKED_MODULES]
    assert leaked == []
    # SGLang's import sets cache folders for its GPU kernels; they must not reach processes later tests start
    assert "sglang" not in os.environ.get("TRITON_CACHE_DIR", "") + os.environ.get("TORCHINDUCTOR_CACHE_DIR", "")
    for name in oracle.FAKED_MODULES:
        if name in ("IPython",):
            continue  # may be really installed on a developer machine
        assert importlib.util.find_spec(name) is None, name
        with pytest.raises(ImportError):
            __import__(name)
    from torch.utils import _triton
    from transformers.utils import import_utils

    assert not _triton.has_triton_package()
    assert not import_utils.is_torchvision_available()
    import torch

    assert float(torch.ones(3).sum()) == 3.0  # torch itself still works in this process
