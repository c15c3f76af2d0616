"""Send the trainer's HF-named weights to engines: ``tensor`` (HTTP), ``distributed`` (broadcast group), ``disk``.

Runs on the trainer's global rank 0, which holds the full tensors (``TrainActor.hf_weights``). Every push carries
a ``weight_version`` that the engines report in their responses and that ends up in each Sample.

``tensor`` speaks SGLang's ``update_weights_from_tensor`` (``slime_lite.weight_wire``): buckets of
``--update-weight-buffer-size`` bytes in the ``flattened_bucket`` format, one payload per engine TP rank. An engine on
this host gets handles: CUDA IPC when the trainer's tensors are on the GPU it shares (``--colocate``: the engine
copies on the device, nothing goes through the host), shared memory for CPU tensors; an engine on another host gets
the tensors by value. ``tensor`` and ``distributed`` pushes run inside SGLang's weight-update session
(``/begin_weight_update`` ... ``/end_weight_update``, which SGLang 0.5.23 requires for both).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import socket
import tempfile
import time
from typing import Any
from urllib.parse import urlsplit

import torch

from slime_lite.backends.megatron.weight_broadcast import _check, buckets, push_distributed
from slime_lite.checks.faults import skips_weight_push
from slime_lite.checks.weight_check import WeightCheckUnavailable, check_weights_equal
from slime_lite.engine_client import lora_adapter_name, on_all, request_json
from slime_lite.errors import EngineError, EngineUnreachable, SlimeLiteError
from slime_lite.io import write_hf_folder
from slime_lite.types import PARTIAL_VERSION
from slime_lite.weight_wire import flatten_bucket, serialize

log = logging.getLogger(__name__)
def push(args: Any, named: dict[str, torch.Tensor], urls: list[str], version: int,
         reference: dict[str, torch.Tensor] | None = None, check: bool = False) -> dict[str, float]:
    """Send ``named`` to every engine; with --check-weight-update-equal (or ``check``) compare against ``reference``
    (the trainer's true weights; ``named`` itself unless a fault was injected into what is sent). Returns the
    seconds of the transport and of the check (``perf/update_weights/{send,check}_time``)."""
    try:
        return _push(args, named, urls, version, reference if reference is not None else named, check)
    except EngineUnreachable as exc:
        raise dead_engine(exc, urls) from None


def dead_engine(exc: EngineUnreachable, urls: list[str]) -> EngineError:
    """The error for an engine that does not answer at all, naming it by rank and URL: refused means nothing
    listens at its address any more (its server died), anything else that it stopped answering."""
    rank = next((i for i, u in enumerate(urls) if u.rstrip("/") == exc.url.rstrip("/")), "?")
    reason = getattr(exc.reason, "reason", exc.reason)  # urllib wraps the socket error
    died = isinstance(reason, ConnectionRefusedError) or "Connection refused" in str(reason)
    what = ("died: nothing listens at its address any more" if died else f"stopped answering ({reason})")
    return EngineError(f"engine {rank} ({exc.url}) {what}; the weight push could not reach it ({exc.route}). "
                       "Look for its error or kill above; --use-fault-tolerance restarts engines that die.")


def _push(args: Any, named: dict[str, torch.Tensor], urls: list[str], version: int,
          reference: dict[str, torch.Tensor], check: bool) -> dict[str, float]:
    times: dict[str, float] = {}
    if args.debug_scramble_engine_weights:  # noise first: a parameter the push skips cannot look right by chance
        gen = torch.Generator().manual_seed(version)
        with weight_update_session(urls):
            _push_tensor(args, {n: torch.randn(t.shape, generator=gen).to(t.dtype) for n, t in reference.items()},
                         urls, -1)
    if skips_weight_push(args.debug_inject_fault):
        log.warning("--debug-inject-fault skip-weight-push: the engines keep their old weights")
    else:
        t0 = time.perf_counter()
        _transport(args, named, urls, version)
        times["perf/update_weights/send_time"] = time.perf_counter() - t0
    if args.check_weight_update_equal or check:
        t0 = time.perf_counter()
        if _check_engines(args, reference, urls):
            times["perf/update_weights/check_time"] = time.perf_counter() - t0
    return times


def _check_engines(args: Any, reference: dict[str, torch.Tensor], urls: list[str]) -> bool:
    """``check_weights_equal``; an engine that cannot be checked (a real SGLang server) stops the run when the user
    asked for the check (--check-weight-update-equal), and is only warned about when the check was forced (a
    restarted engine under --use-fault-tolerance): False then."""
    try:
        check_weights_equal(reference, urls)
    except WeightCheckUnavailable as exc:
        if args.check_weight_update_equal:
            raise
        log.warning("the weights pushed to %s are not checked: %s", ", ".join(urls), exc)
        return False
    return True


def _transport(args: Any, named: dict[str, torch.Tensor], urls: list[str], version: int) -> None:
    transport = args.update_weight_transport
    limit = args.update_weight_buffer_size
    if transport == "tensor":
        with weight_update_session(urls):
            _push_tensor(args, named, urls, version)
    elif transport == "distributed":
        with weight_update_session(urls):
            push_distributed(named, urls, version, colocated=args.colocate, limit=limit,
                              flattened=args.rollout_backend != "sglang", flush_cache=not args.fully_async,
                              cpu_engines=args.rollout_device == "cpu", ranks=engine_ranks(args))
    else:
        _push_disk(args, named, urls, version)


def _begin(url: str) -> bool:
    """Open SGLang's weight-update session on ``url``; False for an engine without the route (SGLang before the
    session existed). A session left open by a push that died half way is closed and opened again."""
    for attempt in range(2):
        try:
            _check(request_json(url, "/begin_weight_update", {}, timeout=300), url, "/begin_weight_update")
            return True
        except EngineError as exc:
            if "HTTP 404" in str(exc):
                log.info("%s has no /begin_weight_update (an SGLang before the session): pushing without one", url)
                return False
            if attempt or "already open" not in str(exc):
                raise
            log.warning("%s: a weight-update session was left open (an earlier push failed): closing it", url)
            _abandon(url)
    return False


def _abandon(url: str) -> None:
    """Close a weight-update session whose push did not complete, and name the engine's weights ``partial``: an
    engine whose own updates all applied would otherwise take the push's version at the session's end while other
    engines, or its later buckets, never got theirs (the weight-version checks then read -1 until a complete
    push). Best effort: the engine may be the one that died."""
    for route, body in (("/end_weight_update", {}),
                        ("/update_weight_version", {"new_version": PARTIAL_VERSION, "abort_all_requests": False})):
        with contextlib.suppress(EngineError):
            request_json(url, route, body, timeout=300)


@contextlib.contextmanager
def weight_update_session(urls: list[str]):
    """``/begin_weight_update`` on every engine, then ``/end_weight_update`` on those that opened one (also when the
    push fails, so the engine is not left in a session)."""
    def begin(url: str) -> bool | EngineError:
        try:
            return _begin(url)
        except EngineError as exc:
            return exc

    begun = on_all(urls, begin)
    opened = [u for u, ok in zip(urls, begun) if ok is True]
    failed = next((exc for exc in begun if isinstance(exc, EngineError)), None)
    if failed is not None:  # one engine could not open one: the others' sessions are closed again, nothing sent
        for u in opened:
            with contextlib.suppress(EngineError):
                request_json(u, "/end_weight_update", {}, timeout=300)
        raise failed
    try:
        yield
    except BaseException:  # (a push that fails before its first bucket changed nothing; partial all the same)
        for u in opened:
            _abandon(u)
        raise
    for u, reply in zip(opened, on_all(opened, lambda u: request_json(u, "/end_weight_update", {}, timeout=300))):
        _check(reply, u, "/end_weight_update")


def _is_local(url: str) -> bool:
    """Whether the engine at ``url`` runs on this host (loopback, or an address this host can bind)."""

    host = urlsplit(url).hostname or ""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, _, _, _, addr in infos:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((addr[0], 0))
            return True
        except OSError:
            continue
    return False


def _shm_room(nbytes: int) -> bool:
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return False
    return st.f_bavail * st.f_frsize > 2 * nbytes


def payload_mode(url: str, named: dict[str, torch.Tensor], colocated: bool, bucket_bytes: int) -> str:
    """``"cuda_ipc"``, ``"shared_memory"`` or ``"by_value"``: how tensors reach the engine at ``url``. Handles need
    the engine on this host; CUDA handles also need it on the trainer's GPU (``--colocate``); shared memory needs
    room in /dev/shm for a bucket."""
    local = _is_local(url)
    if any(t.is_cuda for t in named.values()):
        return "cuda_ipc" if local and colocated else "by_value"
    return "shared_memory" if local and _shm_room(bucket_bytes) else "by_value"


def _push_tensor(args: Any, named: dict[str, torch.Tensor], urls: list[str], version: int) -> None:
    limit = args.update_weight_buffer_size
    ranks = engine_ranks(args)
    groups = buckets(named, limit)
    # the largest bucket: a tensor larger than the limit is a bucket of its own, which /dev/shm must hold too
    largest = max(sum(named[n].numel() * named[n].element_size() for n in names) for names in groups)
    modes = {u: payload_mode(u, named, args.colocate, largest) for u in urls}
    if any(m == "by_value" for m in modes.values()):
        log.info("weight push by value (host copies) to %s: handles reach only engines on this host%s",
                 [u for u, m in modes.items() if m == "by_value"],
                 "; GPU engines elsewhere: --update-weight-transport distributed" if torch.cuda.is_available() else "")
    for k, names in enumerate(groups):
        bucket = flatten_bucket([(n, named[n]) for n in names], shared="shared_memory" in modes.values())
        by_value = serialize(bucket, by_value=True) if "by_value" in modes.values() else None
        bodies = {u: {
            # a handle is read once, by one rank: one payload each; bytes may be read by every rank
            "serialized_named_tensors": [by_value] * ranks if modes[u] == "by_value" else
            [serialize(bucket) for _ in range(ranks)],
            "load_format": "flattened_bucket",
            "flush_cache": k == len(groups) - 1 and not args.fully_async,
            "weight_version": str(version),
        } for u in urls}
        replies = on_all(urls, lambda u, b=bodies: request_json(u, "/update_weights_from_tensor", b[u], timeout=600))
        for url, reply in zip(urls, replies):
            _check(reply, url, "/update_weights_from_tensor")
        del bucket, bodies  # the engines answered after their copies: the bucket can go
    if torch.cuda.is_available():
        torch.cuda.ipc_collect()  # CUDA IPC blocks the engines have closed


def engine_ranks(args: Any) -> int:
    """Ranks per engine that read a push: an SGLang server's TP ranks (one a GPU), the embedded engine's one."""
    return args.rollout_num_gpus_per_engine if args.rollout_backend == "sglang" else 1


def _push_disk(args: Any, named: dict[str, torch.Tensor], urls: list[str], version: int) -> None:
    root = os.path.join(args.save, "weight_push") if args.save else os.path.join(tempfile.gettempdir(),
                                                                              f"slime_lite_push_{os.getpid()}")
    out = os.path.join(root, f"v{version}")
    write_hf_folder(named, args.hf_checkpoint, out)
    body = {"model_path": out, "weight_version": str(version),
            "flush_cache": not args.fully_async}  # --fully-async: retracted requests wait in the queues
    replies = on_all(urls, lambda u: request_json(u, "/update_weights_from_disk", body, timeout=600))
    for url, reply in zip(urls, replies):
        _check(reply, url, "/update_weights_from_disk")
    if not args.save:  # this host's temporary folder: the engines read it in the call, and each push writes it
        shutil.rmtree(root, ignore_errors=True)
        return
    for name in os.listdir(root):  # every earlier push (pushes every --update-weights-interval come 2, 4, ... apart)
        if name != f"v{version}" and re.fullmatch(r"v\d+", name):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


_lora_loaded: dict[str, str] = {}  # engine URL -> the adapter name it serves (LoRA on real SGLang)


def push_lora_to_sglang(args: Any, adapters: dict[str, tuple[torch.Tensor, torch.Tensor]], settings: Any,
                        urls: list[str], version: int, reference: dict[str, tuple[torch.Tensor, torch.Tensor]],
                        base: dict[str, torch.Tensor] | None, restarted: bool = False) -> dict[str, float]:
    """LoRA on real SGLang, through SGLang's own routes (SGLang applies the adapters itself; nothing is merged):
    the adapters ({HF weight name: (A, B unscaled)}) as a PEFT folder, loaded by every engine under
    ``lora_adapter_name(version)`` (/load_lora_adapter), the engines' weight version set (/update_weight_version),
    then the adapter the engine served before unloaded (/unload_lora_adapter; SGLang lets its running requests
    finish first) and its folder removed. ``restarted``: the engines at ``urls`` were just started again
    (--use-fault-tolerance) and hold no adapter, whatever the engine that had their URL before held. The folder
    must be readable by the engines: under --save when given (a file system the nodes share; the last one is kept),
    else this host's temporary folder, removed once the push is over (SGLang keeps a loaded adapter in its memory,
    and every push writes the folder again).

    The weight check (with ``base``, the trainer's frozen base weights): the folder the engines loaded holds exactly
    ``reference`` (the trainer's adapters), and the engines' base weights equal ``base`` (``check_weights_equal``,
    which needs /get_weights_checksum: a real SGLang server has none, see ``_check_engines``). What SGLang computes
    from the two is not read back."""
    from slime_lite.backends.megatron import peft_format

    root = os.path.join(args.save, "lora_push") if args.save else os.path.join(tempfile.gettempdir(),
                                                                            f"slime_lite_lora_{os.getpid()}")
    folder, name = os.path.join(root, f"v{version}"), lora_adapter_name(version)
    times: dict[str, float] = {}
    t0 = time.perf_counter()
    if skips_weight_push(args.debug_inject_fault):
        log.warning("--debug-inject-fault skip-weight-push: the engines keep their old adapters")
    else:
        peft_format.write(adapters, settings, args.hf_checkpoint, folder)
        if restarted:
            for url in urls:
                _lora_loaded.pop(url, None)
        fresh = [u for u in urls if _lora_loaded.get(u) != name]
        on_all(fresh, lambda u: request_json(u, "/load_lora_adapter", {"lora_name": name, "lora_path": folder},
                                             timeout=600))
        body = {"new_version": str(version), "abort_all_requests": False}
        on_all(fresh, lambda u: request_json(u, "/update_weight_version", body, timeout=60))
        for url in fresh:
            old, _lora_loaded[url] = _lora_loaded.get(url), name
            if old is not None:
                request_json(url, "/unload_lora_adapter", {"lora_name": old}, timeout=600)
        for entry in os.listdir(root):
            if entry != f"v{version}" and entry.startswith("v"):
                shutil.rmtree(os.path.join(root, entry), ignore_errors=True)
        times["perf/update_weights/send_time"] = time.perf_counter() - t0
    if base is not None:
        t0 = time.perf_counter()
        loaded = peft_format.read(folder) if os.path.isdir(folder) else {}
        for n, (a, b) in reference.items():
            got = loaded.get(n)
            if got is None or not (torch.equal(got[0], a.cpu()) and torch.equal(got[1], b.cpu())):
                raise SlimeLiteError(
                    f"weight check: the adapter folder {folder} the SGLang engines loaded as {name} does not hold "
                    f"the trainer's adapter of {n}; the push wrote or sent something else.")
        if _check_engines(args, base, urls):  # (no check time: the engines' base weights went unchecked)
            times["perf/update_weights/check_time"] = time.perf_counter() - t0
    if not args.save:
        shutil.rmtree(root, ignore_errors=True)
    return times
