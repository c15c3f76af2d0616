"""--deterministic-mode (slime's name): what each process sets so two runs with the same seeds are bitwise equal.

The trainer and the embedded engines call ``set_deterministic`` first thing; the rollout manager sends a rollout's
groups to the engines in one fixed order (rollout/generate.py) and leaves wall-clock values out of the dumps. What
this does and does not make deterministic on CUDA is measured in BENCHMARKS.md ("Deterministic mode").
"""

from __future__ import annotations

import os


def set_deterministic() -> None:
    """--deterministic-mode in this process (before its first CUDA call): deterministic torch algorithms (an op
    without a deterministic implementation raises instead of warning), cuDNN without autotuning, and the cuBLAS
    workspace setting that deterministic cuBLAS needs."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import torch  # torch: the flag parser reads this module

    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
