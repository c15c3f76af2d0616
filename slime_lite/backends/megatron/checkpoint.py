"""Checkpoints: per-rank Megatron state (model, optimizer, RNG) plus an HF export of the actor, written atomically.
With LoRA the model state is what trains (the adapters; a critic's value head) and the actor's export is a PEFT
folder (``adapter/``) for the base model, whose fingerprint (``base_fingerprint``) a resume checks.

Layout: ``SAVE/iter_0000007/rank_000.pt`` (+ ``hf/`` for the actor) and ``SAVE/latest`` naming the newest complete
iteration. A save is written into a ``.tmp-*`` folder and renamed into place when complete: a save that fails
(a full disk) removes it, and a process killed mid-save leaves only that folder (the next save replaces it), so
``latest`` always names a good checkpoint. A resume logs the checkpoint and iteration it loaded.
Everything saved is plain data (tensors, dicts, lists, tuples, numbers, strings), and loading uses
``weights_only=True``: a crafted checkpoint is refused and nothing in it runs.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from typing import Any

import torch
import torch.distributed as dist

from slime_lite.backends.megatron import peft_format
from slime_lite.backends.megatron.lora_config import ADAPTER_MARK
from slime_lite.backends.megatron.model import unwrap
from slime_lite.errors import SlimeLiteError
from slime_lite.io import atomic_torch_save, atomic_write_text, load_plain, no_space_error, write_hf_folder

logger = logging.getLogger(__name__)

_PLAIN = (str, bytes, int, float, bool, complex, type(None), torch.Tensor, torch.dtype, torch.device, torch.Size)


def latest(root: str) -> str | None:
    """The newest complete iteration folder named by ``root/latest``, or None when there is none."""
    path = os.path.join(root, "latest")
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8", errors="replace") as f:
        name = f.read().strip()
    if not re.fullmatch(r"iter_\d{7}", name):
        raise SlimeLiteError(f"--load {root}: {path} names {name[:80]!r}, not an iteration folder like "
                             "iter_0000007; write the name of the iteration to resume from into it.")
    return os.path.join(root, name)


def iteration(path: str) -> int:
    """The rollout id of an iteration folder ``.../iter_0000007`` (7)."""
    return int(os.path.basename(path).rsplit("_", 1)[1])


def plain_state(value: Any, where: str = "state") -> Any:
    """``value`` as containers ``torch.load(weights_only=True)`` reads back: dicts, lists, tuples, tensors, numbers,
    strings. Anything else is a bug in what we save (TypeError naming where it sits), found at save time rather than
    as an unloadable checkpoint."""
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, dict):  # OrderedDict too: model.load_state_dict takes a plain dict
        return {k: plain_state(v, f"{where}[{k!r}]") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [plain_state(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    raise TypeError(f"checkpoint {where} is a {type(value).__name__}, which a weights_only load cannot read")


def save(actor: Any, root: str, rollout_id: int, data_state: Any) -> None:
    name = f"iter_{rollout_id:07d}"
    final = os.path.join(root, actor.role, name) if actor.role != "actor" else os.path.join(root, name)
    tmp = os.path.join(os.path.dirname(final), f".tmp-{name}")
    hf_out = save_hf_path(actor.args, rollout_id) if actor.args.save_hf and actor.role == "actor" else None

    def prepare() -> None:
        if actor.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp, exist_ok=True)

    on_every_rank(prepare, f"making the folder {tmp}")
    try:
        hf_model = _write_parts(actor, tmp, final, rollout_id, data_state, hf_out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a failed save leaves nothing behind
        raise

    def publish() -> None:
        if actor.rank != 0:
            return
        try:
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        atomic_write_text(name, os.path.join(os.path.dirname(final), "latest"))
        if hf_model is not None:  # --save-hf: written whole or not at all (a full disk: an error naming it)
            try:
                write_hf_folder(hf_model, actor.args.hf_checkpoint, hf_out)
            except Exception as exc:
                raise SlimeLiteError(f"--save-hf: checkpoint {final} was saved, but writing the Hugging Face model "
                                     f"to {hf_out} failed: {exc}") from exc
            logger.info("--save-hf: wrote the actor's Hugging Face model to %s", hf_out)

    on_every_rank(publish, f"publishing checkpoint {final}")


def _write_parts(actor: Any, tmp: str, final: str, rollout_id: int, data_state: Any, hf_out: str | None) -> dict | None:
    """Every rank's file into ``tmp`` and the actor's export (rank 0); returns --save-hf's model on rank 0. The HF
    gathers (collectives) come first, then what may fail on one rank alone, checked on every rank together."""
    a = actor.args
    lora_on = getattr(actor, "lora", None) is not None
    from slime_lite.backends.megatron.optimizer_offload import param_state, plain_groups

    model_state = actor.model.state_dict()
    if lora_on:  # the base is --hf-checkpoint, frozen: what trains (adapters; the critic's head) is the state
        model_state = {k: v for k, v in model_state.items() if k in _trainable(actor.model)}
    optim = {} if a.no_save_optim else {  # --no-save-optim: a smaller checkpoint that cannot resume training
        "optimizer": plain_groups(actor.optimizer.state_dict()),
        "optimizer_param_state": param_state(actor.optimizer),  # --optimizer-cpu-offload (optimizer_offload.py)
    }
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    state = {
        "model": model_state,
        **optim,
        "rng": {"cpu": torch.get_rng_state(), "cuda": cuda_rng},
        "next_rollout_id": rollout_id + 1,
        "data_state": data_state,
        "layout": _layout(actor),
        "lora": _lora_layout(actor),
        "lora_base": _lora_base(actor),  # the frozen base the adapters were trained on
        "trainable": sorted(_trainable(actor.model)),  # the optimizer state is by position over these
    }
    if a.ref_update_interval and getattr(actor, "ref_state", None) is not None:  # the reference moves: keep it
        state["reference"] = actor.ref_state
    export = "adapter" if lora_on else "hf"  # LoRA: a PEFT folder for the --hf-checkpoint base (peft_format.py)
    named = (actor.hf_lora() if lora_on else actor.hf_weights()) if actor.role == "actor" else None
    # --save-hf with LoRA: the base weights gathered here, the adapters merged into them on rank 0 below
    hf_base = actor.hf_weights() if hf_out and lora_on else None
    hf_model: dict[str, Any] = {}

    def write_parts() -> None:
        atomic_torch_save(plain_state(state), os.path.join(tmp, f"rank_{actor.rank:03d}.pt"))
        if actor.rank == 0 and hf_out:  # the whole model, as an engine serves it
            hf_model["weights"] = actor._effective(hf_base, named) if lora_on else named
        if actor.rank == 0 and named is not None:
            try:
                if lora_on:
                    peft_format.write(named, actor.lora, a.hf_checkpoint, os.path.join(tmp, export))
                else:
                    write_hf_folder(named, a.hf_checkpoint, os.path.join(tmp, export))
            except OSError as exc:  # the folder is renamed into place only when complete
                raise (no_space_error(exc, os.path.join(final, export)) or exc) from None

    on_every_rank(write_parts, f"saving checkpoint {final}")
    return hf_model.get("weights")


def on_every_rank(step: Any, what: str) -> None:
    """``step()`` on every rank, then a collective in place of a barrier: when it raised on some rank, every rank
    raises (that rank its own error, the others one naming it) rather than the others waiting at the next barrier
    until the process group's timeout."""
    if not dist.is_initialized():  # one process, no group: nobody to tell
        step()
        return
    error = None
    try:
        step()
    except Exception as exc:  # noqa: BLE001 - raised below, on every rank
        error = exc
    failed = torch.zeros(dist.get_world_size(), device="cuda" if dist.get_backend() == "nccl" else "cpu")
    failed[dist.get_rank()] = float(error is not None)
    dist.all_reduce(failed)
    if error is not None:
        raise error
    if failed.any():
        ranks = ", ".join(str(r) for r in failed.nonzero().flatten().tolist())
        raise SlimeLiteError(f"{what}: failed on rank {ranks} (its error is in that rank's log)")


