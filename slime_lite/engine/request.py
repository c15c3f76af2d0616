"""A generation request of the embedded engine and the snapshot of it that leaves the model thread."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from slime_lite.engine.prefix_cache import DEFAULT_NAMESPACE
from slime_lite.engine.sampling import SamplingParams
from slime_lite.engine_client import ENGINE_ERROR  # noqa: F401 - how the abort message of a request the engine failed
# (not its client) begins: the client sends such a request again

REQUEST_ERROR = "request error: "  # a request that failed for its own sake (its sampling or stop rules raised): the
# engine goes on, and the client does not send it again (it would fail on any engine)


def abort_reason(message: str) -> dict[str, Any]:
    """An aborted request's finish reason, in SGLang's shape (its FINISH_ABORT: no HTTP status or error type set)."""
    return {"type": "abort", "message": message, "status_code": None, "err_type": None}


def rid_matches(request_rid: str, rid: str) -> bool:
    """Whether an abort of ``rid`` reaches the request ``request_rid``: that request, and the ``rid_<i>`` ones a batch
    or ``n`` made of it."""
    return request_rid == rid or request_rid.startswith(rid + "_")


@dataclass
class RequestOutput:
    """A snapshot of a request, safe to read in another thread."""

    rid: str
    prompt_tokens: int
    output_ids: list[int]
    output_logprobs: list[float]
    input_logprobs: list[float | None] | None
    input_ids_for_logprobs: list[int] | None
    finish_reason: dict[str, Any] | None
    weight_version: str
    e2e_latency: float
    params: SamplingParams
    cached_tokens: int = 0
    # per position, ``[(logprob, token_id), ...]`` or None (SGLang's first input position): top_logprobs_num
    # alternatives and the token_ids_logprob tokens, of the output tokens and of the prompt from logprob_start_len
    output_top: list[Any] | None = None
    output_ids_lp: list[Any] | None = None
    input_top: list[Any] | None = None
    input_ids_lp: list[Any] | None = None
    # [positions, layers, top_k] int32 (a dense layer's row 0), when finished (return_routed_experts)
    routed_experts: Any = None
    # the weight version that generated each output token (a request in flight across a weight update spans two)
    output_weight_versions: list[str] | None = None


@dataclass(eq=False)
class Request:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    seed: int
    return_logprob: bool = False
    logprob_start_len: int = -1
    return_text_in_logprobs: bool = False
    top_logprobs_num: int = 0
    token_ids_logprob: list[int] | None = None
    stream: bool = False
    on_output: Callable[[RequestOutput], None] | None = None
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_weight_versions: list[str] = field(default_factory=list)
    input_logprobs: list[float | None] | None = None
    output_top: list[Any] = field(default_factory=list)
    output_ids_lp: list[Any] = field(default_factory=list)
    input_top: list[Any] | None = None
    input_ids_lp: list[Any] | None = None
    finish_reason: dict[str, Any] | None = None
    max_new: int = 0  # max_new_tokens capped to what the slot holds
    banned_ids: list[int] | None = None  # min_new_tokens' bans: stop token ids and eos in the vocabulary (once)
    slot: int = -1
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    # (extra_key, cache_salt): the prefix cache shares K/V only between requests of the same namespace
    cache_namespace: tuple[str | None, str | None] = DEFAULT_NAMESPACE
    kv_version: int = -1  # the weights' write counter (Weights.version) its K/V was computed under (prefill)
    created: float = field(default_factory=time.monotonic)
    # the scheduler's abort-all count when the request was made (Scheduler.prepare): an abort-all after that aborts
    # it when it is submitted later (the rest of a batch waiting for its turn)
    abort_epoch: int | None = None
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    routed_experts: Any = None  # set when the request finishes

    @property
    def host_sampled(self) -> bool:
        """Its tokens need the step's logits on the host side sampler: truncation, a logit bias, or log-probs of
        other tokens than the sampled one."""
        return (self.params.truncates or bool(self.params.logit_bias) or self.top_logprobs_num > 0
                or self.token_ids_logprob is not None)

    def snapshot(self, weight_version: str) -> RequestOutput:
        start = self.logprob_start_len
        return RequestOutput(
            rid=self.rid, prompt_tokens=len(self.input_ids), output_ids=list(self.output_ids),
            output_logprobs=list(self.output_logprobs),
            input_logprobs=None if self.input_logprobs is None else list(self.input_logprobs),
            input_ids_for_logprobs=None if self.input_logprobs is None else self.input_ids[start:],
            finish_reason=self.finish_reason, weight_version=weight_version,
            e2e_latency=time.monotonic() - self.created, params=self.params, cached_tokens=self.cached_tokens,
            output_top=list(self.output_top) if self.top_logprobs_num else None,
            output_ids_lp=list(self.output_ids_lp) if self.token_ids_logprob is not None else None,
            input_top=None if self.input_top is None else list(self.input_top),
            input_ids_lp=None if self.input_ids_lp is None else list(self.input_ids_lp),
            routed_experts=self.routed_experts, output_weight_versions=list(self.output_weight_versions),
        )
