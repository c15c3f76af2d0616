"""The doctor's checks of a finished run (``slime-lite doctor``): weights, weight versions, iteration 2, precision,
memory and the --get-mismatch-metrics rows, read from the run's exit, error line and metrics; the per-rollout
checks themselves are slime_lite/checks/ci.py's. No torch or Ray at import.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

from slime_lite.checks.ci import (
    CAUSES,
    Check,
    cuda_available,
    dtype_name,
    iteration2_check,
    logprob_diff_threshold,
    make_check,
    policy_off_reference,
)
from slime_lite.config import CiConfig, has_reference_model

_check = make_check


# --get-mismatch-metrics in the doctor's table: shown for reading, not pass/fail (healthy low-precision runs have a
# few tokens past any fixed ratio bound; train_rollout_logprob_diff is the check).
MISMATCH_ROWS = (
    ("token_ratio_max", "info: largest exp(train - rollout) over loss tokens (1 when they agree)"),
    ("token_ratio_min", "info: smallest token ratio (1 when they agree)"),
    ("token_ratio_outside_frac", "info: share of loss tokens with a ratio outside [1/c, c], c = "
                                 "--mismatch-ratio-bound"),
    ("seq_ratio_max", "info: largest per-sample ratio (product over its tokens)"),
    ("seq_ratio_outside_frac", "info: share of samples with a ratio outside [1/c, c]"),
    ("k3_kl", "info: k3 estimate of KL(rollout || train) per token"),
)


def mismatch_checks(record: dict[str, Any]) -> list[Check]:
    """The --get-mismatch-metrics values of one metrics record as informational rows (mismatch_<name>)."""
    return [make_check(f"mismatch_{name}", record[f"mismatch/{name}"], what, True)
            for name, what in MISMATCH_ROWS if f"mismatch/{name}" in record]


def routing_check(record: dict[str, Any], logprobs_agree: bool) -> list[Check]:
    """Under --use-rollout-routing-replay: the share of (token, layer) pairs the trainer would have routed to other
    experts than the engine (train/routing_mismatch), next to the log-prob check: informational while log-probs
    agree; when they do not and routing differs too, routing is named as the likely cause."""
    mismatch = record.get("train/routing_mismatch")
    if mismatch is None:
        return []
    layers = {k.rsplit("_", 1)[1]: v for k, v in record.items() if k.startswith("train/routing_mismatch/layer_")}
    worst = max(layers, key=layers.get) if layers else None
    what = "info: share of routed (token, layer) pairs whose trainer top-k differs from the engine's (0: agree)"
    if logprobs_agree or mismatch == 0:
        return [make_check("routing_agreement", mismatch, what, True)]
    cause = (f"engine and trainer route {mismatch:.1%} of the (token, layer) pairs to different experts (worst: layer "
             f"{worst}, {layers[worst]:.1%}): the likely cause of the log-prob disagreement; replay is on, so the "
             "trainer used the engine's experts: check the router weights pushed to the engine (weights_equal_after_"
             "push) and the router dtype (--moe-router-dtype fp32)")
    return [make_check("routing_agreement", mismatch, what, False, cause)]


def describe_worst_tokens(worst: list[dict[str, Any]], n: int = 3) -> str:
    """'worst tokens: '7' (sample 3, position 1): train -0.12 vs rollout -2.3; ...' from mismatch/worst_tokens."""
    parts = []
    for w in worst[:n]:
        token = w["token"] if w.get("token") is not None else f"id {w['token_id']}"
        parts.append(f"{token!r} (sample {w['sample']}, position {w['position']}): train {w['train_log_prob']:.3g} "
                     f"vs rollout {w['rollout_log_prob']:.3g}")
    return "worst tokens: " + "; ".join(parts) if parts else ""


# ------------------------------------------------------------------ checks of a finished run (slime-lite doctor)
@dataclass
class TrainRun:
    out: str
    returncode: int
    seconds: float
    error: str = ""  # the run's last "error: ..." line, if any
    log_path: str = ""
    weight_checks_passed: int = 0  # pushes verified equal ("weight check: ... equal" log lines)
    records: dict[int, dict[str, Any]] = field(default_factory=dict)

    @property
    def weight_check_failed(self) -> bool:
        return "--check-weight-update-equal" in self.error

    @property
    def stopped(self) -> str:
        """Why the run ended early, short: the weight check's long message is shown once, in its own row."""
        if self.weight_check_failed:
            return "the run stopped at the weight check (see weights_equal_after_push)"
        return f"the run stopped: {self.error}" if self.error else "the run stopped early"


