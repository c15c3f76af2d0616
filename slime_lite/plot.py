"""``slime-lite plot-metrics``: draw the reward and eval curves of a ``--metrics-path`` file into a PNG."""

from __future__ import annotations

import argparse
import json
import os
import sys

from slime_lite.errors import SlimeLiteError, run_main


def read_records(path: str) -> list[dict]:
    """The file's records; a last line cut short (a run that died mid-write) is left out with a warning."""
    try:
        lines = [line for line in open(path, encoding="utf-8").read().splitlines() if line.strip()]
    except OSError as exc:
        raise SlimeLiteError(f"--metrics-path {path}: cannot read ({exc.strerror}).") from None
    except UnicodeDecodeError:
        raise SlimeLiteError(f"--metrics-path {path}: not a text file (a run's --metrics-path JSONL is).") from None
    records = []
    for i, line in enumerate(lines):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            if i < len(lines) - 1:
                raise SlimeLiteError(f"--metrics-path {path}: record {i + 1} is not JSON ({exc.msg}).") from None
            print(f"warning: --metrics-path {path}: the last record is cut short (not JSON); left out",
                  file=sys.stderr)
            continue
        if not isinstance(record, dict) or not isinstance(record.get("rollout_id"), int):
            raise SlimeLiteError(f"--metrics-path {path}: record {i + 1} is not a metrics record (an object with an "
                                 f"int rollout_id): {line[:80]}")
        records.append(record)
    return records


def last_per_rollout(rows: list[dict]) -> list[dict]:
    """One row per rollout id, the last one logged (a resumed run logs again the rollouts after its checkpoint),
    in rollout order."""
    return sorted({r["rollout_id"]: r for r in rows}.values(), key=lambda r: r["rollout_id"])


def plot(records: list[dict], out: str, title: str = "") -> None:
    import matplotlib  # matplotlib: its backend is chosen first

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after matplotlib.use

    train = last_per_rollout([r for r in records if "rollout/raw_reward" in r])
    evals = sorted({k for r in records for k in r if k.startswith("eval/") and k.count("/") == 1})
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    values = []
    if train:
        values += [r["rollout/raw_reward"] for r in train]
        ax.plot([r["rollout_id"] for r in train], [r["rollout/raw_reward"] for r in train], label="rollout reward",
                color="C0", marker=".", alpha=0.7)
    for i, key in enumerate(evals):
        rows = last_per_rollout([r for r in records if key in r])
        values += [r[key] for r in rows]
        # eval after rollout i measures the weights trained on rollouts 0..i; -1 is before training
        ax.plot([r["rollout_id"] + 1 for r in rows], [r[key] for r in rows], marker="o", color=f"C{i + 1}",
                label=f"{key} (held out)")
    ax.set_xlabel("rollout")
    ax.set_ylabel("reward / exact-match accuracy")
    lo, hi = min([0.0, *values]), max([1.0, *values])  # custom rewards may leave [0, 1]
    ax.set_ylim(lo - 0.02 * (hi - lo), hi + 0.02 * (hi - lo))
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(title or "slime_lite run")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="slime-lite plot-metrics",
                                description="Draw the reward and eval curves of a --metrics-path file into a PNG.")
    p.add_argument("--metrics-path", required=True, help="the metrics JSONL file of a run (train --metrics-path)")
    p.add_argument("--out", required=True, help="PNG file to write")
    p.add_argument("--title", default="", help="title of the plot (default: none)")
    a = p.parse_args(argv)
    if not a.out.lower().endswith(".png"):
        raise SlimeLiteError(f"--out {a.out}: name a .png file")
    folder = os.path.dirname(os.path.abspath(a.out))
    if not os.path.isdir(folder):
        raise SlimeLiteError(f"--out {a.out}: folder {folder} does not exist; create it first")
    records = read_records(a.metrics_path)
    if not records:
        raise SlimeLiteError(f"--metrics-path {a.metrics_path} has no records.")
    plot(records, a.out, a.title)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main))
