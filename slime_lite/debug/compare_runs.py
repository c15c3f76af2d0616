"""``slime-lite compare-runs METRICS_A METRICS_B``: which metrics of two runs (their ``--metrics-path`` JSONL files)
differ, and where each first does: the step, both values and the relative difference (the ``DESCRIPTION`` below).
Timing metrics are ``metrics.is_timing_metric``'s. The default ``--rtol`` (``DEFAULT_RTOL``) is calibrated on runs
that should agree: a float32 replay under TP=2 against TP=1 differs by about 1e-7 relative in a dozen metrics.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.table import Table

from slime_lite.errors import SlimeLiteError, run_main
from slime_lite.metrics import is_timing_metric

DEFAULT_RTOL = 1e-5  # float32 runs that should agree (TP=1 vs TP=2 replay): ~1e-7; a real change: far more
DESCRIPTION = ("Which metrics of two runs (their --metrics-path JSONL files) differ, and where each first does: the "
               "step, both values and the relative difference. Exit status 0 when every metric agrees within --rtol, "
               "1 when some differ. Timing metrics (perf/, timeline/) are left out unless --include-timings. Rows "
               "are matched by their step (rollout_id; a step's eval record is merged with its train record).")


@dataclass(frozen=True)
class Difference:
    key: str
    step: Any  # the step key's value of the first record where it differs
    a: Any  # None: missing from that run
    b: Any
    rel: float  # |a - b| / max(|a|, |b|); inf when one is missing or not a number
    steps_differing: int


def read_metrics(path: str) -> list[dict[str, Any]]:
    rows = []
    try:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    row = json.loads(line)
                    if not isinstance(row, dict):
                        raise ValueError(f"line {n} is not a JSON object")
                    rows.append(row)
    except FileNotFoundError:
        raise SlimeLiteError(f"{path}: no such metrics file (written by slime-lite train --metrics-path).") from None
    except IsADirectoryError:
        inside = os.path.join(path, "metrics.jsonl")
        raise SlimeLiteError(f"{path} is a folder: give the metrics file in it (e.g. {inside}, as slime-lite train "
                             "--metrics-path wrote it).") from None
    except OSError as exc:
        raise SlimeLiteError(f"{path}: cannot be read ({exc.strerror or exc}).") from None
    except ValueError as exc:
        raise SlimeLiteError(f"{path}: not a metrics JSONL file ({exc}).") from None
    return rows


def _by_step(rows: list[dict[str, Any]], step_key: str) -> dict[Any, dict[str, Any]]:
    """{step: merged record}: the records of one step (a train record and its eval record) merged in file order."""
    out: dict[Any, dict[str, Any]] = {}
    for row in rows:
        out.setdefault(row.get(step_key), {}).update(row)
    return out


def _rel(a: Any, b: Any) -> float:
    """The relative difference of two values; of lists and objects (mismatch/worst_tokens) the largest of their
    entries', inf where their shapes or keys differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        return max((_rel(a[k], b[k]) if k in a and k in b else math.inf for k in set(a) | set(b)), default=0.0)
    if isinstance(a, list) and isinstance(b, list):
        return max(map(_rel, a, b), default=0.0) if len(a) == len(b) else math.inf
    if isinstance(a, bool) or isinstance(b, bool) or not isinstance(a, (int, float)) or not isinstance(b, (int, float)):
        return 0.0 if a == b else math.inf
    if math.isnan(a) or math.isnan(b):
        return 0.0 if math.isnan(a) and math.isnan(b) else math.inf
    if a == b:
        return 0.0
    if math.isinf(a) or math.isinf(b):  # (inf / inf would be NaN, which no tolerance catches)
        return math.inf
    return abs(a - b) / max(abs(a), abs(b))


