"""``slime-lite doctor [train flags] [--out DIR]``: the seed's step-1 / step-2 checklist on a short run, as a table.

The doctor runs ``slime-lite train`` as a subprocess for 2 iterations (one optimizer step per rollout, a small
batch unless given, ``--check-weight-update-equal --debug-scramble-engine-weights`` (no scramble under
``--lora-rank``, which refuses it), metrics and ``--dump-details`` into DIR), without ``--ci-test`` so that every
check is measured. A failed weight check stops that run; the doctor records it and runs once more without the
weight check to measure the rest. It then prints check / value / threshold / pass / likely cause, writes
DIR/doctor.json, and exits 1 when a check fails. When the train/rollout log-probs disagree it localises the first
mismatching sample layer by layer (``localize.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import warnings
from typing import Any, Iterator

from rich.table import Table

from slime_lite import rl_math
from slime_lite.args import parse_args
from slime_lite.checks.ci import (
    Check,
    dtype_name,
    logprob_diff_threshold,
    policy_off_reference,
    rollout_checks,
)
from slime_lite.checks.ci import make_check as _c
from slime_lite.config import CiConfig
from slime_lite.debug import make_console
from slime_lite.debug.localize import first_mismatch, localize_sample
from slime_lite.debug.on_task import on_task_checks, prompt_format_check
from slime_lite.debug.run_checks import (
    TrainRun,
    describe_worst_tokens,
    iteration2,
    memory_checks,
    mismatch_checks,
    precision_check,
    routing_check,
    skipped_rows,
    version_check,
    weight_check,
)
from slime_lite.errors import SlimeLiteError, run_main
from slime_lite.logging_setup import setup_logging
from slime_lite.metrics import train_steps_path
from slime_lite.rollout.dumps import load_rollout_dump

log = logging.getLogger("slime_lite.doctor")

FORCED = {"--num-rollout": "2", "--num-steps-per-rollout": "1"}
SMALL_BATCH = {"--rollout-batch-size": "4", "--n-samples-per-prompt": "4"}
SCRAMBLE = "--debug-scramble-engine-weights"
WEIGHT_FLAGS = ["--check-weight-update-equal", SCRAMBLE]
# set by the doctor itself, or not wanted in a short diagnostic run (checkpoints, resume, eval, loggers)
DROPPED = ("--ci-test", "--metrics-path", "--dump-details", "--save-debug-rollout-data", "--global-batch-size",
           "--save", "--save-interval", "--load", "--eval-interval", "--use-wandb", "--use-tensorboard",
           *FORCED, *WEIGHT_FLAGS,
           # the doctor's run is synchronous: its iteration-2 check needs rollout 1 from the trained weights, and
           # every rollout is checked against the version the pushes so far give (a skipped push is caught)
           "--async", "--fully-async", "--max-weight-staleness", "--max-policy-version-lag",
           "--max-weight-staleness-mode", "--update-weights-interval",  # (a push after every rollout, too)
           "--partial-rollout", "--mask-offpolicy-in-partial-rollout",  # carried samples are of older weights
           "--save-hf")  # it writes at --save's checkpoints, which the doctor drops
INCOMPATIBLE = ("--debug-rollout-only", "--debug-train-only", "--load-debug-rollout-data")


# ----------------------------------------------------------------------------------------------- the run itself
def _nargs_of() -> dict[str, Any]:
    from slime_lite.args import build_parser  # the train parser: only when flags are stripped

    return {opt: a.nargs for a in build_parser()._actions for opt in a.option_strings}


def strip_flags(argv: list[str], names: tuple[str, ...] | list[str]) -> list[str]:
    """``argv`` without the flags ``names`` and their values (``--f v``, ``--f=v``, ``--f v1 v2 ...``)."""
    nargs = _nargs_of()
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        name, eq, _ = arg.partition("=")
        if name not in names:
            out.append(arg)
            i += 1
            continue
        i += 1
        if eq or nargs.get(name) == 0:
            continue
        if nargs.get(name) in ("+", "*"):
            while i < len(argv) and not argv[i].startswith("--"):
                i += 1
        else:
            i += 1
    return out


def given(argv: list[str], name: str) -> bool:
    return any(a == name or a.startswith(name + "=") for a in argv)


def train_argv(user_argv: list[str], out: str, weight_check: bool = True) -> list[str]:
    """The ``slime-lite train`` flags of the doctor's run: the user's, with the doctor's settings forced."""
    for name in INCOMPATIBLE:
        if given(user_argv, name):
            raise SlimeLiteError(f"slime-lite doctor runs the whole loop (engines and trainer); drop {name}.")
    dropped = sorted({a.partition("=")[0] for a in user_argv if a.partition("=")[0] in DROPPED})
    if dropped:
        log.info("doctor: replacing %s with its own settings", ", ".join(dropped))
    argv = strip_flags(user_argv, DROPPED)
    for name, value in SMALL_BATCH.items():
        if not given(argv, name):
            argv += [name, value]
    for name, value in FORCED.items():
        argv += [name, value]
    argv += ["--metrics-path", os.path.join(out, "metrics.jsonl"), "--dump-details", out]
    if not given(argv, "--get-mismatch-metrics"):
        argv.append("--get-mismatch-metrics")  # the table's mismatch rows, the worst tokens of a log-prob failure
    backend = [v.partition("=")[2] or (argv[i + 1] if i + 1 < len(argv) else "")
               for i, v in enumerate(argv) if v.partition("=")[0] == "--rollout-backend"]
    if not weight_check or backend[-1:] == ["sglang"]:  # SGLang servers cannot be checked (train refuses it)
        return argv
    # --lora-rank refuses the scramble (an adapter-only push never restores the scrambled base weights): the
    # equality check alone (the first push's adapters are zero; a skipped later push still differs)
    return argv + [f for f in WEIGHT_FLAGS if not (given(argv, "--lora-rank") and f == SCRAMBLE)]


