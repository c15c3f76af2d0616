"""The one way metrics leave the driver: a readable line, a JSON line in ``--metrics-path``, TensorBoard, wandb."""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import sys
from typing import Any

from slime_lite.errors import SlimeLiteError
from slime_lite.io import append_line, atomic_write_text

log = logging.getLogger("slime_lite.metrics")

# short names for the one-line summary, in print order
_SHORT = [
    ("rollout/raw_reward", "reward"),
    ("eval/", "eval"),
    ("rollout/response_len/mean", "resp_len"),
    ("rollout/truncated_ratio", "trunc"),
    ("train/loss", "loss"),
    ("train/pg_loss", "pg"),
    ("train/kl_loss", "kl"),
    ("rollout/kl", "kl_rollout"),
    ("train/ppo_kl", "ppo_kl"),
    ("train/grad_norm", "grad_norm"),
    ("train/train_rollout_logprob_abs_diff", "lp_diff"),
    ("train/critic-value_loss", "v_loss"),  # the critic's metrics (PPO): slime's train/critic-<name>
    ("perf/step_time", "step_s"),
]


# Metrics that measure the machine rather than the run's numbers (wall-clock times and clock readings, throughput,
# memory): they differ between two runs that compute the same thing, so comparisons of runs leave them out
# (slime-lite compare-runs, --deterministic-mode's byte-identity). Every one of them, and nothing else, is under
# one of these prefixes: perf/ (durations, throughput, memory), timeline/ (--async's clock readings per rollout).
TIMING_PREFIXES = ("perf/", "timeline/")


def is_timing_metric(key: str) -> bool:
    return key.startswith(TIMING_PREFIXES)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e5):
            return f"{value:.3e}"
        return f"{value:.4f}"
    return str(value)


def train_steps_path(metrics_path: str) -> str | None:
    """The file of one record per optimizer step beside --metrics-path (metrics.jsonl: metrics.train_steps.jsonl);
    None where the metrics go to a device or stream (/dev/null, /dev/stdout, /proc/self/fd/1)."""
    if os.path.abspath(metrics_path).startswith(("/dev/", "/proc/")) or (
            os.path.exists(metrics_path) and not os.path.isfile(metrics_path)):
        return None
    root, ext = os.path.splitext(metrics_path)
    return f"{root}.train_steps{ext or '.jsonl'}"


