"""Debug rollout dumps: save, load, subsample, and the metadata that makes a replay safe.

File format: ``torch.save`` of ``{"rollout_id", "samples": [Sample.to_dict()...], "format_version": 1,
"meta": {...}}``. slime reads only ``samples``; we also read slime's own dumps (no ``meta``). Loading always uses
``weights_only=True``, so nothing in a file runs. Writes are atomic (temporary file + rename).
"""

from __future__ import annotations

import collections
import itertools
import math
import os
import re
import string
import time
from dataclasses import dataclass, field
from typing import Any, Iterable

from slime_lite import __version__
from slime_lite.errors import DumpError, SlimeLiteError
from slime_lite.io import atomic_torch_save, load_plain
from slime_lite.rollout.turns import SOURCES
from slime_lite.types import TOKEN_VERSIONS, PrefixCacheInfo, RewardError, Sample, SpecInfo, Status

FORMAT_VERSION = 1
STATUSES = tuple(s.value for s in Status)
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
    """A dump path template must contain ``{rollout_id}`` (or every rollout would write, or read, one file) and no
    other placeholder, nor a format spec (both would stop the run at a dump: eval dumps fill it with ``eval_N``); a
    glob is not a template."""
    example = f"{template.rsplit('.', 1)[0]}_{{rollout_id}}.pt"
    try:  # {rollout_id:03d} names it too (and is refused below)
        names = [name for _, name, _, _ in string.Formatter().parse(template) if name]
        has_id = any(re.match(r"rollout_id(?!\w)", name) for name in names)
    except ValueError:
        has_id = "{rollout_id}" in template
    if not has_id:
        if any(c in template for c in "*?["):
            folder = os.path.dirname(template) or "."
            raise SlimeLiteError(
                f"{flag} {template!r} is a glob, not a template: dumps are named by rollout id, so give the path "
                f"with a '{{rollout_id}}' placeholder, e.g. '{os.path.join(folder, 'data_{rollout_id}.pt')}' "
                "(quote it so the shell leaves it alone).")
        what = "read the same file" if flag.startswith("--load") else "overwrite one file"
        raise SlimeLiteError(
            f"{flag} {template!r} has no '{{rollout_id}}' placeholder, so every rollout would {what}. "
            f"Use e.g. '{example}'."
        )
    try:
        template.format(rollout_id=0)
        template.format(rollout_id="eval_0")
    except (KeyError, IndexError, ValueError, AttributeError, TypeError) as exc:
        raise SlimeLiteError(
            f"{flag} {template!r} is not a valid template ({type(exc).__name__}: {exc}): only the '{{rollout_id}}' "
            "placeholder can be used, without a format spec (eval dumps fill it with 'eval_N'; a literal brace is "
            "written '{{' or '}}').") from None


def dump_path(template: str, rollout_id: int, evaluation: bool = False) -> str:
    """Train dumps are ``T.format(rollout_id=i)``; eval dumps ``T.format(rollout_id=f"eval_{i}")``."""
    return template.format(rollout_id=f"eval_{rollout_id}" if evaluation else rollout_id)


def make_meta(args: Any, tokenizer_fingerprint: str | None, **extra: Any) -> dict[str, Any]:
    meta = {
        "n_samples_per_prompt": args.n_samples_per_prompt,
        "rollout_batch_size": args.rollout_batch_size,
        "tokenizer_fingerprint": tokenizer_fingerprint,
        # absolute: the tools read its tokenizer from wherever they run
        "model_path": os.path.abspath(args.hf_checkpoint) if os.path.isdir(args.hf_checkpoint) else args.hf_checkpoint,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "slime_lite_version": __version__,
    }
    meta.update(extra)
    return meta


_SCALARS = frozenset((int, float, bool, str, type(None)))


