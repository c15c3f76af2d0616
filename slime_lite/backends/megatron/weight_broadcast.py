"""The ``distributed`` weight push (``--update-weight-transport distributed``): one broadcast group of the trainer
(rank 0) and the engines' processes, made on the first push and kept for the later ones; each bucket of tensors goes
as broadcasts (SGLang's ``update_weights_from_distributed``, ``flattened_bucket`` when no tensor needs padding)."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

import torch

from slime_lite.engine_client import request_json, sent_to_all
from slime_lite.errors import EngineError, EngineUnreachable, SlimeLiteError
from slime_lite.io import free_port
from slime_lite.weight_transport import GroupStore, WeightUpdateGroup, check_group_address, group_address

log = logging.getLogger(__name__)
_groups: dict[tuple[str, ...], Any] = {}
BUCKET_BYTES = 512 << 20  # slime's --update-weight-buffer-size default


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


def _check(reply: Any, url: str, route: str) -> None:
    if isinstance(reply, dict) and reply.get("success") is False:
        raise EngineError(f"engine {url}{route} refused the weights: {reply.get('message')}")


def _join_bodies(urls: list[str], ranks: int, host: str, port: int) -> tuple[int, list[dict]]:
    """The group's size and each engine's ``/init_weights_update_group`` body: the trainer is rank 0 and engine i's
    ``ranks`` processes take ``rank_offset + 0 .. ranks - 1`` (SGLang adds its TP rank to ``rank_offset``)."""
    world = 1 + ranks * len(urls)
    return world, [{"master_address": host, "master_port": port, "rank_offset": 1 + i * ranks, "world_size": world,
                    "group_name": "weight_update_group"} for i in range(len(urls))]


def _group(urls: list[str], backend: str, ranks: int = 1) -> Any:
    """One broadcast group trainer(rank 0) + engines (``ranks`` processes each), made on the first push and kept for
    the later ones.

    The trainer's store listens before the engines are asked; the trainer's own join runs in a thread while the
    engines' answers are watched, so an engine that refuses (a 400: a group already there, a backend it cannot use)
    stops the push at once instead of after the group's timeout: the store is closed (which ends the joins waiting
    on it) and the other engines are told to destroy the group (which calls off a join still connecting)."""

    key = tuple(urls)
    if key in _groups:
        return _groups[key]
    for old in list(_groups):  # the engine set changed (--use-fault-tolerance restarted one): one group at a time
        _drop_group(old)
    host = os.environ.get("SLIME_LITE_WEIGHT_MASTER_ADDR") or group_address(urls)
    try:
        check_group_address(host)  # the group's store listens on this address only; never every interface
    except ValueError as exc:
        raise SlimeLiteError(f"SLIME_LITE_WEIGHT_MASTER_ADDR: {exc}") from None
    port = free_port()
    world, bodies = _join_bodies(urls, ranks, host, port)
    server = GroupStore(host, port, world)
    joins = [_in_background(request_json, u, "/init_weights_update_group", {**body, "backend": backend}, timeout=300)
             for u, body in zip(urls, bodies)]
    cuda = torch.cuda.current_device() if backend == "nccl" else None
    own = _in_background(_rank0, host, port, world, backend, server, cuda)
    while True:  # until every side joined, an engine refused, or the trainer's side failed
        refused = next(((u, exc) for u, f in zip(urls, joins) if (exc := _join_error(u, f)) is not None), None)
        pending = [f for f in (*joins, own) if not f.done()]
        if refused or not pending or (own.done() and own.exception() is not None):
            break
        wait(pending, return_when=FIRST_COMPLETED)
    if refused is None and own.exception() is None:
        _groups[key] = own.result()
        return _groups[key]
    server.close()  # every join still waiting on the store ends: the trainer's own, the engines' connected ones
    with contextlib.suppress(Exception):  # (the trainer's side failed, or formed while an engine refused)
        own.result(timeout=_LEAVE_S).destroy()
    _leave(urls, joins, refused[0] if refused else None)
    if refused is None:
        raise own.exception()
    exc = refused[1]
    if isinstance(exc, EngineUnreachable):
        raise exc
    raise EngineError(f"{exc}; the weight update group cannot form without it: the push stopped at once and the "
                      "other engines were told to destroy the group") from None


_LEAVE_S = 10.0  # how long a failed group's engines are asked to leave it


def _in_background(fn: Any, *args: Any, **kwargs: Any) -> Future:
    """``fn(*args, **kwargs)`` in a daemon thread: a join abandoned when the group fails never holds the exit."""
    future: Future = Future()

    def run() -> None:
        future.set_running_or_notify_cancel()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - handed to whoever reads the future
            future.set_exception(exc)

    threading.Thread(target=run, name="weight-group-join", daemon=True).start()
    return future


def _rank0(host: str, port: int, world: int, backend: str, server: GroupStore, cuda: int | None) -> Any:
    if cuda is not None:
        torch.cuda.set_device(cuda)  # NCCL works on the current device, which is per thread
    return WeightUpdateGroup(host, port, 0, world, backend=backend, server=server)


def _join_error(url: str, join: Future) -> EngineError | None:
    """The engine's refusal to join (its HTTP error, or a reply that says it failed); None while it joins or once
    it joined."""
    if not join.done():
        return None
    exc = join.exception()
    if exc is None:
        reply = join.result()
        if not (isinstance(reply, dict) and reply.get("success") is False):
            return None
        exc = EngineError(f"engine {url}/init_weights_update_group refused to join: {reply.get('message')}")
    return exc if isinstance(exc, EngineError) else EngineError(f"engine {url}/init_weights_update_group: {exc!r}")


def _leave(urls: list[str], joins: list[Future], refused: str | None) -> None:
    """Tell every engine but ``refused`` to destroy the group, again while its join is still pending (a request to
    destroy can reach an engine before its join does), for at most ``_LEAVE_S``."""
    deadline = time.monotonic() + _LEAVE_S
    told: set[str] = set()
    while True:
        ask = [u for u, f in zip(urls, joins) if u != refused and (not f.done() or (u not in told and
                                                                                   _join_error(u, f) is None))]
        for u in ask:
            told.add(u)
            try:
                request_json(u, "/destroy_weights_update_group", {"group_name": "weight_update_group"}, timeout=10)
            except EngineError as exc:  # nothing (left) to destroy there
                log.debug("%s: %s", u, exc)
        pending = [f for u, f in zip(urls, joins) if u != refused and not f.done()]
        if not pending or time.monotonic() > deadline:
            if pending:
                log.warning("engines %s did not leave the failed weight update group within %gs",
                            [u for u, f in zip(urls, joins) if not f.done()], _LEAVE_S)
            return
        wait(pending, timeout=0.5)


def _drop_group(key: tuple[str, ...]) -> None:
    """Destroy a broadcast group on the trainer's side and on each of its engines still answering."""
    group = _groups.pop(key)
    for url in key:
        try:
            request_json(url, "/destroy_weights_update_group", {"group_name": "weight_update_group"}, timeout=30)
        except EngineError as exc:  # a dead engine took its side of the group with it
            log.info("weight update group of %s not destroyed there: %s", url, exc)
    group.destroy()


