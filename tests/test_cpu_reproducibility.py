"""Importing slime_lite puts Intel MKL in its strict reproducibility mode (unless the user set MKL_CBWR): a CPU
matrix product gives each row the same bits whatever the rows around it, which the trainer's batch invariance on
CPU (log-prob and train passes packed differently, step-1 ppo_kl exactly 0) rests on. Each check runs in a fresh
interpreter: MKL reads the setting at its first product. On a CPU not Intel's, MKL's strict mode does not reach the
kernels of a product of 1-3 rows (found on an AMD EPYC: their rounding differs from a longer product's rows, strict or
not); only rows of products of 4 or more rows are checked there, which is every product of a packed micro-batch of 4
tokens or more."""

from __future__ import annotations

import os
import subprocess
import sys

CHECK = """
import slime_lite, os, torch
torch.manual_seed(0)
small = large = 0  # mismatches where a part has fewer than 4 rows / where both have 4 or more
for k, n in ((64, 64), (256, 64), (384, 128), (128, 384), (128, 1152)):
    w = torch.randn(n, k)
    for m in (1, 5, 64, 100, 200, 400):
        a = torch.randn(m, k)
        full = a @ w.T
        for r in (1, 3, 4, 8, 37, 99):
            if r < m:
                bad = not torch.equal(full[:r], a[:r] @ w.T) or not torch.equal(full[r:], a[r:] @ w.T)
                small, large = (small + bad, large) if min(r, m - r) < 4 else (small, large + bad)
print(os.environ["MKL_CBWR"], small, large)
"""
INTEL = "GenuineIntel" in open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else False


def _run(env: dict) -> str:
    out = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


def test_rows_of_a_cpu_product_do_not_depend_on_the_batch():
    env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}
    mode, small, large = _run(env).split()
    assert (mode, large) == ("AUTO,STRICT", "0")
    if INTEL:
        assert small == "0"


def test_a_users_own_mkl_setting_is_kept():
    assert _run({**os.environ, "MKL_CBWR": "COMPATIBLE"}).split()[0] == "COMPATIBLE"
