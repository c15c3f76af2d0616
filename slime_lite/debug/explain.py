"""explain: one sample of a rollout token by token, the engine's view (rollout dump) next to the trainer's (train
dump): token, rollout log-prob, train log-prob, their difference, ref log-prob, advantage, loss mask, entropy, and
the weight version that generated the token (a sample continued by --partial-rollout holds several).
Trained tokens whose log-probs differ by more than ``--threshold`` are highlighted, in the terminal and in the HTML
page. A multi-turn sample is shown turn by turn (its number and source on every token, masked turns dimmed).

    slime-lite explain --rollout-dump out/data_3.pt --train-dump out/train_3_*.pt --sample 5 [--html s5.html]
"""

from __future__ import annotations

import argparse
import glob
import html
import math
import os
from dataclasses import dataclass, field
from typing import Any

from rich.table import Table

from slime_lite.backends.megatron.train_dump import TrainDump, load_train_dumps, sample_key
from slime_lite.debug import make_console
from slime_lite.debug.display import version_runs
from slime_lite.errors import DumpError, SlimeLiteError, run_main
from slime_lite.io import atomic_write_text
from slime_lite.rollout.dumps import load_rollout_dump
from slime_lite.rollout.turns import turns
from slime_lite.tokenizer import load_tokenizer
from slime_lite.types import TOKEN_VERSIONS

DEFAULT_THRESHOLD = 0.05  # the bf16 bound of --ci-logprob-diff-threshold: float32 runs sit far below it
HOT = "#ff2a6d"  # the highlight colour of a token over the threshold (the browser test looks for it)
COLUMNS = ("#", "turn", "token", "rollout lp", "train lp", "diff", "ref lp", "adv", "mask", "entropy", "version")
VALUES = ("rollout", "train", "diff", "ref", "adv", "mask", "entropy", "version")


@dataclass
class Row:
    pos: int
    token_id: int
    text: str
    values: dict[str, float | None]  # VALUES: ..., version (the weight version that generated the token)
    hot: bool
    turn: str = "0 model"  # the turn the token is in: its number and source (a single-turn sample: one turn)


@dataclass
class Explained:
    rollout_id: int
    index: int
    sample: Any
    rows: list[Row]
    threshold: float
    sources: list[str]
    summary: dict[str, str] = field(default_factory=dict)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="slime-lite explain", description=(
        "Show one sample token by token: rollout vs train log-probs (large differences highlighted), ref log-prob, "
        "advantage, loss mask, entropy, weight version. Joins a --save-debug-rollout-data dump with "
        "--save-debug-train-data dumps of the same rollout on the sample index."))
    p.add_argument("--rollout-dump", required=True, metavar="FILE", help="one rollout dump (--save-debug-rollout-data)")
    p.add_argument("--train-dump", required=True, nargs="+", metavar="FILE",
                   help="the train dump(s) of the same rollout (--save-debug-train-data); with data parallelism "
                        "each rank's file holds its own samples: pass them all, e.g. 'out/train_3_*.pt'")
    p.add_argument("--sample", required=True, type=int, metavar="I", help="the sample index (Sample.index)")
    p.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD,
                   help="highlight tokens with |train - rollout log-prob| above this (default: %(default)s)")
    p.add_argument("--hf-checkpoint", default=None, metavar="DIR",
                   help="tokenizer for the token text (default: the model path recorded in the rollout dump)")
    p.add_argument("--html", default=None, metavar="FILE", help="also write the same as a self-contained HTML page")
    return p


def _ranges(keys: list[int]) -> str:
    """Sample indices for a message: '0..31' when contiguous, else the first few."""
    keys = sorted(keys)
    if not keys:
        return "none"
    if keys == list(range(keys[0], keys[-1] + 1)):
        return f"{keys[0]}..{keys[-1]}" if len(keys) > 1 else str(keys[0])
    return ", ".join(map(str, keys[:8])) + (f", ... ({len(keys)} in all)" if len(keys) > 8 else "")


def _values(t: Any) -> list[float] | None:
    return None if t is None else [float(x) for x in (t.tolist() if hasattr(t, "tolist") else t)]


