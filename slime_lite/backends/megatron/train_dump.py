"""Debug train dumps (``--save-debug-train-data``, slime's flag): what the trainer computed for each sample of a
rollout before its update, per response token, keyed by the rollout sample index so it joins 1:1 with the rollout
dump (``--save-debug-rollout-data``).

File format (slime's shape, plain data: ``torch.load(weights_only=True)`` reads it):
``{"rollout_id", "rank", "format_version": 1, "rollout_data": {column: [one entry per sample of this rank]}}``.
Columns: ``sample_indices`` (the rollout sample index: ``Sample.index``, else the position in the rollout),
``tokens`` (prompt + response ids), ``response_lengths``, and one float32 tensor per response token for
``log_probs`` (the actor's forward before the update: the loss's "old" log-probs), ``entropy``, ``loss_masks``,
``advantages``, ``returns``, and when they exist ``ref_log_probs``, ``rollout_log_probs``, ``values`` (PPO).
Each last-stage, TP-rank-0 train rank writes the samples of its data-parallel shard.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from slime_lite.errors import DumpError, SlimeLiteError
from slime_lite.io import atomic_torch_save, load_plain

FORMAT_VERSION = 1
PER_TOKEN = ("log_probs", "ref_log_probs", "rollout_log_probs", "advantages", "returns", "values", "loss_masks",
             "entropy")
REQUIRED = ("log_probs", "advantages", "loss_masks")


def sample_key(sample: Any, position: int) -> int:
    """A sample's rollout index: ``Sample.index``, or its position in the rollout when it has none (some slime
    dumps). The rollout dump and the train dump are joined on it."""
    return sample.index if sample.index is not None else position


def train_dump_path(template: str, rollout_id: int, rank: int) -> str:
    return template.format(rollout_id=rollout_id, rank=rank)


def check_train_template(template: str, rollout_template: str | None, writers: int,
                         rollout_flag: str = "--save-debug-rollout-data") -> None:
    """Before Ray starts: the template formats, names every rollout (and every rank when several write), and is
    not the path of the rollout dumps the run writes or (a replay, ``rollout_flag`` --load-debug-rollout-data)
    reads: a train dump never overwrites one."""
    flag = f"--save-debug-train-data {template}"
    try:
        train_dump_path(template, 0, 0)
    except (KeyError, IndexError, ValueError, AttributeError, TypeError) as exc:
        raise SlimeLiteError(f"{flag}: not a valid template ({type(exc).__name__}: {exc}); only {{rollout_id}} and "
                             "{rank} can be used, e.g. 'dumps/train_{rollout_id}_{rank}.pt'.") from None
    if "{rollout_id}" not in template:
        raise SlimeLiteError(f"{flag} has no '{{rollout_id}}' placeholder, so every rollout would overwrite one "
                             "file. Use e.g. 'dumps/train_{rollout_id}_{rank}.pt'.")
    if writers > 1 and "{rank}" not in template:
        raise SlimeLiteError(f"{flag} has no '{{rank}}' placeholder but {writers} data-parallel train ranks each "
                             "write their own samples. Use e.g. 'dumps/train_{rollout_id}_{rank}.pt'.")
    if rollout_template:
        rollout_path = os.path.abspath(rollout_template.format(rollout_id=0))
        if any(os.path.abspath(train_dump_path(template, 0, rank)) == rollout_path for rank in range(writers)):
            raise SlimeLiteError(f"{flag} is the path of {rollout_flag} too ({rollout_template}): a train dump "
                                 "would overwrite a rollout dump; give them different paths.")


def save_train_dump(template: str, rollout_id: int, rank: int, samples: list, positions: list[int],
                    columns: dict[str, list | None]) -> str:
    """Write the samples at ``positions`` of this rollout. ``columns`` maps each PER_TOKEN name to a list over
    *all* samples of the rollout (None when the run has no such value); ``entropy`` may also be a dict holding
    only this rank's positions. Atomic; returns the path."""
    import torch  # torch: slime-lite explain and flag checks read this module


    rows = sorted(positions)
    data: dict[str, Any] = {
        "sample_indices": [sample_key(samples[p], p) for p in rows],
        "tokens": [torch.tensor(samples[p].tokens, dtype=torch.long) for p in rows],
        "response_lengths": [int(samples[p].response_length) for p in rows],
    }
    for name in PER_TOKEN:
        values = columns.get(name)
        if values is not None:  # clone: a slice would save the whole micro-batch storage behind it
            data[name] = [torch.as_tensor(values[p]).detach().to("cpu", torch.float32).clone() for p in rows]
    path = train_dump_path(template, rollout_id, rank)
    atomic_torch_save({"rollout_id": rollout_id, "rank": rank, "format_version": FORMAT_VERSION,
                       "rollout_data": data}, path)
    return path