def compare(rows_a: list[dict[str, Any]], rows_b: list[dict[str, Any]], rtol: float = 0.0,
            include_timings: bool = False, step_key: str = "rollout_id") -> list[Difference]:
    """Every metric that differs by more than ``rtol`` relative at a step both runs have (or is missing from one
    run's record of that step), sorted by its first differing step, then name."""
    a, b = _by_step(rows_a, step_key), _by_step(rows_b, step_key)
    steps = sorted(set(a) & set(b), key=_step_order)
    first: dict[str, Difference] = {}
    counts: dict[str, int] = {}
    for step in steps:
        ra, rb = a.get(step, {}), b.get(step, {})
        for key in sorted(set(ra) | set(rb)):
            if key == step_key or (is_timing_metric(key) and not include_timings):
                continue
            va, vb = ra.get(key), rb.get(key)
            rel = _rel(va, vb) if key in ra and key in rb else math.inf
            if rel > rtol:
                counts[key] = counts.get(key, 0) + 1
                first.setdefault(key, Difference(key, step, va, vb, rel, 0))
    diffs = [Difference(d.key, d.step, d.a, d.b, d.rel, counts[d.key]) for d in first.values()]
    return sorted(diffs, key=lambda d: (steps.index(d.step), d.key))


def _step_order(step: Any) -> tuple:
    return (step is None, step if isinstance(step, (int, float)) else 0, str(step))


def only_in(rows: list[dict[str, Any]], other: list[dict[str, Any]], step_key: str = "rollout_id") -> list[Any]:
    """The steps of ``rows`` that ``other`` has no record of (a run that stopped early, or ran longer)."""
    theirs = {row.get(step_key) for row in other}
    return sorted({row.get(step_key) for row in rows} - theirs, key=_step_order)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.9g}"
    return str(value)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="slime-lite compare-runs", description=DESCRIPTION)
    p.add_argument("metrics_a", help="--metrics-path JSONL of run A")
    p.add_argument("metrics_b", help="--metrics-path JSONL of run B")
    p.add_argument("--rtol", type=float, default=DEFAULT_RTOL,
                   help="relative difference under which two values agree (default: %(default)g, above float32 "
                        "noise between runs that should agree, such as TP=1 vs TP=2; 0: exact)")
    p.add_argument("--include-timings", action="store_true", help="also compare the timing metrics (perf/, timeline/)")
    p.add_argument("--step-key", default="rollout_id", help="the key that matches rows (default: %(default)s)")
    args = p.parse_args(argv)
    if not args.rtol >= 0:  # NaN too: it would agree with nothing and report nothing
        raise SlimeLiteError(f"--rtol {args.rtol} must be a number >= 0.")
    rows_a, rows_b = read_metrics(args.metrics_a), read_metrics(args.metrics_b)
    for path, rows in ((args.metrics_a, rows_a), (args.metrics_b, rows_b)):
        if rows and not any(args.step_key in row for row in rows):  # else every row is step None: last one wins
            keys = sorted({k for row in rows for k in row if not k.startswith(("perf/", "timeline/"))})[:8]
            raise SlimeLiteError(f"{path}: no record has --step-key {args.step_key!r} (keys such as {keys}); give "
                                 "a key every record has, e.g. rollout_id.")
    diffs = compare(rows_a, rows_b, args.rtol, args.include_timings, args.step_key)
    scope = "" if args.include_timings else ", timings (perf/, timeline/) left out"
    extra = [(name, only_in(mine, theirs, args.step_key)) for name, mine, theirs in
             (("A", rows_a, rows_b), ("B", rows_b, rows_a))]
    for name, steps in extra:
        if steps:
            shown = ", ".join(map(str, steps)) if len(steps) <= 8 else f"{steps[0]} .. {steps[-1]}"
            print(f"{args.step_key} only in {name} ({len(steps)} step(s)): {shown}")
    if not diffs and not any(steps for _, steps in extra):
        print(f"no metric differs by more than rtol {args.rtol:g} ({len(rows_a)} and {len(rows_b)} records{scope})")
        return 0
    if not diffs:
        print(f"the steps both runs have agree within rtol {args.rtol:g}{scope}")
        return 1

    table = Table(title=f"{len(diffs)} metric(s) differ by more than rtol {args.rtol:g}{scope}")
    for col in ("metric", f"first {args.step_key}", "A", "B", "rel diff", "steps differing"):
        table.add_column(col, justify="left" if col == "metric" else "right")
    for d in diffs:
        table.add_row(d.key, _cell(d.step), _cell(d.a), _cell(d.b),
                      "missing" if d.a is None or d.b is None else f"{d.rel:.3g}", str(d.steps_differing))
    Console(width=160).print(table)
    return 1


if __name__ == "__main__":  # python -m: a user error is one line, as from slime-lite
    raise SystemExit(run_main(main))