class MetricsLogger:
    """A rollout's record (``log``): its summary line, a line of --metrics-path, TensorBoard's and wandb's values at
    the rollout id. Each optimizer step's train metrics (``log_train_steps``): a line of ``train_steps_path``, and
    TensorBoard's and wandb's values of those names against ``train/step``, as slime logs them; the rollout's
    record keeps their mean over the rollout's steps (its other train/ values, such as train/first_step/* and the
    log-prob pass's, stay at the rollout id)."""

    def __init__(self, args: Any) -> None:
        self.path = args.metrics_path
        self.steps_path = train_steps_path(self.path) if self.path else None
        for path in (self.path, self.steps_path):
            if path:
                os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
                _drop_cut_last_line(path)
        self.steps_per_rollout = args.num_steps_per_rollout or 1
        self.next_step: int | None = None  # train/step of the next optimizer step (None: not yet known)
        self.per_step: set[str] = set()  # names TensorBoard and wandb take from the steps, not the rollout's mean
        self.tb = None
        self.wandb = None
        self.wandb_named: set[str] = set()  # each name wandb has been given its x axis
        self.train_steps = None  # --wandb-always-use-train-step: optimizer steps per rollout
        if args.use_tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # torch, tensorboard: only with --use-tensorboard

            self.tb = SummaryWriter(args.tensorboard_dir or os.path.join(args.save or ".", "tensorboard"))
        if args.use_wandb:
            import wandb  # validate_args checked that it is installed

            if args.wandb_mode:  # slime's: overrides the environment's WANDB_MODE
                os.environ["WANDB_MODE"] = args.wandb_mode
            os.environ.setdefault("WANDB_MODE", "offline")
            if args.wandb_host:
                os.environ["WANDB_BASE_URL"] = args.wandb_host
            if args.wandb_key and os.environ["WANDB_MODE"] not in ("offline", "disabled"):
                wandb.login(key=args.wandb_key, host=args.wandb_host)
            resume = {"id": args.wandb_run_id, "resume": "allow"} if args.wandb_run_id else {}
            name = {} if args.wandb_random_suffix else {"name": args.wandb_group}  # --disable-wandb-random-suffix
            self.wandb = wandb.init(project=args.wandb_project, dir=args.wandb_dir, group=args.wandb_group,
                                    entity=args.wandb_team, config=_plain_args(args), **resume, **name)
            self.train_steps = args.num_steps_per_rollout if args.wandb_always_use_train_step else None
            # every metric against the rollout id (as TensorBoard and the JSONL), not wandb's count of log calls
            # (an eval before training made every rollout one step late); --wandb-always-use-train-step: the
            # train step. Each name is given its axis when first logged (``_wandb_log``): no glob, so no question
            # which of two matching globs wins
            self.axis = "train_step" if self.train_steps else "rollout_id"
            self.wandb.define_metric(self.axis)
            self.wandb.define_metric("train/step")

    def log(self, record: dict[str, Any], step: int, step_key: str = "rollout_id", quiet: bool = False) -> None:
        if not record:  # nothing measured (e.g. no eval before training): no line, no row
            return
        record = {k: (float(v) if hasattr(v, "__float__") and not isinstance(v, (int, bool)) else v)
                  for k, v in record.items()}
        full = {step_key: step, **record}
        if not quiet:
            parts = [f"{step_key}={step}"]
            for prefix, short in _SHORT:
                for key in sorted(k for k in record if k == prefix or (prefix.endswith("/") and k.startswith(prefix))):
                    if prefix.endswith("/") and key.count("/") > 1:
                        continue
                    name = key.split("/", 1)[1] if prefix.endswith("/") else short
                    parts.append(f"{name}={_fmt(record[key])}")
            log.info(" ".join(parts))
        if self.path:
            append_line(self.path, json.dumps(full, default=_json_default))
        plotted = {k: v for k, v in record.items() if k not in self.per_step}
        self._tensorboard(plotted, step)
        if self.wandb is not None:
            steps = {"train_step": step * self.train_steps} if self.train_steps else {}
            self._wandb_log({k: v for k, v in plotted.items() if isinstance(v, (int, float))} | {step_key: step}
                            | steps, self.axis)

    def log_train_steps(self, steps: list[dict[str, float]], rollout_id: int) -> None:
        """Each optimizer step of a rollout, at ``train/step`` = rollout id x --num-steps-per-rollout + the step's
        index (slime's count; later, if an earlier rollout trained more steps than that: a resumed run reads the
        steps file for those)."""
        if self.next_step is None:
            self.next_step = self._steps_before(rollout_id)
        first = max(self.next_step, rollout_id * self.steps_per_rollout)
        for k, values in enumerate(steps):
            n = first + k
            if self.steps_path:
                append_line(self.steps_path, json.dumps({"train/step": n, "rollout_id": rollout_id, **values},
                                                        default=_json_default))
            self.per_step.update(values)
            self._tensorboard(values, n)
            if self.wandb is not None:
                self._wandb_log({**values, "train/step": n}, "train/step")
        self.next_step = first + len(steps)

    def _steps_before(self, rollout_id: int) -> int:
        """The train/step after the last step the steps file holds of a rollout before ``rollout_id`` (0 if none)."""
        last = -1
        if self.steps_path and os.path.isfile(self.steps_path):
            with open(self.steps_path, encoding="utf-8") as f:
                for line in f:
                    row = json.loads(line)
                    if row.get("rollout_id", rollout_id) < rollout_id:
                        last = max(last, row.get("train/step", -1))
        return last + 1

    def _tensorboard(self, values: dict[str, Any], step: int) -> None:
        if self.tb is None:
            return
        for key, value in values.items():
            if isinstance(value, (int, float)) and math.isfinite(value):
                self.tb.add_scalar(key, value, step)

    def _wandb_log(self, values: dict[str, Any], axis: str) -> None:
        for key in values:
            # ("*" in a name would make it a glob, or an error, to wandb: such a name keeps wandb's own axis)
            if (key not in self.wandb_named and key not in (axis, "train/step", "train_step", "rollout_id")
                    and "*" not in key):
                self.wandb.define_metric(key, step_metric=axis)
                self.wandb_named.add(key)
        self.wandb.log(values)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def process_memory() -> dict[str, float]:
    """This process's resident memory now and at its peak (MB), and CUDA memory when a GPU is in use."""

    out = {"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0}
    try:
        with open("/proc/self/statm") as f:
            out["rss_mb"] = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        pass
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        # torch's allocator plus the engine's mapped buffers (engine/vmm.py; their peak is added to torch's: an
        # upper bound of the process's peak)
        vmm = sys.modules.get("slime_lite.engine.vmm")
        mapped, mapped_peak = vmm.mapped_bytes() if vmm is not None else (0, 0)
        allocated, peak = torch.cuda.memory_allocated() + mapped, torch.cuda.max_memory_allocated() + mapped_peak
        out["cuda_allocated_mb"] = allocated / 2**20
        out["cuda_peak_mb"] = peak / 2**20
        # after an offload or a release: the share of the peak still held (issue 13's aim: <= 0.05)
        out["cuda_allocated_of_peak"] = allocated / max(1, peak)
    return out


def memory_record(name: str, reports: list[dict[str, float]]) -> dict[str, float]:
    """``perf/memory/<name>/<key>``: the largest value over the processes of one group."""
    keys = {k for r in reports for k in r}
    return {f"perf/memory/{name}/{k}": max(r.get(k, 0.0) for r in reports) for k in sorted(keys)}


def _json_default(value: Any) -> Any:
    return float(value) if hasattr(value, "__float__") else str(value)


def _plain_args(args: Any) -> dict[str, Any]:
    return {k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool, list, type(None)))}


