"""An agent trajectory's records (``Call``: one chat call as the engine served it) as training samples (the agent
endpoint's ``Trajectory.samples``).

A trajectory's calls fall into segments: a call joins the segment its parent call ends (it extends that
conversation), else starts one (a rewritten history, or calls sent at once from the same history). Each segment is
one sample: its first call's prompt ids, then per call the tokens of the messages added since the parent (tool or
user turns, loss_mask 0) and the completion (the engine's ids and log-probs, the weight version of each token), and
its last call's table of routed experts (--use-rollout-routing-replay)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from slime_lite.rollout.turns import append_turn, routed_experts
from slime_lite.types import TOKEN_VERSIONS, TRAJECTORY_END, Sample, Status, version_number


@dataclass
class Call:
    """One chat call as the engine served it."""

    messages: list[dict[str, Any]]  # as the agent sent them (normalised)
    reply: dict[str, Any]  # the assistant message returned
    prompt_ids: list[int]
    completion_ids: list[int]
    log_probs: list[float]
    text: str
    finish_reason: str
    extends: bool  # prompt_ids = the parent call's prompt + completion + the new messages' tokens
    new_roles: list[str] = field(default_factory=list)  # roles of the messages added since the parent call
    weight_version: str | None = None
    token_versions: list[int] | None = None  # per completion token (a call in flight across a push spans two)
    routed_experts: str | None = None  # --use-rollout-routing-replay: the engine's table (the latest call's only)
    rendered: str | None = None  # the prompt's text, where the chat template rendered all of it
    cached_tokens: int = 0
    malformed: int = 0
    parent: "Call | None" = None  # the call whose messages and reply this one's messages extend
    start: int = 0  # prompt tokens of the first call of this call's chain (its response begins there)
    tools: Any = None  # the tools and template kwargs it was rendered with
    kwargs: dict[str, Any] = field(default_factory=dict)


def segments(calls: list[Call]) -> list[list[Call]]:
    """The calls in segments: a call joins the segment its parent ends, else starts one."""
    out: list[list[Call]] = []
    for call in calls:
        seg = next((g for g in out if call.parent is not None and g[-1] is call.parent), None)
        if seg is not None:
            seg.append(call)
        else:
            out.append([call])
    return out


def trajectory_samples(traj: Any, sample: Sample) -> list[Sample]:
    """One sample per segment (usually one), sharing rollout_id; the first is ``sample`` itself. The trajectory's
    end (truncated: its budget, --max-turns or context ran out) is its last segment's status; an aborted trajectory
    is one ABORTED sample (--partial-rollout runs the agent again once, not once per segment)."""
    segs = segments(traj.calls)
    if traj.aborted:
        segs = segs[:1]
    decode = traj.endpoint.tokenizer.decode
    out = []
    for k, segment in enumerate(segs or [[]]):
        s = sample if k == 0 else copy.deepcopy(sample)  # (k > 0: the fields below reset again)
        s.response, s.response_length, s.loss_mask, s.rollout_log_probs = "", 0, None, None
        s.metadata.pop("turns", None)
        s.metadata.pop(TOKEN_VERSIONS, None)
        s.weight_versions, s.rollout_routed_experts = [], None
        if segment:  # the prompt is the first call's: its rendered text (the drift check re-tokenises it), if any
            s.tokens = list(segment[0].prompt_ids)
            if segment[0].rendered is None:
                s.metadata.pop("prompt_text", None)
            else:
                s.metadata["prompt_text"] = segment[0].rendered
        for call in segment:
            new = call.prompt_ids[len(s.tokens):]
            if new:
                append_turn(s, new, source="tool" if "tool" in call.new_roles else "user", text=decode(new))
            versions = call.token_versions or (None if call.weight_version is None
                                               else [version_number(call.weight_version)] * len(call.completion_ids))
            append_turn(s, call.completion_ids, call.log_probs, source="model", text=call.text, versions=versions)
            if call.weight_version is not None:
                s.weight_versions.append(call.weight_version)
        last = segment[-1] if segment else None
        if last is not None and last.routed_experts is not None:  # its prompt was every token before it
            s.rollout_routed_experts = routed_experts(last.routed_experts)
        s.status = Status.from_finish_reason(last.finish_reason) if last else Status.FAILED
        if traj.truncated and (not segment or segment[-1] is traj.calls[-1]):
            s.status = Status.TRUNCATED
        if traj.aborted:
            s.status = Status.ABORTED
        s.prefix_cache_info.cached_tokens = sum(c.cached_tokens for c in segment)
        s.prefix_cache_info.total_prompt_tokens = sum(len(c.prompt_ids) for c in segment)
        s.metadata.update(agent_calls=len(segment), tool_calls=sum(len(c.reply.get("tool_calls", [])) for c in segment),
                          malformed_tool_calls=sum(c.malformed for c in segment))
        s.metadata.pop(TRAJECTORY_END, None)
        if len(segs) > 1:
            s.rollout_id = sample.index if sample.rollout_id is None else sample.rollout_id
            s.metadata["agent_segment"] = k
            if segment and segment[-1] is traj.calls[-1]:  # its reward is the trajectory's (a group estimator's)
                s.metadata[TRAJECTORY_END] = True
        out.append(s)
    return out