@dataclass
class TrainDump:
    """One or more rank files of one rollout, merged: ``rows[sample index][column]``."""

    rollout_id: int
    paths: list[str]
    rows: dict[int, dict[str, Any]]


def load_train_dump(path: str) -> TrainDump:
    """Load and check one file; errors name the file, the sample and the column."""
    import torch  # torch: slime-lite explain and flag checks read this module


    raw = load_plain(path, "train dump", DumpError)
    data = raw.get("rollout_data") if isinstance(raw, dict) else None
    if not isinstance(data, dict) or not isinstance(data.get("sample_indices"), list):
        raise DumpError(f"train dump {path} has the wrong schema: expected a dict with 'rollout_data' holding a "
                        "'sample_indices' list (written by --save-debug-train-data). Is it a rollout dump?")
    rollout_id = raw.get("rollout_id")
    if isinstance(rollout_id, bool) or not isinstance(rollout_id, int):
        raise DumpError(f"train dump {path}: rollout_id is {rollout_id!r}, expected an int.")
    indices = data["sample_indices"]
    n = len(indices)
    missing = [c for c in REQUIRED if c not in data]
    if missing:
        raise DumpError(f"train dump {path} has no column {', '.join(missing)}: not written by --save-debug-train-data.")
    for name, value in data.items():
        if not isinstance(value, list) or len(value) != n:
            raise DumpError(f"train dump {path}: column {name} is not a list of {n} entries (one per sample).")
    rows: dict[int, dict[str, Any]] = {}
    for k, index in enumerate(indices):
        if isinstance(index, bool) or not isinstance(index, int):
            raise DumpError(f"train dump {path}: sample_indices[{k}] is {index!r}, expected an int.")
        if index in rows:
            raise DumpError(f"train dump {path}: sample index {index} appears twice.")
        row = {name: value[k] for name, value in data.items()}
        length = row.get("response_lengths", len(row["log_probs"]))
        for name in PER_TOKEN:
            t = row.get(name)
            if t is None:
                continue
            if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.numel() != length:
                shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise DumpError(f"train dump {path}: sample {index}: {name} is {shape}, expected a 1-D tensor of "
                                f"{length} values (its response length).")
        rows[index] = row
    return TrainDump(rollout_id, [path], rows)


def load_train_dumps(paths: list[str]) -> TrainDump:
    """Merge the rank files of one rollout (each holds its data-parallel shard); they must not overlap."""
    merged: TrainDump | None = None
    for path in paths:
        dump = load_train_dump(path)
        if merged is None:
            merged = dump
            continue
        if dump.rollout_id != merged.rollout_id:
            raise DumpError(f"train dumps {merged.paths[0]} (rollout {merged.rollout_id}) and {path} (rollout "
                            f"{dump.rollout_id}) are of different rollouts; pass the rank files of one rollout.")
        both = sorted(set(dump.rows) & set(merged.rows))
        if both:
            raise DumpError(f"train dumps {merged.paths[0]} and {path} both hold sample index {both[0]}: pass each "
                            "rank file once, all of one run.")
        merged.rows.update(dump.rows)
        merged.paths.append(path)
    if merged is None:
        raise SlimeLiteError("no train dump given.")
    return merged
