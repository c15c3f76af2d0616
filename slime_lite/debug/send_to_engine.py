"""send-to-engine: resend dumped samples to a running engine (embedded or SGLang) and compare with the dump.

Two checks per sample:
(a) teacher-forced, the strongest: the full dumped tokens go in with ``logprob_start_len = prompt_len - 1``; the
    engine's ``input_token_logprobs`` of the response tokens are compared with the dump's ``rollout_log_probs``.
    Prompt log-probs are of the raw logits (SGLang's and the embedded engine's), so (a) runs for samples generated
    at temperature 1 (or greedily) without a ``logit_bias``; other samples get (b).
(b) regeneration: the prompt part goes in with the recorded sampling params (``metadata["sampling_params"]``,
    including ``sampling_seed``); new ids/text are compared with the dump, and log-probs where the tokens agree.
    (b) is the log-prob check when the engine gives no ``input_token_logprobs``. A multi-turn sample is
    regenerated turn by turn: each model turn from the tokens before it, with the turn's recorded params.

    slime-lite send-to-engine --load-debug-rollout-data /d/rollout_{rollout_id}.pt --rollout-id 0 \
        --url http://127.0.0.1:30000 --all
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

from rich.table import Table
from rich.text import Text

from slime_lite.debug import make_console, select_dumps, shorten
from slime_lite.engine_client import normalize_url, request_json
from slime_lite.errors import EngineError, SlimeLiteError, run_main
from slime_lite.rollout.dumps import load_rollout_dump
from slime_lite.rollout.turns import turns
from slime_lite.types import TOKEN_VERSIONS

GREEDY_TEMPERATURE = 1e-6


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="slime-lite send-to-engine",
        description="Resend dumped samples to a running engine and compare output tokens and log-probs.",
    )
    p.add_argument("--load-debug-rollout-data", required=True, metavar="T",
                   help="dump path template with {rollout_id} (or one dump file)")
    p.add_argument("--rollout-id", type=int, required=True, help="rollout id of the dump")
    p.add_argument("--eval", action="store_true", help="use the eval dump of that id (eval_<id>)")
    p.add_argument("--url", required=True,
                   help="engine base URL, e.g. http://127.0.0.1:30000 (http:// when no scheme is given)")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--sample-index", type=int, default=0, help="position of the sample in the dump (default 0)")
    which.add_argument("--all", action="store_true", help="send every sample of the dump")
    p.add_argument("--greedy", action="store_true", help="regenerate greedily (temperature 0)")
    p.add_argument("--temperature", type=float, default=1.0, help="when the dump recorded no sampling params")
    p.add_argument("--top-p", type=float, default=1.0, help="when the dump recorded no sampling params")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="regeneration length (default: recorded, else the dumped response length)")
    p.add_argument("--atol", type=float, default=1e-3, help="largest log-prob difference that counts as a match")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per engine request")
    return p


@dataclass
class Report:
    position: int
    sample: Any
    rows: list[tuple[str, str]] = field(default_factory=list)
    logprob_diff: float | None = None  # max |engine - dump| on loss-masked response tokens
    tokens_ok: bool | None = None  # None: tokens are not expected to match (unseeded sampling)
    atol: float = 1e-3
    other_weights: bool = False  # the engine serves another weight version than the sample's newest

    @property
    def verdict(self) -> str:
        if self.other_weights:
            return "INCONCLUSIVE"
        if self.tokens_ok is False or (self.logprob_diff is not None and self.logprob_diff > self.atol):
            return "DIFFER"
        if self.logprob_diff is None and self.tokens_ok is None:
            return "INCONCLUSIVE"
        return "MATCH"


def sampling_params(sample: Any, args: argparse.Namespace) -> dict[str, Any]:
    """The params the sample was generated with (recorded in its metadata), else from the flags."""
    recorded = sample.metadata.get("sampling_params")
    params = dict(recorded) if isinstance(recorded, dict) else {"temperature": args.temperature, "top_p": args.top_p}
    if "sampling_seed" not in params and sample.metadata.get("sampling_seed") is not None:
        params["sampling_seed"] = sample.metadata["sampling_seed"]
    if args.max_new_tokens is not None:
        params["max_new_tokens"] = args.max_new_tokens
    elif params.get("max_new_tokens") is None:
        params["max_new_tokens"] = max(1, sample.response_length)
    return params


def _versions(sample: Any) -> list[int] | None:
    """The weight version of each response token, where more than one generated them (None otherwise)."""
    versions = sample.metadata.get(TOKEN_VERSIONS)
    return list(versions) if versions and len(set(versions)) > 1 else None


def _newest_mask(sample: Any) -> list[int]:
    """The loss mask without the tokens of weights older than the sample's newest (no engine holds both)."""
    versions = _versions(sample)
    mask = sample.loss_mask if sample.loss_mask is not None else [1] * sample.response_length
    return mask if versions is None else [m if v == max(versions) else 0 for m, v in zip(mask, versions)]