def join(rollout: Any, train: TrainDump, index: int, threshold: float, texts: Any = None) -> Explained:
    """Pick sample ``index`` from both dumps and line them up token by token; DumpError when the dumps do not join
    or the sample is missing. ``texts(ids) -> [str]`` gives each token's text."""
    where = f"rollout dump {rollout.path}"
    files = " ".join(train.paths)
    if rollout.rollout_id >= 0 and rollout.rollout_id != train.rollout_id:
        raise DumpError(f"the dumps do not join: {where} is rollout {rollout.rollout_id} but train dump {files} is "
                        f"rollout {train.rollout_id}. Pass the train dump of rollout {rollout.rollout_id}.")
    by_key = {sample_key(s, p): s for p, s in enumerate(rollout.samples)}
    extra = sorted(set(train.rows) - set(by_key))
    if extra:
        raise DumpError(f"the dumps do not join: train dump {files} holds sample indices {_ranges(extra)} that "
                        f"{where} does not have (it holds {_ranges(list(by_key))}): they are of different runs or "
                        "rollouts.")
    if index not in by_key:
        raise DumpError(f"sample {index} is not in {where} (it holds sample indices {_ranges(list(by_key))}).")
    if index not in train.rows:
        raise DumpError(f"sample {index} is in {where} but not in train dump {files} (it holds sample indices "
                        f"{_ranges(list(train.rows))}). Each data-parallel rank writes its own samples: pass every "
                        f"rank's file of rollout {train.rollout_id}.")
    sample, row = by_key[index], train.rows[index]
    raw = row.get("tokens")
    tokens = [int(t) for t in (raw.tolist() if hasattr(raw, "tolist") else raw)] if raw is not None else None
    if tokens is not None and tokens != list(sample.tokens):
        raise DumpError(f"the dumps do not join: sample {index} has other tokens in {where} than in train dump "
                        f"{files}: they are of different runs or rollouts.")
    n = sample.response_length
    train_lp = _values(row["log_probs"])
    if len(train_lp) != n:
        raise DumpError(f"the dumps do not join: sample {index} has {n} response tokens in {where} but "
                        f"{len(train_lp)} in train dump {files}.")
    rollout_lp = _values(sample.rollout_log_probs) or _values(row.get("rollout_log_probs"))
    cols = {name: _values(row.get(key)) for name, key in (("ref", "ref_log_probs"), ("adv", "advantages"),
                                                          ("mask", "loss_masks"), ("entropy", "entropy"))}
    versions = sample.metadata.get(TOKEN_VERSIONS)
    cols["version"] = [float(v) for v in versions] if versions is not None and len(versions) == n else None
    newest = max((max(v) for v in (s.metadata.get(TOKEN_VERSIONS) for s in rollout.samples
                                   if isinstance(s.metadata, dict)) if v), default=None)
    ids = list(sample.tokens[len(sample.tokens) - n:])
    text = texts(ids) if texts is not None else [f"#{t}" for t in ids]
    label = [""] * n
    for t, turn in enumerate(turns(sample)):
        for k in range(turn["start"], min(n, turn["start"] + turn["length"])):
            label[k] = f"{t} {turn['source']}"
    rows = []
    for k in range(n):
        diff = train_lp[k] - rollout_lp[k] if rollout_lp is not None else None
        v = {"rollout": rollout_lp[k] if rollout_lp is not None else None, "train": train_lp[k], "diff": diff}
        v.update({name: c[k] if c is not None else None for name, c in cols.items()})
        off = v["mask"] is not None and v["mask"] <= 0  # not trained: its log-prob difference is not a fault
        # a token of older weights than the rollout's newest (continued by --partial-rollout, generated across a
        # push, or a sample of a lagging --fully-async batch): the trainer's weights are not the ones that sampled
        # it, so a difference is expected (the trainer's comparison leaves it out too)
        old = cols["version"] is not None and newest is not None and cols["version"][k] < newest
        rows.append(Row(k, ids[k], text[k], v, diff is not None and not off and not old and not abs(diff) <= threshold,
                        label[k] + (" (older weights)" if old else "")))
    ex = Explained(train.rollout_id, index, sample, rows, threshold, [rollout.path, *train.paths])
    ex.summary = _summary(ex)
    return ex