def precision_check(args: Any) -> Check:
    engine, trainer = dtype_name(args, "engine"), dtype_name(args, "trainer")
    return _check("precision_match", None, f"engine {engine} == trainer {trainer}", engine == trainer,
                  f"engine runs in {engine}, trainer in {trainer}: a dtype cast between them makes rollout and "
                  "train log-probs differ (use --engine-dtype matching the trainer, or --bf16 on both sides)")


def _checkpoint_param_count(hf_dir: str) -> int | None:
    try:
        from safetensors import safe_open

        files = [f for f in os.listdir(hf_dir) if f.endswith(".safetensors")]
        return sum(len(list(safe_open(os.path.join(hf_dir, f), framework="pt").keys())) for f in files) or None
    except (OSError, ImportError, ValueError):
        return None


def weight_check(run: TrainRun, args: Any) -> Check:
    """From the run's exit: did every push leave the engine with the trainer's weights? Names the likely cause."""
    name, threshold = "weights_equal_after_push", "0 differing parameters"
    if args.rollout_backend != "embedded" or "has no /get_weights_checksum" in run.error:
        return Check(name, None, threshold, True, "skipped: the check reads the embedded engine's "
                     "/get_weights_checksum; an SGLang server hashes its own fused, sharded tensors (run the doctor "
                     "with --rollout-backend embedded to check the push)")
    if not run.weight_check_failed:
        if run.returncode == 0 or run.weight_checks_passed:
            return _check(name, 0.0, "0 differing parameters (checked after every push)", True)
        return _check(name, None, threshold, False, f"the weight check never ran: {run.error or 'no push verified'}")
    m = re.search(r"(\d+) differ (\[[^\]]*\])", run.error)
    if not m:
        return _check(name, None, threshold, False, run.error)
    missing = re.search(r"(\d+) never pushed (\[[^\]]*\])", run.error)
    names = re.findall(r"'([^']+)'", m.group(2) + (missing.group(2) if missing else ""))
    n = int(m.group(1)) + (int(missing.group(1)) if missing else 0)
    layers = sorted({int(x) for x in re.findall(r"layers\.(\d+)\.", " ".join(names))})
    total = _checkpoint_param_count(args.hf_checkpoint)
    pp = args.pipeline_model_parallel_size
    of = f"{n} of {total}" if total else str(n)
    if pp > 1 and layers and (total is None or n < total):
        why = (f"{of} parameters differ, decoder layers among them (e.g. layer {layers[0]}), with "
               f"--pipeline-model-parallel-size {pp}: a layer-id mapping error in the conversion (a PP stage's "
               "layer offset lost) is the likely cause")
    elif total is not None and n >= total:
        why = (f"all {n} parameters differ{' at the first push' if not run.records else ''}: the engine never "
               "received the pushed weights (push skipped, or sent to another engine)")
    else:
        why = f"{of} parameters differ: a parameter the push skipped, a name mapping error, or a dtype cast"
    return _check(name, float(n), threshold, False, f"{why} [e.g. {', '.join(names[:3])}]")