def _diffs(new: list[float], old: list[float], mask: list[int] | None) -> list[float]:
    mask = mask if mask is not None else [1] * len(old)
    return [abs(float(a) - float(b)) for a, b, m in zip(new, old, mask) if m]


def _fmt(diffs: list[float]) -> str:
    if not diffs:
        return "no tokens to compare"
    return f"max {max(diffs):.3g}, mean {sum(diffs) / len(diffs):.3g} over {len(diffs)} tokens"


def teacher_forced(url: str, sample: Any, params: dict[str, Any], timeout: float) -> list[float] | None:
    """Engine log-probs of the dumped response tokens given the dumped context; None if the engine gives none."""

    prompt_len, response = sample.prompt_length, [int(t) for t in sample.tokens[sample.prompt_length:]]
    body = {
        "input_ids": [int(t) for t in sample.tokens],
        "sampling_params": {**params, "max_new_tokens": 1},
        "return_logprob": True,
        "logprob_start_len": max(0, prompt_len - 1),
    }
    out = request_json(url, "/generate", body, timeout=timeout)
    entries = (out.get("meta_info") or {}).get("input_token_logprobs") or []
    tail = entries[len(entries) - len(response):] if len(entries) >= len(response) else None
    if not response or tail is None or [int(e[1]) for e in tail] != response or any(e[0] is None for e in tail):
        return None
    return [float(e[0]) for e in tail]


def served_version(url: str, timeout: float) -> str | None:
    """The weight version the engine serves (``/get_model_info``), None where it does not say."""
    try:
        version = request_json(url, "/get_model_info", timeout=timeout).get("weight_version")
    except (EngineError, AttributeError):
        return None
    return None if version is None else str(version)


