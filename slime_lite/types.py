"""Sample and Status: the one shape that crosses the seam between rollout and training.

Field names and meanings follow slime's ``Sample`` so dumps move both ways. ``to_dict`` gives plain data
(loadable with ``torch.load(weights_only=True)``); ``from_dict`` fills missing fields with defaults and keeps
unknown keys as attributes, so dumps from newer code load in older code.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class RewardError(ValueError):
    """A reward that is not one number: none yet, not numeric, or a dict without (or lacking) ``--reward-key``.

    Callers that face the user turn it into a ``SlimeLiteError`` (this module imports nothing of the project)."""


class Status(Enum):
    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"

    @classmethod
    def from_finish_reason(cls, finish_type: str | None) -> "Status":
        """Map an engine finish reason type (``stop``/``length``/``abort``) to a status."""
        return {"stop": cls.COMPLETED, "length": cls.TRUNCATED, "abort": cls.ABORTED}.get(
            finish_type or "", cls.FAILED
        )


@dataclass
class SpecInfo:
    """Speculative-decoding statistics of one sample (zeros when not used)."""

    spec_accept_token_num: int = 0
    spec_draft_token_num: int = 0
    spec_verify_ct: int = 0
    completion_token_num: int = 0


@dataclass
class PrefixCacheInfo:
    """How much of the prompt the engine found in its prefix cache."""

    cached_tokens: int = 0
    total_prompt_tokens: int = 0


def _known(cls: type, data: dict[str, Any] | None) -> Any:
    if data is None:
        return cls()
    if isinstance(data, cls):
        return data
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in data.items() if k in names})


@dataclass
class Sample:
    group_index: int | None = None
    index: int | None = None
    prompt: str | list[dict[str, str]] = ""
    tokens: list[int] = field(default_factory=list)
    multimodal_inputs: dict[str, Any] | None = None
    response: str = ""
    response_length: int = 0
    label: str | None = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    rollout_routed_experts: Any = None
    remove_sample: bool = False
    teacher_log_probs: list[float] | None = None
    status: Status = Status.PENDING
    metadata: dict[str, Any] = field(default_factory=dict)
    train_metadata: dict[str, Any] | None = None
    generate_function_path: str | None = None
    session_id: str | None = None
    non_generation_time: float = 0.0
    spec_info: SpecInfo = field(default_factory=SpecInfo)
    prefix_cache_info: PrefixCacheInfo = field(default_factory=PrefixCacheInfo)

    Status = Status  # slime spells it Sample.Status

    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length

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
        for key, value in data.items():
            if key not in names:
                setattr(sample, key, value)
        return sample

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
