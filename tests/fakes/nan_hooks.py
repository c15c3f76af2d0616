"""A FAKE buggy --custom-advantage-function-path hook: every advantage NaN, as a user's hook that divides by a zero
std would give. The trainer must stop on the non-finite loss before it saves anything."""

from __future__ import annotations

import torch


def advantage(args, rollout_data) -> None:
    rollout_data["advantages"] = [torch.full_like(lp, float("nan")) for lp in rollout_data["log_probs"]]
    rollout_data["returns"] = [torch.zeros_like(lp) for lp in rollout_data["log_probs"]]
