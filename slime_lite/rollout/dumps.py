"""Debug rollout dumps: save, load, subsample, and the metadata that makes a replay safe.

File format (SPEC 4): ``torch.save`` of ``{"rollout_id", "samples": [Sample.to_dict()...], "format_version": 1,
"meta": {...}}``. slime reads only ``samples``; we also read slime's own dumps (no ``meta``). Loading always uses
``weights_only=True``, so nothing in a file runs. Writes are atomic (temporary file + rename).
"""

from __future__ import annotations

import os
import pickle
import time
import zipfile
from dataclasses import dataclass, field
from typing import Any

from slime_lite import __version__
from slime_lite.errors import DumpError, SlimeLiteError
from slime_lite.io import atomic_torch_save
from slime_lite.types import Sample

FORMAT_VERSION = 1
# meta keys that must agree between a dump and the flags of the run replaying it: (meta key, flag)
REPLAY_CHECKS = (
    ("n_samples_per_prompt", "--n-samples-per-prompt"),
    ("rollout_batch_size", "--rollout-batch-size"),
    ("tokenizer_fingerprint", "--hf-checkpoint (tokenizer)"),
)


@dataclass
class RolloutDump:
    rollout_id: int
    samples: list[Sample]
    meta: dict[str, Any] | None = None
    format_version: int | None = None
    path: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def check_template(template: str, flag: str) -> None:
    """A dump path template must contain ``{rollout_id}``, or every rollout would overwrite one file."""
    if "{rollout_id}" not in template:
        raise SlimeLiteError(
            f"{flag} {template!r} has no '{{rollout_id}}' placeholder, so every rollout would overwrite one file. "
            f"Use e.g. '{template.rsplit('.', 1)[0]}_{{rollout_id}}.pt'."
        )


def dump_path(template: str, rollout_id: int, evaluation: bool = False) -> str:
    """Train dumps are ``T.format(rollout_id=i)``; eval dumps ``T.format(rollout_id=f"eval_{i}")``."""
    return template.format(rollout_id=f"eval_{rollout_id}" if evaluation else rollout_id)


def make_meta(args: Any, tokenizer_fingerprint: str | None, **extra: Any) -> dict[str, Any]:
    meta = {
        "n_samples_per_prompt": args.n_samples_per_prompt,
        "rollout_batch_size": args.rollout_batch_size,
        "tokenizer_fingerprint": tokenizer_fingerprint,
        "model_path": args.hf_checkpoint,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "slime_lite_version": __version__,
    }
    meta.update(extra)
    return meta


def _to_plain(value: Any) -> Any:
    """Reduce a value to what ``torch.load(weights_only=True)`` accepts (plain containers, scalars, tensors)."""
    import torch

    if value is None or isinstance(value, (str, bool, int, float, torch.Tensor)):
        return value
    if isinstance(value, dict):
        return {str(k) if not isinstance(k, (int, str)) else k: _to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_plain(v) for v in value]
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        return value.item()
    raise DumpError(f"cannot save a value of type {type(value).__name__} in a rollout dump (plain data only)")


def save_rollout_dump(
    path: str, rollout_id: int, samples: list[Sample], meta: dict[str, Any] | None = None, **extra: Any
) -> None:
    """Write a dump atomically: a crash never leaves a truncated file at ``path``."""
    payload = {
        "rollout_id": rollout_id,
        "samples": [_to_plain(s.to_dict()) for s in samples],
        "format_version": FORMAT_VERSION,
        "meta": _to_plain(meta or {}),
    }
    payload.update(_to_plain(extra))
    atomic_torch_save(payload, path)


def load_rollout_dump(path: str) -> RolloutDump:
    """Load a dump (ours or slime's) safely; errors name the file and what is wrong."""
    import torch

    if not os.path.exists(path):
        raise DumpError(f"rollout dump {path} does not exist. Check --load-debug-rollout-data and the rollout id.")
    if os.path.getsize(path) == 0:
        raise DumpError(f"rollout dump {path} is empty (0 bytes): it was not written completely; re-create it.")
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise DumpError(
            f"rollout dump {path} needs arbitrary pickled objects to load, so it was refused (weights_only=True; "
            f"nothing in it ran). Dumps must hold plain data only. Details: {str(exc).splitlines()[0]}"
        ) from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError, ValueError) as exc:
        raise DumpError(
            f"rollout dump {path} is truncated or not a torch file ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}). Re-create it."
        ) from None
    if not isinstance(data, dict) or not isinstance(data.get("samples"), list):
        raise DumpError(
            f"rollout dump {path} has the wrong schema: expected a dict with a 'samples' list, "
            f"got {type(data).__name__}{' with keys ' + str(sorted(data)) if isinstance(data, dict) else ''}."
        )
    samples = []
    for i, item in enumerate(data["samples"]):
        if not isinstance(item, dict):
            raise DumpError(f"rollout dump {path}: samples[{i}] is a {type(item).__name__}, expected a dict.")
        try:
            sample = Sample.from_dict(item)
            sample.check()
        except (TypeError, ValueError) as exc:
            raise DumpError(f"rollout dump {path}: samples[{i}] is not a valid Sample: {exc}") from None
        samples.append(sample)
    known = {"rollout_id", "samples", "format_version", "meta"}
    return RolloutDump(
        rollout_id=int(data.get("rollout_id", -1)),
        samples=samples,
        meta=data.get("meta"),
        format_version=data.get("format_version"),
        path=path,
        extra={k: v for k, v in data.items() if k not in known},
    )


def check_replay_meta(dump: RolloutDump, expected: dict[str, Any]) -> None:
    """Stop a replay whose dump was made with other settings; slime's dumps (no meta) are accepted."""
    if not dump.meta:
        return
    for key, flag in REPLAY_CHECKS:
        want, have = expected.get(key), dump.meta.get(key)
        if want is not None and have is not None and want != have:
            raise DumpError(
                f"rollout dump {dump.path} was made with {key}={have!r} but this run has {flag} = {want!r}. "
                f"Replay with the dump's setting ({have!r}) or re-create the dump."
            )


def subsample_groups(samples: list[Sample], ratio: float, group_size: int) -> list[Sample]:
    """Keep a deterministic head and tail of the data, whole prompt groups at a time, at least one group."""
    if not 0 < ratio <= 1:
        raise SlimeLiteError(f"--load-debug-rollout-data-subsample {ratio} must be in (0, 1].")
    if ratio == 1:
        return list(samples)
    groups = [samples[i : i + group_size] for i in range(0, len(samples), group_size)]
    keep = max(1, int(len(groups) * ratio))
    head = (keep + 1) // 2
    tail = keep - head
    chosen = groups[:head] + (groups[len(groups) - tail :] if tail else [])
    return [s for g in chosen for s in g]


def find_dumps(template: str, max_id: int = 999) -> list[tuple[str, int, str]]:
    """All dumps of a template for ids 0..max_id: (kind 'train'|'eval', rollout id, path), sorted."""
    found = []
    for rid in range(max_id + 1):
        for kind, evaluation in (("train", False), ("eval", True)):
            path = dump_path(template, rid, evaluation)
            if os.path.exists(path):
                found.append((kind, rid, path))
    return found
