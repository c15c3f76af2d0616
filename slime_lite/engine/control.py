"""Control operations of the embedded engine's scheduler: pause and resume generation, flush the KV cache, release
and resume GPU memory.

A mixin of ``Scheduler`` (scheduler.py): these run in its model thread through ``Scheduler.call``, with no step in
flight (``_map_weights``: in its constructor), and use its state (``running``, ``waiting``, ``paused``, ``released``, ``prefix``, ``pipeline``, ``lm``,
``_stash``, ``_weight_buffer``, ``_weights_at``).
"""

from __future__ import annotations

import logging

import torch

from slime_lite.engine import vmm
from slime_lite.offload import clear_cublas_workspaces

logger = logging.getLogger(__name__)


PAUSE_ABORT = "aborted by /pause_generation"


class EngineBusy(RuntimeError):
    """An operation that needs an idle engine (no running or waiting requests)."""


class ControlMixin:
    def pause(self, mode: str = "abort") -> None:
        """``abort``: abort everything; ``retract``: running requests go back to the queue (recomputed later);
        ``in_place``: keep them (and their cache) as they are. New requests queue until ``resume``. In the model
        thread; an ``abort`` pause is counted (``count_abort_all``) when asked for, so a request made after the ask
        and handled after it waits instead of being aborted."""
        if mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"pause mode {mode!r}: expected abort, retract or in_place")
        if mode == "abort":
            self._abort_all(PAUSE_ABORT, count=False)
        elif mode == "retract":
            for slot in sorted(self.running, reverse=True):
                self._retract(slot)
            self._free_cache()
        self.paused = True
        logger.info("generation paused (%s): %d running, %d waiting", mode, len(self.running), len(self.waiting))

    def resume(self) -> None:
        self.paused = False
        logger.info("generation continued")

    def flush_cache(self) -> None:
        if self.running or self.waiting:
            raise EngineBusy(f"cannot flush the cache with {len(self.running)} running and "
                             f"{len(self.waiting)} waiting requests")
        self._free_cache()

    def _free_cache(self) -> None:
        """Free the KV cache (with what the prefix cache points at in it)."""
        self.prefix.clear()
        self.pipeline.free_cache()

    def release_memory(self, tags: list[str] | None) -> str:
        tags = set(tags or ("weights", "kv_cache"))
        if self.running or self.waiting:
            raise EngineBusy("release_memory_occupation needs an idle engine (requests are in flight)")
        if self.device.type == "cpu":
            logger.info("release_memory_occupation %s: no-op on CPU", sorted(tags))
            self.released |= tags
            return "no-op on CPU"
        # The CUDA graphs hold the cache's and the weights' addresses: they stay valid when both come back where they
        # were (mapped buffers, engine/vmm.py); otherwise they go with the cache and are captured again on use.
        self.prefix.clear()  # the K/V it points at is lost either way
        if not self.cache.release():
            self._free_cache()
        if "weights" in tags and "weights" not in self.released:
            self._weights_at = [t.data_ptr() for t in self.lm.device_tensors()]
            # one pinned host block; the weights stay readable and writable there (updates, checksums) until resumed
            self._stash.offload(self.lm.device_tensors(), keep_on_host=True)
            if self._weight_buffer is not None:
                self._weight_buffer.unmap()
        clear_cublas_workspaces()
        torch.cuda.empty_cache()
        self.released |= tags
        logger.info("released GPU memory %s", sorted(tags))
        return "released"

    def resume_memory(self, tags: list[str] | None) -> str:
        tags = set(tags or ("weights", "kv_cache"))
        if self.device.type != "cpu" and "weights" in tags and "weights" in self.released:
            self._onload_weights()
            if [t.data_ptr() for t in self.lm.device_tensors()] != self._weights_at:
                self.lm.storage_version += 1  # new addresses: CUDA graphs are captured again
        self.released -= tags
        logger.info("resumed memory %s", sorted(tags))
        return "resumed"

    def _onload_weights(self) -> None:
        """The offloaded weights back on the device as one block: a mapped buffer where the device supports it
        (the same addresses at every resume), else a new allocation."""
        if self._weight_buffer is None or self._weight_buffer.nbytes < self._stash.nbytes:
            self._weight_buffer = None
            self._weight_buffer = vmm.buffer(self._stash.nbytes, self.device)
        block = None
        if self._weight_buffer is not None:
            self._weight_buffer.map()
            block = self._weight_buffer.view()
        self._stash.onload(block)  # every weight a view of the block

    def _map_weights(self) -> None:
        """At start (in the constructor), on CUDA: move the weights into their mapped buffer (through the host), so
        that the first resume brings them back where the first CUDA graphs saw them."""
        if vmm.available(self.device):
            self._stash.offload(self.lm.device_tensors(), keep_on_host=True)
            torch.cuda.empty_cache()  # the weights' old blocks: the mapped buffer cannot use torch's cached memory
            try:
                self._onload_weights()
            except torch.OutOfMemoryError as e:  # where they were, by torch (graphs are captured again after resumes)
                logger.warning("weights not moved into mapped memory (%s)", e)
                self._weight_buffer = None
                self._stash.onload()
            self._stash.drop_host()  # pinned memory only while released
            # the loaded weights were counted by torch's peak, and now by the mapped bytes: count them once
            torch.cuda.reset_peak_memory_stats(self.device)
