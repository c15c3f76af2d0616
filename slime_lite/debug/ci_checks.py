"""The seed's step-1 / step-2 precision checks as data: each check has a value, a threshold, and the likely causes.

``--ci-test`` runs ``rollout_checks`` on every metrics record and stops the run at the first failure;
``slime-lite doctor`` shows the same checks as a table, plus the checks of a finished run below (weights, weight
versions, iteration 2, precision, memory) read from its exit, error line and metrics. No torch or Ray at import.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from slime_lite.config import LOGPROB_DIFF_BY_DTYPE, CiConfig
from slime_lite.errors import SlimeLiteError

CAUSES = {
    "step1_kl_zero": (
        "trainer and reference forwards differ at step 1: a non-deterministic kernel (e.g. Transformer Engine "
        "fused attention; try --transformer-impl local), reference weights loaded from a different checkpoint "
        "(--ref-load), or micro-batches padded differently between the two passes"
    ),
    "first_step_ppo_kl_zero": (
        "the old log-probs and the first training forward differ: a Megatron/Transformer Engine numerics bug "
        "(for MoE models: Megatron's moe_permute_fusion left off), dropout left on, or data reordered between "
        "the passes"
    ),
    "train_rollout_logprob_diff": (
        "the engine samples from other weights or another distribution than the trainer scores: weights never "
        "pushed or pushed with a wrong name/layer-id mapping (PP > 1), the engine in a lower precision than the "
        "trainer, a temperature mismatch (--rollout-temperature vs the engine's sampling), or a chat template "
        "that the engine and the trainer apply differently"
    ),
    "grad_norm_finite": (
        "training configuration problem: reward scale, KL coefficient, learning rate or data concatenation; with "
        "--num-steps-per-rollout 1 a large grad-norm at step 1 points to Megatron/TE bugs"
    ),
    "step1_log_probs_small": (
        "log-probs far from the SFT loss level: data that does not follow the model's chat template or its "
        "warm-start distribution (check --apply-chat-template and the prompt format), or weights not loaded"
    ),
    "on_task_nll": (
        "the trainer finds the rollouts unlikely (gibberish or off-task): weights not loaded (check the Megatron "
        "checkpoint load in the log), weights pushed wrongly (name/layer-id mapping under PP > 1; see "
        "--check-weight-update-equal), an engine buffer released too early, or a pretrain model that needs its "
        "instruct version / the chat template it was trained with"
    ),
    "on_task_repetition": (
        "degenerate, repeating rollouts: broken or partly pushed engine weights, a wrong stop token/eos, or a "
        "sampling temperature far below the trainer's"
    ),
    "on_task_valid_chars": (
        "rollouts use characters the task never answers with: wrong weights in the engine, a tokenizer that does "
        "not match the checkpoint, or prompts formatted unlike the model's training data"
    ),
    "iteration2_ran": (
        "the second iteration did not run: weights could not be reloaded into the engines, or memory ran out "
        "(check the placement: trainer and engines competing for the same GPUs under --colocate)"
    ),
}


@dataclass
class Check:
    name: str
    value: float | None
    threshold: str
    passed: bool
    cause: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def make_check(name: str, value: float | None, threshold: str, passed: bool, cause: str | None = None) -> Check:
    """A Check whose cause is ``cause`` (or the listed causes of ``name``) when it failed, empty when it passed."""
    return Check(name, value, threshold, passed, "" if passed else (cause or CAUSES.get(name, "")))


_check = make_check


def rollout_checks(cfg: CiConfig, record: dict[str, Any], first: bool, rollout_id: int | None = None,
                   expected_version: int | None = None) -> list[Check]:
    """Checks for one iteration's metrics record; ``first`` marks the run's first trained rollout. With
    ``rollout_id`` the engine's weight version is checked too (the doctor checks it over the whole run instead):
    it must be ``expected_version`` (default rollout_id; --async: rollout_id - 1 after the first rollout). A rollout
    generated with older weights than the trainer's (off-policy) skips the train/rollout log-prob check."""
    checks: list[Check] = []
    expected = rollout_id if expected_version is None else expected_version
    if first and "rollout/log_probs_ref_max_abs_diff" in record:
        diff = record["rollout/log_probs_ref_max_abs_diff"]
        checks.append(_check("step1_kl_zero", diff, "== 0 (log_probs == ref_log_probs)", diff == 0.0))
    if first and "rollout/log_probs" in record:
        lp = -record["rollout/log_probs"]
        bound = cfg.ci_nll_threshold
        checks.append(_check("step1_log_probs_small", lp, f"mean NLL < {bound}", lp < bound))
    if "train/first_step/ppo_kl" in record:
        value = record["train/first_step/ppo_kl"]
        checks.append(_check("first_step_ppo_kl_zero", value, "== 0", value == 0.0))
    if rollout_id is not None and "rollout/weight_version" in record:  # stale weights: the root cause of a log-prob gap
        version = record["rollout/weight_version"]
        checks.append(_check("weight_version_served", version, f"== {expected} (the weights pushed after "
                             f"{expected} trained rollouts)", version == expected, VERSION_CAUSE))
    if "train/train_rollout_logprob_abs_diff" in record and expected == rollout_id:
        value = record["train/train_rollout_logprob_abs_diff"]
        bound, why = logprob_diff_threshold(cfg)
        checks.append(_check("train_rollout_logprob_diff", value, f"< {bound:g} ({why})", value < bound))
    if "train/first_step/grad_norm" in record:
        value = record["train/first_step/grad_norm"]
        bound = cfg.ci_grad_norm_threshold
        checks.append(_check("grad_norm_finite", value, f"finite, < {bound:g}", math.isfinite(value) and value < bound))
    return checks


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


