"""The seed's step-1 / step-2 precision checks as data (each check has a value, a threshold and its likely causes),
and what ``--ci-test`` does with them during a run: ``enforce`` on every metrics record (the run stops at the first
failure), the iteration-2 check at the end. ``slime-lite doctor`` shows the same rows as a table. No torch or Ray at
import.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import asdict, dataclass, replace
from typing import Any

from slime_lite.checks.grad_norm import GradNormCI
from slime_lite.config import LOGPROB_DIFF_BY_DTYPE, CiConfig, has_reference_model
from slime_lite.engine_client import request_json
from slime_lite.errors import SlimeLiteError

log = logging.getLogger("slime_lite.train")

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
        "trainer, a temperature mismatch (--rollout-temperature vs the engine's sampling), a chat template "
        "that the engine and the trainer apply differently, or a loss mask that trains tokens the engine did not "
        "generate (a generate hook's inserted tool or environment turns)"
    ),
    "token_drift": (
        "the tokens trained are not the tokens the engine generated: a generate hook or agent re-tokenised a turn's "
        "text, or built the conversation with its own template instead of the tokenizer's chat template (keep the "
        "engine's output ids: rollout.turns.append_turn / rollout.multi_turn.model_turn)"
    ),
    "masked_model_turns": (
        "model turns whose every token has loss mask 0 are never trained: the hook masked them (trainable=False, "
        "a model turn appended without its log-probs, or a hand-built loss_mask)"
    ),
    "trained_tokens_without_engine_logprob": (
        "the loss mask trains tokens the engine did not generate (inserted tool or environment turns with mask 1) "
        "or tokens without rollout log-probs: give inserted turns loss mask 0 (append_turn(..., source='tool')) "
        "and model turns the engine's log-probs"
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
                   expected_version: int | None = None, engines: bool = True, step1_kl: bool = True) -> list[Check]:
    """Checks for one iteration's metrics record; ``first`` marks the run's first trained rollout. With
    ``rollout_id`` the engine's weight version is checked too (the doctor checks it over the whole run instead):
    it must be ``expected_version`` (default rollout_id; --async: rollout_id - 1 after the first rollout). A rollout
    generated with older weights than the trainer's (off-policy) skips the train/rollout log-prob check. A replay
    (``engines`` False) has no engine to check: the version is the dump's. ``step1_kl`` False: the policy does not
    start at the reference's weights (``policy_off_reference``), so the step-1 KL is not expected to be zero."""
    checks: list[Check] = []
    expected = rollout_id if expected_version is None else expected_version
    step1_kl = step1_kl and not cfg.ci_disable_kl_checker  # --ci-disable-kl-checker: no zero-KL checks
    if first and step1_kl and "rollout/log_probs_ref_max_abs_diff" in record:
        diff = record["rollout/log_probs_ref_max_abs_diff"]
        checks.append(_check("step1_kl_zero", diff, "== 0 (log_probs == ref_log_probs)", diff == 0.0))
    if first and "rollout/log_probs" in record:
        lp = -record["rollout/log_probs"]
        bound = cfg.ci_nll_threshold
        checks.append(_check("step1_log_probs_small", lp, f"mean NLL < {bound}", lp < bound))
    # (with --lora-dropout the train step's forward drops what the old log-probs' forward kept: not zero by design)
    if "train/first_step/ppo_kl" in record and not cfg.ci_disable_kl_checker and not cfg.lora_dropout:
        value = record["train/first_step/ppo_kl"]
        checks.append(_check("first_step_ppo_kl_zero", value, "== 0", value == 0.0))
    if engines and rollout_id is not None and "rollout/weight_version" in record:  # stale weights: a log-prob gap
        version = record["rollout/weight_version"]
        checks.append(_check("weight_version_served", version, f"== {expected} (the weights pushed after "
                             f"{expected} trained rollouts)", version == expected, VERSION_CAUSE))
    for name in TURN_CHECKS:  # multi-turn samples (rollout/drift.py): before the log-prob check, which they explain
        key = "rollout/token_drift_samples" if name == "token_drift" else f"rollout/{name}"
        if key in record:
            value = record[key]
            examples = "; ".join(record.get(f"rollout/{name}/examples") or [])
            checks.append(_check(name, value, "== 0", value == 0, f"{CAUSES[name]}. Found: {examples}"))
    # --fully-async: compared over the tokens of the newest weights in the batch, which are the trainer's only when
    # some were generated after the last push (rollout/async/newest_lag 0)
    if "train/train_rollout_logprob_abs_diff" in record and expected == rollout_id \
            and not record.get("rollout/async/newest_lag"):
        value = record["train/train_rollout_logprob_abs_diff"]
        bound, why = logprob_diff_threshold(cfg)
        checks.append(_check("train_rollout_logprob_diff", value, f"< {bound:g} ({why})", value < bound,
                             logprob_cause(record)))
    if "train/first_step/grad_norm" in record:
        value = record["train/first_step/grad_norm"]
        bound = cfg.ci_grad_norm_threshold
        checks.append(_check("grad_norm_finite", value, f"finite, < {bound:g}", math.isfinite(value) and value < bound))
    return checks

TURN_CHECKS = ("token_drift", "masked_model_turns", "trained_tokens_without_engine_logprob")


