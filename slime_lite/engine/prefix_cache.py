"""The embedded engine's prefix cache: a finished request's KV stays in its batch slot for the next prompt that
starts the same way.

The KV cache is one region per batch slot (``kv_cache.KVCache``). When a request leaves its slot, the slot remembers
the tokens whose K/V it holds (prompt plus generated tokens but the last). A new request is admitted into the free
slot whose remembered tokens share the longest prefix with its prompt; only the rest of the prompt is prefilled
(``CausalLM.prefill_extend``), and ``meta_info.cached_tokens`` says how many tokens were reused. With no match it
takes a slot that remembers nothing, else the least recently used one (eviction: the number of cached prefixes is
the number of free slots, so KV pressure, i.e. many running requests, leaves fewer of them). A match that would
overwrite some of its slot's tokens (a new conversation that shares a system prompt, or only a chat template's first
tokens, with a cached one) takes a slot that remembers nothing instead while there is one, else the least recently
used one unless that is the matched slot itself (written over in place), and the matched K/V is copied there
(``KVCache.copy_prefix``): both stay cached, as branches of SGLang's radix tree would, and what is given up is what
LRU eviction gives up.

Namespaces: each entry keeps the namespace of the request that left it (SGLang's ``extra_key`` and ``cache_salt``;
both absent is the default namespace), and a prompt matches only entries of its own namespace. So a client that
salts its requests shares no K/V with others, and ``cached_tokens`` tells no one else how its prompts begin.

What is cached is dropped whole (``clear``) by ``/flush_cache``, whenever the KV cache is freed, and by every
weight update: entries carry the weights' write counter (``Weights.version``), and a lookup under another counter
clears everything first, so no route that writes weights can leave stale KV behind; a request that was running
during an update (its prompt's K/V is the old weights') leaves nothing in the cache.
"""

from __future__ import annotations

import itertools
from typing import Callable, Hashable

DEFAULT_NAMESPACE = (None, None)  # (extra_key, cache_salt) of a request that sets neither


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixCache:
    """Which free slot holds the K/V of which tokens. All calls come from the model thread."""

    def __init__(self, weights_version: Callable[[], int], enabled: bool = True) -> None:
        self.enabled = enabled
        self._version = weights_version
        self._seen_version = weights_version()
        self._tokens: dict[int, list[int]] = {}  # free slot -> tokens whose K/V it holds, positions 0..len-1
        self._namespace: dict[int, Hashable] = {}  # free slot -> the namespace of the request that left it
        self._used: dict[int, int] = {}  # free slot -> last use (LRU)
        self._clock = itertools.count()
        self.hits = self.lookups = self.hit_tokens = self.prompt_tokens = 0

    def __len__(self) -> int:
        return len(self._tokens)

    @property
    def cached_tokens(self) -> int:
        # read by the HTTP thread (/get_server_info) while the model thread changes the dict: list() copies it in
        # one C call, which no other Python thread interrupts
        return sum(map(len, list(self._tokens.values())))

    def clear(self) -> None:
        self._tokens.clear()
        self._namespace.clear()
        self._used.clear()

    def _check_version(self) -> None:
        version = self._version()
        if version != self._seen_version:
            self.clear()
            self._seen_version = version

    def release(self, slot: int, tokens: list[int] | None, version: int | None = None,
                namespace: Hashable = DEFAULT_NAMESPACE) -> None:
        """``slot`` is free again and holds the K/V of ``tokens`` (None: nothing reusable) of a request of
        ``namespace``, computed under the weights' write counter ``version`` (None: the current one). K/V of other
        weights is not kept: a request that ran across a weight update holds its prompt's K/V under the old
        weights."""
        self._check_version()
        if self.enabled and tokens and version in (None, self._seen_version):
            self._tokens[slot] = list(tokens)
            self._namespace[slot] = namespace
            self._used[slot] = next(self._clock)
        else:
            self.forget(slot)

    def forget(self, slot: int) -> None:
        self._tokens.pop(slot, None)
        self._namespace.pop(slot, None)
        self._used.pop(slot, None)

    def match(self, free: list[int], prompt: list[int], limit: int,
              namespace: Hashable = DEFAULT_NAMESPACE) -> tuple[int, int, int]:
        """``(slot, reused, source)``: the free slot for ``prompt`` (of a request of ``namespace``) and how many of its
        first tokens already have K/V in slot ``source`` (at most ``limit``), from entries of that namespace only.
        ``source`` is ``slot`` unless the match would overwrite tokens cached after it and another slot is the one to
        give up (one that holds nothing, else the least recently used): then ``slot`` is that one, and the caller
        copies the ``reused`` positions from ``source`` into it. With no match: that slot to give up."""
        self._check_version()
        best, best_len = -1, 0
        if self.enabled and limit > 0:
            for slot in free:
                held = self._tokens.get(slot)
                if held and self._namespace[slot] == namespace:
                    n = min(common_prefix(held, prompt), limit)
                    if n > best_len:
                        best, best_len = slot, n
        empty = [s for s in free if s not in self._tokens]
        victim = min(empty) if empty else min(free, key=lambda s: self._used[s])
        if best >= 0 and best_len < len(self._tokens[best]) and victim != best:  # fork: both stay cached
            self._used[best] = next(self._clock)  # a prefix forked from is in use
            return victim, best_len, best
        return (best, best_len, best) if best >= 0 else (victim, 0, victim)

    def take(self, slot: int, prompt_len: int, reused: int) -> None:
        """A request got ``slot`` (from ``match``): its entry goes (the request writes over what follows)."""
        self.forget(slot)
        self.lookups += 1
        self.prompt_tokens += prompt_len
        if reused:
            self.hits += 1
            self.hit_tokens += reused
