"""Grad-norm regression across runs (slime's ``--ci-save-grad-norm`` / ``--ci-load-grad-norm``).

A run with ``--ci-save-grad-norm PATH`` writes the grad-norm of every optimizer step; a later run with
``--ci-load-grad-norm PATH`` (another parallelism, another machine, the next commit) stops at the first step whose
grad-norm differs from the saved one by more than ``--ci-grad-norm-rtol`` relative. PATH may hold slime's
placeholders ``{role}`` (actor, critic), ``{rollout_id}`` and ``{step_id}`` (the step within the rollout): each
formatted path is one JSON file ``{"grad_norms": [{"role", "rollout_id", "step", "grad_norm"}, ...]}``, so a plain
path keeps the whole run in one file and slime's ``dir/{role}_{rollout_id}_{step_id}.json`` keeps one step per file.

The driver checks (each train group's result carries its per-step norms), after the rollout's metrics are written, so the
metrics of the failing rollout are on disk for ``slime-lite compare-runs``. No torch or Ray at import.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any

from slime_lite.errors import SlimeLiteError
from slime_lite.io import atomic_write_text

# Default --ci-grad-norm-rtol by training precision. float32, measured on CPU with the tiny replay of
# tests/backends/test_train_replay.py (2 rollouts x 2 steps, every step compared with TP=PP=DP=1): TP=2 differs by
# at most 7.2e-6 relative, DP=2 by 4.4e-6, PP=2 by 1.1e-7 (sums in another order), while --lr x2 moves the later
# steps by 3.5e-3 to 0.93 and half the samples (--load-debug-rollout-data-subsample 0.5) by 0.999 or more: 1e-4
# sits between them with a margin of 14x and 35x. Differences grow with the number of steps: raise it for long
# runs. bfloat16 keeps 8 mantissa bits (~4e-3 per rounding): slime checks its bf16 CI runs at 1e-2 to 3e-2.
GRAD_NORM_RTOL_BY_DTYPE = {"float32": 1e-4, "bfloat16": 2e-2}


class GradNormMismatch(SlimeLiteError):
    """A step's grad-norm differs from the one saved by ``--ci-save-grad-norm`` (or none was saved)."""


def default_rtol(bf16: bool) -> float:
    return GRAD_NORM_RTOL_BY_DTYPE["bfloat16" if bf16 else "float32"]


def grad_norm_path(template: str, role: str, rollout_id: int, step: int) -> str:
    """The file of one step: ``template`` with slime's placeholders filled (a plain path is itself)."""
    try:
        return template.format(role=role, rollout_id=rollout_id, step_id=step)
    except (KeyError, IndexError, ValueError, AttributeError, TypeError) as exc:
        raise SlimeLiteError(
            f"grad-norm path {template!r}: only the placeholders {{role}}, {{rollout_id}} and {{step_id}} are "
            f"filled ({exc!r}); escape other braces as {{{{ }}}}.") from None


def _read(path: str, flag: str) -> list[dict[str, Any]]:
    try:
        with open(path, encoding="utf-8") as f:
            records = json.load(f)["grad_norms"]
    except FileNotFoundError:
        raise SlimeLiteError(f"{flag} {path}: no such file (written by a run with --ci-save-grad-norm).") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SlimeLiteError(f"{flag} {path}: not a grad-norm file written by --ci-save-grad-norm ({exc}).") \
            from None
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        raise SlimeLiteError(f"{flag} {path}: 'grad_norms' must be a list of records.")
    return records


def _key(record: dict[str, Any]) -> tuple[str, int, int]:
    return str(record["role"]), int(record["rollout_id"]), int(record["step"])


def close(a: float, b: float, rtol: float) -> bool:
    """|a - b| <= rtol x max(|a|, |b|); two NaNs, or two infinities of one sign, are equal (both runs broke the
    same way), an infinity is equal to nothing else."""
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    if math.isinf(a) or math.isinf(b):
        return a == b
    return abs(a - b) <= rtol * max(abs(a), abs(b), 1e-12)


@dataclass
class GradNormCI:
    """Saves and/or checks every step's grad-norm. ``start`` is the first rollout of this run (resume keeps the
    saved records of the rollouts before it)."""

    save: str | None
    load: str | None
    rtol: float
    start: int = 0

    def __post_init__(self) -> None:
        self._saved: dict[str, dict[tuple[str, int, int], dict[str, Any]]] = {}
        self._loaded: dict[str, dict[tuple[str, int, int], float]] = {}

    @classmethod
    def from_args(cls, args: Any, start: int = 0) -> GradNormCI | None:
        if not (args.ci_save_grad_norm or args.ci_load_grad_norm):
            return None
        rtol = args.ci_grad_norm_rtol if args.ci_grad_norm_rtol is not None else default_rtol(args.bf16)
        return cls(args.ci_save_grad_norm, args.ci_load_grad_norm, rtol, start)

    def update(self, role: str, rollout_id: int, norms: list[float]) -> None:
        """Record (and save) one rollout's per-step grad-norms of one train role, then check them against the
        loaded ones: GradNormMismatch at the first step that differs."""
        if self.save:
            touched = set()
            for step, value in enumerate(norms):
                path = grad_norm_path(self.save, role, rollout_id, step)
                if path not in self._saved:
                    self._saved[path] = self._resumed(path)
                self._saved[path][(role, rollout_id, step)] = {
                    "role": role, "rollout_id": rollout_id, "step": step, "grad_norm": float(value)}
                touched.add(path)
            for path in sorted(touched):
                self._write(path)
        if self.load:
            for step, value in enumerate(norms):
                self._check(role, rollout_id, step, float(value))

    def _resumed(self, path: str) -> dict[tuple[str, int, int], dict[str, Any]]:
        """Records already in ``path`` from the rollouts before this run's first (a resumed run appends)."""
        if not self.start or not os.path.exists(path):
            return {}
        return {_key(r): r for r in _read(path, "--ci-save-grad-norm") if int(r["rollout_id"]) < self.start}

    def _write(self, path: str) -> None:
        records = [self._saved[path][k] for k in sorted(self._saved[path])]
        atomic_write_text(json.dumps({"grad_norms": records}, indent=1) + "\n", path)

    def _check(self, role: str, rollout_id: int, step: int, value: float) -> None:
        path = grad_norm_path(self.load, role, rollout_id, step)
        if path not in self._loaded:
            self._loaded[path] = {_key(r): float(r["grad_norm"]) for r in _read(path, "--ci-load-grad-norm")}
        expected = self._loaded[path].get((role, rollout_id, step))
        if expected is None:
            raise GradNormMismatch(
                f"--ci-load-grad-norm {path}: no saved grad-norm for {role} rollout {rollout_id} step {step}; the "
                "saved run had fewer rollouts or steps per rollout (--num-rollout, --num-steps-per-rollout, "
                "--global-batch-size must match).")
        if not close(value, expected, self.rtol):
            rel = abs(value - expected) / max(abs(expected), 1e-12)
            raise GradNormMismatch(
                f"grad-norm check failed: {role} rollout {rollout_id} step {step}: grad_norm {value!r} differs from "
                f"the saved {expected!r} (--ci-load-grad-norm {path}) by {rel:.3g} relative, over --ci-grad-norm-rtol "
                f"{self.rtol:g}. Likely causes: another learning rate or optimizer setting, other or reordered "
                "training data (dumps, --global-batch-size, subsampling), a loss or advantage change, or numerics "
                "of another precision (--bf16 needs a looser --ci-grad-norm-rtol). slime-lite compare-runs A B "
                "shows every metric that moved.")