def version_check(run: TrainRun) -> Check:
    """Rollout r must be generated with the weights pushed after r trained rollouts (weight version r). When the
    samples carry no versions (a generate hook that records none), the run read them from the engines: said so."""
    name, threshold = "weight_version_served", "rollout r served by version r"
    seen = {r: rec.get("rollout/weight_version") for r, rec in sorted(run.records.items())}
    if any(rec.get("rollout/weight_version_from_engines") for rec in run.records.values()):
        threshold += " (read from the engines: the samples carry no weight_versions)"
    if not seen:
        return _check(name, None, threshold, False, f"no rollout finished: {run.stopped}")
    bad = [r for r, v in seen.items() if v is None or int(v) != r]
    last = seen[max(seen)]
    shown = ", ".join(f"rollout {r}: {'none' if v is None or v < 0 else int(v)}" for r, v in seen.items())
    return _check(name, None if last is None else float(last), threshold, not bad,
                  f"engine weight versions {shown}: the engine never received the pushed weights (it still serves "
                  "the checkpoint it loaded, or an older push); check the weight push")


def iteration2(run: TrainRun, cfg: CiConfig) -> Check:
    """The second iteration ran on reloaded weights: its train/rollout log-prob diff and first-step ppo_kl."""
    base = iteration2_check(len(run.records))
    if not base.passed:
        base.cause = f"{run.stopped}. {base.cause}" if run.error else base.cause
        return base
    rec = run.records[max(run.records)]
    diff = rec.get("train/train_rollout_logprob_abs_diff")
    ppo_kl = rec.get("train/first_step/ppo_kl", 0.0)
    bound = logprob_diff_threshold(cfg)[0]
    # (--lora-dropout: the train step's forward drops what the old log-probs' forward kept, a KL by design)
    kl_ok = bool(cfg.ci_disable_kl_checker or cfg.lora_dropout or ppo_kl == 0.0)
    passed = diff is not None and diff < bound and kl_ok
    first = run.records[min(run.records)].get("train/train_rollout_logprob_abs_diff")
    if passed:
        cause = ""
    elif diff is not None and math.isnan(diff):
        cause = (f"iteration 2's train/rollout log-prob diff is {diff}: the trainer's or the engine's log-probs are "
                 "not finite (weights broken by the push or by the training step; see weights_equal_after_push)")
    elif diff is not None and diff >= bound and first is not None and first < bound:
        cause = (f"iteration 1 agreed ({first:.2e}) but iteration 2 does not: the engine did not reload the trained "
                 "weights (push skipped, or a parameter lost on the way); see weight_version_served")
    elif diff is not None and diff >= bound:
        cause = "rollout and train log-probs disagree from the first iteration on (see train_rollout_logprob_diff)"
    elif not kl_ok:
        cause = f"first-step ppo_kl of iteration 2 is {ppo_kl:g}, not 0: {CAUSES['first_step_ppo_kl_zero']}"
    else:
        cause = ("iteration 2's train/rollout log-prob diff was not measured (no rollout log-probs: a generate hook "
                 "that records none), so the reload of the trained weights is unchecked")
    return _check("iteration2_reload", diff, f"2nd iteration ran, log-prob diff < {bound:g}, ppo_kl == 0", passed,
                  cause)


MEMORY_CAUSE = ("trainer and engines compete for memory: lower --rollout-batch-size / --micro-batch-size / "
                "--engine-kv-cache-tokens, or use --offload-train / --offload-rollout under --colocate")