def _summary(ex: Explained) -> dict[str, str]:
    s = ex.sample
    kept = [r for r in ex.rows if r.values["mask"] is None or r.values["mask"] > 0]
    compared = [r for r in kept if not r.turn.endswith("(older weights)")]  # the sampling weights' tokens
    diffs = [abs(r.values["diff"]) for r in compared if r.values["diff"] is not None]
    worst = max(compared, key=lambda r: abs(r.values["diff"]) if r.values["diff"] is not None else -1.0, default=None)
    out = {"rollout / sample": f"{ex.rollout_id} / {ex.index} (group {s.group_index})",
           "status / reward": f"{s.status.value} / {s.reward!r}",
           "prompt": _short(s.prompt if isinstance(s.prompt, str) else repr(s.prompt)),
           "response": _short(s.response),
           "tokens": f"{len(ex.rows)} response tokens, {len(kept)} in the loss"}
    if len(turns(s)) > 1:
        out["turns"] = ", ".join(_turn_line(ex, t, turn) for t, turn in enumerate(turns(s)))
    if diffs:
        out["|train - rollout|"] = (f"mean {sum(diffs) / len(diffs):.3g}, max {max(diffs):.3g} at token "
                                    f"{worst.pos} {worst.text!r}" + (f" (the {len(kept) - len(compared)} tokens "
                                    "of older weights not compared)" if len(compared) < len(kept) else ""))
    elif compared or not kept:
        out["|train - rollout|"] = "no rollout log-probs in either dump"
    else:
        out["|train - rollout|"] = (f"not compared: all {len(kept)} tokens in the loss are of older weights than the "
                                    "rollout's newest")
    versions = s.metadata.get(TOKEN_VERSIONS)
    if versions:
        since = s.metadata.get("start_rollout_id")
        out["weight versions"] = version_runs(versions) + (
            f" (continued since rollout {since}: --partial-rollout)" if since is not None and since != ex.rollout_id
            else "")
    out["over threshold"] = f"{sum(r.hot for r in ex.rows)} token(s) with |diff| > {ex.threshold:g} (highlighted)"
    return out


def _turn_line(ex: Explained, t: int, turn: dict[str, Any]) -> str:
    rows = ex.rows[turn["start"]:turn["start"] + turn["length"]]
    trained = sum(1 for r in rows if r.values["mask"] is None or r.values["mask"] > 0)
    diffs = [abs(r.values["diff"]) for r in rows if r.values["diff"] is not None and
             (r.values["mask"] is None or r.values["mask"] > 0)]
    lp = f", max |diff| {max(diffs):.3g}" if diffs else ""
    state = "trained" if trained == len(rows) else ("masked" if trained == 0 else f"{trained} trained")
    return f"{t} {turn['source']} ({len(rows)} tokens, {state}{lp})"


def _short(text: Any, limit: int = 300) -> str:
    text = str(text)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


def _fmt(name: str, v: float | None) -> str:
    if v is None:
        return "-"
    if name in ("mask", "version"):
        return f"{v:g}"
    if not math.isfinite(v):
        return str(v)
    if name == "diff":  # float32 noise (1e-7) stays visible
        return "0" if v == 0 else (f"{v:+.4f}" if abs(v) >= 1e-3 else f"{v:+.1e}")
    return f"{v:.4f}"


def _cells(r: Row) -> list[str]:
    return [str(r.pos), r.turn, repr(r.text)[1:-1]] + [_fmt(k, r.values[k]) for k in VALUES]


def render_terminal(ex: Explained, console: Any) -> None:
    head = Table(show_header=False, box=None, title=f"explain: {' + '.join(ex.sources)}", title_justify="left")
    head.add_column(style="bold", no_wrap=True)
    head.add_column(overflow="fold")
    for k, v in ex.summary.items():
        head.add_row(k, v)
    console.print(head)
    table = Table(show_lines=False)
    for name in COLUMNS:
        table.add_column(name, justify="left" if name == "token" else "right", no_wrap=True)
    for i, r in enumerate(ex.rows):
        if i and r.turn != ex.rows[i - 1].turn:
            table.add_section()  # each turn apart
        off = r.values["mask"] is not None and r.values["mask"] <= 0
        table.add_row(*_cells(r), style=f"bold white on {HOT}" if r.hot else ("dim" if off else None))
    console.print(table)


CSS = f"""
body {{ font: 14px/1.45 "DejaVu Sans Mono", "Liberation Mono", monospace; margin: 16px; color: #111;
        background: #fff; }}
h1 {{ font-size: 18px; margin: 0 0 8px; }}
.summary td {{ padding: 1px 12px 1px 0; vertical-align: top; }}
.summary td:first-child {{ font-weight: bold; white-space: nowrap; }}
.strip {{ margin: 12px 0; line-height: 2.1; }}
.strip span {{ white-space: pre; border: 1px solid #bbb; border-radius: 3px; padding: 2px 3px; margin: 1px; }}
.strip span.off {{ color: #999; border-style: dashed; }}
.strip b.turn {{ display: inline-block; margin: 0 4px 0 10px; font-size: 11px; color: #555; }}
table.tokens {{ border-collapse: collapse; }}
table.tokens th, table.tokens td {{ border: 1px solid #ccc; padding: 2px 8px; text-align: right; }}
table.tokens td.tok {{ text-align: left; white-space: pre; }}
tr.off td {{ color: #999; }}
.hot, tr.hot td {{ background: {HOT}; color: #fff; font-weight: bold; }}
"""


