"""Sample and Status: the one shape that crosses the seam between rollout and training.

Field names and meanings follow slime's ``Sample`` so dumps move both ways. ``to_dict`` gives plain data
(loadable with ``torch.load(weights_only=True)``); ``from_dict`` fills missing fields with defaults and keeps
unknown keys as attributes, so dumps from newer code load in older code.
"""

from __future__ import annotations

import array
import base64
import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


# metadata key of the weight version of every response token (ints, one per token, as ``version_number`` reads a
# served version): a sample continued across rollouts (--partial-rollout) holds tokens of several versions
TOKEN_VERSIONS = "token_weight_versions"
LEADING_UNVERSIONED = "_unversioned_leading_tokens"  # metadata: inserted tokens before the first model turn
# metadata key set on a sample --partial-rollout carried already finished: the rollout that took it so (its last
# request was made in an earlier rollout, with older weights, so it tells nothing of the weights this rollout used)
FINISHED_BEFORE = "finished_before_rollout_id"
# metadata key of the reward --custom-reward-post-process-path gave the sample: the one the advantage estimator takes
POST_PROCESSED_REWARD = "post_processed_reward"
# metadata: the part of a split trajectory that holds its last call (an agent's side call, made from a fresh
# history, can be a later part than the conversation that ends it); unmarked: the trajectory's last part
TRAJECTORY_END = "trajectory_end"
# metadata of a carried group's first sample (--partial-rollout): the group finished and passed the dynamic-sampling
# filter after its rollout had its groups; kept through a checkpoint, so it is neither filtered nor counted again
FILTER_PASSED = "passed_dynamic_filter"
ENGINE_CUTS = "engine_cuts"  # metadata: the times the engines cut the sample's group short (--fully-async)
REFUSED = "engine_aborted_unchanged"  # metadata: a continued sample aborted again with nothing new
# the weight version of an engine whose weights a push left mixed, old and new (read as -1 by version_number)
PARTIAL_VERSION = "partial"


def trajectory_ends(samples: list[Any]) -> list[int]:
    """The positions of each trajectory's end (``Sample.trajectory``: the part marked ``TRAJECTORY_END``, else its
    last part), in the order the trajectories first appear: every position for samples not split."""
    ends: dict[tuple, int] = {}
    for i, s in enumerate(samples):
        end = ends.get(s.trajectory)
        if end is None or not (samples[end].metadata or {}).get(TRAJECTORY_END):  # the latest, until the marked one
            ends[s.trajectory] = i
    return list(ends.values())


def version_number(version: Any) -> int:
    """A served weight version as a number: -1 for "default" (the weights the engine loaded itself)."""
    return int(version) if str(version).isdigit() else -1


def oldest_version(sample: Any) -> int:
    """The oldest weight version among the sample's requests (``weight_versions``, not empty)."""
    return min(version_number(v) for v in sample.weight_versions)


def _turn_versions(meta_info: dict | None, n: int) -> list[int] | None:
    """The weight version of each of a model turn's ``n`` tokens from its request's meta_info: the engine's per-token
    versions, else the request's one version for all; None when it reported none."""
    per_token = (meta_info or {}).get("output_token_weight_versions")
    if per_token is not None and len(per_token) == n:
        return [version_number(v) for v in per_token]
    version = (meta_info or {}).get("weight_version")
    return None if version is None else [version_number(version)] * n


def extend_token_versions(sample: Any, n_before: int, n: int, versions: list[int] | None, model: bool) -> None:
    """One weight version per response token while every model turn gave its own; unknown (the key removed: the
    rollout then stamps the last request's version on all) once one did not. Inserted turns before the first model
    turn (an environment's opening observation) take that turn's first version, counted until it comes."""
    have = sample.metadata.get(TOKEN_VERSIONS)
    lead = sample.metadata.pop(LEADING_UNVERSIONED, 0)
    if have is None and n_before == lead and not model:
        sample.metadata[LEADING_UNVERSIONED] = lead + n  # no version yet: the first model turn's
        return
    if have is None and n_before == lead and model and versions:
        have = [int(versions[0])] * lead
    if have is None or len(have) != n_before or (model and (versions is None or len(versions) != n)) \
            or (not model and not have):
        sample.metadata.pop(TOKEN_VERSIONS, None)
        return
    sample.metadata[TOKEN_VERSIONS] = list(have) + ([int(v) for v in versions] if model else [have[-1]] * n)


