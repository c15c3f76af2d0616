"""How scripts/test-gpu.sh --slice K/N splits a test run (tests/conftest.py applies it)."""

from __future__ import annotations

DEFAULT_SECONDS = 30.0  # a test with no recorded duration


def slice_of(node_ids: list[str], durations: dict[str, float], count: int) -> dict[str, int]:
    """Each test's part (0..count-1): longest first, each to the part with the least time so far."""
    default = DEFAULT_SECONDS
    loads = [0.0] * count
    out = {}
    for node in sorted(node_ids, key=lambda n: (-durations.get(n, default), n)):
        part = min(range(count), key=lambda j: (loads[j], j))
        out[node] = part
        loads[part] += durations.get(node, default)
    return out
