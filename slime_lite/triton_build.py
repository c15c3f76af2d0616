"""How the project's Triton kernels are built: at their first use, once per process, and only where Triton is installed
(the CPU build has none; the callers then take their torch paths)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any


def triton_kernels(build: Callable[[Any, Any], Any]) -> Callable[[], Any]:
    """Decorates ``build(triton, tl)``, which defines the kernels and returns them: the decorated name becomes a
    function that returns what ``build`` returned, built at the first call and kept, or None without Triton. Built
    at the first call, not at import: ``TRITON_INTERPRET`` (the CPU tests) is read when a kernel is defined."""

    @functools.lru_cache(maxsize=1)
    def kernels() -> Any:
        try:
            import triton
            import triton.language as tl
        except ImportError:
            return None
        return build(triton, tl)

    return functools.update_wrapper(kernels, build)