def write_args_json(args: Any, path: str) -> None:
    atomic_write_text(json.dumps(_plain_args(args), indent=2, sort_keys=True), path)


def _drop_cut_last_line(path: str) -> None:
    """A record cut short at the end of ``path`` (a run killed, or out of disk, mid-write) is dropped before a
    resumed run appends: glued to the next record it would make both unreadable. The resume logs that rollout
    again."""
    if not os.path.isfile(path):  # (not yet written, or a device such as /dev/null)
        return
    with open(path, "rb+") as f:
        end = f.seek(0, os.SEEK_END)
        if end == 0 or (f.seek(end - 1) >= 0 and f.read(1) == b"\n"):
            return
        cut = 0
        while end > 0:  # back to the last newline, a block at a time
            start = max(0, end - (1 << 16))
            f.seek(start)
            at = f.read(end - start).rfind(b"\n")
            if at >= 0:
                cut = start + at + 1
                break
            end = start
        f.truncate(cut)
    log.warning("--metrics-path %s: its last record was cut short (the run before stopped mid-write); dropped it",
                path)


def _non_finite_losses(values: dict[str, Any]) -> dict[str, float]:
    return {k: v for k, v in values.items()
            if k.rsplit("/", 1)[-1].endswith("loss") and isinstance(v, float) and not math.isfinite(v)}


def check_finite_losses(record: dict[str, Any], rollout_id: int, steps: list[dict[str, Any]] = ()) -> None:
    """Stop the run when a training step reported a NaN or infinite loss (before a checkpoint saves the weights),
    naming the first of the rollout's optimizer ``steps`` that did."""
    bad = _non_finite_losses(record)
    if bad:
        first = next((k for k, step in enumerate(steps) if _non_finite_losses(step)), None)
        at = "" if first is None else f" from its optimizer step {first} of {len(steps)} on"
        raise SlimeLiteError(
            f"rollout {rollout_id}: the training loss is not finite{at} "
            f"({', '.join(f'{k}={v}' for k, v in bad.items())}). "
            "The weights are no longer usable, so the run stops here. Usual causes: a learning rate too high "
            "(--lr), NaN/inf in the rollout log-probs or rewards (slime-lite display-rollouts), or an overflow in "
            "low precision; replay the rollout with --load-debug-rollout-data to reproduce it.")
