"""Send the trainer's HF-named weights to engines: ``tensor`` (HTTP), ``distributed`` (broadcast group), ``disk``.

Runs on the trainer's global rank 0, which holds the full tensors (``TrainActor.hf_weights``). Every push carries
a ``weight_version`` that the engines report in their responses and that ends up in each Sample.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from slime_lite.debug.faults import skips_weight_push
from slime_lite.engine_client import request_json
from slime_lite.errors import EngineError, SlimeLiteError
from slime_lite.io import free_port

log = logging.getLogger(__name__)
BUCKET_BYTES = 64 << 20
_groups: dict[tuple[str, ...], Any] = {}


def buckets(named: dict[str, torch.Tensor], limit: int = BUCKET_BYTES) -> list[list[str]]:
    out: list[list[str]] = [[]]
    size = 0
    for name, t in named.items():
        nbytes = t.numel() * t.element_size()
        if out[-1] and size + nbytes > limit:
            out.append([])
            size = 0
        out[-1].append(name)
        size += nbytes
    return out


def _all(urls: list[str], fn: Any) -> list[Any]:
    with ThreadPoolExecutor(max_workers=max(1, len(urls))) as pool:
        return list(pool.map(fn, urls))


def _check(reply: Any, url: str, route: str) -> None:
    if isinstance(reply, dict) and reply.get("success") is False:
        raise EngineError(f"engine {url}{route} refused the weights: {reply.get('message')}")


def push(args: Any, named: dict[str, torch.Tensor], urls: list[str], version: int,
         reference: dict[str, torch.Tensor] | None = None, check: bool = False) -> None:
    """Send ``named`` to every engine; with --check-weight-update-equal (or ``check``) compare against ``reference``
    (the trainer's true weights; ``named`` itself unless a fault was injected into what is sent)."""
    reference = reference if reference is not None else named
    if args.debug_scramble_engine_weights:  # noise first: a parameter the push skips cannot look right by chance
        gen = torch.Generator().manual_seed(version)
        _push_tensor({n: torch.randn(t.shape, generator=gen).to(t.dtype) for n, t in reference.items()}, urls, -1)
    if skips_weight_push(args.debug_inject_fault):
        log.warning("--debug-inject-fault skip-weight-push: the engines keep their old weights")
    else:
        _transport(args, named, urls, version)
    if args.check_weight_update_equal or check:
        check_weights_equal(reference, urls)


def _transport(args: Any, named: dict[str, torch.Tensor], urls: list[str], version: int) -> None:
    transport = args.update_weight_transport
    if transport == "tensor":
        _push_tensor(named, urls, version)
    elif transport == "distributed":
        _push_distributed(named, urls, version, colocated=args.colocate)
    else:
        _push_disk(args, named, urls, version)


def _push_tensor(named: dict[str, torch.Tensor], urls: list[str], version: int) -> None:
    from slime_lite.weight_transport import serialize_named_tensors

    groups = buckets(named)
    for k, names in enumerate(groups):
        body = {
            "serialized_named_tensors": [serialize_named_tensors({n: named[n] for n in names})],
            "flush_cache": k == len(groups) - 1,
            "weight_version": str(version),
        }
        for url, reply in zip(urls, _all(urls, lambda u: request_json(u, "/update_weights_from_tensor", body,
                                                                      timeout=600))):
            _check(reply, url, "/update_weights_from_tensor")


def _group(urls: list[str], backend: str) -> Any:
    """One broadcast group trainer(rank 0) + engines, made on the first push and kept for the later ones."""
    from slime_lite.weight_transport import WeightUpdateGroup, check_group_address

    key = tuple(urls)
    if key in _groups:
        return _groups[key]
    for old in list(_groups):  # the engine set changed (--use-fault-tolerance restarted one): one group at a time
        _drop_group(old)
    host = os.environ.get("SLIME_LITE_WEIGHT_MASTER_ADDR", "127.0.0.1")
    try:
        check_group_address(host)  # the group's store listens on this address only; never every interface
    except ValueError as exc:
        raise SlimeLiteError(f"SLIME_LITE_WEIGHT_MASTER_ADDR: {exc}") from None
    port = free_port()
    world = 1 + len(urls)
    with ThreadPoolExecutor(max_workers=len(urls) + 1) as pool:
        futures = [
            pool.submit(request_json, u, "/init_weights_update_group",
                        {"master_address": host, "master_port": port, "rank_offset": 1 + i, "world_size": world,
                         "group_name": "weight_update_group", "backend": backend}, timeout=300)
            for i, u in enumerate(urls)
        ]
        group = WeightUpdateGroup(host, port, 0, world, backend=backend)
        for u, f in zip(urls, futures):
            _check(f.result(), u, "/init_weights_update_group")
    _groups[key] = group
    return group


def _drop_group(key: tuple[str, ...]) -> None:
    """Destroy a broadcast group on the trainer's side and on each of its engines still answering."""
    group = _groups.pop(key)
    for url in key:
        try:
            request_json(url, "/destroy_weights_update_group", {"group_name": "weight_update_group"}, timeout=30)
        except EngineError as exc:  # a dead engine took its side of the group with it
            log.info("weight update group of %s not destroyed there: %s", url, exc)
    group.destroy()


def _push_distributed(named: dict[str, torch.Tensor], urls: list[str], version: int, colocated: bool = False) -> None:
    # NCCL needs one GPU per rank: colocated engines share the trainer's GPU, so they use gloo (host memory)
    backend = "nccl" if torch.cuda.is_available() and not colocated else "gloo"
    group = _group(urls, backend)
    device = "cuda" if backend == "nccl" else "cpu"
    for names in buckets(named):
        body = {
            "names": names,
            "dtypes": [str(named[n].dtype).removeprefix("torch.") for n in names],
            "shapes": [list(named[n].shape) for n in names],
            "group_name": "weight_update_group",
            "weight_version": str(version),
            "flush_cache": True,
        }
        with ThreadPoolExecutor(max_workers=len(urls)) as pool:
            futures = [pool.submit(request_json, u, "/update_weights_from_distributed", body, timeout=600)
                       for u in urls]
            for n in names:
                group.broadcast(named[n].to(device).contiguous(), src=0)
            for u, f in zip(urls, futures):
                _check(f.result(), u, "/update_weights_from_distributed")


def write_hf_folder(named: dict[str, torch.Tensor], hf_checkpoint: str, out_dir: str) -> None:
    """An HF checkpoint folder (config, tokenizer files of ``hf_checkpoint``, model.safetensors), written atomically."""
    from safetensors.torch import save_file

    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-hf-", dir=parent)
    for name in os.listdir(hf_checkpoint):
        src = os.path.join(hf_checkpoint, name)
        if os.path.isfile(src) and not name.endswith((".safetensors", ".bin")) and name != "model.safetensors.index.json":
            shutil.copy2(src, tmp)
    save_file({k: v.contiguous() for k, v in named.items()}, os.path.join(tmp, "model.safetensors"),
              metadata={"format": "pt"})
    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)