def memory_checks(run: TrainRun, args: Any, headroom: float = 0.1) -> list[Check]:
    """Peak memory per process group (RSS; CUDA when used) and the headroom left on the host and GPU."""
    groups: dict[str, dict[str, float]] = {}
    for rec in run.records.values():
        for key, value in rec.items():
            m = re.match(r"perf/memory/([^/]+)/(peak_rss_mb|cuda_peak_mb)$", key)
            # engine_released / actor_offloaded: the same processes measured after a release or offload (their
            # lifetime peaks again), not more processes
            if m and isinstance(value, (int, float)) and not m.group(1).endswith(("_released", "_offloaded")):
                g = groups.setdefault(m.group(1), {})
                g[m.group(2)] = max(g.get(m.group(2), 0.0), float(value))
    if not groups:
        return [_check("peak_memory", None, "measured", False, f"no memory reported: {run.stopped}")]
    counts = {"actor": args.actor_num_nodes * args.actor_num_gpus_per_node,
              "critic": args.critic_num_nodes * args.critic_num_gpus_per_node,
              "engine": max(1, args.rollout_num_gpus // args.rollout_num_gpus_per_engine), "rollout_manager": 1}
    checks = []
    for name, g in sorted(groups.items()):
        n = counts.get(name, 1)
        checks.append(_check(f"peak_memory/{name}", g.get("peak_rss_mb"), f"RSS MB per process (x{n})", True))
        if g.get("cuda_peak_mb"):
            checks.append(_check(f"peak_cuda/{name}", g["cuda_peak_mb"], "CUDA MB per process", True))
    total_mb = _total_ram_mb()
    if total_mb:
        free = 1.0 - sum(g.get("peak_rss_mb", 0.0) * counts.get(n, 1) for n, g in groups.items()) / total_mb
        checks.append(_check("memory_headroom", free, f">= {headroom:.0%} of {total_mb / 1024:.0f} GiB RAM free "
                             "at peak", free >= headroom, MEMORY_CAUSE))
    gpu_mb = _gpu_total_mb()
    cuda = [g["cuda_peak_mb"] for g in groups.values() if g.get("cuda_peak_mb")]
    if gpu_mb and cuda:
        # colocated with both offloads (--colocate turns them on) the trainer's and the engines' peaks are in
        # different phases; colocated without them they add up
        shared = args.colocate and not (args.offload_train and args.offload_rollout)
        free = 1.0 - (sum(cuda) if shared else max(cuda)) / gpu_mb
        checks.append(_check("gpu_memory_headroom", free, f">= {headroom:.0%} of {gpu_mb / 1024:.0f} GiB per GPU "
                             "free at peak", free >= headroom, MEMORY_CAUSE))
    return checks


def _total_ram_mb() -> float | None:
    try:
        for line in open("/proc/meminfo", encoding="utf-8"):
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return None


def _gpu_total_mb() -> float | None:
    if not cuda_available():
        return None
    import torch  # torch: only where a GPU is asked about

    return torch.cuda.get_device_properties(0).total_memory / 2**20


# The first iteration's rows that a run may not measure: (name, threshold) in the order rollout_checks gives them.
FIRST_ITERATION_ROWS = (("step1_kl_zero", "== 0 (log_probs == ref_log_probs)"), ("first_step_ppo_kl_zero", "== 0"),
                        ("grad_norm_finite", "finite"))


def skipped_rows(args: Any, present: set[str], run: TrainRun) -> list[Check]:
    """A row for each first-iteration check the run did not measure, saying why (so no row silently disappears):
    step-1 KL needs a reference model and a policy that starts at it, anything else a first iteration that
    finished."""
    rows = []
    for name, threshold in FIRST_ITERATION_ROWS:
        if name in present:
            continue
        if name != "grad_norm_finite" and args.ci_disable_kl_checker:
            why = "skipped: --ci-disable-kl-checker (drop it to check that the KL is zero at step 1)"
        elif name == "step1_kl_zero" and not has_reference_model(args):
            why = "skipped: no reference model in this run (add --use-kl-loss, --kl-coef or --ref-load to check it)"
        elif name == "step1_kl_zero" and policy_off_reference(args, 0):
            why = f"skipped: {policy_off_reference(args, 0)} (its KL is not zero at step 1)"
        elif name == "first_step_ppo_kl_zero" and args.lora_dropout:
            why = ("skipped: --lora-dropout (the train step's forward drops other activations than the old "
                   "log-probs' forward: ppo_kl is not zero by design)")
        else:
            why = f"not measured: {run.stopped if run.error else 'the first iteration did not report it'}"
        rows.append(Check(name, None, threshold, passed=why.startswith("skipped"), cause=why))
    return rows
