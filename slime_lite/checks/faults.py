"""Fault injection (``--debug-inject-fault``): each fault breaks the loop the way a real bug does, at the place the
bug would sit, so the doctor and ``--ci-test`` can be seen catching it (and ``kill-engine`` the way a crash does, so
``--use-fault-tolerance`` can be seen recovering). Every fault is defined here; the loop calls one hook per place
(sampling, the trainer's weights out, the push, the rollout's requests). Imports nothing of the project, so both the
rollout and the train side may call it.
"""

from __future__ import annotations

import re
from typing import Any

FAULTS = {
    "skip-weight-push": "the trainer never sends its weights: engines keep generating with the old ones",
    "swap-pp-layers": "a later pipeline stage names its layers by local ids (the PP layer offset forgotten)",
    "engine-temperature": "the engine samples at 1.5x the temperature the trainer scores with",
    "kill-engine": "engine 0's server process is SIGKILLed while rollout 1 is generated, once its first group has "
                   "finished and before its last group is sent (see --use-fault-tolerance)",
}
ENGINE_TEMPERATURE_FACTOR = 1.5
KILL_ENGINE_ROLLOUT = 1  # the second rollout: the trainer's weights then differ from the checkpoint's


def sampling_temperature(fault: str | None, temperature: float, evaluation: bool) -> float:
    """The temperature the engine is asked to sample rollouts with (evaluation is left alone)."""
    if fault == "engine-temperature" and not evaluation:
        return temperature * ENGINE_TEMPERATURE_FACTOR
    return temperature


def breaks_sent_weights(fault: str | None) -> bool:
    """Whether the weights sent to the engines differ from the trainer's (the check then compares against these)."""
    return fault == "swap-pp-layers"


def sent_stage_weights(fault: str | None, named: dict[str, Any], pp_rank: int) -> dict[str, Any]:
    """One pipeline stage's HF-named weights as the push sends them."""
    if fault != "swap-pp-layers" or pp_rank == 0:
        return named
    ids = sorted({int(m.group(1)) for n in named for m in [re.search(r"layers\.(\d+)\.", n)] if m})
    if not ids:
        return named
    first = ids[0]
    return {re.sub(r"layers\.(\d+)\.", lambda m: f"layers.{int(m.group(1)) - first}.", n): t for n, t in named.items()}


def skips_weight_push(fault: str | None) -> bool:
    return fault == "skip-weight-push"


def kills_engine(fault: str | None, rollout_id: int) -> bool:
    """Whether engine 0 is to be killed during this rollout's generation (once per run)."""
    return fault == "kill-engine" and rollout_id == KILL_ENGINE_ROLLOUT