def _to_plain(value: Any) -> Any:
    """Reduce a value to what ``torch.load(weights_only=True)`` accepts (plain containers, scalars, tensors)."""
    import torch  # torch: flag checks read this module

    if value is None or isinstance(value, (str, bool, int, float, torch.Tensor)):
        return value
    if isinstance(value, dict):
        return {str(k) if not isinstance(k, (int, str)) else k: _to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        if all(type(v) in _SCALARS for v in value):  # token ids, log-probs, masks: kept as they are, not walked
            return list(value)
        return [_to_plain(v) for v in value]
    if type(value).__module__ == "numpy" and getattr(value, "ndim", 0) > 0:  # slime's generate: routed experts
        try:
            return torch.as_tensor(value)
        except TypeError:  # an object array
            raise DumpError(f"cannot save a numpy array of dtype {value.dtype} in a rollout dump (plain data "
                            "only)") from None
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        return value.item()
    raise DumpError(f"cannot save a value of type {type(value).__name__} in a rollout dump (plain data only)")


def plain_sample(sample: Sample) -> dict[str, Any]:
    """A sample as the plain data a dump (or a checkpoint) holds; a value that is not plain data is a DumpError
    naming the field."""
    out = {}
    for name, value in sample.to_dict().items():
        try:
            out[name] = _to_plain(value)
        except DumpError as exc:
            raise DumpError(f"sample {sample.index}: {name}: {exc}") from None
    return out


def save_rollout_dump(
    path: str, rollout_id: int, samples: list[Sample], meta: dict[str, Any] | None = None, **extra: Any
) -> None:
    """Write a dump atomically: a crash never leaves a truncated file at ``path``."""
    try:
        plain = [plain_sample(s) for s in samples]
    except DumpError as exc:
        raise DumpError(f"rollout dump {path} not written: {exc}. A generate hook or rollout function put it in "
                        "the sample: keep tensors, numbers, strings, lists and dicts there.") from None
    payload = {
        "rollout_id": rollout_id,
        "samples": plain,
        "format_version": FORMAT_VERSION,
        "meta": _to_plain(meta or {}),
    }
    payload.update(_to_plain(extra))
    atomic_torch_save(payload, path)


def load_rollout_dump(path: str) -> RolloutDump:
    """Load a dump (ours or slime's) safely; errors name the file, the sample and the field that is wrong."""
    data = load_plain(path, "rollout dump", DumpError, numpy_arrays=True)
    if not isinstance(data, dict) or not isinstance(data.get("samples"), list):
        raise DumpError(
            f"rollout dump {path} has the wrong schema: expected a dict with a 'samples' list, "
            f"got {type(data).__name__}{' with keys ' + str(sorted(map(str, data))) if isinstance(data, dict) else ''}."
        )
    samples = []
    for i, item in enumerate(data["samples"]):
        if not isinstance(item, dict):
            raise DumpError(f"rollout dump {path}: samples[{i}] is a {type(item).__name__}, expected a dict.")
        try:  # slime keeps routed experts as a numpy array
            item = {k: _from_numpy(v, k) for k, v in item.items()}
        except ValueError as exc:
            raise DumpError(f"rollout dump {path}: samples[{i}].{exc}") from None
        if "metadata" in item and item["metadata"] is None:
            item["metadata"] = {}
        problem = _field_problem(item)
        if problem is not None:
            raise DumpError(f"rollout dump {path}: samples[{i}].{problem}")
        item = {**item, **{k: _as_list(item[k]) for k in ("tokens", "loss_mask", "rollout_log_probs") if k in item}}
        if isinstance(item.get("metadata"), dict) and TOKEN_VERSIONS in item["metadata"]:
            item["metadata"] = {**item["metadata"], TOKEN_VERSIONS: _as_list(item["metadata"][TOKEN_VERSIONS])}
        try:
            sample = Sample.from_dict(item)
            sample.check()
        except (TypeError, ValueError) as exc:
            raise DumpError(f"rollout dump {path}: samples[{i}] is not a valid Sample: {exc}") from None
        samples.append(sample)
    unsplit = [s.trajectory for s in samples if s.rollout_id is None]
    if len(set(unsplit)) < len(unsplit):  # no sample index (slime's default: None), or one repeated in a group:
        for i, s in enumerate(samples):  # numbered by position, as a live rollout numbers its samples, else
            s.index = i  # every sample of a prompt group would be taken for one trajectory split into parts
    rollout_id = data.get("rollout_id", -1)
    if isinstance(rollout_id, bool) or not isinstance(rollout_id, int):
        raise DumpError(f"rollout dump {path}: rollout_id is {rollout_id!r}, expected an int.")
    meta = data.get("meta")
    if meta is not None and not isinstance(meta, dict):
        raise DumpError(f"rollout dump {path}: meta is a {type(meta).__name__}, expected a dict.")
    known = {"rollout_id", "samples", "format_version", "meta"}
    return RolloutDump(
        rollout_id=rollout_id,
        samples=samples,
        meta=meta,
        format_version=data.get("format_version"),
        path=path,
        extra={k: v for k, v in data.items() if k not in known},
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _as_list(value: Any) -> Any:
    """A 1-D tensor as a list (slime's dumps may hold per-token tensors); anything else unchanged."""
    import torch  # torch: flag checks read this module

    return value.tolist() if isinstance(value, torch.Tensor) and value.dim() == 1 else value


def _from_numpy(value: Any, name: str) -> Any:
    """A numeric numpy array as a tensor (another dtype: ValueError naming ``name``); anything else as it is."""
    import numpy as np
    import torch

    if not isinstance(value, np.ndarray):
        return value
    if value.dtype.kind not in "biuf" or value.dtype.fields is not None:
        raise ValueError(f"{name}: a numpy array of dtype {value.dtype}, not numbers")
    if value.dtype.kind == "u" and value.dtype.itemsize > 1:  # torch has few ops for uint16-64: as int64
        if value.size and int(value.max()) > np.iinfo(np.int64).max:
            raise ValueError(f"{name}: a numpy {value.dtype} array with values past int64")
        return torch.from_numpy(value.astype(np.int64))
    return torch.from_numpy(value.astype(value.dtype.newbyteorder("="), copy=True))


def _field_problem(item: dict[str, Any]) -> str | None:
    """What is wrong with the fields of one raw sample that training and the tools read, as 'field: problem'."""
    tokens = _as_list(item.get("tokens", []))
    if not isinstance(tokens, (list, tuple)):
        return f"tokens: expected a list of token ids, got {type(tokens).__name__}"
    for k, t in enumerate(tokens):
        if not _is_int(t) or t < 0:
            return f"tokens[{k}]: {t!r} is not a token id (a non-negative int)"
    length = item.get("response_length", 0)
    if not _is_int(length) or length < 0:
        return f"response_length: {length!r} is not a non-negative int"
    if length > len(tokens):
        return f"response_length: {length} is more than len(tokens) = {len(tokens)}"
    if tokens and length == len(tokens):  # the first response token's log-prob is read at the token before it
        return f"response_length: {length} is all of tokens: a sample needs at least one prompt token"
    for name in ("loss_mask", "rollout_log_probs"):
        value = _as_list(item.get(name))
        if value is None:
            continue
        if not isinstance(value, (list, tuple)):
            return f"{name}: expected a list of numbers or None, got {type(value).__name__}"
        if len(value) != length:
            return f"{name}: has {len(value)} entries but response_length is {length}"
        bad = next((k for k, v in enumerate(value) if not isinstance(v, (int, float))), None)
        if bad is not None:
            return f"{name}[{bad}]: {value[bad]!r} is not a number"
    metadata = item.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        return f"metadata: expected a dict or None, got {type(metadata).__name__}"
    versions = _as_list(metadata.get(TOKEN_VERSIONS)) if isinstance(metadata, dict) else None
    if versions is not None and (not isinstance(versions, (list, tuple)) or len(versions) != length
                                 or not all(_is_int(v) for v in versions)):
        return (f"metadata[{TOKEN_VERSIONS!r}]: expected one int weight version per response token "
                f"({length}), got {versions!r:.80}")
    problem = _turns_problem(metadata.get("turns") if isinstance(metadata, dict) else None, length)
    if problem is not None:
        return f"metadata['turns']{problem}"
    weight_versions = item.get("weight_versions", [])
    if not isinstance(weight_versions, (list, tuple)):
        return f"weight_versions: expected a list (each engine call's weight version), got {weight_versions!r:.80}"
    for name in ("spec_info", "prefix_cache_info"):  # slime's dicts of counters
        value = item.get(name)
        if value is not None and not isinstance(value, (dict, SpecInfo, PrefixCacheInfo)):
            return f"{name}: expected a dict, got {type(value).__name__} {value!r:.80}"
    reward = item.get("reward")
    if reward is not None and not isinstance(reward, (int, float, dict)):
        return f"reward: expected a number, a dict or None, got {type(reward).__name__} {reward!r}"
    for name in ("index", "group_index"):
        value = item.get(name)
        if value is not None and not _is_int(value):
            return f"{name}: expected an int or None, got {type(value).__name__} {value!r}"
    status = item.get("status", Status.PENDING.value)
    if not isinstance(status, (str, Status)) or str(getattr(status, "value", status)) not in STATUSES:
        return f"status: {status!r} is not one of {', '.join(STATUSES)}"
    return None


def _turns_problem(recorded: Any, length: int) -> str | None:
    """What is wrong with a sample's turn record (multi-turn: a list of {start, length, source, ...} inside the
    response, as rollout/turns.py writes it), as '[k].field: problem' or ': problem'; None when fine or absent."""
    if recorded is None:
        return None
    if not isinstance(recorded, list):
        return f": expected a list of turns ({{'start', 'length', 'source'}} each), got {recorded!r:.60}"
    for k, turn in enumerate(recorded):
        if not isinstance(turn, dict):
            return f"[{k}]: expected a dict with 'start', 'length' and 'source', got {turn!r:.60}"
        start, size = turn.get("start"), turn.get("length")
        if not _is_int(start) or not _is_int(size) or start < 0 or size < 0 or start + size > length:
            return (f"[{k}]: start {start!r} and length {size!r} must be non-negative ints inside the "
                    f"{length} response tokens")
        if turn.get("source") not in SOURCES:
            return f"[{k}].source: {turn.get('source')!r} is not one of {', '.join(SOURCES)}"
    return None


def check_rewards(samples: list[Sample], reward_key: str | None, where: str, strict: bool) -> None:
    """Every reward is a finite number (SlimeLiteError naming ``where``, the sample and its reward). ``strict``: a
    sample with no usable scalar reward is an error too (a replay trains on every sample)."""
    for i, s in enumerate(samples):
        try:
            reward = s.scalar_reward(reward_key)
        except RewardError as exc:
            if strict:
                raise DumpError(f"{where}: samples[{i}].reward: {exc}") from None
            continue
        if not math.isfinite(reward):
            raise SlimeLiteError(
                f"{where}: samples[{i}].reward is {reward} (sample index {s.index}, prompt group {s.group_index}). "
                "Rewards must be finite numbers: a NaN or infinite reward makes the advantages and the loss NaN. "
                "Fix the reward function (--rm-type / --custom-rm-path) or the dump."
            )


def check_generated_samples(samples: list[Sample], vocab_size: int, where: str) -> None:
    """What a rollout (a generate hook or a rollout function) produced has the shape training reads: token ids in
    the model's vocabulary, ``loss_mask`` and ``rollout_log_probs`` one per response token, a response no longer
    than the tokens. A SlimeLiteError naming ``where``, the sample index and the field; nothing is trained."""
    for i, s in enumerate(samples):
        problem = _field_problem(s.to_dict())
        if problem is None:
            bad = next((k for k, t in enumerate(s.tokens) if t >= vocab_size), None)
            if bad is not None:
                problem = f"tokens[{bad}]: {s.tokens[bad]} is not below the model's vocab size {vocab_size}"
        if problem is not None:
            raise SlimeLiteError(
                f"{where}: sample {i} (index {s.index}): {problem}. The generate hook or rollout function built a "
                "malformed sample (rollout.turns.append_turn keeps tokens, loss_mask and rollout_log_probs "
                "aligned); nothing of this rollout is trained.")


def check_replay_samples(dump: RolloutDump, vocab_size: int, reward_key: str | None) -> None:
    """What training on a dump needs beyond its schema: samples, token ids inside the model's vocab, finite
    rewards, finite rollout log-probs (a masked token's too: a mask multiplies it, and NaN x 0 is NaN)."""
    if not dump.samples:
        raise DumpError(f"rollout dump {dump.path} has no samples: there is nothing to train on. Re-create it.")
    for i, s in enumerate(dump.samples):
        bad = next((k for k, t in enumerate(s.tokens) if t >= vocab_size), None)
        if bad is not None:
            raise DumpError(
                f"rollout dump {dump.path}: samples[{i}].tokens[{bad}] = {s.tokens[bad]} is not below the model's "
                f"vocab size {vocab_size} (--hf-checkpoint): the dump was made with another tokenizer or model."
            )
        lps = s.rollout_log_probs or []
        bad = next((k for k, v in enumerate(lps) if not math.isfinite(v)), None)
        if bad is not None:
            raise DumpError(
                f"rollout dump {dump.path}: samples[{i}].rollout_log_probs[{bad}] = {lps[bad]} is not finite (an "
                "engine's log-prob of a token it drew never is): --use-tis and the rollout-vs-train log-prob "
                "checks would read it, even under loss_mask 0. Re-create the dump.")
    check_rewards(dump.samples, reward_key, f"rollout dump {dump.path}", strict=True)


def group_problem(samples: list[Sample], group_size: int, estimator: str) -> str | None:
    """A group estimator (GRPO, REINFORCE++-baseline) compares the ``group_size`` trajectories of a prompt (the
    samples one trajectory was split into share ``rollout_id``): a dump whose prompt groups (``group_index``) hold
    another number or are not adjacent (made with a per-sample estimator and a generate hook that returned several
    trajectories) would be trained with prompts mixed. What is wrong, or None (also for dumps whose samples have no
    group_index: nothing to compare)."""
    if all(s.group_index is None for s in samples):
        return None
    trajectories: dict[Any, set] = collections.defaultdict(set)
    for s in samples:
        trajectories[s.group_index].add(s.trajectory)
    wrong = [(group, len(t)) for group, t in trajectories.items() if len(t) != group_size]
    runs = [group for group, _ in itertools.groupby(samples, key=lambda s: s.group_index)]
    if wrong:
        what = f"its prompt group {wrong[0][0]} has {wrong[0][1]} trajectories"
    elif len(runs) > len(trajectories):
        what = f"the samples of its prompt group {next(g for k, g in enumerate(runs) if g in runs[:k])} are apart"
    else:
        return None
    return (f"{what}, but --advantage-estimator {estimator} compares the --n-samples-per-prompt {group_size} "
            "trajectories of each prompt, adjacent (replay such a dump with a per-sample estimator, e.g. "
            "reinforce_plus_plus or ppo)")


def check_replay_meta(dump: RolloutDump, expected: dict[str, Any], more: Iterable[str] = ()) -> None:
    """Stop a replay whose dump was made with other settings, naming every one at once (and the ``more`` problems
    the caller found); slime's dumps (no meta) are checked for ``more`` only."""
    problems = [f"{key}={have!r} in the dump, {flag} = {want!r} in this run"
                for key, flag in REPLAY_CHECKS
                for want, have in [(expected.get(key), (dump.meta or {}).get(key))]
                if want is not None and have is not None and want != have]
    problems += list(more)
    if problems:
        raise DumpError(f"rollout dump {dump.path} does not fit this run ({len(problems)} setting(s)): "
                        + "; ".join(problems) + ". Replay with the dump's settings or re-create the dump.")


def subsample_groups(samples: list[Sample], ratio: float, group_size: int) -> list[Sample]:
    """Keep a deterministic head and tail of the data, whole prompt groups at a time, at least one group."""
    if not 0 < ratio <= 1:
        raise SlimeLiteError(f"--load-debug-rollout-data-subsample {ratio} must be in (0, 1].")
    if ratio == 1:
        return list(samples)
    if all(s.group_index is not None for s in samples):  # a group's samples: its trajectories, split or not
        groups = [list(g) for _, g in itertools.groupby(samples, key=lambda s: s.group_index)]
    else:
        groups = [samples[i : i + group_size] for i in range(0, len(samples), group_size)]
    keep = max(1, int(len(groups) * ratio))
    head = (keep + 1) // 2
    tail = keep - head
    chosen = groups[:head] + (groups[len(groups) - tail :] if tail else [])
    return [s for g in chosen for s in g]


def find_dumps(template: str, max_id: int = 999, ids: Iterable[int] | None = None) -> list[tuple[str, int, str]]:
    """All dumps of a template for ids 0..max_id (or ``ids``): (kind 'train'|'eval', rollout id, path), sorted.
    A run with several eval sets writes one eval dump per set, ``<eval dump>_<name><ext>`` (the manager's
    ``evaluate``)."""
    listings: dict[str, list[str]] = {}

    def per_set(path: str) -> list[str]:
        root, ext = os.path.splitext(path)
        folder, head = os.path.split(root)
        if folder not in listings:
            listings[folder] = sorted(os.listdir(folder or ".")) if os.path.isdir(folder or ".") else []
        return [os.path.join(folder, name) for name in listings[folder]
                if name.startswith(head + "_") and name.endswith(ext) and len(name) > len(head) + 1 + len(ext)]

    found = []
    for rid in range(max_id + 1) if ids is None else ids:
        for kind, evaluation in (("train", False), ("eval", True)):
            path = dump_path(template, rid, evaluation)
            if os.path.exists(path):
                found.append((kind, rid, path))
        found += [("eval", rid, path) for path in per_set(dump_path(template, rid, evaluation=True))]
    return found
