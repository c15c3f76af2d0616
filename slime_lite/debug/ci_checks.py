"""The seed's step-1 / step-2 precision checks as data: each check has a value, a threshold, and the likely causes.

``--ci-test`` runs ``rollout_checks`` on every metrics record and stops the run at the first failure;
``slime-lite doctor`` shows the same checks as a table. Pure Python: no torch, no Ray.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from slime_lite.errors import SlimeLiteError

CAUSES = {
    "step1_kl_zero": (
        "trainer and reference forwards differ at step 1: a non-deterministic kernel (e.g. Transformer Engine "
        "fused attention; try --attention-backend flash), reference weights loaded from a different checkpoint "
        "(--ref-load), or micro-batches padded differently between the two passes"
    ),
    "first_step_ppo_kl_zero": (
        "the old log-probs and the first training forward differ: a Megatron/Transformer Engine numerics bug "
        "(for MoE models turn on --moe-permute-fusion), dropout left on, or data reordered between the passes"
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


def _check(name: str, value: float | None, threshold: str, passed: bool) -> Check:
    return Check(name, value, threshold, passed, "" if passed else CAUSES.get(name, ""))


def rollout_checks(args: Any, record: dict[str, Any], first: bool) -> list[Check]:
    """Checks for one iteration's metrics record; ``first`` marks the run's first trained rollout."""
    checks: list[Check] = []
    if first and "rollout/log_probs_ref_max_abs_diff" in record:
        diff = record["rollout/log_probs_ref_max_abs_diff"]
        checks.append(_check("step1_kl_zero", diff, "== 0 (log_probs == ref_log_probs)", diff == 0.0))
    if first and "rollout/log_probs" in record:
        lp = -record["rollout/log_probs"]
        bound = getattr(args, "ci_nll_threshold", 2.0)
        checks.append(_check("step1_log_probs_small", lp, f"mean NLL < {bound}", lp < bound))
    if "train/first_step/ppo_kl" in record:
        value = record["train/first_step/ppo_kl"]
        checks.append(_check("first_step_ppo_kl_zero", value, "== 0", value == 0.0))
    if "train/train_rollout_logprob_abs_diff" in record:
        value = record["train/train_rollout_logprob_abs_diff"]
        bound = getattr(args, "ci_logprob_diff_threshold", 1e-3)
        checks.append(_check("train_rollout_logprob_diff", value, f"< {bound:g}", value < bound))
    if "train/first_step/grad_norm" in record:
        value = record["train/first_step/grad_norm"]
        bound = getattr(args, "ci_grad_norm_threshold", 100.0)
        checks.append(_check("grad_norm_finite", value, f"finite, < {bound:g}", math.isfinite(value) and value < bound))
    return checks


class CiCheckFailed(SlimeLiteError):
    def __init__(self, check: Check, rollout_id: int) -> None:
        self.check = check
        super().__init__(
            f"--ci-test: check {check.name} failed at rollout {rollout_id}: value {check.value!r}, expected "
            f"{check.threshold}. Likely causes: {check.cause}."
        )


ADVISORY = {"step1_log_probs_small"}  # a heuristic: shown by the doctor, not enforced by --ci-test


def enforce(args: Any, record: dict[str, Any], rollout_id: int, first: bool) -> list[Check]:
    checks = rollout_checks(args, record, first)
    for check in checks:
        if not check.passed and check.name not in ADVISORY:
            raise CiCheckFailed(check, rollout_id)
    return checks


def iteration2_check(rollouts_done: int) -> Check:
    return _check("iteration2_ran", float(rollouts_done), ">= 2 iterations", rollouts_done >= 2)
