"""Moving weights from the trainer to rollout engines: code shared by the sender and the engine receiver.

Two transports, both used by the trainer side and by ``slime_lite.engine`` (this module imports neither the engine
nor Megatron, so either side can use it):

- **Serialized tensors** (``/update_weights_from_tensor``): SGLang's payload format, in ``slime_lite.weight_wire``
  (CUDA IPC or shared-memory handles on one host, tensors by value across hosts; a restricted unpickler reads it).
- **A broadcast group** (``/init_weights_update_group`` + ``/update_weights_from_distributed``):
  ``WeightUpdateGroup`` is one member of a torch.distributed group built directly from a TCPStore, without the
  default process group (the trainer already has Megatron's). Rank 0 is the trainer and hosts the store; the
  engines join with rank ``rank_offset + tp_rank``. The store keys are laid out as torch's own ``new_group`` path
  lays them out (``<group>`` then ``<group>/`` then ``<device>/`` prefixes), which is also what SGLang's engines
  use, so a trainer-side member can broadcast to a real SGLang server as well as to the embedded engine.

The weight-equality check's checksum, which both sides use too, is ``slime_lite.weight_checksum``.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import socket
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from slime_lite.io import is_loopback

logger = logging.getLogger(__name__)

DEFAULT_GROUP_NAME = "weight_update_group"
WILDCARD_ENV = "SLIME_LITE_WEIGHT_GROUP_ALLOW_WILDCARD"  # "1": a weight group may listen on 0.0.0.0 / ::


def is_wildcard(address: str) -> bool:
    """Whether ``address`` means every interface (``0.0.0.0``, ``::``, empty)."""

    try:
        return ipaddress.ip_address(address.strip("[]")).is_unspecified
    except ValueError:
        return address.strip() == ""


def wildcard_allowed() -> bool:
    return os.environ.get(WILDCARD_ENV, "") == "1"


def check_group_address(address: str) -> None:
    """Refuse a wildcard weight-group address unless the user set ``SLIME_LITE_WEIGHT_GROUP_ALLOW_WILDCARD=1``."""
    if is_wildcard(address) and not wildcard_allowed():
        raise ValueError(f"master_address {address!r} would listen on every interface; give the address to bind "
                         f"(e.g. 127.0.0.1 or this host's cluster address), or set {WILDCARD_ENV}=1 to allow it")


def group_address(urls: list[str]) -> str:
    """Where the trainer's weight group listens unless SLIME_LITE_WEIGHT_MASTER_ADDR says: 127.0.0.1 when every
    engine is on this host's loopback, else this host's address on the route to the first engine elsewhere (an
    engine on another node could not reach the loopback)."""
    from urllib.parse import urlsplit

    for url in urls:
        host = urlsplit(url).hostname or "127.0.0.1"
        if not is_loopback(host):
            return _local_address_towards(host, urlsplit(url).port or 80)
    return "127.0.0.1"


def _local_address_towards(address: str, port: int) -> str:
    """This host's address on the route to ``address`` (the address itself when it is local): what gloo binds."""

    if is_wildcard(address):
        return "0.0.0.0"
    info = socket.getaddrinfo(address, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(info[0], socket.SOCK_DGRAM) as s:
        s.connect(info[4])  # UDP: no packet is sent, only the route is chosen
        return s.getsockname()[0]


def dtype_from_name(name: str) -> "torch.dtype":
    """``"bfloat16"`` or ``"torch.bfloat16"`` -> ``torch.bfloat16``; a clear error for anything else."""

    dt = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} (expected e.g. 'bfloat16', 'float32')")
    return dt


class GroupJoinCancelled(RuntimeError):
    """A member's join that was called off (``cancelled``) before the group formed."""


class GroupStore:
    """Rank 0's side of a group's rendezvous: the TCPStore server, listening on ``master_address`` only. It waits
    for no member, so it can be started before the members are asked to join; ``close`` ends every join still
    pending on it at once (the members waiting on the store see their connection closed), which is how a trainer
    gives up on a group that one engine refused to join instead of waiting out the timeout."""

    def __init__(self, master_address: str, master_port: int, world_size: int, timeout_s: float = 300.0) -> None:
        check_group_address(master_address)
        info = socket.getaddrinfo(master_address.strip("[]"), int(master_port), type=socket.SOCK_STREAM)[0]
        listener = socket.socket(info[0], socket.SOCK_STREAM)  # torch's server would bind every interface
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(info[4])
            listener.listen(max(64, world_size))
        except OSError:
            listener.close()
            raise
        # the store owns the socket from here (it closes it when it goes)
        self._store: dist.TCPStore | None = dist.TCPStore(
            master_address, int(master_port), world_size, True, datetime.timedelta(seconds=timeout_s),
            wait_for_workers=False, master_listen_fd=listener.detach(), use_libuv=False)

    def close(self) -> None:
        """Stop the server (its last reference goes): every member's store connection is closed."""
        self._store = None


def _wait_listening(address: str, port: int, deadline: float, cancelled: Callable[[], bool]) -> None:
    """Until something listens at ``address:port`` (rank 0's store), checking ``cancelled`` between tries: torch's
    own connect retries until its timeout and cannot be called off."""
    while True:
        if cancelled():
            raise GroupJoinCancelled("the join was called off before rank 0's store answered")
        left = deadline - time.monotonic()
        try:
            socket.create_connection((address.strip("[]"), port), timeout=max(0.05, min(1.0, left))).close()
            return
        except OSError as exc:
            if left <= 0:
                raise TimeoutError(f"nothing listens at {address}:{port} (rank 0's store): {exc}") from None
        time.sleep(min(0.1, max(0.0, left)))