def save_hf_path(a: Any, rollout_id: int) -> str:
    """--save-hf PATH's folder for this save, PATH.format(rollout_id=...); checked on every rank before the save
    starts: a PATH that names the model this run starts from is refused (args_check refuses a fixed one)."""
    out = a.save_hf.format(rollout_id=rollout_id)
    for flag in ("hf_checkpoint", "ref_load"):
        value = getattr(a, flag)
        if value and os.path.realpath(out) == os.path.realpath(value):
            raise SlimeLiteError(f"--save-hf {a.save_hf} names the --{flag.replace('_', '-')} folder {value} at "
                                 f"rollout {rollout_id}: it would be replaced; give --save-hf another path.")
    return out


def _layout(actor: Any) -> dict[str, int]:
    """The parallel layout the rank files are cut by: world, TP, PP, and the experts' EP and expert-TP."""
    a = actor.args
    return {"world": actor.world_size, "tp": a.tensor_model_parallel_size, "pp": a.pipeline_model_parallel_size,
            "ep": a.expert_model_parallel_size, "etp": a.expert_tensor_parallel_size or a.tensor_model_parallel_size}


def _lora_layout(actor: Any) -> dict[str, float] | None:
    """The adapters' rank and alpha (their scaling alpha/rank), None without LoRA."""
    settings = getattr(actor, "lora", None)
    return None if settings is None else {"rank": settings.rank, "alpha": settings.alpha}


