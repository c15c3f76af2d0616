"""The project's Triton kernels on the CPU, in Triton's interpreter (``TRITON_INTERPRET=1``: a kernel's Python runs on
numpy, one program at a time). The variable is read when a kernel is defined, so each check runs in a fresh Python
process: ``run_interpreted("tests.backends.test_logprobs:_some_check")`` imports the module and calls the function.
The processes find Triton in ``TRITON_DIR`` (``scripts/setup.sh dev`` installs it there, out of site-packages: the
tests' own process stays without Triton, as the SGLang oracle expects); skipped where it is missing.

The interpreter's limits (Triton 3.9): bf16 values are kept as uint16, so ``tl.dot`` on bf16 is wrong and casts to
bf16 truncate instead of rounding; the checks run in float32 and float16, the GPU tests in bf16."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TRITON_DIR = ROOT / ".venv" / "triton-interpreter"


def run_interpreted(target: str, timeout: float = 600) -> str:
    """Run ``module:function`` with the Triton interpreter in a new process; fail with its output if it raises."""
    if not (TRITON_DIR / "triton").is_dir():
        pytest.skip(f"no Triton in {TRITON_DIR} (bash scripts/setup.sh dev installs it)")
    module, function = target.split(":")
    code = f"import {module} as m; m.{function}()"
    path = os.pathsep.join([str(ROOT), str(TRITON_DIR), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=False,
                       timeout=timeout)
    assert r.returncode == 0, f"{target} under TRITON_INTERPRET=1 failed:\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    return r.stdout
