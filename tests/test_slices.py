"""scripts/test-gpu.sh --slice K/N: every test in exactly one part, the same parts every time, balanced by time."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.slices import slice_of

ROOT = Path(__file__).resolve().parents[1]


def test_every_test_is_in_exactly_one_part_and_the_parts_are_balanced():
    ids = [f"t::{i}" for i in range(10)]
    durations = {"t::0": 300.0, "t::1": 200.0, "t::2": 100.0}
    parts = slice_of(ids, durations, 3)
    assert sorted(parts) == sorted(ids) and set(parts.values()) == {0, 1, 2}
    assert parts == slice_of(list(reversed(ids)), durations, 3)  # the order tests are collected in does not matter
    loads = [sum(durations.get(n, 30.0) for n, p in parts.items() if p == j) for j in range(3)]
    assert max(loads) == 300.0  # the longest test alone bounds the split: the rest fill the other parts


def test_the_slices_of_a_collection_cover_it_once(tmp_path):
    names = []
    for k in (1, 2, 3):
        out = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider",
                              "--slice", f"{k}/3", "tests/test_rl_math.py"], cwd=ROOT, capture_output=True,
                             text=True, timeout=300)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        names.append({line for line in out.stdout.splitlines() if "::" in line})
    everything = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider",
                                 "tests/test_rl_math.py"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    full = {line for line in everything.stdout.splitlines() if "::" in line}
    assert set().union(*names) == full and sum(len(n) for n in names) == len(full) and all(names)