def push_distributed(named: dict[str, torch.Tensor], urls: list[str], version: int, colocated: bool = False,
                      limit: int = BUCKET_BYTES, flattened: bool = True, flush_cache: bool = True,
                      cpu_engines: bool = False, ranks: int = 1) -> None:
    """Buckets of at most ``limit`` bytes, each one ``/update_weights_from_distributed`` request (to engines of
    ``ranks`` processes each: ``engine_ranks``); ``flattened``: a
    bucket goes as one broadcast of its tensors' bytes back to back (SGLang's ``load_format="flattened_bucket"``)
    when no tensor would need padding, else (and for SGLang servers: not every version reads it) one broadcast per
    tensor. ``flush_cache`` False under --fully-async: the retracted requests wait in the engines' queues (SGLang
    refuses to flush the cache while requests wait). ``cpu_engines``: the engines run on the CPU (--rollout-device cpu)."""
    # NCCL needs one GPU per rank: colocated engines share the trainer's GPU, and CPU engines have none (they refuse
    # an NCCL group, and the trainer would wait for them until the group's timeout), so both use gloo (host memory)
    backend = "nccl" if torch.cuda.is_available() and not colocated and not cpu_engines else "gloo"
    group = _group(urls, backend, ranks)
    device = "cuda" if backend == "nccl" else "cpu"
    route = "/update_weights_from_distributed"
    try:
        for names in buckets(named, limit):
            flat = _packed([named[n] for n in names], device) if flattened else None
            body = {
                "names": names,
                "dtypes": [str(named[n].dtype).removeprefix("torch.") for n in names],
                "shapes": [list(named[n].shape) for n in names],
                "group_name": "weight_update_group",
                "weight_version": str(version),
                "flush_cache": flush_cache,
                **({"load_format": "flattened_bucket"} if flat is not None else {}),
            }
            with sent_to_all(urls, route, body, 600) as sent:  # each engine joins the broadcast on its request
                if flat is not None:
                    group.broadcast(flat, src=0)
                else:
                    for n in names:
                        group.broadcast(named[n].to(device).contiguous(), src=0)
                replies = [request.result() for request in sent]
            for u, reply in zip(urls, replies):
                _check(reply, u, route)
    except Exception:  # an engine that missed a broadcast left the group: the next push forms it again
        if tuple(urls) in _groups:
            _drop_group(tuple(urls))
        raise


def _packed(tensors: list[torch.Tensor], device: str) -> torch.Tensor | None:
    """The tensors' bytes back to back on ``device`` (one copy), or None when one would start at an offset that is
    not a multiple of its element size (SGLang's flattened bucket has no padding)."""
    offset = 0
    for t in tensors:
        if offset % t.element_size():
            return None
        offset += t.numel() * t.element_size()
    return torch.cat([t.detach().to(device).contiguous().reshape(-1).view(torch.uint8) for t in tensors])