def routed_rows_fit(sample: Any, rows: int) -> bool:
    """Whether ``rows`` rows of routed experts (--use-rollout-routing-replay) fit ``sample``: one per token but the
    last, or fewer where every token after them is untrained (a multi-turn sample's tool or user tokens after its
    last model call, whose table covers every token before its end)."""
    n = len(sample.tokens)
    mask = sample.loss_mask if sample.loss_mask is not None else [1] * sample.response_length
    return rows == n - 1 or (1 <= rows < n - 1 and not any(mask[max(0, rows + 1 - (n - sample.response_length)):]))


class RewardError(ValueError):
    """A reward that is not one number: none yet, not numeric, or a dict without (or lacking) ``--reward-key``.

    Callers that face the user turn it into a ``SlimeLiteError`` (this module imports nothing of the project)."""


def _int32s(meta_info: dict[str, Any], keys: tuple[str, ...]) -> list[int] | None:
    """An int32 array SGLang puts in meta_info (base64 of little-endian int32, bytes, or a list), as slime decodes
    it; None when none of ``keys`` is there."""

    value = next((meta_info[k] for k in keys if k in meta_info), None)
    if value is None:
        return None
    if isinstance(value, str):
        value = base64.b64decode(value.encode("ascii"))
    if isinstance(value, (bytes, bytearray, memoryview)):
        out = array.array("i")
        out.frombytes(bytes(value))
        return out.tolist()
    return [int(v) for v in (value.reshape(-1).tolist() if hasattr(value, "reshape") else value)]


def _as_list(values: Any, kind: type) -> list | None:
    if values is None:
        return None
    if hasattr(values, "tolist"):
        values = values.reshape(-1).tolist() if hasattr(values, "reshape") else values.tolist()
    return [kind(v) for v in values]


def _known(cls: type, data: dict[str, Any] | None) -> Any:
    if data is None:
        return cls()
    if isinstance(data, cls):
        return data
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in data.items() if k in names})