MARK = ".slime-lite-doctor"  # written first into a folder the doctor runs in: a later run may clear it


def _clean(out: str) -> None:
    """Clear the files an earlier doctor run wrote in ``out``; a folder the doctor never ran in that holds files
    (a real run's --dump-details folder has the same names) is refused, nothing deleted."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise SlimeLiteError(f"--out {out} is a file: pass a folder (a new one is created)")
    held = sorted(os.listdir(out)) if os.path.isdir(out) else []
    if held and MARK not in held and "doctor.json" not in held:
        raise SlimeLiteError(f"--out {out} holds files the doctor did not write ({', '.join(held[:4])}"
                             f"{', ...' if len(held) > 4 else ''}): a doctor run replaces metrics.jsonl, "
                             "metrics.train_steps.jsonl, args.json, train.log, rollout_data/ and train_data/ "
                             "there. Pass an empty or new folder, or one an earlier doctor run used.")
    metrics = os.path.join(out, "metrics.jsonl")
    for path in (metrics, train_steps_path(metrics), *(os.path.join(out, n) for n in ("args.json", "train.log",
                                                                                      "doctor.json"))):
        if os.path.exists(path):
            os.unlink(path)
    for name in ("rollout_data", "train_data", "mismatch", "rerun"):
        shutil.rmtree(os.path.join(out, name), ignore_errors=True)
    os.makedirs(out, exist_ok=True)
    open(os.path.join(out, MARK), "w").close()


def run_train(argv: list[str], out: str, timeout: float) -> TrainRun:
    """Run ``slime-lite train argv`` (its output to OUT/train.log); read back its error line and metrics."""
    _clean(out)
    log_path = os.path.join(out, "train.log")
    cmd = [sys.executable, "-m", "slime_lite.cli", "train", *argv]
    log.info("doctor: running slime-lite train (log: %s)", log_path)
    t0 = time.monotonic()
    with open(log_path, "w", encoding="utf-8") as f:
        proc, rc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True), None
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        finally:  # at the timeout, or on Ctrl-C (it reaches the doctor only): the run's session, Ray workers too
            if rc is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    text = open(log_path, encoding="utf-8", errors="replace").read()
    errors = [line[len("error: "):] for line in text.splitlines() if line.startswith("error: ")]
    error = errors[-1] if errors else ""
    if rc is None:
        rc, error = -9, f"the run did not finish within {timeout:g}s (see {log_path})"
    elif rc < 0 and not error:  # not by the doctor (SIGKILL: most often the out-of-memory killer)
        error = f"the run was killed by signal {-rc}{' (SIGKILL: out of memory?)' * (rc == -9)} (see {log_path})"
    elif rc and not error:
        last = [line.strip() for line in text.splitlines() if line.strip()][-1:]
        error = f"exit code {rc}: {last[0] if last else 'no output'} (see {log_path})"
    checked = len(re.findall(r"weight check: \d+ parameters equal", text))
    run = TrainRun(out, rc, time.monotonic() - t0, error, log_path, checked)
    path = os.path.join(out, "metrics.jsonl")
    if os.path.exists(path):
        for line in open(path, encoding="utf-8"):
            rec = json.loads(line)
            if int(rec.get("rollout_id", -1)) >= 0:
                run.records[int(rec["rollout_id"])] = rec
    log.info("doctor: run finished with exit code %d in %.0fs%s", rc, run.seconds, f": {error}" if error else "")
    return run


# ----------------------------------------------------------------------------------------------- checks from dumps
def _load_rollout(out: str, rollout_id: int) -> tuple[list, list | None]:
    """(samples, trainer per-token log-probs per sample or None) of one rollout from the run's dumps."""
    import torch  # torch: `slime-lite doctor --help` stays instant

    path = os.path.join(out, "rollout_data", f"{rollout_id}.pt")
    if not os.path.exists(path):
        return [], None
    samples = load_rollout_dump(path).samples
    train_path = os.path.join(out, "train_data", f"{rollout_id}.pt")
    lps = torch.load(train_path, weights_only=True).get("log_probs") if os.path.exists(train_path) else None
    return samples, lps


