"""Admission of the embedded engine's scheduler: waiting requests get a batch slot (the prefix cache picks it) and
are prefilled together; their prompt log-probs and first token come out of that prefill.

A mixin of ``Scheduler`` (scheduler.py): these methods run in its model thread and use its state (``waiting``,
``running``, ``_free_slots``, ``cache``, ``prefix``, ``lm``).
"""

from __future__ import annotations

import heapq
import logging

import torch

from slime_lite.engine import logprobs as lpx
from slime_lite.engine.request import ENGINE_ERROR, Request, abort_reason

logger = logging.getLogger(__name__)

PREFILL_MAX_TOKENS = 8192  # padded tokens per prefill batch
LOGPROB_ROWS = 1024  # prompt positions per [positions, vocabulary] log-softmax (prompt log-probs)


class AdmissionMixin:
    def _admitting(self) -> bool:
        """Admit in groups (each admission is one prefill forward) unless the queue fits or the batch is empty."""
        free = len(self._free_slots)
        return bool(self.waiting) and free > 0 and (
            free >= self._admit_group or len(self.waiting) <= free or not self.running)

    def _need_len(self, req: Request) -> int:
        return len(req.input_ids) + max(req.max_new - 1, len(req.output_ids))

    @staticmethod
    def _prefill_seq(req: Request) -> list[int]:
        """What a prefill runs: the prompt, plus what it generated when it comes back from a retraction."""
        return req.input_ids + req.output_ids[:-1]

    @staticmethod
    def _reuse_limit(req: Request, seq_len: int) -> int:
        """How many leading tokens may come from the prefix cache: all but the last (its logits pick the next
        token), and none from where prompt log-probs are asked."""
        limit = seq_len - 1
        if req.return_logprob and req.input_logprobs is None and req.logprob_start_len < len(req.input_ids):
            limit = min(limit, req.logprob_start_len)
        return limit

    def _admit(self) -> None:
        if self.cache.kv is None:
            self.prefix.clear()  # the K/V it pointed at is gone
        batch: list[Request] = []
        reused: list[int] = []
        forks: list[tuple[int, int, int]] = []  # (source slot, slot, positions): cached K/V copied before the prefill
        width = 0
        while self.waiting and self._free_slots:
            req = self.waiting[0]
            seq = self._prefill_seq(req)
            slot, hit, source = self.prefix.match(self._free_slots, seq, self._reuse_limit(req, len(seq)),
                                                  req.cache_namespace)
            n = len(seq) - hit
            if batch and (len(batch) + 1) * max(width, n) > PREFILL_MAX_TOKENS:
                break
            self.waiting.popleft()
            self.prefix.take(slot, len(seq), hit)
            self._free_slots.remove(slot)
            heapq.heapify(self._free_slots)
            width = max(width, n)
            req.slot = slot
            self.running[slot] = req
            batch.append(req)
            reused.append(hit)
            if hit and source != slot:
                forks.append((source, slot, hit))
        need = max(self._need_len(r) for r in self.running.values())
        if any(reused):  # prefill_extend's padding writes one position past each prompt
            need = max(need, min(self.slot_len, max(len(r.input_ids) + len(r.output_ids) for r in batch) + 1))
        self.cache.ensure(max(self.running) + 1, need)
        for source, slot, n in forks:  # before any prefill of this batch writes over a source
            self.cache.copy_prefix(source, slot, n)
            if self.lm.routes is not None:  # --enable-return-routed-experts: the prefix's routing goes with it
                self.lm.routes.copy_prefix(source, slot, n)
        self._prefill(batch, reused)

    def _prefill(self, batch: list[Request], reused: list[int]) -> None:
        # A request retracted by pause(mode="retract") is re-prefilled with what it generated so far.
        seqs = [self._prefill_seq(r)[p:] for r, p in zip(batch, reused)]
        width = max(len(s) for s in seqs)
        tokens = torch.zeros((len(batch), width), dtype=torch.long)
        for i, s in enumerate(seqs):
            tokens[i, : len(s)] = torch.tensor(s)
        dev = self.lm.device
        slots = torch.tensor([r.slot for r in batch], device=dev)
        if any(reused):
            hidden = self.lm.prefill_extend(tokens.to(dev), torch.tensor(reused, device=dev),
                                            torch.tensor([len(s) for s in seqs], device=dev), slots, self.cache)
        else:
            hidden = self.lm.prefill(tokens.to(dev), slots, self.cache)
        failed = []
        for i, r in enumerate(batch):
            r.kv_version = self.weights.version  # the prefix cache reuses it only under these weights
            if not r.output_ids:
                r.cached_tokens = reused[i]
            if r.return_logprob and r.input_logprobs is None:
                try:
                    self._input_logprobs(r, hidden[i], reused[i])
                except Exception as exc:  # noqa: BLE001 - its own work (out of memory): it alone fails
                    logger.exception("request %s: prompt log-probs failed", r.rid)
                    failed.append((r, exc))
        for r, exc in failed:
            self._finish(r, abort_reason(f"{ENGINE_ERROR}its prompt log-probs failed ({type(exc).__name__}: {exc})"))
        fresh = [i for i, r in enumerate(batch) if not r.output_ids and r.finish_reason is None]
        for i in [i for i in fresh if batch[i].max_new == 0]:
            self._finish(batch[i], {"type": "length", "length": 0})
        fresh = [i for i in fresh if batch[i].max_new > 0]
        if fresh:
            last = torch.tensor([len(seqs[i]) - 1 for i in fresh], device=dev)
            logits = self.lm.logits(hidden[torch.tensor(fresh, device=dev), last])
            reqs = [batch[i] for i in fresh]
            self._append(reqs, *self._sample(reqs, logits))

    def _input_logprobs(self, req: Request, hidden: torch.Tensor, offset: int) -> None:
        """Prompt log-probs from ``logprob_start_len`` (``lpx``'s conventions); ``hidden`` row ``k`` is position
        ``offset + k``."""
        n, start = len(req.input_ids), req.logprob_start_len
        if start >= n:
            req.input_logprobs, req.input_top, req.input_ids_lp = [], [], []
            return
        rows = hidden[start - offset : n - 1 - offset]
        targets = torch.tensor(req.input_ids[start + 1 : n], device=rows.device)
        values: list[float | None] = [None]
        top: list | None = [None] if req.top_logprobs_num > 0 else None
        ids: list | None = [None] if req.token_ids_logprob is not None else None
        for lo in range(0, rows.shape[0], LOGPROB_ROWS):  # a long prompt's logits never at once
            logp = torch.log_softmax(self.lm.logits(rows[lo : lo + LOGPROB_ROWS]), dim=-1)  # raw, as SGLang's
            values += logp.gather(1, targets[lo : lo + LOGPROB_ROWS, None])[:, 0].tolist()
            more_top, more_ids = lpx.extras(logp, req.top_logprobs_num, req.token_ids_logprob)
            top, ids = top and top + more_top, ids and ids + more_ids
        req.input_logprobs, req.input_top, req.input_ids_lp = values, top, ids