@dataclass
class Sample:
    """One prompt's sample: slime's ``Sample`` fields in slime's order (positional construction matches)."""

    group_index: int | None = None
    index: int | None = None
    rollout_id: int | None = None  # samples split from one rollout share it; None: ``index``
    prompt: str | list[dict[str, str]] = ""
    tokens: list[int] = field(default_factory=list)
    multimodal_inputs: dict[str, Any] | None = None
    multimodal_train_inputs: dict[str, Any] | None = None
    multimodal_train_input_id: str | None = None
    apply_chat_template_kwargs: dict = field(default_factory=dict)
    response: str = ""
    response_length: int = 0
    label: str | int | list | dict | None = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    rollout_top_p_token_ids: list[int] | None = None  # ragged: token i keeps ids[offsets[i]:offsets[i + 1]]
    rollout_top_p_token_offsets: list[int] | None = None
    rollout_routed_experts: Any = None
    remove_sample: bool = False
    teacher_log_probs: list[float] | None = None

    class Status(Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        FAILED = "failed"  # recoverable failure (tool call, parsing): partial output may be kept

        @classmethod
        def from_finish_reason(cls, finish_type: str | None) -> "Sample.Status":
            """Map an engine finish reason type (``stop``/``length``/``abort``) to a status."""
            return {"stop": cls.COMPLETED, "length": cls.TRUNCATED, "abort": cls.ABORTED}.get(
                finish_type or "", cls.FAILED
            )

    status: Status = Status.PENDING
    metadata: dict[str, Any] = field(default_factory=dict)
    generate_function_path: str | None = None
    custom_rm_path: str | None = None
    train_metadata: dict[str, Any] | None = None
    session_id: str | None = None
    non_generation_time: float = 0.0

    @dataclass
    class SpecInfo:
        """Speculative-decoding statistics of one sample (zeros when not used)."""

        spec_accept_token_num: int = 0
        spec_draft_token_num: int = 0
        spec_verify_ct: int = 0
        completion_token_num: int = 0

        @property
        def spec_accept_rate(self) -> float:
            return self.spec_accept_token_num / self.spec_draft_token_num if self.spec_draft_token_num > 0 else 0.0

        @property
        def spec_accept_length(self) -> float:
            return self.completion_token_num / self.spec_verify_ct if self.spec_verify_ct > 0 else 0.0

        def add(self, meta_info: dict) -> None:
            self.spec_accept_token_num += meta_info.get("spec_accept_token_num", 0)
            self.spec_draft_token_num += meta_info.get("spec_draft_token_num", 0)
            self.spec_verify_ct += meta_info.get("spec_verify_ct", 0)
            self.completion_token_num += meta_info.get("completion_tokens", 0)

        def to_dict(self) -> dict[str, int]:
            return dataclasses.asdict(self)

        @staticmethod
        def from_dict(data: dict) -> "Sample.SpecInfo":
            return _known(Sample.SpecInfo, data)

    spec_info: SpecInfo = field(default_factory=SpecInfo)

    @dataclass
    class PrefixCacheInfo:
        """How much of the prompt the engine found in its prefix cache."""

        cached_tokens: int = 0
        total_prompt_tokens: int = 0

        @property
        def prefix_cache_hit_rate(self) -> float:
            return self.cached_tokens / self.total_prompt_tokens if self.total_prompt_tokens > 0 else 0.0

        def add(self, meta_info: dict) -> None:
            self.cached_tokens += meta_info.get("cached_tokens", 0)
            self.total_prompt_tokens += meta_info.get("prompt_tokens", 0)

        def to_dict(self) -> dict[str, int]:
            return dataclasses.asdict(self)

        @staticmethod
        def from_dict(data: dict) -> "Sample.PrefixCacheInfo":
            return _known(Sample.PrefixCacheInfo, data)

    prefix_cache_info: PrefixCacheInfo = field(default_factory=PrefixCacheInfo)

    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length

    @property
    def trajectory(self) -> tuple:
        """The trajectory this sample trains a part of, within its prompt group: the samples one trajectory was split
        into (an agent's rewritten history, a generate hook's list) share ``rollout_id``; a sample without one is a
        trajectory of its own."""
        if self.rollout_id is not None:
            return (self.group_index, "split", self.rollout_id)
        return (self.group_index, "sample", self.index)

    def scalar_reward(self, reward_key: str | None = None) -> float:
        """The reward as a float; a dict reward is read at ``reward_key`` (``--reward-key``). Else RewardError."""
        reward: Any = self.reward
        if isinstance(reward, dict):
            if reward_key is None:
                raise RewardError(
                    f"sample {self.index}: the reward is a dict with keys {sorted(reward)}; "
                    "pass --reward-key to pick the scalar reward."
                )
            if reward_key not in reward:
                raise RewardError(
                    f"sample {self.index}: --reward-key {reward_key!r} is not in the reward dict "
                    f"(keys: {sorted(reward)})."
                )
            reward = reward[reward_key]
        if reward is None:
            raise RewardError(f"sample {self.index} has no reward (status {self.status.value}).")
        try:
            return float(reward)
        except (TypeError, ValueError):
            raise RewardError(
                f"sample {self.index}: reward {reward!r} is not a number"
                + ("" if reward_key else "; pass --reward-key if it is a dict")
            ) from None

    def to_dict(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out["status"] = self.status.value
        out["spec_info"] = dataclasses.asdict(self.spec_info)
        out["prefix_cache_info"] = dataclasses.asdict(self.prefix_cache_info)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Sample":
        names = {f.name for f in dataclasses.fields(cls)}
        known = {k: v for k, v in data.items() if k in names}
        status = known.get("status", Status.PENDING)
        known["status"] = status if isinstance(status, Status) else Status(status)
        known["spec_info"] = _known(SpecInfo, known.get("spec_info"))
        known["prefix_cache_info"] = _known(PrefixCacheInfo, known.get("prefix_cache_info"))
        sample = cls(**known)
        for key, value in data.items():  # another version's fields kept; never one that would shadow the class's
            if key not in names and not hasattr(cls, key):  # (a property such as prompt_length: derived, not data)
                setattr(sample, key, value)
        return sample

    def get_reward_value(self, args: Any) -> Any:
        """slime's accessor: the reward, or its ``args.reward_key`` entry."""
        return self.reward if not args.reward_key else self.reward[args.reward_key]

    @property
    def effective_response_length(self) -> int:
        return sum(self.loss_mask) if self.loss_mask is not None else self.response_length

    def append_response_tokens(self, args: Any = None, *, tokens: Any = None, log_probs: Any = None,
                               trainable: bool = True, meta_info: dict | None = None, text: str | None = None,
                               update_terminal_info: bool = True) -> None:
        """Append response tokens keeping loss mask, log-probs and top-p spans aligned (slime's method): model tokens
        with ``trainable=True`` and their log-probs; tool/environment tokens with ``trainable=False`` (mask 0)."""
        tokens = _as_list(tokens, int) or []
        log_probs = _as_list(log_probs, float)
        if log_probs is not None and len(log_probs) != len(tokens):
            raise ValueError(f"log_probs length {len(log_probs)} != tokens length {len(tokens)}")
        if tokens and trainable and log_probs is None:
            raise ValueError("trainable response tokens require rollout log probabilities.")
        if tokens and not trainable:
            if log_probs is not None:
                raise ValueError("non-trainable response tokens should not pass rollout log probabilities.")
            log_probs = [0.0] * len(tokens)
        if text is not None:
            self.response += text
        before = self.response_length
        if tokens:  # the weight version of each token, as a multi-turn sample's turns keep them
            extend_token_versions(self, before, len(tokens), _turn_versions(meta_info, len(tokens)), trainable)
            self.tokens = list(self.tokens) + tokens
            self.response_length += len(tokens)
            self.loss_mask = (self.loss_mask if self.loss_mask is not None else [1] * before) + \
                [1 if trainable else 0] * len(tokens)
        if log_probs is not None:
            if self.rollout_log_probs is None:
                if trainable and before:
                    raise ValueError("Cannot append trainable rollout log probabilities to a sample with existing "
                                     "response tokens but no existing rollout_log_probs.")
                self.rollout_log_probs = [0.0] * before
            self.rollout_log_probs = list(self.rollout_log_probs) + log_probs
        pad_top_p = bool(tokens and not trainable)
        if meta_info is not None or pad_top_p:
            self._apply_meta_info(args, meta_info or {}, new_token_count=len(tokens), pad_missing_top_p=pad_top_p,
                                  update_terminal_info=update_terminal_info)
        self._validate_response_metadata_lengths()

    def _apply_meta_info(self, args: Any, meta_info: dict, *, new_token_count: int = 0,
                         pad_missing_top_p: bool = False, update_terminal_info: bool = True) -> None:
        applied = False
        ids = _int32s(meta_info, ("top_p_token_ids", "top_p_kept_token_ids")) if new_token_count else None
        offsets = _int32s(meta_info, ("top_p_token_offsets", "top_p_kept_token_offsets")) if new_token_count else None
        if ids is not None or offsets is not None:
            if ids is None or offsets is None or not offsets or offsets[0] != 0 or offsets[-1] != len(ids) \
                    or len(offsets) != new_token_count + 1:
                raise ValueError("SGLang top-p token replay needs token ids and offsets (starting at 0, ending at "
                                 "the id count, one per generated token + 1).")
            applied = True
            if self.rollout_top_p_token_ids is None and self.rollout_top_p_token_offsets is None:
                self.rollout_top_p_token_ids, self.rollout_top_p_token_offsets = ids, offsets
            else:
                base = list(self.rollout_top_p_token_offsets or [0])
                self.rollout_top_p_token_ids = list(self.rollout_top_p_token_ids or []) + ids
                self.rollout_top_p_token_offsets = base + [o + base[-1] for o in offsets[1:]]
        if pad_missing_top_p and new_token_count and self.rollout_top_p_token_offsets is not None and not applied:
            offsets = list(self.rollout_top_p_token_offsets)
            self.rollout_top_p_token_offsets = offsets + [offsets[-1]] * new_token_count
        experts = _int32s(meta_info, ("routed_experts",))
        if experts is not None:
            if args is None:
                raise ValueError("args is required to decode routed experts metadata.")
            start = int(meta_info.get("routed_experts_start_len", 0) or 0)
            rows = max(0, len(self.tokens) - 1 - start)
            per_row = args.num_layers * args.moe_router_topk
            if len(experts) != rows * per_row:
                raise ValueError(f"SGLang routed_experts has {len(experts)} values, expected {rows * per_row}.")
            table = [[experts[(r * args.num_layers + layer) * args.moe_router_topk:
                              (r * args.num_layers + layer + 1) * args.moe_router_topk]
                      for layer in range(args.num_layers)] for r in range(rows)]
            old = self.rollout_routed_experts
            if start:  # the rows before ``start`` are the earlier calls' ([rows, layers, top_k], also when stored flat)
                import torch

                kept = [] if old is None else torch.as_tensor(old).reshape(-1, args.num_layers,
                                                                            args.moe_router_topk).tolist()
                if len(kept) < start:
                    raise ValueError(f"SGLang routed_experts starts at row {start} (routed_experts_start_len) but "
                                     f"the sample holds {len(kept)} rows: the routes of the tokens in between are "
                                     "missing (send routed_experts_start_len 0 to get every row again).")
                table = kept[:start] + table
            self.rollout_routed_experts = table
        if not update_terminal_info or "finish_reason" not in meta_info:
            return
        if args is not None and vars(args).get("sglang_speculative_algorithm"):  # SGLang flag slime forwards
            self.spec_info.add(meta_info=meta_info)
        self.prefix_cache_info.add(meta_info=meta_info)
        if "weight_version" in meta_info:
            self.weight_versions.append(meta_info["weight_version"])
        finish = (meta_info["finish_reason"] or {}).get("type")
        if finish in ("length", "abort", "stop"):
            self.status = Sample.Status.from_finish_reason(finish)

    def _validate_response_metadata_lengths(self) -> None:
        if self.loss_mask is not None and len(self.loss_mask) != self.response_length:
            raise ValueError(f"loss_mask length {len(self.loss_mask)} != response_length {self.response_length}")
        if self.rollout_log_probs is not None and len(self.rollout_log_probs) != self.response_length:
            raise ValueError(f"rollout_log_probs length {len(self.rollout_log_probs)} != response_length "
                             f"{self.response_length}")
        ids, offsets = self.rollout_top_p_token_ids, self.rollout_top_p_token_offsets
        if ids is None and offsets is None:
            return
        if ids is None or offsets is None or len(offsets) != self.response_length + 1 or offsets[-1] != len(ids):
            raise ValueError("rollout top-p replay: offsets must have response_length + 1 entries ending at the "
                             "number of token ids.")

    def check(self) -> None:
        """Raise ValueError when per-token lists disagree with ``response_length``."""
        for name in ("rollout_log_probs", "loss_mask"):
            value = getattr(self, name)
            if value is not None and len(value) != self.response_length:
                raise ValueError(
                    f"sample {self.index}: len({name})={len(value)} != response_length={self.response_length}"
                )
        if self.response_length > len(self.tokens):
            raise ValueError(f"sample {self.index}: response_length {self.response_length} > len(tokens)")
        versions = self.metadata.get(TOKEN_VERSIONS) if isinstance(self.metadata, dict) else None
        if versions is not None and len(versions) != self.response_length:
            raise ValueError(f"sample {self.index}: len(metadata[{TOKEN_VERSIONS!r}])={len(versions)} != "
                             f"response_length={self.response_length}")


# slime spells these Sample.Status, Sample.SpecInfo, Sample.PrefixCacheInfo; the short names are the same classes
Status = Sample.Status
SpecInfo = Sample.SpecInfo
PrefixCacheInfo = Sample.PrefixCacheInfo


@dataclass
class TrainResult:
    """What one rollout's training reports (the reporter rank's): metrics averaged over the optimizer steps, every
    step's grad-norm (--ci-save-grad-norm / --ci-load-grad-norm check them step by step), and every step's own
    metrics under the same names (logged against ``train/step``, as slime logs them). Defined here, not with the
    train workers, so the driver reads it without importing megatron-core."""

    metrics: dict[str, Any]
    grad_norms: list[float]
    steps: list[dict[str, float]] = field(default_factory=list)
