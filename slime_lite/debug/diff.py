"""diff-rollouts: compare two dump files sample by sample (tokens, rewards, status, log-probs, loss masks, text; a
multi-turn sample's first difference is named by its turn).

    slime-lite diff-rollouts run1/rollout_0.pt run2/rollout_0.pt     # exit 0: identical, 1: they differ
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Any

from rich.table import Table
from rich.text import Text

from slime_lite.debug import make_console
from slime_lite.debug.replay_reward import rewards_equal
from slime_lite.errors import run_main
from slime_lite.rollout.dumps import load_rollout_dump
from slime_lite.rollout.turns import turns


ATOL = 1e-5  # same weights, greedy, float32: log-probs differ by ~1.25e-6 with another batch composition


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="slime-lite diff-rollouts",
        description="Compare two rollout dumps sample by sample (matched by position). Exit 1 when they differ.",
    )
    p.add_argument("a", help="first dump file")
    p.add_argument("b", help="second dump file")
    p.add_argument("--atol", type=float, default=ATOL,
                   help="log-probs and rewards closer than this are equal (default: %(default)g, above the float32 "
                        "noise of greedy dumps from the same weights under another batch, ~1e-6)")
    p.add_argument("--max-rows", type=int, default=50, help="show at most this many differing samples")
    return p


@dataclass
class SampleDiff:
    position: int
    group_index: Any
    index: Any
    first_token_diff: int | None  # position in ``tokens`` of the first differing id (None: equal)
    token_detail: str
    reward: tuple[Any, Any] | None  # (a, b) when they differ
    status: tuple[str, str] | None
    response_differs: bool
    logprob_max_abs_diff: float | None  # over response positions before the first differing token
    logprob_note: str
    mask_note: str = ""  # where the loss masks first differ

    def differs(self, atol: float) -> bool:
        lp = self.logprob_max_abs_diff is not None and self.logprob_max_abs_diff > atol
        return bool(
            self.first_token_diff is not None or self.reward or self.status or self.response_differs or lp
            or self.logprob_note or self.mask_note
        )


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first position where ``a`` and ``b`` differ (a length difference counts); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _turn_of(sample: Any, position: int) -> str:
    """'response' for a single-turn sample, else 'response, turn k (source)' of a response position."""
    recorded = turns(sample)
    if len(recorded) < 2:
        return "response"
    k, t = next(((k, t) for k, t in enumerate(recorded) if position < t["start"] + t["length"]),
                (len(recorded) - 1, recorded[-1]))
    return f"response, turn {k} ({t['source']})"


def compare_samples(position: int, sa: Any, sb: Any, atol: float) -> SampleDiff:
    ta, tb = [int(t) for t in sa.tokens], [int(t) for t in sb.tokens]
    first = first_difference(ta, tb)
    detail = ""
    if first is not None:
        side = "prompt" if first < min(sa.prompt_length, sb.prompt_length) else _turn_of(sa, first - sa.prompt_length)
        va = ta[first] if first < len(ta) else "end"
        vb = tb[first] if first < len(tb) else "end"
        detail = f"token {first} ({side}): {va} vs {vb}"
    lp_diff, note = None, ""
    la, lb = sa.rollout_log_probs, sb.rollout_log_probs
    if (la is None) != (lb is None):
        note = f"rollout_log_probs only in {'A' if la is not None else 'B'}"
    elif la is not None and lb is not None and sa.prompt_length == sb.prompt_length:
        n = min(len(la), len(lb))
        if first is not None:
            n = min(n, max(0, first - sa.prompt_length))  # after a token differs, log-probs are not comparable
        if n:
            lp_diff = max(_abs_diff(float(x), float(y)) for x, y in zip(la[:n], lb[:n]))
    # None: every response token in the loss (slime's default), so it equals an all-ones mask and no other
    ma, mb = (m.loss_mask if m.loss_mask is not None else [1] * m.response_length for m in (sa, sb))
    mask_note = ""
    if [int(x) for x in ma] != [int(x) for x in mb]:
        at = first_difference([int(x) for x in ma], [int(x) for x in mb])
        mask_note = f"loss_mask differs from response token {at} ({_turn_of(sa, at)})"
    reward = None if rewards_equal(sa.reward, sb.reward, atol) else (sa.reward, sb.reward)
    status = None if sa.status == sb.status else (sa.status.value, sb.status.value)
    return SampleDiff(position, sa.group_index, sa.index, first, detail, reward, status,
                      sa.response != sb.response, lp_diff, note, mask_note)


def _abs_diff(x: float, y: float) -> float:
    """|x - y|, inf where one side only is NaN or infinite (max() and > would let a NaN through)."""
    if math.isnan(x) or math.isnan(y):
        return 0.0 if math.isnan(x) and math.isnan(y) else math.inf
    return 0.0 if x == y else abs(x - y)


def _run(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    da, db = load_rollout_dump(args.a), load_rollout_dump(args.b)
    console = make_console()
    n = min(len(da.samples), len(db.samples))
    diffs = [compare_samples(i, da.samples[i], db.samples[i], args.atol) for i in range(n)]
    differing = [d for d in diffs if d.differs(args.atol)]
    lp_values = [d.logprob_max_abs_diff for d in diffs if d.logprob_max_abs_diff is not None]

    if differing:
        table = Table(title=f"{len(differing)} of {n} samples differ", title_justify="left")
        for col in ("position", "group/index", "first differing token", "reward A / B", "status A / B",
                    "response", "max |dlogp| (agreeing tokens)"):
            table.add_column(col, overflow="fold")
        for d in differing[: args.max_rows]:
            lp = f"{d.logprob_max_abs_diff:.3g}" if d.logprob_max_abs_diff is not None else "-"
            table.add_row(
                str(d.position), f"{d.group_index}/{d.index}", Text(d.token_detail or "-"),
                Text(f"{d.reward[0]!r} / {d.reward[1]!r}" if d.reward else "same"),
                Text(f"{d.status[0]} / {d.status[1]}" if d.status else "same"),
                "differs" if d.response_differs else "same",
                Text(lp + "".join(f" ({n})" for n in (d.logprob_note, d.mask_note) if n)),
            )
        console.print(table)
        if len(differing) > args.max_rows:
            console.print(f"... {len(differing) - args.max_rows} more differing samples (--max-rows)")

    summary = Table(title="diff-rollouts", title_justify="left")
    summary.add_column("check")
    summary.add_column("result", overflow="fold")
    summary.add_row("A", Text(args.a))
    summary.add_row("B", Text(args.b))
    count_ok = len(da.samples) == len(db.samples)
    summary.add_row("sample count", f"A {len(da.samples)}, B {len(db.samples)}" + ("" if count_ok else
                    f": length mismatch, compared the first {n}"))
    summary.add_row("tokens differ", str(sum(d.first_token_diff is not None for d in diffs)))
    summary.add_row("responses differ", str(sum(d.response_differs for d in diffs)))
    summary.add_row("rewards differ", str(sum(d.reward is not None for d in diffs)))
    masks = [d for d in diffs if d.mask_note]
    summary.add_row("loss masks differ", Text(f"{len(masks)}" + (f" (first: sample {masks[0].position}, "
                                                                  f"{masks[0].mask_note})" if masks else "")))
    summary.add_row("status differs", str(sum(d.status is not None for d in diffs)))
    summary.add_row("rollout log-probs max |A-B|",
                    f"{max(lp_values):.3g} (atol {args.atol:g})" if lp_values else "not compared")
    console.print(summary)
    same = count_ok and not differing
    console.print(("IDENTICAL" if same else "DIFFERENT") + f" (log-probs and rewards compared with atol {args.atol:g})")
    return 0 if same else 1


def main(argv: list[str] | None = None) -> int:
    return run_main(_run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
