"""Typed groups of ``slime-lite train`` flags, each built once from the parsed flags and passed on.

``XConfig.from_args(args)`` copies the group's flags from a namespace made by ``slime_lite.args.parse_args`` (or
``parser_defaults`` in tests and tools); a flag missing from the namespace is an AttributeError, not a silent
default: every default lives in the parser (slime_lite/args.py) only. Field names are the flags' dest names; a
value derived from flags (not itself a flag) is a property of the group that needs it, computed in one place here.

``parse_args`` returns the flags frozen (``FrozenFlags``): nothing writes to them after validation. Runtime state
(engine clients, URLs, the router's address) lives in the objects that own it. Imports only rl_math (a leaf), so
both the train and the rollout side may use this module.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import Any, TypeVar

from slime_lite import rl_math

Config = TypeVar("Config")


class FrozenFlags(argparse.Namespace):
    """The parsed and validated ``train`` flags, read-only. Pickles (to Ray actors) and copies like a Namespace."""

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"the train flags are read-only after validation (tried to set {name!r}): runtime "
                             "state belongs to the object that owns it, derived values to a config section")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"the train flags are read-only after validation (tried to delete {name!r})")


def freeze(args: argparse.Namespace) -> FrozenFlags:
    """``args`` as read-only flags (the same values)."""
    frozen = FrozenFlags.__new__(FrozenFlags)
    frozen.__dict__.update(vars(args))
    return frozen


def has_reference_model(args: Any) -> bool:
    """Whether the run keeps reference weights: a KL term (--use-kl-loss, --kl-coef) or an explicit --ref-load."""
    return bool(args.use_kl_loss or args.kl_coef > 0 or args.ref_load)


class _FromArgs:
    @classmethod
    def from_args(cls: type[Config], args: Any) -> Config:
        """This group's flags, read from a parsed namespace (``parse_args`` or ``parser_defaults``)."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})  # type: ignore[arg-type]


def periodic(rollout_id: int, interval: int | None, num_rollout: int, per_epoch: int | None = None) -> bool:
    """A save or an eval after rollout_id (as slime's periodic actions): every ``interval`` rollouts, after the last
    one, and at each epoch's end when --num-epoch counted the rollouts (``per_epoch``); never without an interval."""
    if not interval:
        return False
    step = rollout_id + 1
    return step % interval == 0 or step == num_rollout or bool(per_epoch and step % per_epoch == 0)


@dataclass(frozen=True)
class LossConfig(_FromArgs):
    """The actor's policy loss (backends/megatron/loss.py ``rl_loss``)."""

    loss_type: str
    eps_clip: float
    eps_clip_high: float | None
    eps_clip_c: float | None
    entropy_coef: float
    use_kl_loss: bool
    kl_loss_coef: float
    kl_loss_type: str
    use_tis: bool
    tis_clip: float
    tis_clip_low: float | None
    tis_level: str
    tis_mode: str
    use_rs: bool
    rs_level: str
    rs_lower_bound: float | None
    rs_upper_bound: float | None  # None: --tis-clip
    rs_veto_threshold: float | None


# The default bound on train/train_rollout_logprob_abs_diff (mean |train - rollout| log-prob per response token) by
# the precision engine and trainer compute in. Healthy float32 CPU runs stay near 1e-7; on an H200 healthy bfloat16
# runs gave 0.005-0.009 and an engine sampling at 1.5x the trainer's temperature 0.11 (bench/gpu_doctor.sh,
# BENCHMARKS.md). float16 keeps 3 more mantissa bits than bfloat16. Engine and trainer in different precisions are
# held to the tighter bound: the dtype mismatch is itself a fault (checks/ci.py logprob_diff_threshold).
LOGPROB_DIFF_BY_DTYPE = {"float32": 1e-3, "float16": 1e-2, "bfloat16": 5e-2}


