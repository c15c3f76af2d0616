"""``slime-lite ima-bisect [train flags] [--toggles ...] [--timeout S] [--core-dump DIR]``: triage an SGLang
illegal memory access (IMA) by bisecting the usual suspects.

The seed's four steps as one command: every job runs with ``CUDA_LAUNCH_BLOCKING=1`` (step 1); one short
rollout-only job per combination of CUDA graph on/off, speculative decoding on/off and DeepEP on/off (steps 2-3,
the last two only when the train flags configure them); with ``--core-dump DIR`` the CUDA core-dump variables are
set too (step 4) and the dumps found are listed with the cuda-gdb command that opens them. Each job is a
subprocess in its own process group, killed at ``--timeout`` (or with ``--stall-timeout S`` once its logs have not
grown for S seconds); nothing it started is left running.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field

from rich.console import Console
from rich.table import Table

from slime_lite.args import NOT_PASSTHROUGH, parse_args
from slime_lite.errors import SlimeLiteError, run_main
from slime_lite.logging_setup import setup_logging

TOGGLES = ("cuda-graph", "spec", "deepep")
TOGGLE_HELP = {
    "cuda-graph": "off = --sglang-disable-cuda-graph (embedded engine: --engine-disable-cuda-graph)",
    "spec": "off = drop the --sglang-speculative-* flags",
    "deepep": "off = drop --sglang-moe-a2a-backend deepep and --sglang-deepep-*",
}
CUDA_ERROR_RE = re.compile(
    r"CUDA error|illegal memory access|illegal instruction|misaligned address|device-side assert|"
    r"unspecified launch failure|Warp Illegal|CUDA_ERROR_ILLEGAL|cudaErrorIllegal|CUDA Exception", re.IGNORECASE)
# with CUDA_ENABLE_COREDUMP_ON_EXCEPTION the driver dumps and aborts before PyTorch can print the error
COREDUMP_RE = re.compile(r"coredump: Starting GPU coredump generation")
KERNEL_RES = (
    re.compile(r"\bkernel(?: name)?\s*[:=]\s*['\"`]?([A-Za-z_][\w:<>,]*)"),
    re.compile(r"\bin kernel\s+['\"`]?([A-Za-z_][\w:<>,]*)"),
)
# cuda-gdb on a core dump: "CUDA Exception: Warp Illegal Address" / "...triggered at PC 0x7f.. kernel_name (file:7)"
GDB_EXCEPTION_RE = re.compile(r"CUDA Exception:\s*(.+)")
GDB_KERNEL_RE = re.compile(r"triggered at PC 0x[0-9a-fA-F]+\s+(\S+)(?:\s+\(([^)]*)\))?")
JOB_MARKER = "SLIME_LITE_IMA_JOB"  # in every job's environment, to find and end whatever the job started
INTERRUPT_GRACE_S = 10.0


@dataclass
class ComboResult:
    off: list[str]
    status: str  # ok | crashed | hung
    returncode: int | None
    seconds: float
    detail: str = ""
    kernel: str | None = None
    log_dir: str = ""
    core_dumps: list[str] = field(default_factory=list)


# ---- flags ---------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="slime-lite ima-bisect",
        usage="slime-lite ima-bisect [train flags] [--toggles T,...] [--timeout S] [--stall-timeout S] "
              "[--core-dump DIR] [--out DIR]",
        description="Run a short rollout-only job (the train flags + --debug-rollout-only --num-rollout 1, with "
                    "CUDA_LAUNCH_BLOCKING=1) once per combination of SGLang toggles, and report which combination "
                    "avoids the crash. Every flag not listed here is a `slime-lite train` flag (it needs "
                    "--rollout-backend sglang). A --num-rollout in the train flags replaces the default 1.",
        allow_abbrev=False,
    )
    p.add_argument("--toggles", default=",".join(TOGGLES),
                   help="comma-separated, from: " + "; ".join(f"{k} ({v})" for k, v in TOGGLE_HELP.items())
                   + ". spec and deepep are toggled only when the train flags configure them")
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds per job before it counts as hung")
    p.add_argument("--stall-timeout", type=float, default=None, metavar="S",
                   help="also count a job as hung, and kill it, once its driver and engine logs have not grown for S "
                        "seconds (a hang found in minutes instead of at --timeout; default: off)")
    p.add_argument("--core-dump", default=None, metavar="DIR", help="turn on CUDA core dumps, written under DIR")
    p.add_argument("--out", default=None, metavar="DIR", help="per-job logs and results.json (default: a temp dir)")
    return p


def parse_bisect_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    opts, train_argv = build_parser().parse_known_args(argv)
    opts.toggles = list(dict.fromkeys(t.strip() for t in opts.toggles.split(",") if t.strip()))  # each once
    bad = [t for t in opts.toggles if t not in TOGGLES]
    if bad:
        raise SlimeLiteError(f"--toggles: unknown {', '.join(bad)}; choose from {', '.join(TOGGLES)}.")
    if opts.timeout <= 0:
        raise SlimeLiteError(f"--timeout {opts.timeout} must be > 0 seconds.")
    if opts.stall_timeout is not None and opts.stall_timeout <= 0:
        raise SlimeLiteError(f"--stall-timeout {opts.stall_timeout} must be > 0 seconds (leave it out to turn it "
                             "off).")
    return opts, train_argv


def _sglang_tokens(argv: list[str]) -> list[tuple[int, int, str, str | None]]:
    """(start, end, name, value) of each --sglang-* flag in argv, split as slime_lite.args.split_sglang_args does."""

    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        name, eq, value = arg.partition("=")
        if arg.startswith("--sglang-") and name not in NOT_PASSTHROUGH:
            if eq:
                out.append((i, i + 1, name, value))
            elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                out.append((i, i + 2, name, argv[i + 1]))
                i += 1
            else:
                out.append((i, i + 1, name, None))
        i += 1
    return out


def _is_spec(name: str, value: str | None) -> bool:
    return name.startswith("--sglang-speculative-")


def _is_deepep(name: str, value: str | None) -> bool:
    return ((name == "--sglang-moe-a2a-backend" and value == "deepep") or name.startswith("--sglang-deepep-")
            or name == "--sglang-enable-deepep-moe")


def _cuda_graph_off_flag(train_argv: list[str]) -> str:
    """The flag that turns CUDA graphs off for the engine these train flags use (SGLang's or the embedded one)."""
    sglang = bool(_sglang_tokens(train_argv)) or any(
        a == "--rollout-backend=sglang" or (a == "--rollout-backend" and train_argv[i + 1:i + 2] == ["sglang"])
        for i, a in enumerate(train_argv))
    return "--sglang-disable-cuda-graph" if sglang else "--engine-disable-cuda-graph"


def detect_toggles(train_argv: list[str], requested: list[str]) -> tuple[list[str], list[str]]:
    """The toggles that apply to these flags, and a note for each requested one that does not."""
    tokens = _sglang_tokens(train_argv)
    names = {name for _, _, name, _ in tokens}
    toggles, notes = [], []
    for t in requested:
        if t == "cuda-graph":
            flag = _cuda_graph_off_flag(train_argv)
            if flag in names or flag in train_argv:
                notes.append(f"cuda-graph: already off in your flags ({flag}); not toggled")
                continue
        elif t == "spec":
            if not any(_is_spec(n, v) for _, _, n, v in tokens):
                notes.append("spec: no --sglang-speculative-* flag given; not toggled")
                continue
        elif t == "deepep":
            if not any(_is_deepep(n, v) for _, _, n, v in tokens):
                notes.append("deepep: --sglang-moe-a2a-backend deepep not given; not toggled")
                continue
        toggles.append(t)
    return toggles, notes


def combinations(toggles: list[str]) -> list[frozenset[str]]:
    """Every subset of toggles to turn off, the full configuration first, then by how many are off."""
    return [frozenset(c) for k in range(len(toggles) + 1) for c in itertools.combinations(toggles, k)]


def combination_argv(train_argv: list[str], off: frozenset[str] | set[str]) -> list[str]:
    """The train flags with the toggles in ``off`` turned off, plus --debug-rollout-only and --num-rollout 1."""
    drop: set[int] = set()
    for start, end, name, value in _sglang_tokens(train_argv):
        if ("spec" in off and _is_spec(name, value)) or ("deepep" in off and _is_deepep(name, value)):
            drop.update(range(start, end))
    argv = [a for i, a in enumerate(train_argv) if i not in drop]
    if "cuda-graph" in off:
        argv.append(_cuda_graph_off_flag(train_argv))
    argv.append("--debug-rollout-only")
    if not any(a == "--num-rollout" or a.startswith("--num-rollout=") for a in argv):
        argv += ["--num-rollout", "1"]
    return argv


def coredump_env(core_dir: str) -> dict[str, str]:
    """CUDA's GPU core dump on exception, without the large memory sections; files core_<host>_<pid>_<time>."""
    return {
        "CUDA_ENABLE_COREDUMP_ON_EXCEPTION": "1",
        "CUDA_COREDUMP_SHOW_PROGRESS": "1",
        "CUDA_COREDUMP_GENERATION_FLAGS":
            "skip_nonrelocated_elf_images,skip_global_memory,skip_shared_memory,skip_local_memory",
        "CUDA_COREDUMP_FILE": os.path.join(os.path.abspath(core_dir), "core_%h_%p_%t"),
        "SGLANG_CUDA_COREDUMP": "1",
    }


def label(off: frozenset[str] | list[str]) -> str:
    return "all on" if not off else "off: " + "+".join(t for t in TOGGLES if t in off)


# ---- running one job -------------------------------------------------------------------------------------------
def marked_pids(marker: str) -> list[int]:
    """Processes whose environment carries ``JOB_MARKER=marker`` (everything a job started, however detached)."""
    needle = f"{JOB_MARKER}={marker}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:
            continue
    return found


def _end_marked(marker: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        pids = marked_pids(marker)
        if not pids or time.monotonic() > deadline:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.2)


def _output_bytes(paths: list[str]) -> int:
    """Bytes in these files and in the files directly under these folders (a job's logs), missing ones as 0."""
    total = 0
    for path in paths:
        try:
            names = [os.path.join(path, n) for n in os.listdir(path)] if os.path.isdir(path) else [path]
        except OSError:
            continue
        for name in names:
            try:
                total += os.path.getsize(name)
            except OSError:
                pass
    return total


def run_job(cmd: list[str], env: dict[str, str], timeout: float, log_path: str, stall_timeout: float | None = None,
            watch: tuple[str, ...] = ()) -> tuple[int | None, str, float]:
    """Run cmd in its own process group, output to log_path; (returncode, why it was killed or "", seconds). It is
    killed at the timeout, or, with ``stall_timeout``, once neither log_path nor any file in the ``watch`` folders
    (the engines' logs) has grown for that long. Killing: the driver gets SIGINT (so it can shut Ray down), then
    the group gets SIGKILL; anything left is ended by pid."""
    marker = uuid.uuid4().hex
    env = {**env, JOB_MARKER: marker}
    t0 = time.monotonic()
    killed = ""
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        size, grew = -1, t0
        try:
            while proc.poll() is None:
                now = time.monotonic()
                if now - t0 >= timeout:
                    killed = "killed at the timeout"
                    break
                if stall_timeout:
                    seen = _output_bytes([log_path, *watch])
                    if seen != size:
                        size, grew = seen, now
                    elif now - grew >= stall_timeout:
                        killed = f"killed after {stall_timeout:g} s without output (--stall-timeout)"
                        break
                time.sleep(min(0.5, max(0.0, timeout - (now - t0))))
            if killed:
                try:
                    os.kill(proc.pid, signal.SIGINT)
                    proc.wait(timeout=INTERRUPT_GRACE_S)
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    pass
        except BaseException:
            killed = "interrupted"
            raise
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
            _end_marked(marker)
    return (None if killed else proc.returncode), killed, time.monotonic() - t0


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def classify(returncode: int | None, killed: str, texts: list[str]) -> tuple[str, str, str | None]:
    """(status, detail, kernel) from the exit, why the job was killed (``run_job``'s, "" if it was not) and the logs
    (engine logs first: that is where a crash starts)."""
    lines = [line.strip() for text in texts for line in text.splitlines() if line.strip()]
    cuda = next((line for line in lines if CUDA_ERROR_RE.search(line)), None)
    kernel = None
    for line in lines:
        for rx in KERNEL_RES:
            m = rx.search(line)
            if m:
                kernel = m.group(1)
                break
        if kernel:
            break
    if cuda is None and any(COREDUMP_RE.search(line) for line in lines):
        cuda = "GPU exception: the CUDA driver wrote a core dump and aborted the process"
    if killed:
        return "hung", killed + (f"; before that: {cuda}" if cuda else ""), kernel
    if cuda:
        return "crashed", cuda, kernel
    if returncode:
        driver = texts[-1].splitlines() if texts else []
        errs = [line for line in driver if line.startswith("error:")]
        last = errs[-1] if errs else next((line for line in reversed(driver) if line.strip()), "")
        return "crashed", f"no CUDA error line; {last.strip()[:300]}", kernel
    return "ok", "", kernel


def inspect_core_dump(path: str, timeout: float = 180.0) -> tuple[str | None, str | None]:
    """(exception, kernel) that cuda-gdb reports for a GPU core dump; (None, None) without cuda-gdb or on failure."""

    gdb = shutil.which("cuda-gdb")
    if gdb is None:
        return None, None
    try:
        proc = subprocess.run([gdb, "-batch", "-ex", f"target cudacore {path}"], capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None, None
    text = proc.stdout + "\n" + proc.stderr
    exc, kern = GDB_EXCEPTION_RE.search(text), GDB_KERNEL_RE.search(text)
    kernel = None
    if kern:
        kernel = kern.group(1) + (f" ({kern.group(2)})" if kern.group(2) else "")
    return (exc.group(1).strip() if exc else None), kernel


def analyse_job(returncode: int | None, killed: str, texts: list[str],
                core_dumps: list[str]) -> tuple[str, str, str | None]:
    """classify(), completed from the first core dump through cuda-gdb when the logs do not name the kernel."""
    status, detail, kernel = classify(returncode, killed, texts)
    if core_dumps and status != "ok" and kernel is None:
        exc, gdb_kernel = inspect_core_dump(core_dumps[0])
        kernel = gdb_kernel
        if exc and (not detail or detail.startswith(("GPU exception", "no CUDA error line"))):
            detail = f"CUDA Exception: {exc} (cuda-gdb on the core dump)"
    return status, detail, kernel


def minimal_off_sets(results: list[ComboResult]) -> list[list[str]]:
    """The smallest sets of toggles to turn off among the combinations that ran cleanly (ties: all of them)."""
    oks = [r.off for r in results if r.status == "ok"]
    if not oks:
        return []
    k = min(len(o) for o in oks)
    return [o for o in oks if len(o) == k]


def _core_files(core_dir: str | None) -> set[str]:
    if not core_dir or not os.path.isdir(core_dir):
        return set()
    return {os.path.join(root, f) for root, _, files in os.walk(core_dir) for f in files}


# ---- the command ---------------------------------------------------------------------------------------------
def run_bisect(opts: argparse.Namespace, train_argv: list[str]) -> list[ComboResult]:
    args = parse_args(combination_argv(train_argv, frozenset()))  # user errors now (SGLang flags too), not in every job
    if args.rollout_backend != "sglang" or args.rollout_external_engine_addrs:
        raise SlimeLiteError("ima-bisect restarts SGLang engines with different flags: it needs --rollout-backend "
                             "sglang and no --rollout-external-engine-addrs.")
    toggles, notes = detect_toggles(train_argv, opts.toggles)
    for note in notes:
        print(f"note: {note}")
    out = os.path.abspath(opts.out or tempfile.mkdtemp(prefix="ima_bisect_"))
    os.makedirs(out, exist_ok=True)
    if opts.core_dump:
        os.makedirs(opts.core_dump, exist_ok=True)
    combos = combinations(toggles)
    print(f"ima-bisect: {len(combos)} job(s) over toggles {toggles or '(none)'}; logs under {out}", flush=True)
    results: list[ComboResult] = []
    for n, off in enumerate(combos):
        job_dir = os.path.join(out, f"{n:02d}_" + ("all-on" if not off else "off-" + "+".join(sorted(off))))
        engine_logs = os.path.join(job_dir, "engine_logs")
        shutil.rmtree(engine_logs, ignore_errors=True)  # an earlier bisect into this --out: its logs are not this job's
        os.makedirs(engine_logs, exist_ok=True)
        env_vars = {"CUDA_LAUNCH_BLOCKING": "1", "SLIME_LITE_ENGINE_LOG_DIR": engine_logs}
        if opts.core_dump:
            env_vars.update(coredump_env(opts.core_dump))
        argv = combination_argv(train_argv, off)
        for key, value in env_vars.items():
            argv += ["--debug-env", f"{key}={value}"]
        cmd = [sys.executable, "-m", "slime_lite.train", *argv]
        with open(os.path.join(job_dir, "command.json"), "w") as f:
            json.dump(cmd, f, indent=1)
        before = _core_files(opts.core_dump)
        print(f"[{n + 1}/{len(combos)}] {label(off)} ...", flush=True)
        driver_log = os.path.join(job_dir, "driver.log")
        rc, killed, secs = run_job(cmd, {**os.environ, **env_vars, "PYTHONUNBUFFERED": "1"}, opts.timeout,
                                   driver_log, opts.stall_timeout, (engine_logs,))
        logs = sorted((os.path.join(engine_logs, f) for f in os.listdir(engine_logs)), key=os.path.getmtime)
        dumps = sorted(_core_files(opts.core_dump) - before, key=os.path.getmtime)
        status, detail, kernel = analyse_job(rc, killed, [_read(p) for p in logs] + [_read(driver_log)], dumps)
        res = ComboResult(sorted(off, key=TOGGLES.index), status, rc, round(secs, 1), detail, kernel, job_dir,
                          dumps)
        print(f"[{n + 1}/{len(combos)}] {label(off)}: {status} ({secs:.0f}s) {detail[:160]}", flush=True)
        results.append(res)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump({"toggles": toggles, "results": [asdict(r) for r in results],
                   "minimal_off": minimal_off_sets(results)}, f, indent=1)
    report(results, toggles, out)
    return results


def report(results: list[ComboResult], toggles: list[str], out: str) -> None:
    console = Console(width=max(120, int(os.environ.get("COLUMNS", "0") or 0)))
    table = Table(title="ima-bisect (every job with CUDA_LAUNCH_BLOCKING=1)")
    table.add_column("#", justify="right")
    for t in toggles:
        table.add_column(t)
    for col in ("result", "exit", "secs", "first CUDA error / detail", "kernel"):
        table.add_column(col, overflow="fold")
    style = {"ok": "green", "crashed": "red", "hung": "yellow"}
    for n, r in enumerate(results):
        table.add_row(str(n), *("off" if t in r.off else "on" for t in toggles),
                      f"[{style[r.status]}]{r.status}[/]", "-" if r.returncode is None else str(r.returncode),
                      f"{r.seconds:.0f}", r.detail or "-", r.kernel or "-")
    console.print(table)
    minimal = minimal_off_sets(results)
    if results and results[0].status == "ok":
        console.print("The full configuration ran cleanly: the crash was not reproduced in this short run "
                      "(pass --num-rollout N among the train flags for a longer one).")
    elif minimal and not minimal[0]:
        console.print("No toggle needs turning off.")
    elif minimal:
        sets = " or ".join("{" + ", ".join(m) + "}" for m in minimal)
        console.print(f"Smallest set of toggles to turn off that avoids the crash: {sets}")
        for m in minimal:
            console.print("  i.e. " + "; ".join(f"{t}: {TOGGLE_HELP[t]}" for t in m))
    else:
        console.print("No combination ran cleanly: the crash does not depend on these toggles. Use --core-dump DIR "
                      "to find the failing kernel.")
    dumps = [d for r in results for d in r.core_dumps]
    if dumps:
        console.print("GPU core dumps (open with cuda-gdb, then `target cudacore FILE`):")
        for d in dumps:
            console.print(f"  cuda-gdb -ex 'target cudacore {d}'")
    console.print(f"logs and results.json: {out}")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        build_parser().print_help()
        return 0
    opts, train_argv = parse_bisect_args(argv)
    results = run_bisect(opts, train_argv)
    return 0 if any(r.status == "ok" for r in results) else 1


if __name__ == "__main__":
    setup_logging()
    raise SystemExit(run_main(main))
