"""The embedded engine's decode steps: launching them, reading their tokens back, and chaining them.

The scheduler owns the requests and their slots; it asks the pipeline for one decode step over the running batch
(``{slot: Request}``) at a time. A step is one of:

- dynamic: the batch's own shapes (no ``PaddedDecoder``, or more running slots than its ``max_bs``); its tokens are read
  at once, drawn by the scheduler's sampler;
- padded, general sampler: some row truncates (top-k/p, min-p), bans tokens (``min_new_tokens``), has a logit bias
  or asks for other tokens' log-probs (``Request.host_sampled``); the step's logits go to the scheduler's sampler;
- padded, sampled in the step (every row plain): its tokens are read one step late. The step stays in flight
  while the next one is launched, chained to its draws on the device (same slots, no request at its last token),
  so the host's bookkeeping of one step overlaps the GPU's work on the next; a request that finishes meanwhile
  drops its extra token (``collect`` keeps only tokens of requests still running in their slot).

The scheduler's decode is ``if not chains(running): collect(running)`` then ``launch(running)``; it collects before
anything else that needs no step in flight (admission, calls) and ``drop``s the step on an abort.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from slime_lite.engine.cuda_graph import PaddedDecoder, StepInputs, Ticket
from slime_lite.engine.kv_cache import KVCache
from slime_lite.engine.model import CausalLM
from slime_lite.engine.request import Request
from slime_lite.engine.sampling import uniforms

# requests and the token and log-prob each drew (and, from the general sampler, their top / token-id log-probs)
Drawn = tuple
Sampler = Callable[[list[Request], torch.Tensor], tuple]  # (requests, float32 logits) -> tokens, log-probs, extras


@dataclass
class _InFlight:
    reqs: list[Request]
    ticket: Ticket


class DecodePipeline:
    """Launches decode steps over the running batch and reads their tokens; at most one step is in flight."""

    def __init__(self, lm: CausalLM, cache: KVCache, decoder: PaddedDecoder | None, sample: Sampler) -> None:
        self.lm, self.cache, self.decoder, self.sample = lm, cache, decoder, sample
        self._in_flight: _InFlight | None = None

    @property
    def in_flight(self) -> bool:
        """A padded step was launched and its tokens were not read yet."""
        return self._in_flight is not None

    @property
    def holds_cache(self) -> bool:
        """Captured CUDA graphs hold the KV cache's address: it stays allocated (at its flag-given size)."""
        return self.decoder is not None and bool(self.decoder.graphs)

    def free_cache(self) -> None:
        """Free the KV cache, with the graphs and buffers that hold it (with no step in flight)."""
        if self.decoder is not None:
            self.decoder.reset()
        self.cache.free()

    def chains(self, running: dict[int, Request]) -> bool:
        """Whether the next step can be launched before the step in flight is read: the same slots, every row
        samples in the step, and no request is at its last token in the step in flight."""
        if self._in_flight is None:
            return False
        slots = sorted(running)
        if self._in_flight.ticket.slots != slots:
            return False
        reqs = [running[s] for s in slots]
        return self._fused(reqs, lag=1) and all(len(r.output_ids) + 1 < r.max_new for r in reqs)

    def launch(self, running: dict[int, Request]) -> Drawn:
        """Launch one step over ``running``; return the tokens ready now: this step's (dynamic, general sampler),
        the previous step's (chained), or none. With a step in flight, call it only when ``chains(running)``."""
        slots = sorted(running)
        reqs = [running[s] for s in slots]
        if self.decoder is None or len(slots) > self.decoder.max_bs:
            return self._dynamic(slots, reqs)
        chain = self._in_flight is not None
        lag = int(chain)  # tokens drawn by the step in flight, not appended yet
        fused = chain or self._fused(reqs, lag)
        params = [r.params for r in reqs]
        inputs = StepInputs(
            token=[0 if chain else r.output_ids[-1] for r in reqs],
            position=[len(r.input_ids) + len(r.output_ids) - 1 + lag for r in reqs],
            temperature=[1.0 if p.greedy else p.temperature for p in params],
            uniform=uniforms([r.seed for r in reqs], [len(r.output_ids) + lag for r in reqs]) if fused
            else [0.0] * len(reqs),
            greedy=[p.greedy for p in params])
        ticket = self.decoder.run(slots, inputs, chain=chain)
        if not fused:
            return (reqs, *self.sample(reqs, self.decoder.logits()))
        drawn = self.collect(running)  # the chained-to step's tokens, read after this step is launched
        self._in_flight = _InFlight(reqs, ticket)
        return drawn

    def collect(self, running: dict[int, Request]) -> Drawn:
        """The tokens of the step in flight (none if none is), for the requests still running in their slot."""
        f, self._in_flight = self._in_flight, None
        if f is None:
            return [], [], []
        tokens, logprobs = self.decoder.sampled(f.ticket)
        keep = [i for i, (s, r) in enumerate(zip(f.ticket.slots, f.reqs)) if running.get(s) is r]
        return [f.reqs[i] for i in keep], [tokens[i] for i in keep], [logprobs[i] for i in keep]

    def drop(self) -> None:
        """Forget the step in flight (an abort): wait for it, so nothing runs on after; a failed step's error (raised
        again here) is dropped with it."""
        f, self._in_flight = self._in_flight, None
        if f is not None and f.ticket.done is not None:
            try:
                f.ticket.done.synchronize()
            except Exception:  # noqa: BLE001
                pass

    @staticmethod
    def _fused(reqs: list[Request], lag: int) -> bool:
        """Every row can be drawn by the sampler inside the step: no truncation, no banned tokens (``min_new_tokens``)
        at the step's token index (``lag`` tokens after those appended)."""
        return not any(r.host_sampled or len(r.output_ids) + lag < r.params.min_new_tokens for r in reqs)

    def _dynamic(self, slots: list[int], reqs: list[Request]) -> Drawn:
        dev = self.lm.device
        pos = [len(r.input_ids) + len(r.output_ids) - 1 for r in reqs]
        tokens = torch.tensor([r.output_ids[-1] for r in reqs], device=dev)
        contiguous = slots[-1] - slots[0] + 1 == len(slots)
        hidden = self.lm.decode(tokens, torch.tensor(pos, device=dev), torch.tensor(slots, device=dev), self.cache,
                                kv_len=max(pos) + 1, slot_range=(slots[0], slots[-1] + 1) if contiguous else None,
                                same_length=min(pos) == max(pos))
        return (reqs, *self.sample(reqs, self.lm.logits(hidden)))