def base_fingerprint(folder: str) -> str:
    """A cheap fingerprint of the HF model in ``folder``: its config.json (less the saving library's version and
    path) and, per weight file, its name, size and 17 samples of 4 KiB spread over it (the safetensors header
    first): ~70 KiB read per file, not the weights, and the same for a copy of the folder elsewhere."""
    digest = hashlib.sha256()
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if name == "config.json":
            with open(path, encoding="utf-8") as f:
                config = {k: v for k, v in json.load(f).items() if k not in ("transformers_version", "_name_or_path")}
            digest.update(json.dumps(config, sort_keys=True).encode())
        elif name.endswith((".safetensors", ".bin")):
            size = os.path.getsize(path)
            digest.update(f"{name}\0{size}\0".encode())
            with open(path, "rb") as f:
                for i in range(17):
                    f.seek(size * i // 17 if i < 16 else max(size - 4096, 0))
                    digest.update(f.read(4096))
    return digest.hexdigest()


def _lora_base(actor: Any) -> dict[str, str] | None:
    """The folder and ``base_fingerprint`` of a LoRA run's frozen base, None without LoRA."""
    if getattr(actor, "lora", None) is None:
        return None
    folder = actor._init_checkpoint()
    return {"folder": os.path.abspath(folder), "fingerprint": base_fingerprint(folder)}


def _check_lora_base(actor: Any, root: str, file: str, saved: dict | None) -> None:
    """A LoRA checkpoint resumes only on the base its adapters were trained on (checkpoints without the fingerprint,
    from before 2026-12-07, resume on any)."""
    now = _lora_base(actor) if saved is not None else None
    if now is None or saved["fingerprint"] == now["fingerprint"]:
        return
    raise SlimeLiteError(f"--load {root}: {file} holds adapters trained on the base model {saved['folder']}, and "
                         f"this run's --hf-checkpoint {actor._init_checkpoint()} holds other weights (its config.json "
                         "or weight files differ): the adapters fit only their base. Resume with --hf-checkpoint "
                         f"{saved['folder']} (or a copy of it), or start afresh with another --load folder.")


def _trainable(model: torch.nn.Module) -> set[str]:
    """Names of the trainable parameters, as the model's state_dict (DDP's is its module's) names them."""
    return {n for n, p in unwrap(model).named_parameters() if p.requires_grad}


def _load_rank_file(root: str, folder: str, file: str, mmap: bool = False) -> Any:
    try:
        return load_plain(file, f"--load {root}: checkpoint", mmap=mmap)
    except SlimeLiteError as exc:
        raise SlimeLiteError(f"{exc} To resume from the iteration before, delete {os.path.dirname(file)} and write "
                             f"that iteration's name into {os.path.join(folder, 'latest')}.") from None


def check_loadable(root: str, critic: bool) -> None:
    """Before Ray starts (preflight): the newest iteration under ``root`` (and ``root/critic``) is a folder whose
    every rank file is a plain-tensor torch file (memory-mapped, so only the pickle is read, not the tensors'
    bytes), and, when the run trains a ``critic``, the critic's is the actor's iteration (a run stopped between the
    two saves would resume them at different rollouts)."""
    newest: dict[str, str] = {}
    for folder in (root, os.path.join(root, "critic")):
        path = latest(folder)
        if path is None:
            continue
        if not os.path.isdir(path):
            raise SlimeLiteError(f"--load {root}: {os.path.join(folder, 'latest')} names {os.path.basename(path)}, "
                                 f"but there is no folder {path} (deleted or moved?); write the name of an "
                                 "iteration folder that is there into it.")
        newest[folder] = path
        ranks = [n for n in sorted(os.listdir(path)) if re.fullmatch(r"rank_\d{3}\.pt", n)]
        if not ranks:
            raise SlimeLiteError(f"--load {root}: {path} holds no rank files (rank_000.pt, ...): a checkpoint copied "
                                 f"in part? Copy it whole, or write the name of a complete iteration folder into "
                                 f"{os.path.join(folder, 'latest')}.")
        for name in ranks:
            check_has_optimizer(root, path, _load_rank_file(root, folder, os.path.join(path, name), mmap=True))
    actor, critics = newest.get(root), newest.get(os.path.join(root, "critic"))
    if critic and actor is not None and critics is None:
        raise SlimeLiteError(
            f"--load {root}: the run trains a critic, but the checkpoint has none ({os.path.join(root, 'critic')} "
            "has no 'latest'): resuming would start the critic from scratch next to a trained actor. Resume a "
            "checkpoint saved with the critic, or start afresh (another --load folder).")
    if critic and actor is not None and critics is not None and iteration(actor) != iteration(critics):
        name = os.path.basename(min(actor, critics, key=iteration))
        raise SlimeLiteError(
            f"--load {root}: the actor's newest checkpoint is {os.path.basename(actor)} but the critic's is "
            f"{os.path.basename(critics)} (the run stopped between the two saves): resuming would continue them at "
            f"different rollouts. Resume from the iteration both have: write {name} into "
            f"{os.path.join(root, 'latest')} and {os.path.join(root, 'critic', 'latest')}.")


def check_has_optimizer(root: str, path: str, state: Any) -> None:
    """A checkpoint saved with --no-save-optim holds no optimizer state and, as in slime, cannot resume training."""
    if isinstance(state, dict) and {"model", "next_rollout_id"} <= set(state) and "optimizer" not in state:
        start = (f"--lora-adapter-path {os.path.join(path, 'adapter')}" if state.get("lora")
                 else f"--hf-checkpoint {os.path.join(path, 'hf')}")
        raise SlimeLiteError(f"--load {root}: {path} was saved with --no-save-optim (no optimizer state), so it "
                             f"cannot resume training. Start from its weights with a fresh optimizer: {start}, and "
                             "give --load and --save another folder.")


def load_reference(actor: Any, root: str, state: dict) -> None:
    """--ref-update-interval: the reference weights saved with the checkpoint replace the start weights; a
    checkpoint without them (saved without the flag) leaves the reference at the start weights, logged."""
    ref = getattr(actor, "ref_state", None)
    if ref is None or not actor.args.ref_update_interval:
        return
    saved = state.get("reference")
    if saved is None:
        if actor.rank == 0:
            logger.warning("--load %s: the checkpoint holds no reference weights (saved without "
                           "--ref-update-interval): the reference is the start weights until its next update", root)
        return
    if set(saved) != set(ref):
        raise SlimeLiteError(f"--load {root}: the checkpoint's reference weights are not this model's; resume with "
                             "the same --hf-checkpoint and layout.")
    for n, t in saved.items():
        ref[n].copy_(t)


def load(actor: Any, root: str) -> dict[str, Any]:
    folder = os.path.join(root, actor.role) if actor.role != "actor" else root
    path = latest(folder)
    if path is None:
        return {"next_rollout_id": 0, "data_state": None}
    file = os.path.join(path, f"rank_{actor.rank:03d}.pt")
    if not os.path.exists(file):
        raise SlimeLiteError(f"--load {root}: {file} is missing; the checkpoint was made with another GPU count "
                             "or is incomplete.")
    state = _load_rank_file(root, folder, file)
    if not isinstance(state, dict) or not {"model", "rng", "next_rollout_id"} <= set(state):
        raise SlimeLiteError(f"--load {root}: {file} is not a slime_lite checkpoint (expected a dict with model, "
                             "optimizer, rng and next_rollout_id).")
    check_has_optimizer(root, path, state)
    saved, want = state.get("layout") or {}, _layout(actor)
    if not saved or {k: want.get(k) for k in saved} != saved:  # (checkpoints before EP was recorded: no ep, etp)
        raise SlimeLiteError(f"--load {root}: the checkpoint was saved with {saved or 'no layout'} but this run uses "
                             f"{want}; resume with the same --actor-num-gpus-per-node, TP, PP, "
                             "--expert-model-parallel-size and --expert-tensor-parallel-size.")
    current = actor.model.state_dict()
    other = [(k, v.dtype, current[k].dtype) for k, v in state["model"].items()
             if torch.is_tensor(v) and torch.is_tensor(current.get(k)) and v.dtype != current[k].dtype]
    if other:  # the optimizer state would not match either (which parameters have float32 master copies)
        k, saved, now = other[0]
        start = ("" if actor.role != "actor" else " or start from its export (weights only; the optimizer starts "
                 "afresh): " + (f"--lora-adapter-path {path}/adapter" if state.get("lora")
                                else f"--hf-checkpoint {path}/hf"))
        raise SlimeLiteError(
            f"--load {root}: {file} holds {len(other)} weight(s) in another dtype than this run's model (e.g. {k}: "
            f"{str(saved).removeprefix('torch.')} saved, {str(now).removeprefix('torch.')} here): it was saved with "
            "another --bf16 setting, or by a slime-lite from before 2026-12-01 whose bf16 models kept their norms in "
            f"float32. Resume with the same --bf16{start}.")
    lora_on = getattr(actor, "lora", None) is not None
    saved_lora = any(ADAPTER_MARK in k for k in state["model"])
    if lora_on != saved_lora:
        raise SlimeLiteError(f"--load {root}: {file} was saved {'with' if saved_lora else 'without'} LoRA adapters "
                             f"and this run is {'with' if lora_on else 'without'} them; resume with the same "
                             "--lora-* flags.")
    saved_layout, layout = state.get("lora"), _lora_layout(actor)
    if saved_lora and saved_layout is not None and saved_layout != layout:  # older checkpoints have none
        raise SlimeLiteError(f"--load {root}: {file} holds adapters of --lora-rank {saved_layout['rank']} "
                             f"--lora-alpha {saved_layout['alpha']:g} and this run has --lora-rank {layout['rank']} "
                             f"--lora-alpha {layout['alpha']:g} (the adapters are scaled by alpha/rank): resume with "
                             f"--lora-rank {saved_layout['rank']} --lora-alpha {saved_layout['alpha']:g}.")
    _check_lora_base(actor, root, file, state.get("lora_base"))
    shaped = next(((k, v.shape, current[k].shape) for k, v in state["model"].items() if torch.is_tensor(v)
                   and torch.is_tensor(current.get(k)) and v.shape != current[k].shape), None)
    if shaped is not None:
        k, saved, now = shaped
        raise SlimeLiteError(f"--load {root}: {file} holds {k} of shape {list(saved)} and this run's model has "
                             f"{list(now)}: the checkpoint was trained from another model. Resume with the "
                             "--hf-checkpoint (and --lora-* flags) it was trained with.")
    if not lora_on:  # another layer count or layout at the same widths: torch's strict load would only list them
        names = set(current)  # (as the save took it)
        odd = sorted(names ^ set(state["model"]))
        if odd:
            raise SlimeLiteError(f"--load {root}: {file} and this run's model hold different weights (e.g. {odd[0]} "
                                 f"{'only here' if odd[0] in names else 'only in the checkpoint'}; {len(odd)} in "
                                 "all): the checkpoint was trained from another model. Resume with the "
                                 "--hf-checkpoint it was trained with.")
    # the module's own load (Megatron's DDP wrapper returns no missing keys); LoRA: the base is not saved
    result = unwrap(actor.model).load_state_dict(state["model"], strict=not lora_on)
    absent = [k for k in result.missing_keys if k in _trainable(actor.model)] + list(result.unexpected_keys)
    if absent:
        raise SlimeLiteError(f"--load {root}: {file} and this run's adapters differ (e.g. {absent[0]}): resume with "
                             "the same --lora-target-modules.")
    trained, now_trained = state.get("trainable"), sorted(_trainable(actor.model))
    if trained is not None and trained != now_trained:  # checkpoints before 2026-12-06 have no list
        k = next(iter(sorted(set(trained) ^ set(now_trained))))
        raise SlimeLiteError(f"--load {root}: {file} was trained with other parameters frozen ({k} "
                             f"{'trained' if k in trained else 'was frozen'} then): its optimizer state would go to "
                             "other parameters. Resume with the same --freeze-params-name-list / "
                             "--only-train-params-name-list.")
    from slime_lite.backends.megatron.optimizer_offload import check_param_state, load_param_state

    check_param_state(actor.optimizer, state.get("optimizer_param_state"), f"--load {root}: {file}")
    actor.optimizer.load_state_dict(state["optimizer"])
    load_param_state(actor.optimizer, state.get("optimizer_param_state"))
    load_reference(actor, root, state)
    torch.set_rng_state(state["rng"]["cpu"])
    if state["rng"]["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])
    if actor.rank == 0:
        logger.info("resumed the %s from checkpoint %s (iteration %d); training goes on at rollout %d",
                    actor.role or "actor", path, iteration(path), state["next_rollout_id"])
    return {"next_rollout_id": state["next_rollout_id"], "data_state": state["data_state"]}