def logprob_cause(record: dict[str, Any]) -> str:
    """The train/rollout log-prob check's likely causes; first, when the loss mask trains tokens the engine did not
    generate (their rollout log-probs are placeholders, so they always disagree), the mask and those tokens."""
    if record.get("rollout/trained_tokens_without_engine_logprob"):
        examples = "; ".join(record.get("rollout/trained_tokens_without_engine_logprob/examples") or [])
        return (f"the loss mask: {record['rollout/trained_tokens_without_engine_logprob']:g} tokens the engine did "
                f"not generate (inserted turns) are trained with placeholder log-probs ({examples}); give inserted "
                f"turns loss mask 0. Otherwise: {CAUSES['train_rollout_logprob_diff']}")
    return CAUSES["train_rollout_logprob_diff"]


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
            expected_version: int | None = None, engines: bool = True, step1_kl: bool = True) -> list[Check]:
    checks = rollout_checks(cfg, record, first, rollout_id, expected_version, engines, step1_kl)
    for check in checks:
        if not check.passed and check.name not in ADVISORY:
            raise CiCheckFailed(check, rollout_id)
    return checks


def policy_off_reference(args: Any, start_rollout_id: int) -> str | None:
    """Why the run's first rollout is scored with other weights than the reference's (its step-1 KL is then not
    zero by design), or None when the policy starts at the reference: a run resumed from a --load checkpoint (the
    checkpoint's trained weights; the reference is --ref-load / --hf-checkpoint), or --lora-adapter-path (trained
    adapters; the reference is the base without them)."""
    if start_rollout_id > 0:
        return (f"resumed at rollout {start_rollout_id} from a --load checkpoint: the policy's weights are trained, "
                "the reference's are the start weights")
    if args.lora_adapter_path:
        return ("--lora-adapter-path: the policy starts with trained adapters, the reference is the base model "
                "without them")
    return None


def iteration2_check(rollouts_done: int) -> Check:
    return _check("iteration2_ran", float(rollouts_done), ">= 2 iterations", rollouts_done >= 2)


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


class LogprobDiffWatch:
    """Warns when the rollout/train log-prob mismatch jumps between rollouts (names the weight version)."""

    def __init__(self, factor: float) -> None:
        self.factor = factor
        self.best: float | None = None

    def update(self, record: dict) -> None:
        value = record.get("train/train_rollout_logprob_abs_diff")
        if value is None or not self.factor:
            return
        if self.best is not None and not value <= self.factor * max(self.best, 1e-7):  # a NaN warns too
            log.warning(
                "train_rollout_logprob_abs_diff jumped to %.3g (lowest so far %.3g) with engine weight version %s: "
                "check the last weight push (--check-weight-update-equal) and the engine's precision",
                value, self.best, record.get("rollout/weight_version", "?"),
            )
        if math.isfinite(value):  # a NaN is no "lowest so far": min() would keep it and silence every later jump
            self.best = value if self.best is None else min(self.best, value)


class RunChecks:
    """What a training run checks as it goes, after each rollout's training and before its checkpoint (a failing
    rollout's metrics are then written for ``slime-lite compare-runs``, and no checkpoint holds its weights): the
    log-prob jump warning (on-policy rollouts), the ``--ci-test`` checks, and every step's grad-norm
    (--ci-save-grad-norm / --ci-load-grad-norm); at the end,
    --ci-test's iteration-2 check. A run without a trainer (--debug-rollout-only) checks nothing. A replay
    (--load-debug-rollout-data) has no engine: a rollout counts as on-policy when its dump was generated with the
    weights the trainer has at that rollout (the dump's weight version; "default", the checkpoint's own weights, is
    version 0), and the served-version check is left out. A run whose policy does not start at the reference
    (resumed from a checkpoint, --lora-adapter-path: ``policy_off_reference``) is not held to a zero step-1 KL."""

    def __init__(self, args: Any, urls: list[str], start_rollout_id: int, trains: bool) -> None:
        self.ci = with_engine_dtype(CiConfig.from_args(args), urls)  # the log-prob bound follows the engines
        self.enforce = self.ci.ci_test and trains
        self.trains = trains
        self.replay = bool(args.load_debug_rollout_data)
        self.start = start_rollout_id
        self.off_reference = policy_off_reference(args, start_rollout_id)  # the step-1 KL is then not zero
        if self.enforce and self.off_reference and has_reference_model(args):
            log.info("--ci-test: step1_kl_zero is not checked (%s)", self.off_reference)
        self.watch = LogprobDiffWatch(self.ci.logprob_diff_jump_factor)
        self.grad = GradNormCI.from_args(args, start_rollout_id)

    def after_rollout(self, rollout_id: int, record: dict[str, Any], grad_norms: dict[str, list[float]],
                      expected_version: int) -> None:
        """``expected_version``: the weight version the rollout had to be generated with (--async: one older)."""
        if not self.trains:
            return
        if self.replay:  # the dump's version; none recorded (slime's dumps, hooks, samples all carried finished):
            # on-policy only for the first rollout of a run from its checkpoint
            version = record.get("rollout/weight_version")
            if version is None and rollout_id > 0:
                log.info("--ci-test: rollout %d's dump records no weight version: its train/rollout log-prob "
                         "check is left out (the weights it was generated with are unknown)", rollout_id)
            expected_version = max(int(version), 0) if version is not None else 0 if rollout_id == 0 else -1
        if expected_version == rollout_id and not record.get("rollout/async/newest_lag"):
            self.watch.update(record)  # off-policy rollouts (--async, --fully-async, replays) differ from the trainer
        if self.enforce:
            enforce(self.ci, record, rollout_id, first=rollout_id == self.start, expected_version=expected_version,
                    engines=not self.replay, step1_kl=self.off_reference is None)
        if self.grad is not None:
            for role, norms in grad_norms.items():
                self.grad.update(role, rollout_id, norms)