CONNECT_TRY_S = 5.0  # one try of a member's connect to rank 0's store (then the call-off is checked again)


def _connect(address: str, port: int, world_size: int, deadline: float, cancelled: Callable[[], bool]) -> Any:
    """A member's client of rank 0's store. torch's connect retries until its timeout, with backoff delays of up to
    a minute, and cannot be called off: a store closed between ``_wait_listening`` and the connect (the trainer
    gave up on the group) would hold the join for the whole group timeout. So each try gets ``CONNECT_TRY_S``, and
    ``cancelled`` is checked between them."""
    while True:
        _wait_listening(address, port, deadline, cancelled)
        left = deadline - time.monotonic()
        try:
            return dist.TCPStore(address, port, world_size, False,
                                 datetime.timedelta(seconds=max(0.5, min(CONNECT_TRY_S, left))), wait_for_workers=True)
        except dist.DistNetworkError:  # no answer in this try (a store error of another kind is raised at once)
            if cancelled():
                raise GroupJoinCancelled("the join was called off while connecting to rank 0's store") from None
            if time.monotonic() >= deadline:
                raise


class WeightUpdateGroup:
    """One member of a broadcast group between the trainer (rank 0) and engine ranks.

    Every member must be constructed at the same time (with gloo, construction blocks until all ``world_size``
    members joined, or ``timeout_s`` passed; NCCL forms its communicator at the first broadcast). ``backend`` is
    ``"gloo"`` (CPU tensors) or ``"nccl"`` (CUDA tensors, the current CUDA device). Rank 0 hosts the store: its
    ``server`` (a ``GroupStore`` started beforehand, which the group then owns) or one it starts. Another rank's
    join can be called off (``cancelled`` returns True) while it waits for rank 0's store; once connected, its join
    ends when rank 0's store closes.

    Every socket binds to one address, never every interface: rank 0's store listens on ``master_address`` only,
    and gloo's pairs on this host's address towards it. A wildcard ``master_address`` (``0.0.0.0``, ``::``) is
    refused unless ``SLIME_LITE_WEIGHT_GROUP_ALLOW_WILDCARD=1``.
    """

    def __init__(
        self,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        backend: str = "gloo",
        group_name: str = DEFAULT_GROUP_NAME,
        timeout_s: float = 300.0,
        server: GroupStore | None = None,
        cancelled: Callable[[], bool] = lambda: False,
    ) -> None:
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend {backend!r}: expected 'gloo' or 'nccl'")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} out of range for world_size {world_size}")
        check_group_address(master_address)
        self.rank, self.world_size, self.backend, self.group_name = rank, world_size, backend, group_name
        timeout = datetime.timedelta(seconds=timeout_s)
        url = f"tcp://{master_address}:{int(master_port)}"
        self._server = (server or GroupStore(master_address, master_port, world_size, timeout_s)) if rank == 0 else None
        self._pg = None
        try:
            if rank:
                store = _connect(master_address, int(master_port), world_size, time.monotonic() + timeout_s,
                                 cancelled)
            else:
                store = dist.TCPStore(master_address, int(master_port), world_size, False, timeout,
                                      wait_for_workers=False)
            store.set_timeout(timeout)
            device = "cuda" if backend == "nccl" else "cpu"
            store = dist.PrefixStore(f"{device}/", dist.PrefixStore(f"{group_name}/",
                                                                    dist.PrefixStore(group_name, store)))
            if backend == "gloo":
                opts = dist.ProcessGroupGloo._Options()
                opts._timeout = timeout
                local = master_address if rank == 0 else _local_address_towards(master_address, int(master_port))
                opts._devices = [dist.ProcessGroupGloo.create_device(hostname=local)]
                self._pg = dist.ProcessGroupGloo(store, rank, world_size, opts)
            else:
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = timeout
                self._pg = dist.ProcessGroupNCCL(store, rank, world_size, opts)
            if cancelled():
                raise GroupJoinCancelled("the join was called off while the group formed")
        except BaseException:
            self.destroy(quiet=True)
            raise
        self._store = store
        logger.info("weight update group %r: joined as rank %d/%d (%s, %s)", group_name, rank, world_size, backend, url)

    def broadcast(self, tensor: "torch.Tensor", src: int = 0) -> None:
        """Broadcast ``tensor`` in place from rank ``src`` to every member (blocks until done)."""

        if self._pg is None:
            raise RuntimeError(f"weight update group {self.group_name!r} was destroyed")
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        self._pg.broadcast([tensor], opts).wait()

    def destroy(self, quiet: bool = False) -> None:
        """Leave the group and free its communicator (rank 0: and stop its store)."""
        pg, self._pg = self._pg, None
        if pg is not None and self.backend == "nccl":
            try:
                pg.shutdown()
            except Exception:  # noqa: BLE001 - best effort on teardown
                logger.warning("weight update group %r: NCCL shutdown failed", self.group_name, exc_info=True)
        self._store = None
        if self._server is not None:
            self._server.close()
        if not quiet:
            logger.info("weight update group %r: destroyed (rank %d)", self.group_name, self.rank)
