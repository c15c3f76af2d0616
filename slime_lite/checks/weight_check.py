"""``--check-weight-update-equal``: after a push, every parameter the engines hold equals the trainer's. Both sides
hash the bytes with ``weight_checksum.tensor_checksums`` (the engines on ``/get_weights_checksum``); the trainer
hashes its tensors while the engines hash theirs. Runs in the trainer's rank 0 (torch imported)."""

from __future__ import annotations

import logging

import torch

from slime_lite.engine_client import SentRequest, sent_to_all
from slime_lite.errors import EngineError, SlimeLiteError
from slime_lite.weight_checksum import tensor_checksums

log = logging.getLogger(__name__)


class WeightCheckUnavailable(SlimeLiteError):
    """An engine without ``/get_weights_checksum`` (not the embedded engine): its weights cannot be compared."""


def _hash_device() -> torch.device | None:
    """Where the trainer hashes: this thread's GPU where there is one (host copies go there a batch at a time: hashing
    on the host is ~10x slower than a push). Asked in the caller's thread: another thread's current GPU is GPU 0."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None


def _digests(named: dict[str, torch.Tensor], device: torch.device | None, dtype: torch.dtype | None = None) -> list[str]:
    """``weight_checksum.tensor_checksums`` of the trainer's tensors, on ``device``."""
    return tensor_checksums(list(named.values()), dtype=dtype, device=device)


def _checksums(request: SentRequest) -> dict[str, str]:
    """The engine's ``/get_weights_checksum`` answer; WeightCheckUnavailable for an engine without the route."""
    try:
        return request.result()
    except EngineError as exc:
        if "answered HTTP 404" not in str(exc):
            raise
        raise WeightCheckUnavailable(
            f"--check-weight-update-equal: engine {request.url} has no /get_weights_checksum: it is not slime-lite's "
            "embedded engine (a real SGLang server's /weights_checker hashes its own fused, TP-sharded tensors under "
            "its own names, which cannot be compared with the trainer's HF-named weights). The weight check needs "
            "--rollout-backend embedded; with --rollout-backend sglang drop --check-weight-update-equal.") from None


def check_weights_equal(named: dict[str, torch.Tensor], urls: list[str]) -> None:
    """Every parameter the engines hold equals the trainer's: ``weight_checksum.tensor_checksums`` of the bytes on
    both sides, the trainer's computed while the engines compute theirs. A tensor that matches only after a cast to
    another float dtype (cast on its device) is equal in the engine's precision: counted apart and reported."""
    alias = {"lm_head.weight": "model.embed_tokens.weight"}  # tied embeddings: the engine lists both names
    with sent_to_all(urls, "/get_weights_checksum", {}, 300) as sent:
        ours = dict(zip(named, _digests(named, _hash_device())))
        engines = [_checksums(request) for request in sent]
    for url, engine in zip(urls, engines):
        source = {n: n if n in named else alias.get(n) for n in engine}  # engine name -> the trainer's name
        missing = sorted(n for n, s in source.items() if s not in named)
        unequal = [n for n, s in source.items() if s in named and ours[s] != engine[n]]
        cast: list[str] = []
        for dt in (torch.bfloat16, torch.float16, torch.float32):  # one batch per dtype, only the unequal ones
            retry = [n for n in unequal if n not in cast and named[source[n]].dtype != dt]
            if retry:
                sums = _digests({n: named[source[n]] for n in retry}, _hash_device(), dt)
                cast += [n for n, digest in zip(retry, sums) if digest == engine[n]]
        differ = [n for n in unequal if n not in cast]
        if differ or missing:
            raise SlimeLiteError(
                f"--check-weight-update-equal: engine {url} holds weights that differ from the trainer's: "
                f"{len(differ)} differ {differ[:8]}{'...' if len(differ) > 8 else ''}; {len(missing)} never pushed "
                f"{missing[:8]}. Likely causes: a name or layer-id mapping error under PP (layer ids offset per "
                "stage), a parameter the push skipped, or a dtype cast on the way."
            )
        if cast:
            log.warning("weight check: %d parameter(s) equal only after a dtype cast (engine precision differs from "
                        "the trainer's), e.g. %s", len(cast), cast[:3])
    log.info("weight check: %d parameters equal on %d engine(s)", len(named), len(urls))