# ----------------------------------------------------------------------------------------------- the doctor
def localize_mismatch(run: TrainRun, args: Any, rollout_id: int = 0) -> dict[str, Any] | None:
    """Layer-by-layer localisation of the worst train/rollout mismatch of ``rollout_id`` (weights of the
    checkpoint the run pushed first: ``--hf-checkpoint``)."""
    samples, lps = _load_rollout(run.out, rollout_id)
    if not samples or lps is None:
        return None
    bound = logprob_diff_threshold(CiConfig.from_args(args))[0]
    i = first_mismatch(samples, lps, bound)
    if i is None:
        return {"rollout_id": rollout_id, "summary": f"no sample of rollout {rollout_id} differs beyond the "
                f"threshold: the mismatch starts at a later push of trained weights (the push, not the forward)"}
    temp = rl_math.scoring_temperature(args.rollout_temperature)
    loc = localize_sample(samples[i], args.hf_checkpoint, engine_dtype=dtype_name(args, "engine"),
                          trainer_dtype=dtype_name(args, "trainer"), temperature=temp, logprob_tol=bound)
    return {"rollout_id": rollout_id, "sample_index": samples[i].index, **loc.as_dict()}


def first_iteration_checks(args: Any, ci: CiConfig, first: dict[str, Any]) -> list[Check]:
    """checks/ci.py's checks of the first rollout's record, but the NLL heuristic (the doctor's on_task_nll rows
    replace it); the step-1 KL only where the policy starts at the reference (``policy_off_reference``: the doctor
    drops --load, so --lora-adapter-path)."""
    checks = rollout_checks(ci, first, first=True, step1_kl=policy_off_reference(args, 0) is None)
    return [c for c in checks if c.name != "step1_log_probs_small"]