@dataclass(frozen=True)
class TokenBudget(_FromArgs):
    """--use-dynamic-batch-size: the tokens (prompt + response) one packed micro-batch holds, in the train steps
    (--max-tokens-per-gpu) and in the forward-only log-prob passes (--log-probs-max-tokens-per-gpu, by default the
    train budget). The one rule, for the flag check, the batch planner (backends/megatron/batch.py) and the replay
    preflight alike: samples are packed together while their tokens fit; a sample longer than the budget is never
    refused, cut or dropped: it is a micro-batch of its own (logged). A budget that cannot hold one prompt token
    plus --rollout-max-response-len is refused (every full-length sample would be alone)."""

    use_dynamic_batch_size: bool
    max_tokens_per_gpu: int | None
    log_probs_max_tokens_per_gpu: int | None

    def tokens(self, log_probs: bool = False) -> int:
        """The budget of a train step's micro-batch, or (``log_probs``) of a log-prob pass's."""
        assert self.max_tokens_per_gpu is not None, "a token budget needs --use-dynamic-batch-size"
        if log_probs and self.log_probs_max_tokens_per_gpu is not None:
            return self.log_probs_max_tokens_per_gpu
        return self.max_tokens_per_gpu

    def flags(self, log_probs: bool = False) -> str:
        """The flag and value a budget comes from, for messages."""
        if log_probs and self.log_probs_max_tokens_per_gpu is not None:
            return f"--log-probs-max-tokens-per-gpu {self.log_probs_max_tokens_per_gpu}"
        return f"--max-tokens-per-gpu {self.max_tokens_per_gpu}"

    def alone(self, lengths: list[int], log_probs: bool = False) -> list[int]:
        """Indices of the samples longer than the budget: each is a micro-batch of its own."""
        if not self.use_dynamic_batch_size:
            return []
        budget = self.tokens(log_probs)
        return [i for i, n in enumerate(lengths) if n > budget]

    def too_small_for(self, max_response_len: int) -> str | None:
        """Why the budgets cannot hold a full-length sample (one prompt token + ``max_response_len``), or None."""
        for log_probs in (False, True):
            if self.use_dynamic_batch_size and self.tokens(log_probs) < max_response_len + 1:
                flag = self.flags(log_probs)
                return (f"{flag} is smaller than one prompt token plus --rollout-max-response-len {max_response_len}:"
                        f" every full-length sample would be a micro-batch of its own, over the budget. Raise "
                        f"{flag.split()[0]} to at least the longest prompt + response.")
        return None


@dataclass(frozen=True)
class CiConfig(_FromArgs):
    """The precision checks of ``--ci-test`` and the doctor (checks/ci.py). ``bf16``, ``engine_dtype``,
    ``rollout_device`` and ``hf_checkpoint`` tell the precisions in use (``engine_dtype`` "auto" is resolved from the
    engines once they run: checks/ci.py ``with_engine_dtype``)."""

    ci_test: bool
    ci_nll_threshold: float
    ci_logprob_diff_threshold: float | None  # None: LOGPROB_DIFF_BY_DTYPE of the precisions in use
    ci_disable_kl_checker: bool  # no step1_kl_zero / first_step_ppo_kl_zero checks
    lora_dropout: float  # > 0: the train step's forward drops adapter inputs, so its first ppo_kl is not zero
    ci_grad_norm_threshold: float
    logprob_diff_jump_factor: float
    bf16: bool
    engine_dtype: str
    rollout_device: str
    hf_checkpoint: str


@dataclass(frozen=True)
class RolloutConfig(_FromArgs):
    """What the generator needs for a rollout or an eval: sampling, batch sizes, seeds (rollout/generate.py)."""

    rollout_temperature: float
    rollout_top_p: float
    rollout_top_k: int
    rollout_max_response_len: int
    rollout_stop: list[str] | None
    rollout_stop_token_ids: list[int] | None
    eval_min_new_tokens: int | None
    eval_temperature: float
    eval_max_response_len: int
    eval_top_p: float
    eval_top_k: int
    rollout_batch_size: int
    n_samples_per_prompt: int
    over_sampling_batch_size: int | None
    partial_rollout: bool
    mask_offpolicy_in_partial_rollout: bool
    fully_async: bool
    max_weight_staleness: int | None
    max_weight_staleness_mode: str
    n_samples_per_eval_prompt: int
    rollout_seed: int
    debug_inject_fault: str | None
    deterministic_mode: bool


