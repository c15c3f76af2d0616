"""display-rollouts: show every train/eval dump of a template, sample by sample, with recomputed metrics.

    slime-lite display-rollouts --load-debug-rollout-data /data/rollout_{rollout_id}.pt [--max-samples 4]
"""

from __future__ import annotations

import argparse
from typing import Any

from rich.table import Table
from rich.text import Text

from slime_lite.debug import make_console, select_dumps, shorten
from slime_lite.errors import SlimeLiteError, run_main
from slime_lite.rollout.dumps import load_rollout_dump
from slime_lite.rollout.stats import rollout_metrics
from slime_lite.types import TOKEN_VERSIONS

TEXT_LIMIT = 400
OWN_ROWS = ("turns", TOKEN_VERSIONS)  # metadata shown in rows of their own


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="slime-lite display-rollouts",
        description="Show the samples, recomputed rollout metrics and meta of rollout dumps (train and eval).",
    )
    p.add_argument("--load-debug-rollout-data", required=True, metavar="T",
                   help="dump path template with {rollout_id} (or one dump file); ids 0..999 are searched")
    p.add_argument("--rollout-id", type=int, default=None, help="only this rollout id")
    p.add_argument("--max-samples", type=int, default=None, metavar="N", help="show at most N samples per file")
    p.add_argument("--full", action="store_true", help="do not shorten prompts and responses")
    p.add_argument("--reward-key", default=None, help="key of the scalar reward when rewards are dicts")
    return p


def _value(x: Any) -> Any:
    return Text(x if isinstance(x, str) else repr(x))


def sample_table(sample: Any, position: int, full: bool) -> Any:
    limit = 0 if full else TEXT_LIMIT
    table = Table(title=f"sample {position}", show_header=False, title_justify="left")
    table.add_column("field", style="bold", no_wrap=True)
    table.add_column("value", overflow="fold")
    rows = [
        ("group/index", f"{sample.group_index}/{sample.index}"),
        ("prompt", shorten(sample.prompt, limit)),
        ("response", shorten(sample.response, limit)),
        ("label", shorten(sample.label, limit)),
        ("reward", repr(sample.reward)),
        ("status", sample.status.value),
        ("response_length", str(sample.response_length)),
        ("weight_versions", ", ".join(map(str, sample.weight_versions)) or "-"),
        ("token versions", version_runs(sample.metadata.get(TOKEN_VERSIONS))),
    ]
    rows += [(f"metadata.{key}", shorten(value, limit)) for key, value in sorted(sample.metadata.items(), key=str)
             if key not in OWN_ROWS]
    for name, value in rows:
        table.add_row(name, _value(value))
    for k, turn in enumerate(sample.metadata.get("turns") or []):  # a multi-turn sample: each turn apart
        table.add_row(f"turn {k}", turn_text(sample, turn, limit))
    return table


def turn_text(sample: Any, turn: dict[str, Any], limit: int) -> Text:
    """One turn as 'source, tokens a..b, mask m: text': trained model turns in green, masked turns dimmed."""
    mask = sample.loss_mask[turn["start"]:turn["start"] + turn["length"]] if sample.loss_mask is not None else []
    masks = sorted(set(mask)) or ["-"]
    head = (f"{turn['source']}, response tokens {turn['start']}..{turn['start'] + turn['length'] - 1}, "
            f"loss mask {'/'.join(map(str, masks))}")
    extra = ", ".join(f"{k} {turn[k]}" for k in ("cached_tokens", "prompt_tokens") if k in turn)
    style = "green" if masks == [1] else ("dim" if masks == [0] else "yellow")
    out = Text(head + (f" ({extra})" if extra else "") + ": ", style="bold " + style)
    out.append(shorten(turn.get("text") or "", limit), style=style)
    return out


def version_runs(versions: list[int] | None) -> str:
    """Per-token weight versions as runs: '3 x12, 4 x20' (tokens 0-11 by version 3, the next 20 by version 4)."""
    runs: list[list[int]] = []
    for v in versions or []:
        if runs and runs[-1][0] == v:
            runs[-1][1] += 1
        else:
            runs.append([v, 1])
    return ", ".join(f"{v} x{n}" for v, n in runs) or "-"


def dict_table(title: str, data: dict[str, Any]) -> Any:
    table = Table(title=title, title_justify="left")
    table.add_column("key", no_wrap=True)
    table.add_column("value", overflow="fold")
    for key, value in data.items():
        table.add_row(_value(str(key)), _value(f"{value:.6g}" if isinstance(value, float) else value))
    return table


def _run(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    if args.max_samples is not None and args.max_samples < 0:
        raise SlimeLiteError(f"--max-samples {args.max_samples}: must be >= 0.")
    console = make_console()
    for kind, rollout_id, path in select_dumps(args.load_debug_rollout_data, args.rollout_id):
        dump = load_rollout_dump(path)
        console.rule(f"{kind} rollout {dump.rollout_id}: {path} ({len(dump.samples)} samples)")
        shown = dump.samples if args.max_samples is None else dump.samples[: args.max_samples]
        for position, sample in enumerate(shown):
            console.print(sample_table(sample, position, args.full))
        if len(shown) < len(dump.samples):
            console.print(f"... {len(dump.samples) - len(shown)} more samples not shown (--max-samples)")
        try:
            metrics = rollout_metrics(dump.samples, args.reward_key)
            metrics.pop("rollout/rewards", None)  # depends on the run's estimator, which a dump does not record
            console.print(dict_table("rollout metrics (recomputed)", metrics))
        except SlimeLiteError as exc:  # e.g. dict rewards without --reward-key: the samples are still shown
            console.print(Text(f"rollout metrics not computed: {exc}"))
        if dump.meta:
            console.print(dict_table(f"meta (format_version {dump.format_version})", dump.meta))
        else:
            console.print("meta: none (a slime dump, or made without slime_lite's meta)")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_main(_run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
