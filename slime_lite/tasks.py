"""Task data for the quickstart and tests: ``slime-lite make-data --task addition --out FILE.jsonl``.

Each line is ``{"prompt": "37+48=", "label": "85"}``. The prompt is fed to the model as raw text (no chat
template) and the model answers with the label followed by ``<|endoftext|>``; the tiny model's warm start uses
exactly this format. Every task enumerates all its problems, shuffles them with the seed, and takes the eval
split first and the train split after it, so the two never share a prompt and, for the same seed and ``n_eval``,
the eval split is the one the warm start held out.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
from pathlib import Path

from slime_lite.errors import SlimeLiteError

TASKS = ("addition", "math", "tool_math")
DEFAULT_N_TRAIN = 4000
DEFAULT_N_EVAL = 200


def _addition() -> list[dict[str, str]]:
    """Two-digit additions ("37+48=" -> "85"): 10,000 problems."""
    return [{"prompt": f"{a}+{b}=", "label": str(a + b)} for a in range(100) for b in range(100)]


def _math() -> list[dict[str, str]]:
    """Three single-digit operands with +, - and * under the usual precedence ("7*8-5=" -> "51"): 9,000 problems."""
    out = []
    for a, b, c in itertools.product(range(10), repeat=3):
        for op1, op2 in itertools.product("+-*", repeat=2):
            expr = f"{a}{op1}{b}{op2}{c}"
            out.append({"prompt": f"{expr}=", "label": str(eval(expr))})  # digits and + - * only
    return out


def _tool_math() -> list[dict[str, str]]:
    """Two operations over three numbers in 1..25 ("12+24*5=" -> "132"), for the calculator task of
    slime_lite/rollout/calc_task.py (the model calls the calculator once per operation): 140,625 problems."""
    out = []
    for a, b, c in itertools.product(range(1, 26), repeat=3):
        for op1, op2 in itertools.product("+-*", repeat=2):
            expr = f"{a}{op1}{b}{op2}{c}"
            out.append({"prompt": f"{expr}=", "label": str(eval(expr))})  # digits and + - * only
    return out


_BUILDERS = {"addition": _addition, "math": _math, "tool_math": _tool_math}


def n_problems(task: str) -> int:
    """How many distinct problems ``task`` has (the most ``n_train + n_eval`` can be)."""
    if task not in _BUILDERS:
        raise SlimeLiteError(f"--task {task!r}: unknown task; choose one of {', '.join(TASKS)}.")
    return len(_BUILDERS[task]())


def split_problems(task: str, *, n_train: int, n_eval: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """Deterministic disjoint (train, eval) lists of ``{"prompt", "label"}`` for ``task``."""
    if task not in _BUILDERS:
        raise SlimeLiteError(f"--task {task!r}: unknown task; choose one of {', '.join(TASKS)}.")
    if n_train < 0 or n_eval < 0:
        raise SlimeLiteError(f"--n-train {n_train} / --n-eval {n_eval}: must be >= 0.")
    problems = _BUILDERS[task]()
    if n_train + n_eval > len(problems):
        raise SlimeLiteError(
            f"--n-train {n_train} + --n-eval {n_eval} = {n_train + n_eval}: task {task!r} has only "
            f"{len(problems)} distinct problems; ask for fewer."
        )
    random.Random(seed).shuffle(problems)
    return problems[n_eval:n_eval + n_train], problems[:n_eval]


def eval_path_for(out_path: str | Path) -> Path:
    """``data/add.jsonl`` -> ``data/add_eval.jsonl``."""
    p = Path(out_path)
    return p.with_name(f"{p.stem}_eval{p.suffix or '.jsonl'}")


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def make_data(task: str, out_path: str | Path, *, n_train: int = DEFAULT_N_TRAIN, n_eval: int = DEFAULT_N_EVAL,
              seed: int = 0) -> tuple[str, str]:
    """Write the train split to ``out_path`` and the eval split to ``<stem>_eval.jsonl``; return both paths."""
    train, evals = split_problems(task, n_train=n_train, n_eval=n_eval, seed=seed)
    out = Path(out_path)
    if out.is_dir():
        raise SlimeLiteError(f"--out {out}: is a folder; give a file path such as {out / (task + '.jsonl')}.")
    if out.suffix != ".jsonl":  # training reads a file by its suffix: JSONL written as .parquet would not load
        raise SlimeLiteError(f"--out {out}: make-data writes JSONL; give a path ending in .jsonl "
                             f"({out.with_suffix('.jsonl')}).")
    out.parent.mkdir(parents=True, exist_ok=True)
    eval_out = eval_path_for(out)
    _write_jsonl(out, train)
    _write_jsonl(eval_out, evals)
    return str(out), str(eval_out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="slime-lite make-data",
        description="Write prompt/label JSONL for a task: train split to --out, eval split to <stem>_eval.jsonl.",
    )
    parser.add_argument("--task", required=True, choices=TASKS)
    parser.add_argument("--out", required=True, help="train JSONL path; the eval split goes next to it")
    parser.add_argument("--n-train", type=int, default=DEFAULT_N_TRAIN)
    parser.add_argument("--n-eval", type=int, default=DEFAULT_N_EVAL)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        train, evals = make_data(args.task, args.out, n_train=args.n_train, n_eval=args.n_eval, seed=args.seed)
    except SlimeLiteError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.n_train} train prompts to {train} and {args.n_eval} eval prompts to {evals}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