def diagnose(user_argv: list[str], out: str, timeout: float = 600.0, rerun: bool = True,
             localize: bool = True, nll_threshold: float = 1.5) -> dict[str, Any]:
    """Run the short job(s) and every check; returns the doctor's report (also written to OUT/doctor.json)."""

    argv = train_argv(user_argv, out)
    args = parse_args(argv)  # a flag error stops here, before anything starts
    if args.rollout_backend != "embedded":  # an SGLang server has no /get_weights_checksum: no weight check
        argv = train_argv(user_argv, out, weight_check=False)
    run = run_train(argv, out, timeout)
    measured = run
    if run.weight_check_failed and rerun:
        log.info("doctor: the weight check failed; running again without it to measure the other checks")
        measured = run_train(train_argv(user_argv, os.path.join(out, "rerun"), weight_check=False),
                             os.path.join(out, "rerun"), timeout)
    samples, lps = _load_rollout(measured.out, 0)
    checks = on_task_checks(args, samples, lps, nll_threshold, f"not measured: {measured.stopped}")
    if samples:
        with quiet():
            checks.append(prompt_format_check(args, samples))
    first = measured.records.get(0, {})
    ci = CiConfig.from_args(args)
    checks += first_iteration_checks(args, ci, first)
    checks += skipped_rows(args, {c.name for c in checks}, measured)
    if "train/train_rollout_logprob_abs_diff" not in first:
        bound, why = logprob_diff_threshold(ci)
        checks.append(_c("train_rollout_logprob_diff", None, f"< {bound:g} ({why})", False,
                         f"not measured: {measured.stopped if measured.error else 'no rollout log-probs'}"))
    checks += mismatch_checks(first)
    checks += routing_check(first, next((c.passed for c in checks if c.name == "train_rollout_logprob_diff"), True))
    checks += [precision_check(args), weight_check(run, args), version_check(measured), iteration2(measured, ci)]
    checks += memory_checks(measured, args)
    runs = [run] if measured is run else [run, measured]
    report: dict[str, Any] = {"out": out, "runs": [_run_info(r) for r in runs],
                              "worst_tokens": first.get("mismatch/worst_tokens", [])}
    by = {c.name: c for c in checks}
    lp = by["train_rollout_logprob_diff"]
    if localize and not lp.passed and lp.value is not None:
        try:
            with quiet():
                report["localization"] = localize_mismatch(measured, args)
        except Exception as exc:  # a diagnosis aid: never hide the table behind it
            log.warning("doctor: localisation failed: %s", exc)
            report["localization"] = {"summary": f"localisation failed: {exc}"}
    _refine(by, report.get("localization"), report["worst_tokens"])
    report["checks"] = [c.as_dict() for c in checks]
    report["passed"] = all(c.passed for c in checks)
    with open(os.path.join(out, "doctor.json"), "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2, default=str)
    return report


def _run_info(run: TrainRun) -> dict[str, Any]:
    return {"out": run.out, "returncode": run.returncode, "seconds": round(run.seconds, 1), "error": run.error,
            "log": run.log_path}


def _refine(by: dict[str, Check], loc: dict[str, Any] | None, worst: list[dict[str, Any]] = ()) -> None:
    """Put the evidence other checks found first in the causes of the checks it explains (and name the worst
    tokens of a log-prob failure)."""
    weights_bad = not by["weights_equal_after_push"].passed
    lp = by["train_rollout_logprob_diff"]
    mask = by.get("trained_tokens_without_engine_logprob")
    explained = mask is not None and not mask.passed  # the log-prob cause already names the mask and the tokens
    if not lp.passed and lp.value is not None and not explained:
        evidence = [f"localised: {loc['summary']}"] if loc else []
        if not by["precision_match"].passed and "precision" not in " ".join(evidence):
            evidence.append(by["precision_match"].cause)
        if weights_bad:
            evidence.append("the engine holds other weights than the trainer (see weights_equal_after_push)")
        if evidence:
            lp.cause = "; ".join(evidence)
        if worst:
            lp.cause = f"{lp.cause} [{describe_worst_tokens(worst)}]"
    for name in ("on_task_nll", "on_task_repetition", "on_task_valid_chars"):
        if not by[name].passed and weights_bad and by[name].value is not None:
            by[name].cause = "the engine generated with other weights than the trainer's (see weights_equal_after_push)"


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if value == 0 or 1e-3 <= abs(value) < 1e5 else f"{value:.2e}"
    return str(value)


def print_report(report: dict[str, Any]) -> None:
    console = make_console()
    table = Table(title="slime-lite doctor", show_lines=False)
    for col in ("check", "value", "threshold", "pass", "likely cause"):
        table.add_column(col, overflow="fold")
    for c in report["checks"]:
        mark = "[green]PASS[/green]" if c["passed"] else "[red]FAIL[/red]"
        if c["threshold"].startswith("info:"):  # a value to read (mismatch rows), not a check
            mark = "info"
        elif c["cause"].startswith("skipped:"):  # a check this run's flags leave out (the cause says why)
            mark = "skip"
        table.add_row(c["name"], _fmt(c["value"]), c["threshold"], mark, c["cause"])
    console.print(table)
    loc = report.get("localization")
    if loc:
        console.print(f"localisation (rollout {loc.get('rollout_id', '?')}, sample {loc.get('sample_index', '?')}): "
                      f"{loc['summary']}")
        if loc.get("layers"):
            lt = Table(title="HF (engine) vs Megatron (trainer), layer by layer")
            for col in ("layer", "max abs diff", "rel diff"):
                lt.add_column(col)
            for d in loc["layers"]:
                style = "red" if d["name"] == loc.get("first_divergent") else ""
                lt.add_row(d["name"], f"{d['max_abs_diff']:.2e}", f"{d['rel_diff']:.2e}", style=style)
            console.print(lt)
    lp = next((c for c in report["checks"] if c["name"] == "train_rollout_logprob_diff"), None)
    if lp is not None and not lp["passed"] and report.get("worst_tokens"):
        wt = Table(title="worst tokens of rollout 0 (--get-mismatch-metrics; all: mismatch/0.jsonl)")
        for col in ("sample", "position", "token", "train log-prob", "rollout log-prob", "abs diff"):
            wt.add_column(col)
        for w in report["worst_tokens"]:
            wt.add_row(str(w["sample"]), str(w["position"]), repr(w["token"]), f"{w['train_log_prob']:.4g}",
                       f"{w['rollout_log_prob']:.4g}", f"{w['abs_diff']:.3g}")
        console.print(wt)
    failed = [c["name"] for c in report["checks"] if not c["passed"]]
    console.print(f"{'all checks passed' if not failed else 'FAILED: ' + ', '.join(failed)}; "
                  f"report: {os.path.join(report['out'], 'doctor.json')}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="slime-lite doctor", allow_abbrev=False,
        description="Run a 2-iteration job with the flags of `slime-lite train` and check it against the "
                    "precision-alignment checklist (weights pushed and equal, rollout vs train log-probs, step-1 KL, "
                    "iteration 2, on-task text). Any flag not listed here goes to `slime-lite train`.",
    )
    p.add_argument("--out", default="slime-lite-doctor", help="folder for the metrics, dumps, log and doctor.json")
    p.add_argument("--run-timeout", type=float, default=600.0, help="seconds per train run")
    p.add_argument("--nll-threshold", type=float, default=1.5,
                   help="most mean trainer NLL per response token for rollouts to count as on-task language")
    p.add_argument("--no-rerun", action="store_true", help="after a failed weight check, do not run again without it")
    p.add_argument("--no-localize", action="store_true", help="skip the layer-by-layer localisation")
    return p


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """The doctor's own forwards (format check, localisation) without progress bars or Megatron start-up lines."""

    from transformers.utils import logging as hf_logging  # transformers: only for the on-task checks

    loggers = {name: logging.getLogger(name) for name in ("megatron", "slime_lite.backends")}
    levels = {name: lg.level for name, lg in loggers.items()}
    bars, verbosity = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    for lg in loggers.values():
        lg.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for name, lg in loggers.items():
            lg.setLevel(levels[name])
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        build_parser().print_help()
        return 0
    ours, rest = build_parser().parse_known_args(argv)
    report = diagnose(rest, os.path.abspath(ours.out), ours.run_timeout, rerun=not ours.no_rerun,
                      localize=not ours.no_localize, nll_threshold=ours.nll_threshold)
    print_report(report)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    setup_logging()
    raise SystemExit(run_main(main))