def describe_worst_tokens(worst: list[dict[str, Any]], n: int = 3) -> str:
    """'worst tokens: '7' (sample 3, position 1): train -0.12 vs rollout -2.3; ...' from mismatch/worst_tokens."""
    parts = []
    for w in worst[:n]:
        token = w["token"] if w.get("token") is not None else f"id {w['token_id']}"
        parts.append(f"{token!r} (sample {w['sample']}, position {w['position']}): train {w['train_log_prob']:.3g} "
                     f"vs rollout {w['rollout_log_prob']:.3g}")
    return "worst tokens: " + "; ".join(parts) if parts else ""


VERSION_CAUSE = ("the engine generated this rollout with older weights than the trainer last pushed: the push was "
                 "skipped or went to another engine (check the weight push; --check-weight-update-equal)")


def logprob_diff_threshold(cfg: CiConfig) -> tuple[float, str]:
    """The bound on train/train_rollout_logprob_abs_diff in use, and why: the flag, else the default for the
    precision engine and trainer compute in (the tighter one when they differ)."""
    if cfg.ci_logprob_diff_threshold is not None:
        return cfg.ci_logprob_diff_threshold, "set by --ci-logprob-diff-threshold"
    engine, trainer = dtype_name(cfg, "engine"), dtype_name(cfg, "trainer")
    if engine == trainer:
        return LOGPROB_DIFF_BY_DTYPE[engine], f"the default for {engine} engine and trainer"
    tight = min((engine, trainer), key=LOGPROB_DIFF_BY_DTYPE.__getitem__)
    return LOGPROB_DIFF_BY_DTYPE[tight], (f"engine {engine}, trainer {trainer}: the {tight} default, since a dtype "
                                          "mismatch is itself a fault")


def with_engine_dtype(cfg: CiConfig, urls: list[str]) -> CiConfig:
    """``cfg`` with ``engine_dtype`` "auto" replaced by the dtype the first engine reports (its /get_server_info):
    the driver may not see the engines' GPUs, so it cannot tell their precision itself."""
    if cfg.engine_dtype != "auto" or not urls:
        return cfg
    from slime_lite.engine_client import request_json

    try:
        info = request_json(urls[0], "/get_server_info", timeout=30.0, method="GET")
    except Exception:  # an engine without the route: the precision is then derived from the flags
        return cfg
    reported = str((info or {}).get("dtype", "")).removeprefix("torch.") if isinstance(info, dict) else ""
    return replace(cfg, engine_dtype=reported) if reported in LOGPROB_DIFF_BY_DTYPE else cfg


class CiCheckFailed(SlimeLiteError):
    def __init__(self, check: Check, rollout_id: int) -> None:
        self.check = check
        super().__init__(
            f"--ci-test: check {check.name} failed at rollout {rollout_id}: value {check.value!r}, expected "
            f"{check.threshold}. Likely causes: {check.cause}."
        )


ADVISORY = {"step1_log_probs_small"}  # a heuristic, not enforced by --ci-test (the doctor shows on_task_nll)


def enforce(cfg: CiConfig, record: dict[str, Any], rollout_id: int, first: bool,
            expected_version: int | None = None) -> list[Check]:
    checks = rollout_checks(cfg, record, first, rollout_id, expected_version)
    for check in checks:
        if not check.passed and check.name not in ADVISORY:
            raise CiCheckFailed(check, rollout_id)
    return checks


def iteration2_check(rollouts_done: int) -> Check:
    return _check("iteration2_ran", float(rollouts_done), ">= 2 iterations", rollouts_done >= 2)


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


def dtype_name(args: Any, side: str) -> str:
    if side == "trainer":
        return "bfloat16" if args.bf16 else "float32"
    if args.engine_dtype != "auto":
        return args.engine_dtype
    if args.rollout_device == "cpu" or not cuda_available():
        return "float32"
    cfg = json.load(open(os.path.join(args.hf_checkpoint, "config.json"), encoding="utf-8"))
    name = str(cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16").removeprefix("torch.")
    return name if name in ("float32", "bfloat16", "float16") else "bfloat16"


def cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


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
    """Rollout r must be generated with the weights pushed after r trained rollouts (weight version r)."""
    name, threshold = "weight_version_served", "rollout r served by version r"
    seen = {r: rec.get("rollout/weight_version") for r, rec in sorted(run.records.items())}
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
    passed = diff is not None and diff < bound and ppo_kl == 0.0
    first = run.records[min(run.records)].get("train/train_rollout_logprob_abs_diff")
    if passed:
        cause = ""
    elif diff is not None and diff >= bound and first is not None and first < bound:
        cause = (f"iteration 1 agreed ({first:.2e}) but iteration 2 does not: the engine did not reload the trained "
                 "weights (push skipped, or a parameter lost on the way); see weight_version_served")
    elif diff is not None and diff >= bound:
        cause = "rollout and train log-probs disagree from the first iteration on (see train_rollout_logprob_diff)"
    else:
        cause = f"first-step ppo_kl of iteration 2 is {ppo_kl:g}, not 0: {CAUSES['first_step_ppo_kl_zero']}"
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
            if m and isinstance(value, (int, float)):
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
        free = 1.0 - (sum(cuda) if args.colocate else max(cuda)) / gpu_mb
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
    import torch

    return torch.cuda.get_device_properties(0).total_memory / 2**20
