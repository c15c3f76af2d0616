"""Checkpoints: per-rank Megatron state (model, optimizer, RNG) plus an HF export of the actor, written atomically.

Layout: ``SAVE/iter_0000007/rank_000.pt`` (+ ``hf/`` for the actor) and ``SAVE/latest`` naming the newest complete
iteration. A crash mid-save leaves only a ``.tmp-*`` folder: ``latest`` still names the previous good checkpoint.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import torch

from slime_lite.errors import SlimeLiteError


def latest(root: str) -> str | None:
    path = os.path.join(root, "latest")
    if not os.path.exists(path):
        return None
    name = open(path).read().strip()
    return os.path.join(root, name)


def save(actor: Any, root: str, rollout_id: int, data_state: Any) -> None:
    import torch.distributed as dist

    from slime_lite.backends.megatron.weight_push import write_hf_folder
    from slime_lite.io import atomic_torch_save

    name = f"iter_{rollout_id:07d}"
    final = os.path.join(root, actor.role, name) if actor.role != "actor" else os.path.join(root, name)
    tmp = os.path.join(os.path.dirname(final), f".tmp-{name}")
    if actor.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp, exist_ok=True)
    dist.barrier()
    a = actor.args
    state = {
        "model": actor.model.state_dict(),
        "optimizer": actor.optimizer.state_dict(),
        "rng": {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
        "next_rollout_id": rollout_id + 1,
        "data_state": data_state,
        "layout": {"world": actor.world_size, "tp": a.tensor_model_parallel_size, "pp": a.pipeline_model_parallel_size},
    }
    atomic_torch_save(state, os.path.join(tmp, f"rank_{actor.rank:03d}.pt"))
    named = actor.hf_weights() if actor.role == "actor" else None
    if actor.rank == 0 and named is not None:
        write_hf_folder(named, a.hf_checkpoint, os.path.join(tmp, "hf"))
    dist.barrier()
    if actor.rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        pointer = os.path.join(os.path.dirname(final), "latest")
        with open(pointer + ".tmp", "w") as f:
            f.write(name)
        os.replace(pointer + ".tmp", pointer)
    dist.barrier()


def load(actor: Any, root: str) -> dict[str, Any]:
    folder = os.path.join(root, actor.role) if actor.role != "actor" else root
    path = latest(folder)
    if path is None:
        return {"next_rollout_id": 0, "data_state": None}
    file = os.path.join(path, f"rank_{actor.rank:03d}.pt")
    try:
        state = torch.load(file, map_location="cpu", weights_only=False)
    except FileNotFoundError:
        raise SlimeLiteError(f"--load {root}: {file} is missing; the checkpoint was made with another GPU count "
                             "or is incomplete.") from None
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the same user-facing problem
        raise SlimeLiteError(f"--load {root}: {file} is corrupt or truncated ({type(exc).__name__}). "
                             "Delete that iteration folder and fix 'latest' to resume from the one before.") from None
    a = actor.args
    want = {"world": actor.world_size, "tp": a.tensor_model_parallel_size, "pp": a.pipeline_model_parallel_size}
    if state.get("layout") != want:
        raise SlimeLiteError(f"--load {root}: the checkpoint was saved with {state.get('layout')} but this run uses "
                             f"{want}; resume with the same --actor-num-gpus-per-node, TP and PP.")
    actor.model.load_state_dict(state["model"])
    actor.optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"]["cpu"])
    if state["rng"]["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])
    return {"next_rollout_id": state["next_rollout_id"], "data_state": state["data_state"]}