def check_sample(url: str, position: int, sample: Any, args: argparse.Namespace,
                 served: str | None = None) -> Report:
    rep = Report(position, sample, atol=args.atol)
    if served is not None and sample.weight_versions:  # "default" (the checkpoint's weights) is version "0"
        newest = str(sample.weight_versions[-1])
        rep.other_weights = served != newest and {served, newest} != {"default", "0"}
        rep.rows.append(("weight version", f"engine {served}, sample {newest}" + (
            ": the engine holds other weights, so its tokens and log-probs need not match: load that version's "
            "weights (update_weights_from_disk with its weight_version), or, where the engine holds them already, "
            "name them with POST /update_weight_version" if rep.other_weights else "")))
    params = sampling_params(sample, args)
    dumped_lp = sample.rollout_log_probs
    prompt_len = sample.prompt_length
    response = [int(t) for t in sample.tokens[prompt_len:]]
    rep.rows.append(("prompt / response tokens", f"{prompt_len} / {len(response)}"))
    rep.rows.append(("sampling params", repr(params)))

    temperature = float(params.get("temperature", 1.0))
    # prompt log-probs are of the raw logits (SGLang's and the embedded engine's): comparable with the sampled
    # tokens' only where those were not scaled or biased either
    raw = (temperature <= GREEDY_TEMPERATURE or temperature == 1.0) and not params.get("logit_bias")
    try:
        tf = teacher_forced(url, sample, params, args.timeout) if response and raw else None
    except EngineError as exc:
        if "answered HTTP 4" not in str(exc):
            raise
        tf = None  # the engine refused the scoring request (e.g. no logprob_start_len): fall back to (b)
    if not raw:
        rep.rows.append(("(a) teacher-forced log-probs", "not compared: prompt log-probs are of the raw logits, "
                         f"the dump's of logits at temperature {temperature:g} (or with a logit_bias); using (b)"))
    elif tf is None:
        rep.rows.append(("(a) teacher-forced log-probs", "engine gave no input_token_logprobs; using (b)"))
    elif dumped_lp is None:
        rep.rows.append(("(a) teacher-forced log-probs", "dump has no rollout_log_probs to compare"))
    else:
        diffs = _diffs(tf, dumped_lp, _newest_mask(sample))
        rep.logprob_diff = max(diffs) if diffs else None
        rep.rows.append(("(a) teacher-forced |engine - dump|", _fmt(diffs) + (
            " (the newest weights' tokens: older ones were sampled by other weights)" if _versions(sample) else "")))

    if len(turns(sample)) > 1:
        return regenerate_turns(url, rep, sample, params, args)
    regen = dict(params, temperature=0.0) if args.greedy else params
    body = {"input_ids": [int(t) for t in sample.tokens[:prompt_len]], "sampling_params": regen,
            "return_logprob": True}
    out = request_json(url, "/generate", body, timeout=args.timeout)
    new_ids = [int(t) for t in out.get("output_ids") or []]
    meta = out.get("meta_info") or {}
    new_lp = [float(e[0]) for e in meta.get("output_token_logprobs") or []]
    same = 0
    while same < min(len(new_ids), len(response)) and new_ids[same] == response[same]:
        same += 1
    if new_ids == response:
        rep.rows.append(("(b) regenerated tokens", f"identical ({len(new_ids)} tokens)"))
    else:
        rep.rows.append(("(b) regenerated tokens",
                         f"first difference at response token {same} ({len(new_ids)} new vs {len(response)} dumped)"))
    rep.rows.append(("(b) regenerated text", "identical" if out.get("text") == sample.response else "differs"))
    finish = (meta.get("finish_reason") or {}).get("type")
    rep.rows.append(("(b) finish reason / dumped status", f"{finish} / {sample.status.value}"))
    if args.greedy:
        rep.rows.append(("(b) log-probs where tokens agree", "not compared (--greedy changes the distribution)"))
    elif dumped_lp is not None and len(new_lp) == len(new_ids):
        diffs = _diffs(new_lp[:same], dumped_lp[:same], _newest_mask(sample)[:same])
        rep.rows.append(("(b) log-probs where tokens agree", _fmt(diffs)))
        if tf is None and diffs:
            rep.logprob_diff = max(diffs)
    seeded = params.get("sampling_seed") is not None and not args.greedy and not _versions(sample)
    greedy_dump = float(params.get("temperature", 1.0)) <= GREEDY_TEMPERATURE
    if seeded or greedy_dump:
        rep.tokens_ok = new_ids == response
    rep.rows.append(("tokens expected to match", "yes (seeded or greedy dump)" if rep.tokens_ok is not None
                     else "no (generated by several weight versions: --partial-rollout or a push mid-request)"
                     if _versions(sample) else "no (unseeded sampling or --greedy)"))
    return rep


