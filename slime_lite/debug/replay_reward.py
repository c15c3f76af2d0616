"""replay-reward: recompute the rewards of dumped samples and report where they differ from the stored ones.

    slime-lite replay-reward --load-debug-rollout-data /data/rollout_{rollout_id}.pt --custom-rm-path my_rm.reward
"""

from __future__ import annotations

import argparse
import asyncio
import math
from typing import Any

from rich.table import Table
from rich.text import Text

from slime_lite.debug import make_console, select_dumps, shorten
from slime_lite.errors import SlimeLiteError, run_main
from slime_lite.rollout.dumps import load_rollout_dump
from slime_lite.rollout.rewards import compute_group_rewards, compute_reward, sample_rm_type


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="slime-lite replay-reward",
        description="Recompute rewards of dumped samples with a reward model and compare with the stored rewards.",
    )
    p.add_argument("--load-debug-rollout-data", required=True, metavar="T",
                   help="dump path template with {rollout_id} (or one dump file)")
    p.add_argument("--rollout-id", type=int, default=None, help="only this rollout id (default: all found)")
    p.add_argument("--rm-type", default=None, help="built-in reward type (as for train)")
    p.add_argument("--custom-rm-path", default=None, help="module.function reward hook (as for train)")
    p.add_argument("--rm-url", default=None, help="reward model service of --rm-type remote_rm (as for train)")
    p.add_argument("--group-rm", action="store_true", help="score each prompt's group at once (as for train)")
    p.add_argument("--rollout-request-timeout", type=float, default=300.0,
                   help="seconds per --rm-url request (default: %(default)s)")
    p.add_argument("--reward-key", default=None, help="compare only this key of dict rewards")
    p.add_argument("--atol", type=float, default=1e-6, help="rewards closer than this count as the same")
    p.add_argument("--max-rows", type=int, default=50, help="show at most this many differing samples per file")
    p.add_argument("--fail-on-diff", action="store_true", help="exit 1 when any reward differs")
    return p


def rewards_equal(a: Any, b: Any, atol: float) -> bool:
    """Numbers within ``atol`` (NaN equals NaN), dicts key by key, anything else by ``==``."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(rewards_equal(a[k], b[k], atol) for k in a)
    numbers = (int, float)
    if isinstance(a, numbers) and isinstance(b, numbers) and not isinstance(a, bool) and not isinstance(b, bool):
        if math.isnan(a) or math.isnan(b):
            return math.isnan(a) and math.isnan(b)
        return abs(float(a) - float(b)) <= atol
    return a == b


def _pick(reward: Any, key: str | None) -> Any:
    if key is None or not isinstance(reward, dict):
        return reward
    if key not in reward:  # else both sides would read None and every reward would look the same
        raise SlimeLiteError(f"--reward-key {key!r} is not in the reward dict (keys: {sorted(reward)}); pass one "
                             "of those keys.")
    return reward[key]


async def _recompute(args: argparse.Namespace, samples: list[Any]) -> list[Any]:
    if not args.group_rm:
        return list(await asyncio.gather(*(compute_reward(args, s) for s in samples)))
    groups: dict[Any, list[int]] = {}
    for i, s in enumerate(samples):
        groups.setdefault(s.group_index if s.group_index is not None else ("sample", i), []).append(i)
    out: list[Any] = [None] * len(samples)
    for positions in groups.values():
        for i, r in zip(positions, await compute_group_rewards(args, [samples[i] for i in positions])):
            out[i] = r
    return out


def _run(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    console = make_console()
    summary = Table(title="replay-reward summary", title_justify="left")
    for col in ("kind", "rollout", "file", "samples", "same", "differ"):
        summary.add_column(col)
    total_differ = 0
    for kind, _, path in select_dumps(args.load_debug_rollout_data, args.rollout_id):
        dump = load_rollout_dump(path)
        untyped = next((s for s in dump.samples if sample_rm_type(args, s) is None), None)
        if untyped is not None and not args.custom_rm_path:
            raise SlimeLiteError(f"{path}: sample {untyped.index} has no rm_type field; replay-reward needs --rm-type "
                                 "NAME or --custom-rm-path module.function (as the run that wrote the dump).")
        unlabelled = next((s for s in dump.samples if s.label is None and sample_rm_type(args, s) != "remote_rm"),
                          None)
        if unlabelled is not None and not args.custom_rm_path:
            raise SlimeLiteError(f"{path}: sample {unlabelled.index} has no label (the run that wrote the dump read "
                                 "none: its --label-key); --rm-type scores against the label, so replay these with "
                                 "--custom-rm-path module.function, or dump a run that reads the labels.")
        new_rewards = asyncio.run(_recompute(args, dump.samples))
        differ = [
            (pos, s, new)
            for pos, (s, new) in enumerate(zip(dump.samples, new_rewards))
            if not rewards_equal(_pick(s.reward, args.reward_key), _pick(new, args.reward_key), args.atol)
        ]
        total_differ += len(differ)
        summary.add_row(kind, str(dump.rollout_id), Text(path), str(len(dump.samples)),
                        str(len(dump.samples) - len(differ)), str(len(differ)))
        if differ:
            table = Table(title=f"{path}: {len(differ)} rewards differ", title_justify="left")
            for col in ("position", "group/index", "stored", "new", "label", "response"):
                table.add_column(col, overflow="fold")
            for pos, s, new in differ[: args.max_rows]:
                table.add_row(str(pos), f"{s.group_index}/{s.index}",
                              Text(repr(_pick(s.reward, args.reward_key))), Text(repr(_pick(new, args.reward_key))),
                              Text(shorten(s.label, 60)), Text(shorten(s.response, 120)))
            console.print(table)
            if len(differ) > args.max_rows:
                console.print(f"... {len(differ) - args.max_rows} more differing samples (--max-rows)")
    console.print(summary)
    console.print(f"{total_differ} rewards differ" if total_differ else "all rewards are the same")
    return 1 if total_differ and args.fail_on_diff else 0


def main(argv: list[str] | None = None) -> int:
    return run_main(_run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