def render_html(ex: Explained) -> str:
    """The same as the terminal view, as one page: inline CSS, no scripts, nothing fetched."""
    e = html.escape
    summary = "".join(f"<tr><td>{e(k)}</td><td>{e(v)}</td></tr>" for k, v in ex.summary.items())
    strip, body = [], []
    for i, r in enumerate(ex.rows):
        if not i or r.turn != ex.rows[i - 1].turn:
            strip.append(f'<b class="turn">turn {e(r.turn)}</b>')
        off = r.values["mask"] is not None and r.values["mask"] <= 0
        cls = "hot" if r.hot else ("off" if off else "")
        tip = ", ".join(f"{k} {_fmt(k, v)}" for k, v in r.values.items())
        strip.append(f'<span class="{cls}" title="{e(tip)}">{e(r.text)}</span>')
        cells = "".join(f'<td class="tok">{e(c)}</td>' if j == 2 else f"<td>{e(c)}</td>"
                        for j, c in enumerate(_cells(r)))
        body.append(f'<tr class="{cls}">{cells}</tr>')
    head = "".join(f"<th>{e(c)}</th>" for c in COLUMNS)
    title = f"rollout {ex.rollout_id}, sample {ex.index}"
    return (f'<!doctype html>\n<html><head><meta charset="utf-8"><title>{e(title)}</title>'
            f"<style>{CSS}</style></head>\n<body><h1>explain: {e(title)}</h1>"
            f'<table class="summary">{summary}</table>'
            f'<div class="strip">{"".join(strip)}</div>'
            f'<table class="tokens"><tr>{head}</tr>\n' + "\n".join(body) + "</table>"
            f"<p>sources: {e(', '.join(ex.sources))}</p></body></html>\n")


def token_texts(checkpoint: str | None) -> Any:
    """``ids -> [text]`` with the checkpoint's tokenizer; None when there is none to load."""
    if not checkpoint or not os.path.isdir(checkpoint):
        return None

    tok = load_tokenizer(checkpoint)
    return lambda ids: [tok.decode([t]) for t in ids]


def train_files(patterns: list[str]) -> list[str]:
    """--train-dump's files: a quoted pattern ('out/train_3_*.pt', as the help writes it) is expanded here, the
    shell having left it alone; a pattern that matches nothing is a SlimeLiteError naming it."""
    files = []
    for pattern in patterns:
        if os.path.exists(pattern) or not any(c in pattern for c in "*?["):
            files.append(pattern)
            continue
        matched = sorted(glob.glob(pattern))
        if not matched:
            raise SlimeLiteError(f"--train-dump {pattern}: no file matches this pattern (train dumps are written by "
                                 "--save-debug-train-data, e.g. out/train_{rollout_id}_{rank}.pt).")
        files += matched
    return files


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if not a.threshold >= 0:
        raise SlimeLiteError(f"--threshold {a.threshold} must be >= 0.")
    rollout = load_rollout_dump(a.rollout_dump)
    train = load_train_dumps(train_files(a.train_dump))
    checkpoint = a.hf_checkpoint or (rollout.meta or {}).get("model_path")
    if a.hf_checkpoint and not os.path.isdir(a.hf_checkpoint):
        raise SlimeLiteError(f"--hf-checkpoint {a.hf_checkpoint} is not a folder (a tokenizer is needed for the "
                             "token text).")
    texts = token_texts(checkpoint)
    console = make_console()
    if texts is None:
        console.print(f"no tokenizer at {checkpoint!r} (the dump's model_path): tokens are shown as ids; give "
                      "--hf-checkpoint for their text")
    ex = join(rollout, train, a.sample, a.threshold, texts)
    render_terminal(ex, console)
    if a.html:
        atomic_write_text(render_html(ex), a.html)
        print(f"wrote {a.html}")
    return 0


if __name__ == "__main__":  # python -m: a user error is one line, as from slime-lite
    raise SystemExit(run_main(main))