def regenerate_turns(url: str, rep: Report, sample: Any, params: dict[str, Any], args: argparse.Namespace) -> Report:
    """(b) for a multi-turn sample: each model turn resent as it was generated, the sample's tokens before it as
    ``input_ids`` with the turn's recorded sampling params (else the sample's, for the turn's length)."""
    prompt_len, dumped_lp, mask = sample.prompt_length, sample.rollout_log_probs, _newest_mask(sample)
    all_same, all_seeded = True, not _versions(sample)  # several weight versions: no engine regenerates them all
    from_a = rep.logprob_diff is not None  # (a)'s teacher-forced difference is the verdict's when it has one
    for k, turn in enumerate(turns(sample)):
        if turn["source"] != "model" or not turn["length"]:
            continue
        lo, n = turn["start"], turn["length"]
        turn_params = dict(turn.get("sampling_params") or dict(params, max_new_tokens=n))
        if args.greedy:
            turn_params["temperature"] = 0.0
        body = {"input_ids": [int(t) for t in sample.tokens[:prompt_len + lo]], "sampling_params": turn_params,
                "return_logprob": True}
        out = request_json(url, "/generate", body, timeout=args.timeout)
        new_ids = [int(t) for t in out.get("output_ids") or []]
        old_ids = [int(t) for t in sample.tokens[prompt_len + lo:prompt_len + lo + n]]
        same = next((i for i, (a, b) in enumerate(zip(new_ids, old_ids)) if a != b), min(len(new_ids), n))
        result = (f"identical ({n} tokens)" if new_ids == old_ids else
                  f"first difference at turn token {same} ({len(new_ids)} new vs {n} dumped)")
        new_lp = [float(e[0]) for e in (out.get("meta_info") or {}).get("output_token_logprobs") or []]
        if dumped_lp is not None and not args.greedy and len(new_lp) == len(new_ids):
            diffs = _diffs(new_lp[:same], dumped_lp[lo:lo + same], mask[lo:lo + same])
            result += f"; log-probs where tokens agree: {_fmt(diffs)}"
            if not from_a and diffs:  # the largest over every turn
                rep.logprob_diff = max(rep.logprob_diff or 0.0, max(diffs))
        rep.rows.append((f"(b) turn {k} (model) regenerated", result))
        all_same &= new_ids == old_ids
        all_seeded &= turn_params.get("sampling_seed") is not None or float(turn_params.get("temperature", 1)) <= \
            GREEDY_TEMPERATURE
    if all_seeded and not args.greedy:
        rep.tokens_ok = all_same
    rep.rows.append(("tokens expected to match", "yes (seeded or greedy turns)" if rep.tokens_ok is not None
                     else "no (generated by several weight versions)" if _versions(sample)
                     else "no (unseeded sampling or --greedy)"))
    return rep


def _run(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    kind = "eval" if args.eval else "train"
    found = [d for d in select_dumps(args.load_debug_rollout_data, args.rollout_id) if d[0] in (kind, "file")]
    if not found:
        raise SlimeLiteError(f"--load-debug-rollout-data {args.load_debug_rollout_data}: no {kind} dump for "
                             f"--rollout-id {args.rollout_id}.")
    path = found[0][2]
    dump = load_rollout_dump(path)
    if args.all and not dump.samples:
        raise SlimeLiteError(f"{path}: the dump holds no samples; nothing to send.")
    if args.all:
        chosen = list(enumerate(dump.samples))
    elif 0 <= args.sample_index < len(dump.samples):
        chosen = [(args.sample_index, dump.samples[args.sample_index])]
    else:
        raise SlimeLiteError(f"--sample-index {args.sample_index}: {path} has {len(dump.samples)} samples "
                             f"(valid: 0..{len(dump.samples) - 1}).")
    console = make_console()
    url = normalize_url(args.url)  # 127.0.0.1:30000 works as http://127.0.0.1:30000
    reports = []
    served = served_version(url, args.timeout)
    for position, sample in chosen:
        rep = check_sample(url, position, sample, args, served)
        reports.append(rep)
        table = Table(title=f"{path} sample {position} (group/index {sample.group_index}/{sample.index}): "
                            f"{rep.verdict}", show_header=False, title_justify="left")
        table.add_column("check", style="bold", no_wrap=True)
        table.add_column("result", overflow="fold")
        table.add_row("response", Text(shorten(sample.response, 200)))
        for name, value in rep.rows:
            table.add_row(name, Text(value))
        console.print(table)
    counts = {v: sum(r.verdict == v for r in reports) for v in ("MATCH", "DIFFER", "INCONCLUSIVE")}
    worst = [r.logprob_diff for r in reports if r.logprob_diff is not None]
    overall = "MATCH" if counts["MATCH"] == len(reports) else ("DIFFER" if counts["DIFFER"] else "INCONCLUSIVE")
    console.print(
        f"verdict: {overall} ({counts['MATCH']} match, {counts['DIFFER']} differ, {counts['INCONCLUSIVE']} "
        f"inconclusive; max log-prob diff {max(worst):.3g} vs --atol {args.atol:g})" if worst else
        f"verdict: {overall} ({counts['MATCH']} match, {counts['DIFFER']} differ, {counts['INCONCLUSIVE']} "
        "inconclusive; no log-probs compared)"
    )
    return 0 if overall == "MATCH" else 1


def main(argv: list[str] | None = None) -> int:
    return run_main(_run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
