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


# counters of the kernels whose last program to finish a piece of work completes it (split-K products, split
# attention), per (device, stream), all zero between kernels (each resets the ones it used): kernels of one stream run
# one after the other (with PDL too, a kernel counts only after its wait); never replaced, as captured graphs keep
# their address
_COUNTERS: dict[tuple[Any, int], Any] = {}
COUNTERS = 1 << 16


def counters(t: Any) -> Any:
    """The ``COUNTERS`` int32 counters (zeros) for kernels on ``t``'s device and current stream."""
    import torch

    key = (t.device, torch.cuda.current_stream(t.device).cuda_stream if t.is_cuda else 0)
    if key not in _COUNTERS:
        _COUNTERS[key] = torch.zeros(COUNTERS, dtype=torch.int32, device=t.device)
    return _COUNTERS[key]


PDL = True  # programmatic dependent launch where the device has it (benchmarks switch it off to compare)


@functools.lru_cache(maxsize=8)
def _pdl_device(index: int) -> bool:
    import torch

    try:
        import triton.language.extra.cuda as cuda_extra
    except ImportError:
        return False
    return torch.cuda.get_device_capability(index)[0] >= 9 and hasattr(cuda_extra, "gdc_wait")


def pdl_available(t: Any) -> bool:
    """Kernels for tensor ``t`` may be launched with programmatic dependent launch: a CUDA device of compute
    capability 9 or later (Hopper) and a Triton with ``gdc_wait``, and ``PDL`` on."""
    return PDL and t.is_cuda and _pdl_device(t.device.index if t.device.index is not None else 0)


def pdl_args(t: Any) -> dict:
    """Launch arguments of a kernel with a ``GDC`` constexpr: with PDL (``pdl_available``) it is launched so that
    it may start while the kernel before it runs, and must wait for it (``gdc_wait``) before reading anything that
    kernel writes; it lets the next one launch (``gdc_launch_dependents``) only after its own wait, so what kernels
    before the one just before it wrote (weights, the step's inputs and tables, earlier steps' KV cache) is complete
    when it starts and may be read before the wait. Else a plain launch."""
    return {"GDC": True, "launch_pdl": True} if pdl_available(t) else {"GDC": False}
