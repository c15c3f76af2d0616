"""Weight updates of the embedded engine, by Hugging Face parameter name.

Every method but ``init_group`` (which touches no weights and may wait for the trainer) runs in the engine's model
thread between forward steps (``Scheduler.call``), so a generation step never sees half-updated weights. Updates are
checked in full (names, shapes, dtypes) before any parameter is written. Joining a group and each receive on it end
within ``GROUP_TIMEOUT_S``; a receive that fails destroys the group (it is out of step with the sender).
A tied LM head (``tie_word_embeddings``) is the embedding's parameter: writing either name writes both. MoE
experts load by their fused in-memory names and by their on-disk per-expert ones (``moe.expert_views``); checksums
and the full-checkpoint check use the per-expert names, which are what a trainer sends.
LoRA adapters (``slime_lite.lora_wire`` names) are merged into the weights they adapt: the engine serves
W + (alpha/R) B A, merged rather than served unmerged, so generation runs at the base model's speed and the
weight-equality check sees the weights it samples with.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from slime_lite.engine.moe import expert_views, is_fused
from slime_lite.lora_wire import merged, split_adapters
from slime_lite.weight_checksum import tensor_checksums
from slime_lite.weight_transport import GroupJoinCancelled, WeightUpdateGroup, dtype_from_name

logger = logging.getLogger(__name__)

GROUP_TIMEOUT_S = 300.0  # joining a weight update group (every member), and each receive on it
# Rotary-embedding buffers some checkpoints hold (the model computes them from its config; loading at startup skips
# them too): a checkpoint on disk may carry them, an update of named tensors may not.
NON_PARAMETER_BUFFERS = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


class WeightError(ValueError):
    """A weight update or query that cannot be applied (unknown name, wrong shape, missing files)."""


def _inside(path: Path, entry: Any) -> Path:
    """``path / entry`` when it names a file inside ``path`` (after symlinks); WeightError naming the entry
    otherwise."""
    where = f"{path / 'model.safetensors.index.json'}: weight_map entry {entry!r}"
    if not isinstance(entry, str) or not entry or "\x00" in entry:
        raise WeightError(f"{where} is not a file name")
    rel = Path(entry)
    if rel.is_absolute() or ".." in rel.parts:
        raise WeightError(f"{where} leaves the model folder (absolute paths and '..' are refused)")
    target = (path / rel).resolve()
    if not target.is_relative_to(path.resolve()):
        raise WeightError(f"{where} leads out of the model folder (a symlink to {target})")
    if not target.is_file():
        raise WeightError(f"{where}: no such file in the model folder")
    return target


def _safetensors_files(path: Path) -> list[Path]:
    """The checkpoint's files, each inside ``path``: index entries and symlinks may not lead out of the folder."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            entries = set(weight_map.values())
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise WeightError(f"{index}: not a safetensors index ({type(exc).__name__}: {exc})") from None
        return [_inside(path, e) for e in sorted(entries, key=str)]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise WeightError(f"{path}: no *.safetensors files (the engine loads safetensors checkpoints only)")
    for f in files:
        if not f.resolve().is_relative_to(path.resolve()):
            raise WeightError(f"{f} leads out of the model folder (a symlink to {f.resolve()})")
    return files


class _Params(Mapping):
    """``{hf_name: tensor}`` (read-only): the parameters by their in-memory names, tied ones under each name, and
    each MoE expert's slices of the fused parameters under its on-disk name (a view taken at each access)."""

    def __init__(self, model: Any) -> None:
        self.named = dict(model.named_parameters(remove_duplicate=False))
        self.views = expert_views(model)
        # the names a whole-model check covers: per-expert names instead of the fused tensors they slice
        self.canonical = [n for n in self.named if not (self.views and is_fused(n))] + list(self.views)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self.named:
            return self.named[name]
        param, expert, rows = self.views[name]
        return param.data[expert, rows]

    def __contains__(self, name: object) -> bool:
        return name in self.named or name in self.views

    def __iter__(self):
        yield from self.named
        yield from self.views

    def __len__(self) -> int:
        return len(self.named) + len(self.views)


