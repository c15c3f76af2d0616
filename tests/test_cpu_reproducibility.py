"""Importing slime_lite puts Intel MKL in its strict reproducibility mode (unless the user set MKL_CBWR): a CPU
matrix product gives each row the same bits whatever the rows around it, which the trainer's batch invariance on
CPU (log-prob and train passes packed differently, step-1 ppo_kl exactly 0) rests on. Each check runs in a fresh
interpreter: MKL reads the setting at its first product."""

from __future__ import annotations

import os
import subprocess
import sys

CHECK = """
import slime_lite, os, torch
torch.manual_seed(0)
bad = 0
for k, n in ((64, 64), (256, 64), (384, 128), (128, 384), (128, 1152)):
    w = torch.randn(n, k)
    for m in (1, 5, 64, 100, 200, 400):
        a = torch.randn(m, k)
        full = a @ w.T
        bad += sum(not torch.equal(full[:r], a[:r] @ w.T) or not torch.equal(full[r:], a[r:] @ w.T)
                   for r in (1, 3, 8, 37, 99) if r < m)
print(os.environ["MKL_CBWR"], bad)
"""


def _run(env: dict) -> str:
    out = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


def test_rows_of_a_cpu_product_do_not_depend_on_the_batch():
    env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}
    assert _run(env) == "AUTO,STRICT 0"


def test_a_users_own_mkl_setting_is_kept():
    assert _run({**os.environ, "MKL_CBWR": "COMPATIBLE"}).split()[0] == "COMPATIBLE"
