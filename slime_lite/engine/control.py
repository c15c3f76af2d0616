"""The engine's control operations (pause and resume, cache flush, memory release and resume), run in the model
thread through ``Scheduler.call`` between two steps, with no step in flight."""

from __future__ import annotations

import heapq
import logging

import torch

logger = logging.getLogger(__name__)


class EngineBusy(RuntimeError):
    """An operation that needs an idle engine (no running or waiting requests)."""


class ControlOps:
    """Mixed into ``Scheduler``: uses its queue, running batch, cache and model."""

    def pause(self, mode: str = "abort") -> None:
        """``abort``: abort everything; ``retract``: running requests go back to the queue (recomputed later);
        ``in_place``: keep them (and their cache) as they are. New requests queue until ``resume``."""
        if mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"pause mode {mode!r}: expected abort, retract or in_place")
        if mode == "abort":
            self._abort_all("aborted by /pause_generation")
        elif mode == "retract":
            for slot in sorted(self.running, reverse=True):
                req = self.running.pop(slot)
                heapq.heappush(self._free_slots, slot)
                req.slot = -1
                self.waiting.appendleft(req)
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

    def release_memory(self, tags: list[str] | None) -> str:
        tags = set(tags or ("weights", "kv_cache"))
        if self.running or self.waiting:
            raise EngineBusy("release_memory_occupation needs an idle engine (requests are in flight)")
        if self.device.type == "cpu":
            logger.info("release_memory_occupation %s: no-op on CPU", sorted(tags))
            self.released |= tags
            return "no-op on CPU"
        if "weights" in tags and "weights" not in self.released:
            self.lm.layers, self.lm.cos, self.lm.sin = [], None, None  # drop the fused tensors' GPU memory
            self.hf.to("cpu")
        self._free_cache()
        torch.cuda.empty_cache()
        self.released |= tags
        logger.info("released GPU memory %s", sorted(tags))
        return "released"

    def resume_memory(self, tags: list[str] | None) -> str:
        tags = set(tags or ("weights", "kv_cache"))
        if self.device.type != "cpu" and "weights" in tags and "weights" in self.released:
            self.hf.to(self.device)
            self.lm.refresh()
        self.released -= tags
        logger.info("resumed memory %s", sorted(tags))
        return "resumed"
