"""Multi-turn samples: a response is model turns with inserted turns (tool or environment output) between them.

``append_turn`` is the one way a rollout (a generate hook, the agent endpoint, the tool task) grows a sample, and it
keeps every per-token field aligned: ``tokens`` (prompt + response), ``response_length``, ``loss_mask`` (1 on model
tokens, 0 on inserted ones), ``rollout_log_probs`` (the engine's for model tokens; 0.0 for inserted tokens, which
the mask keeps out of every loss and metric: never invented values), and the text of each turn. Each turn is
recorded in ``sample.metadata["turns"]`` as ``{"start", "length", "source", "trainable", "text"}`` (``start`` and
``length`` in response tokens), which the debug tools show and the token drift check reads. A model turn given its
tokens' weight ``versions`` keeps ``metadata["token_weight_versions"]`` one per response token (an inserted turn
takes the version of the turn before it), so a sample spanning weight pushes knows which weights wrote each token.

``restart`` takes a sample back to its prompt: a multi-turn hook given a sample that --partial-rollout carried
aborted (in the middle of a trajectory it cannot resume) generates it again, and the tokens dropped are counted
(``metadata["restarted_tokens"]``) as wasted, not carried.

A turn's tokens are the engine's own ids (model turns) or the tokenizer's ids of the inserted text: training tokens
are never rebuilt by re-tokenising a model turn's text.
"""

from __future__ import annotations

import base64
from typing import Any

from slime_lite.types import LEADING_UNVERSIONED, TOKEN_VERSIONS, Sample, Status, extend_token_versions

SOURCES = ("model", "tool", "env", "user")  # who wrote a turn: only "model" turns come from the engine
AGE_MASKED = "age_masked_positions"  # metadata: response positions masked for the age of their weights
INSERTED_CUT = "inserted_tokens_cut"  # metadata: inserted tokens left out to fit the budget (multi_turn.py)
RESTARTED = "restarted_tokens"  # metadata: response tokens ``restart`` dropped (over the sample's restarts)


def append_turn(sample: Sample, tokens: list[int], log_probs: list[float] | None = None, *, trainable: bool = True,
                source: str = "model", text: str | None = None, versions: list[int] | None = None) -> Sample:
    """Append one turn to ``sample``'s response (in place; returns the sample).

    Model turns (``source`` "model") carry the engine's ``log_probs``, one per token; a model turn without them is
    left untrainable (its tokens get mask 0), since a trained token needs its rollout log-prob. Inserted turns get
    mask 0 and log-prob 0.0 whatever ``trainable`` says: the model did not produce them."""
    if source not in SOURCES:
        raise ValueError(f"turn source {source!r}: expected one of {SOURCES}")
    tokens = [int(t) for t in tokens]
    if log_probs is not None and len(log_probs) != len(tokens):
        raise ValueError(f"a turn of {len(tokens)} tokens with {len(log_probs)} log-probs")
    model = source == "model"
    trained = bool(trainable and model and log_probs is not None)
    n_before = sample.response_length
    if sample.loss_mask is None:
        sample.loss_mask = [1] * n_before
    if sample.rollout_log_probs is None and n_before == 0:  # else: earlier tokens have none, and neither does this
        sample.rollout_log_probs = []
    extend_token_versions(sample, n_before, len(tokens), versions, model)
    sample.tokens = list(sample.tokens) + tokens
    sample.response_length = n_before + len(tokens)
    sample.loss_mask = list(sample.loss_mask) + [1 if trained else 0] * len(tokens)
    if sample.rollout_log_probs is not None:
        lps = [float(x) for x in log_probs] if (model and log_probs is not None) else [0.0] * len(tokens)
        sample.rollout_log_probs = list(sample.rollout_log_probs) + lps
    if text is not None:
        sample.response = (sample.response or "") + text
    sample.metadata.setdefault("turns", []).append(
        {"start": n_before, "length": len(tokens), "source": source, "trainable": trained, "text": text})
    return sample


def mask_older(sample: Sample, versions: list[int], bound: int) -> int:
    """Loss mask 0 on the response tokens written by weights older than ``bound`` (``versions``: one per token);
    their positions go to ``metadata[AGE_MASKED]`` (the multi-turn mask check does not count a model turn masked
    for its weights' age as one a hook masked). Returns the trained tokens it masked."""
    mask = sample.loss_mask if sample.loss_mask is not None else [1] * sample.response_length
    sample.loss_mask = [m if v >= bound else 0 for m, v in zip(mask, versions)]
    old = [i for i, v in enumerate(versions) if v < bound]
    sample.metadata[AGE_MASKED] = sorted(set(sample.metadata.get(AGE_MASKED, [])) | set(old))
    return sum(bool(m) for m in mask) - sum(bool(m) for m in sample.loss_mask)


def restart(sample: Sample) -> int:
    """Back to the prompt: the response, its per-token fields and turns dropped, the status PENDING; returns the
    response tokens dropped (added to ``metadata["restarted_tokens"]``)."""
    n = sample.response_length
    sample.tokens = list(sample.tokens[:len(sample.tokens) - n])
    sample.response, sample.response_length, sample.loss_mask, sample.rollout_log_probs = "", 0, None, None
    sample.weight_versions, sample.status, sample.rollout_routed_experts = [], Status.PENDING, None
    for key in ("turns", TOKEN_VERSIONS, LEADING_UNVERSIONED, AGE_MASKED):
        sample.metadata.pop(key, None)
    sample.metadata[RESTARTED] = sample.metadata.get(RESTARTED, 0) + n
    return n


def turns(sample: Sample) -> list[dict[str, Any]]:
    """The sample's turns; a single-turn sample (no record) is one model turn over its whole response."""
    recorded = sample.metadata.get("turns")
    if recorded:
        return list(recorded)
    return [{"start": 0, "length": sample.response_length, "source": "model",
             "trainable": True, "text": sample.response}]


def model_tokens(sample: Sample) -> int:
    """The tokens of the sample's model turns (what the engines generated; inserted turns are not)."""
    return sum(t["length"] for t in turns(sample) if t["source"] == "model")


def inserted_and_trained(samples: list[Sample]) -> tuple[int, int]:
    """(tokens of inserted turns, model-turn tokens at loss_mask 1) over multi-turn samples; raises ValueError naming
    the first sample with an inserted token at loss_mask 1 (it would be trained as if the model wrote it)."""
    inserted = trained = 0
    for s in samples:
        for t in turns(s):
            mask = s.loss_mask[t["start"]:t["start"] + t["length"]]
            if t["source"] == "model":
                trained += sum(mask)
            elif any(mask):
                raise ValueError(f"sample {s.index}: its {t['source']} turn at {t['start']} has loss_mask 1")
            else:
                inserted += t["length"]
    return inserted, trained


def routed_experts(b64: str) -> Any:
    """The engine's ``meta_info.routed_experts`` (--use-rollout-routing-replay: base64 of int32 ``[prompt + output
    tokens - 1, layers, top_k]``, every position the call fed through the model) as a flat int32 tensor."""
    import torch  # torch: only with routing replay (the rollout process has it then)

    return torch.frombuffer(bytearray(base64.b64decode(b64)), dtype=torch.int32)