def _push_disk(args: Any, named: dict[str, torch.Tensor], urls: list[str], version: int) -> None:
    root = os.path.join(args.save, "weight_push") if args.save else os.path.join(tempfile.gettempdir(),
                                                                              f"slime_lite_push_{os.getpid()}")
    out = os.path.join(root, f"v{version}")
    write_hf_folder(named, args.hf_checkpoint, out)
    body = {"model_path": out, "weight_version": str(version)}
    for url, reply in zip(urls, _all(urls, lambda u: request_json(u, "/update_weights_from_disk", body, timeout=600))):
        _check(reply, url, "/update_weights_from_disk")
    old = os.path.join(root, f"v{version - 1}")
    if os.path.isdir(old):
        shutil.rmtree(old, ignore_errors=True)


def check_weights_equal(named: dict[str, torch.Tensor], urls: list[str]) -> None:
    """Every parameter the engines hold equals the trainer's (SHA-256 of the bytes). A tensor that matches only
    after a cast to another float dtype is equal in the engine's precision: counted apart and reported."""
    from slime_lite.weight_transport import tensor_sha256

    alias = {"lm_head.weight": "model.embed_tokens.weight"}  # tied embeddings: the engine lists both names
    for url in urls:
        engine = request_json(url, "/get_weights_checksum", {}, timeout=300)
        missing = sorted(n for n in engine if n not in named and alias.get(n) not in named)
        differ, cast = [], []
        for name, digest in engine.items():
            if name not in named and alias.get(name) not in named:
                continue
            t = named[name] if name in named else named[alias[name]]
            if tensor_sha256(t) == digest:
                continue
            if any(tensor_sha256(t.to(dt)) == digest for dt in (torch.bfloat16, torch.float16, torch.float32)
                   if dt != t.dtype):
                cast.append(name)
            else:
                differ.append(name)
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