@dataclass(frozen=True)
class EngineConfig(_FromArgs):
    """How one rollout engine is started: the embedded engine (rollout/engines.py) or an SGLang server
    (backends/sglang/launcher.py)."""

    hf_checkpoint: str
    rollout_backend: str
    rollout_device: str
    engine_dtype: str
    engine_max_running_requests: int | None
    engine_kv_cache_tokens: int | None
    engine_disable_cuda_graph: bool
    engine_enable_torch_compile: bool
    rollout_num_gpus_per_engine: int
    rollout_seed: int
    colocate: bool
    rollout_external_engine_addrs: str | None
    use_sglang_router: bool
    offload_rollout: bool
    rollout_max_response_len: int
    eval_max_response_len: int | None
    rollout_max_prompt_len: int | None
    rollout_max_context_len: int | None
    sglang_server_module: str
    sglang_args: list[str]
    use_rollout_routing_replay: bool
    lora_rank: int | None
    lora_target_modules: list[str]
    rollout_num_gpus: int
    deterministic_mode: bool
    rollout_batch_size: int
    over_sampling_batch_size: int | None
    n_samples_per_prompt: int

    @property
    def request_tokens(self) -> int:
        """The tokens one request of the run may hold (the embedded engine sizes its batch slots to at least this
        when --engine-kv-cache-tokens is not given): --rollout-max-context-len, else the longest response (train or
        eval) and --rollout-max-prompt-len (else 1,024) prompt tokens."""
        if self.rollout_max_context_len:
            return self.rollout_max_context_len
        return max(self.rollout_max_response_len, self.eval_max_response_len or 0) + (self.rollout_max_prompt_len
                                                                                     or 1024)

    @property
    def request_body_bytes(self) -> int:
        """The largest /generate body the run sends, for its embedded engines' body limit (never below the
        engine's default): 32 bytes of JSON a token (token ids take about 7) of ``request_tokens`` for every
        request of one call: a group, or under --deterministic-mode a whole wave."""
        calls = self.requests_per_engine if self.deterministic_mode else self.n_samples_per_prompt
        return 32 * self.request_tokens * calls

    @property
    def requests_per_engine(self) -> int:
        """Requests one engine gets at once in a rollout (the generator submits a whole wave): the embedded
        engine's batch slots when --engine-max-running-requests is not given (engine/scheduler.py). Under
        --deterministic-mode a wave goes to one engine in one call, so every engine is sized for a whole wave
        (sized by the engine count, the first engine ran it in smaller batches: other numbers with more engines)."""
        engines = 1 if self.deterministic_mode else max(1, self.rollout_num_gpus // max(1,
                                                                                        self.rollout_num_gpus_per_engine))
        wave = (self.over_sampling_batch_size or self.rollout_batch_size) * self.n_samples_per_prompt
        return -(-wave // engines)


@dataclass(frozen=True)
class TrainSideConfig(_FromArgs):
    """What the driver's train side (backends/megatron/side.py) decides from: which train groups exist, where the
    actor starts, when it saves, whether it gives up its memory between phases."""

    debug_rollout_only: bool
    advantage_estimator: str
    hf_checkpoint: str
    ref_load: str | None
    save: str | None
    save_interval: int | None
    num_rollout: int
    num_rollout_per_epoch: int | None
    offload_train: bool
    ref_update_interval: int | None
    n_samples_per_prompt: int
    custom_reward_post_process_path: str | None

    @property
    def group_size(self) -> int:
        """The samples a trim keeps together: a group estimator's (GRPO) prompt group, else one (also where a
        --custom-reward-post-process-path hook gives the rewards the groups' normalisation would)."""
        groups = rl_math.estimator(self.advantage_estimator).needs_groups and not self.custom_reward_post_process_path
        return self.n_samples_per_prompt if groups else 1

    @property
    def trains(self) -> bool:
        """--debug-rollout-only builds (and imports) no trainer."""
        return not self.debug_rollout_only

    @property
    def has_critic(self) -> bool:
        """The estimator takes a critic's values (rl_math's registry): a critic group is placed and trained."""
        return self.trains and rl_math.estimator(self.advantage_estimator).needs_critic

    @property
    def init_checkpoint(self) -> str:
        """The HF folder the actor starts from: --ref-load when given (as slime), else --hf-checkpoint; a --load
        checkpoint, when there is one, replaces these weights."""
        return self.ref_load or self.hf_checkpoint

    def saves_after(self, rollout_id: int) -> bool:
        """A checkpoint after rollout_id trained: every --save-interval rollouts, at the end of each --num-epoch
        epoch, and after the last one (as slime: a run's end is never left unsaved)."""
        return bool(self.save and periodic(rollout_id, self.save_interval, self.num_rollout,
                                           self.num_rollout_per_epoch))

    def updates_reference_after(self, rollout_id: int) -> bool:
        """--ref-update-interval N: the reference takes the actor's weights after rollouts N-1, 2N-1, ... trained
        (as slime)."""
        return bool(self.trains and self.ref_update_interval and (rollout_id + 1) % self.ref_update_interval == 0)


@dataclass(frozen=True)
class RolloutSideConfig(_FromArgs):
    """What the driver's rollout side (rollout/side.py) decides from: engines or none, the router, fault-tolerant
    restarts, memory release/resume, eval, and the engine-side fault."""

    debug_train_only: bool
    use_sglang_router: bool
    use_fault_tolerance: bool
    offload_rollout: bool
    fully_async: bool
    eval_interval: int | None
    eval_prompt_data: list[str] | None
    num_rollout: int
    num_rollout_per_epoch: int | None
    debug_inject_fault: str | None
    rollout_backend: str
    lora_rank: int | None
    update_weights_interval: int

    @property
    def names_lora_adapter(self) -> bool:
        """LoRA on real SGLang: each push loads the adapters under a new name, which /generate must name."""
        return self.lora_rank is not None and self.rollout_backend == "sglang"

    def evaluates_after(self, rollout_id: int) -> bool:
        """Eval after rollout_id trained (and at the end, and at the end of each --num-epoch epoch): every
        --eval-interval rollouts, given eval sets."""
        return bool(self.eval_prompt_data and periodic(rollout_id, self.eval_interval, self.num_rollout,
                                                       self.num_rollout_per_epoch))

    def pushes_after(self, rollout_id: int) -> bool:
        """Whether the trainer's weights go to the engines after rollout_id trained: every
        --update-weights-interval rollouts (as slime), and before every eval, which must see the trained weights."""
        n = self.update_weights_interval
        return n == 1 or (rollout_id + 1) % n == 0 or self.evaluates_after(rollout_id)

    def served_version(self, rollout_id: int, start: int) -> int:
        """The weight version the engines serve while rollout_id is generated (synchronous training): that of the
        last push before it, ``start`` being the initial push's."""
        version = rollout_id
        while version > start and not self.pushes_after(version - 1):
            version -= 1
        return version