class Weights:
    """The served model's parameters: load, update, read back and checksum them."""

    def __init__(self, hf_model: Any) -> None:
        self.model = hf_model
        self.groups: dict[str, WeightUpdateGroup] = {}
        self.joining: dict[str, threading.Event] = {}  # groups being joined: set to call the join off
        self.version = 0  # counts weight writes: the prefix cache drops its K/V when it changes
        self._lora_base: dict[str, torch.Tensor] = {}  # adapted weights before their first adapter (host copies)
        self._lora_pending: dict[str, dict[str, torch.Tensor]] = {}  # adapter halves waiting for the other half

    @functools.cached_property
    def params(self) -> _Params:
        """``{hf_name: parameter}``, tied ones under each name, MoE experts also by their per-expert names
        (read-only). Made once (a walk of the modules costs ~0.4 ms, paid per bucket and per check before): the
        engine swaps a parameter's ``.data`` (fusing, offload) but never the parameter objects themselves. Code that
        ever replaces one must drop this cache and ``_distinct`` (``del weights.params``), or updates and checksums
        would reach the old object."""
        return _Params(self.model)

    @functools.cached_property
    def _distinct(self) -> tuple[list[torch.nn.Parameter], list[int]]:
        """Each parameter of the whole-model names (``_Params.canonical``) once (tied ones share one), and the place
        of each name's parameter in that list; expert views are taken afresh by ``checksums``."""
        named = [self.params.named[n] for n in self.params.canonical if n in self.params.named]
        first: dict[int, int] = {}
        place = [first.setdefault(id(p), len(first)) for p in named]
        return list({id(p): p for p in named}.values()), place

    def check_update(self, named: dict[str, torch.Tensor]) -> None:
        """Names, shapes and dtypes of an update against the model, before any byte is copied: WeightError naming
        the first mismatch. A floating-point tensor loads into a floating-point parameter of any precision (cast,
        as SGLang's loaders do); any other dtype must be the parameter's own."""
        params = self.params
        named, adapters = split_adapters(named)
        unknown = sorted(n for n in [*named, *adapters] if n not in params)
        if unknown:
            raise WeightError(f"unknown parameter name(s) {unknown[:5]} (expected Hugging Face names such as "
                              f"{next(iter(params))!r})")
        for name, t in named.items():
            p = params[name]
            if tuple(p.shape) != tuple(t.shape):
                raise WeightError(f"parameter {name!r}: shape {tuple(t.shape)} does not match the model's "
                                  f"{tuple(p.shape)}")
            if t.dtype != p.dtype and not (t.dtype.is_floating_point and p.dtype.is_floating_point):
                raise WeightError(f"parameter {name!r}: dtype {str(t.dtype).removeprefix('torch.')} cannot be "
                                  f"loaded into the model's {str(p.dtype).removeprefix('torch.')}")
        for name, parts in adapters.items():
            shape = tuple(params[name].shape)
            waiting = self._lora_pending.get(name, {})  # a half of an earlier bucket: this one's must fit it
            a, b = parts.get("A", waiting.get("A")), parts.get("B", waiting.get("B"))
            if len(shape) != 2:
                problem = "is not a matrix (LoRA adapts 2-D weights only)"
            elif a is not None and (a.dim() != 2 or a.shape[1] != shape[1] or not a.dtype.is_floating_point):
                problem = f"has lora_A of shape {tuple(a.shape)}, not float [rank, {shape[1]}]"
            elif b is not None and (b.dim() != 2 or b.shape[0] != shape[0] or not b.dtype.is_floating_point):
                problem = f"has lora_B of shape {tuple(b.shape)}, not float [{shape[0]}, rank]"
            elif a is not None and b is not None and a.shape[0] != b.shape[1]:
                problem = f"has lora_A of rank {a.shape[0]} and lora_B of rank {b.shape[1]}"
            else:
                continue
            raise WeightError(f"adapter of {name!r} {problem}; the weight's shape is {shape}")

    @torch.no_grad()
    def load_named(self, named: dict[str, torch.Tensor]) -> int:
        """Copy ``{hf_name: tensor}`` into the model (any subset of parameters); returns how many were written.
        On CUDA it returns once the copies are done, so the sender may reuse or free its buffers (CUDA IPC)."""
        self.check_update(named)
        params = self.params
        named, adapters = split_adapters(named)
        # every tensor converted first: a failure here (memory, a bad dtype) leaves the weights as they were
        staged = {name: tensor.to(device=params[name].device, dtype=params[name].dtype)
                  for name, tensor in named.items()}
        # a full write of an adapted weight, or of one whose adapter comes in this update, is its new base
        for name in set(staged) & (set(self._lora_base) | set(adapters)):
            self._lora_base[name] = staged[name].to("cpu", copy=True)
        served, pending = self._merge_adapters(adapters)
        staged.update(served)
        if not staged:  # an empty bucket (slime sends them for idle ranks): nothing changes, the cache stays
            self._lora_pending = pending
            return 0
        self.version += 1
        # one multi-tensor copy (a few kernels) rather than one copy per tensor: a bucket holds hundreds
        torch._foreach_copy_([params[name] for name in staged], list(staged.values()))
        self._lora_pending = pending  # only once applied: a refused update leaves no half waiting
        if any(t.is_cuda for t in staged.values()) or any(t.is_cuda for t in named.values()):
            torch.cuda.synchronize()
        return len(staged)

    def _merge_adapters(self, adapters: dict[str, dict[str, torch.Tensor]]
                        ) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
        """The served weights of LoRA adapters (``lora_wire``): each adapted weight is its base (the weight before
        its first adapter, kept on the host) merged with the adapter, once both halves arrived (they may come in
        different buckets); and the halves left waiting for theirs, for the caller to keep once the update
        applied."""
        out, waiting = {}, dict(self._lora_pending)
        for name, parts in adapters.items():
            pending = {**waiting.pop(name, {}), **parts}
            if len(pending) < 2:
                waiting[name] = pending
                continue
            param = self.params[name]
            if name not in self._lora_base:
                self._lora_base[name] = param.detach().to("cpu", copy=True)
            out[name] = merged(self._lora_base[name].to(param.device), pending["A"], pending["B"])
        return out, waiting

    def pending_adapters(self) -> list[str]:
        """The adapted weights with one adapter half arrived and the other not (a push cut between them)."""
        return sorted(self._lora_pending)

    def drop_pending_adapters(self) -> None:
        """A new weight-update session: adapter halves an earlier push left waiting never pair with its own."""
        self._lora_pending = {}

    def load_from_disk(self, model_path: str) -> int:
        """Load every parameter from a safetensors checkpoint folder of the same architecture (its
        ``NON_PARAMETER_BUFFERS`` are skipped)."""

        path = Path(model_path)
        if not path.is_dir():
            raise WeightError(f"model_path {model_path!r} is not a folder")
        named: dict[str, torch.Tensor] = {}
        for f in _safetensors_files(path):
            try:
                named.update(load_file(str(f), device="cpu"))
            except (SafetensorError, OSError) as exc:  # empty, truncated or not safetensors at all
                raise WeightError(f"{f}: not a readable safetensors file ({exc}); no weight was changed") from None
        named = {n: t for n, t in named.items() if not n.endswith(NON_PARAMETER_BUFFERS)}
        missing = set(self.params.canonical) - set(named)
        if getattr(self.model.config, "tie_word_embeddings", False):
            missing.discard("lm_head.weight")
        if missing:
            raise WeightError(f"{model_path}: checkpoint lacks {len(missing)} parameter(s), e.g. {sorted(missing)[:3]}")
        return self.load_named(named)

    def init_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                   group_name: str, backend: str) -> None:
        """Join the trainer's broadcast group as rank ``rank_offset``: blocks until every member joined, at most
        ``GROUP_TIMEOUT_S``; ``destroy_group`` meanwhile calls the join off (at once while the trainer's store does
        not answer; once connected, the join ends when the trainer closes its store). It touches no weights, so it
        runs outside the model thread (generation goes on)."""
        if group_name in self.groups or group_name in self.joining:
            raise WeightError(f"weight update group {group_name!r} already exists (or is being joined); destroy it "
                              "first")
        device = self.model.get_input_embeddings().weight.device
        if backend == "nccl" and device.type != "cuda":
            raise WeightError("backend 'nccl' needs the engine on CUDA; use 'gloo' for a CPU engine")
        if device.type == "cuda" and device.index is not None:
            torch.cuda.set_device(device)  # NCCL works on the current device
        call_off = self.joining[group_name] = threading.Event()
        try:
            group = WeightUpdateGroup(master_address, int(master_port), int(rank_offset), int(world_size), backend,
                                      group_name, timeout_s=GROUP_TIMEOUT_S, cancelled=call_off.is_set)
        except GroupJoinCancelled:
            raise WeightError(f"joining weight update group {group_name!r} was called off "
                              "(/destroy_weights_update_group)") from None
        except Exception as exc:  # noqa: BLE001 - a timeout, a refused connection: the group is not formed
            raise WeightError(f"could not join weight update group {group_name!r} at {master_address}:{master_port} "
                              f"within {GROUP_TIMEOUT_S:g}s: {type(exc).__name__}: {exc}") from None
        finally:
            self.joining.pop(group_name, None)
        self.groups[group_name] = group

    def update_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                group_name: str, flattened: bool = False) -> int:
        """Receive ``names`` in order from rank 0 of ``group_name`` and load them: one broadcast per tensor, or
        (``flattened``, SGLang's ``load_format="flattened_bucket"``) one broadcast of their bytes back to back, each
        tensor starting at a multiple of its element size (SGLang's rule: no padding)."""
        group = self.groups.get(group_name)
        if group is None:
            raise WeightError(f"no weight update group {group_name!r}; call /init_weights_update_group first")
        if not len(names) == len(dtypes) == len(shapes):
            raise WeightError("names, dtypes and shapes must have the same length")
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise WeightError(f"names: {dupes[:5]} named more than once")
        device = "cuda" if group.backend == "nccl" else "cpu"
        dts = [dtype_from_name(dtype) for dtype in dtypes]
        # staging buffers: the parameters are written only once every named tensor arrived (load_named); a receive
        # that ends early (timeout, sender gone) leaves the weights as they were and the buffers are dropped
        starts = [0]
        for dt, shape in zip(dts, shapes):
            starts.append(starts[-1] + math.prod(shape) * dt.itemsize)
        # the whole model in float64: every parameter once, the fused MoE experts included (``_distinct`` leaves
        # them out: checksums reach them through their per-expert views)
        limit = 8 * sum(p.numel() for p in self.model.parameters())
        if starts[-1] > limit:
            raise WeightError(f"shapes: {starts[-1]} bytes declared, more than the whole model holds even in float64 "
                              f"({limit}); nothing was received")
        buffers = ([torch.empty(starts[-1], dtype=torch.uint8, device=device)] if flattened else
                   [torch.empty(tuple(shape), dtype=dt, device=device) for dt, shape in zip(dts, shapes)])
        arrived = 0
        try:
            for t in buffers:  # receive everything first so the sender never hangs on a bad name
                group.broadcast(t, src=0)  # at most GROUP_TIMEOUT_S each (the group's timeout)
                arrived += 1
        except Exception as exc:  # noqa: BLE001 - the group is out of step with the sender: it cannot be reused
            self.groups.pop(group_name, None)
            group.destroy()
            raise WeightError(f"receiving from weight update group {group_name!r} failed after {arrived} of "
                              f"{len(buffers)} broadcast(s) ({type(exc).__name__}: {exc}); no weight was changed; "
                              f"the group was destroyed: initialise it again") from None
        if not flattened:
            return self.load_named(dict(zip(names, buffers)))
        staging = {}
        for name, dt, shape, start, end in zip(names, dts, shapes, starts, starts[1:]):
            if start % dt.itemsize:
                raise WeightError(f"load_format 'flattened_bucket': {name!r} starts at byte {start}, not a multiple "
                                  f"of its {dt} element size (the bucket has no padding); no weight was changed")
            staging[name] = buffers[0][start:end].view(dt).view(tuple(shape))
        return self.load_named(staging)

    def destroy_group(self, group_name: str) -> None:
        """Leave ``group_name``, or call its join off while it is being joined."""
        group = self.groups.pop(group_name, None)
        if group is None:
            call_off = self.joining.get(group_name)
            if call_off is None:
                raise WeightError(f"no weight update group {group_name!r}")
            call_off.set()
            return
        group.destroy()

    def get_by_name(self, name: str, truncate_size: int = 100) -> list[Any]:
        """The first ``truncate_size`` entries along dim 0, as float32 (nested lists for matrices), like SGLang."""
        param = self.params.get(name)
        if param is None:
            raise WeightError(f"unknown parameter name {name!r}")
        return param.detach()[: int(truncate_size)].float().cpu().tolist()

    def checksums(self, names: Iterable[str] | None = None) -> dict[str, str]:
        """``{hf_name: weight_checksum.tensor_checksums digest of the parameter's bytes}`` in the engine's dtype (all
        parameters by default), computed on the parameters' device; a tied parameter is hashed once."""
        params = self.params
        if names is None:  # the whole model (the weight check after every push): the distinct list is kept
            unique, place = self._distinct
            views = list(params.views)
            digests = tensor_checksums(unique + [params[n] for n in views])
            named = [n for n in params.canonical if n in params.named]
            return {**{n: digests[i] for n, i in zip(named, place)},
                    **{n: digests[len(unique) + i] for i, n in enumerate(views)}}
        names = list(names)
        unknown = [n for n in names if n not in params]
        if unknown:
            raise WeightError(f"unknown parameter name(s) {unknown[:5]}")
        tensors = {n: params[n] for n in names}  # (an expert's view is a new tensor at each access)
        chosen = {id(t): t for t in tensors.values()}
        by_id = dict(zip(chosen, tensor_checksums(list(chosen.values()))))
        return {n: by_id[id(t)] for n, t in tensors.items()}

    def destroy_all(self) -> None:
        for event in list(self.joining.values()):  # joins still waiting for the trainer are called off
            event.set()
        for name in list(self.groups):
            self.destroy_group(name)
