"""``--fully-async``: generation runs continuously on the engines while the trainer trains (slime's
examples/fully_async), and each step trains on the next ``--rollout-batch-size`` prompt groups that finished.

A background loop on the rollout manager's event loop keeps prompt groups generating: up to ``--rollout-batch-size``
groups are in flight or finished and waiting, and a group taken by a rollout is replaced at once. When the engines
are slower than the trainer they never stop; when they are faster they wait for the next rollout to make room, so
the groups a step takes were started under the previous weights at the oldest (a queue twice that size kept them
two versions behind on the tiny CPU task). A weight push does not
abort anything: the driver pauses the engines between decode steps (``/pause_generation`` mode ``in_place``),
updates them, and continues (rollout/side.py); a request in flight across the push continues under the new weights,
and the engine reports the version that produced each token (``meta_info.output_token_weight_versions``, kept in
``metadata["token_weight_versions"]``).

``rollout(r)`` takes finished groups in the order they finished. A group whose oldest token is more than
``--max-weight-staleness`` K versions behind the trainer (version r while it trains rollout r) is handled by
``--max-weight-staleness-mode``: ``drop`` leaves the whole group out (GRPO needs whole groups; counted in
``rollout/async/dropped_stale_samples``) and the next finished group takes its place; ``mask`` sets ``loss_mask`` 0
on the tokens older than K versions (``rollout/async/masked_tokens``, ``masked_samples``). Every rollout logs the
lag of its samples' oldest tokens (``rollout/async/lag_mean``, ``lag_max``), the lag of its newest
(``rollout/async/newest_lag``: 0 when some tokens were sampled from the trainer's weights, which the --ci-test
train/rollout log-prob check compares), and ``rollout/weight_version``: the version the engines serve when the
rollout is taken, which a missed push leaves behind. A ``--dynamic-sampling-filter-path`` that drops every group
stops the rollout (as without --fully-async) instead of generating forever; the groups it drops, and those an
engine cut short, are counted in the next rollout's metrics, the ones dropped while the trainer trained included.

Checkpoints keep every prompt: the finished groups waiting are saved as they are (a resumed run trains them, with
their versions), the groups in flight are saved as their fresh prompts and generated again from the start. They
keep the next sample index too (each sample's sampling seed is derived from its index, unique over the run): a
resumed run numbers its samples on from it and never repeats a seed of the run it resumes.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from slime_lite.engine_client import request_json
from slime_lite.errors import SlimeLiteError
from slime_lite.rollout import dumps
from slime_lite.rollout.generate import sampling_params, seed_base
from slime_lite.rollout.oversample import MAX_SUBMITS, complete
from slime_lite.rollout.turns import mask_older
from slime_lite.types import ENGINE_CUTS, TOKEN_VERSIONS, Sample, oldest_version, version_number

log = logging.getLogger(__name__)
_UNVERSIONED: list[bool] = []  # warned once per process
MAX_CUT = 3  # a group the engines cut short this many times is dropped (they refuse it), not regenerated
CUTS = ENGINE_CUTS  # metadata: the times the engines cut the sample's group short before


def token_versions(sample: Sample) -> list[int]:
    """The weight version of each response token (the oldest request's version for all of them when none was
    recorded per token)."""
    versions = sample.metadata.get(TOKEN_VERSIONS)
    if versions:
        return list(versions)
    if sample.weight_versions and sample.response_length:
        return [oldest_version(sample)] * sample.response_length
    return []


def apply_staleness(groups: list[list[Sample]], trainer_version: int, max_staleness: int | None,
                    mode: str) -> tuple[list[list[Sample]], dict[str, float]]:
    """The groups to train at ``trainer_version`` under ``--max-weight-staleness`` / ``-mode``, and the counts."""
    kept: list[list[Sample]] = []
    dropped = masked_tokens = masked_samples = 0
    oldest_bound = None if max_staleness is None else trainer_version - max_staleness
    for group in groups:
        versions = [token_versions(s) for s in group]
        if max_staleness is not None and not _UNVERSIONED and any(s.response_length and not v
                                                                  for s, v in zip(group, versions)):
            _UNVERSIONED.append(True)
            log.warning("--max-weight-staleness %d: a sample carries no weight version (a generate hook that records "
                        "no meta_info.weight_version), so the bound cannot apply to it (logged once)", max_staleness)
        stale = oldest_bound is not None and any(v and min(v) < oldest_bound for v in versions)
        if stale and mode == "drop":
            dropped += len(group)
            continue
        if stale:
            for s, v in zip(group, versions):
                if v and min(v) < oldest_bound:
                    out = mask_older(s, v, oldest_bound)  # not tool tokens (0 already)
                    masked_tokens += out
                    masked_samples += out > 0
        kept.append(group)
    return kept, {"rollout/async/dropped_stale_samples": float(dropped),
                  "rollout/async/masked_tokens": float(masked_tokens),
                  "rollout/async/masked_samples": float(masked_samples)}


def lag_metrics(samples: list[Sample], trainer_version: int) -> dict[str, float]:
    versions = [v for v in (token_versions(s) for s in samples) if v]
    if not versions:
        return {}
    lags = [trainer_version - min(v) for v in versions]
    return {"rollout/async/lag_mean": sum(lags) / len(lags), "rollout/async/lag_max": float(max(lags)),
            "rollout/async/newest_lag": float(trainer_version - max(max(v) for v in versions))}


class FullyAsyncWorker:
    """The background generation loop (started by the first ``rollout``) and the finished groups it queues."""

    def __init__(self, gen: Any, source: Any) -> None:
        self.gen, self.source, self.config = gen, source, gen.config
        self.capacity = self.config.rollout_batch_size  # groups in flight + finished and waiting
        self.pending: list[list[Sample]] = []  # from a checkpoint: they go first
        self.finished: list[list[Sample]] = []
        self.in_flight: dict[asyncio.Future, list[dict[str, Any]]] = {}  # task -> its group as sent (plain)
        self.task: asyncio.Task | None = None
        self.room: asyncio.Event | None = None  # set when a rollout took groups: the loop refills
        self.arrived: asyncio.Event | None = None  # set when a group finished: a waiting rollout looks again
        self.next_index = 0
        self.filtered = self.failed = self.refused = 0
        self.logged = (0, 0, 0)  # self.filtered, self.failed, self.refused as the last rollout's metrics saw them

    def load_state(self, groups: list[list[dict[str, Any]]], next_index: int | None = None) -> None:
        """Groups of a checkpoint: the finished ones wait to be trained first, in the order they finished; the
        others (saved as their prompts; or aborted, from a --partial-rollout run's checkpoint: continued) are
        generated again. ``next_index``: the saved run's next sample index, so the resumed run's samples (and
        their sampling seeds) follow on from it; a checkpoint without it (saved before it was kept) continues
        after the highest index of its groups, the newest the saved run had sent."""
        loaded = [[Sample.from_dict(d) for d in g] for g in groups]
        done = [complete(g) for g in loaded]
        self.finished = [g for g, d in zip(loaded, done) if d]
        self.pending = [g for g, d in zip(loaded, done) if not d]
        if next_index is None:
            next_index = max((s.index + 1 for g in loaded for s in g if s.index is not None), default=0)
        self.next_index = int(next_index)

    async def state(self) -> dict[str, Any]:
        """The prompt cursor, every group taken from it but not trained yet, and the next sample index (run on the
        event loop, so the background loop does not move in between)."""
        carried = [[dumps.plain_sample(s) for s in g] for g in self.pending + self.finished]
        carried += list(self.in_flight.values())
        return {"source": self.source.state() if self.source else None, "carried": carried,
                "next_index": self.next_index}

    def _next_group(self) -> list[Sample]:
        if self.pending:
            group = self.pending.pop(0)
        else:
            group = self.gen.new_group(self.source.next_batch(1)[0], 0)
        for s in group:  # unique sampling seeds over the run
            s.index = self.next_index
            self.next_index += 1
        return group

    async def _loop(self) -> None:
        params = sampling_params(self.config)
        base = seed_base(self.config.rollout_seed, 500_009)
        while True:
            while len(self.in_flight) + len(self.finished) < self.capacity:
                group = self._next_group()
                sent = [dumps.plain_sample(s) for s in group]
                self.in_flight[asyncio.ensure_future(self.gen.over._run(group, params, base))] = sent
            self.room.clear()
            waiter = asyncio.ensure_future(self.room.wait())  # full: a rollout takes some
            done, _ = await asyncio.wait([*self.in_flight, waiter], return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            done.discard(waiter)
            for task in done:
                sent = self.in_flight.pop(task)
                group = task.result()  # an error (a hook's, the engines') ends the loop: rollout() raises it
                if not complete(group):  # cut short by an engine (nothing here aborts): never trained
                    cuts = sent[0]["metadata"].get(CUTS, 0) + 1  # this group's, kept through the re-queues
                    if cuts >= MAX_CUT:  # the engines refuse it (e.g. its input): not forever
                        self.refused += 1
                        log.warning("--fully-async: the engines cut the group of prompt %s short %d times: dropped",
                                    group[0].metadata.get("prompt_index"), MAX_CUT)
                        continue
                    self.failed += 1
                    log.warning("--fully-async: a group came back unfinished (an engine error); generating its "
                                "prompt again")
                    self.pending.append([Sample.from_dict({**d, "metadata": {**d["metadata"], CUTS: cuts}})
                                         for d in sent])
                    continue
                if self.gen.filter_fn is not None and not self.gen.filter_fn(self.gen.args, group).keep:
                    self.filtered += 1
                else:
                    self.finished.append(group)
            if done:
                self.arrived.set()

    def _start(self) -> None:
        if self.task is None:
            self.room, self.arrived = asyncio.Event(), asyncio.Event()
            self.task = asyncio.ensure_future(self._loop())

    async def _wait(self) -> None:
        self.arrived.clear()
        waiter = asyncio.ensure_future(self.arrived.wait())
        await asyncio.wait([waiter, self.task], return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        if self.task.done():
            self.task.result()  # raises the loop's error
            raise RuntimeError("the --fully-async generation loop stopped")

    async def rollout(self, rollout_id: int) -> tuple[list[Sample], dict[str, float]]:
        """The next ``--rollout-batch-size`` finished groups for rollout ``rollout_id`` (trainer version
        ``rollout_id``), after the staleness bound; generation goes on meanwhile."""
        a = self.config
        self._start()
        versions = await self._engine_versions()  # what the pushes so far left on the engines
        engine_version = min(versions) if versions else None
        bound = None if a.max_weight_staleness is None else rollout_id - a.max_weight_staleness
        if bound is not None and versions and max(versions) < bound:
            lost = ("dropped" if a.max_weight_staleness_mode == "drop" else
                    "masked (--max-weight-staleness-mode mask: a rollout that trains nothing)")
            raise SlimeLiteError(
                f"--fully-async rollout {rollout_id}: every engine serves weight version {max(versions)} or older, "
                f"more than --max-weight-staleness {a.max_weight_staleness} behind the trainer's {rollout_id}, so "
                f"every group they generate would be {lost}: the weight push did not reach the engines (or "
                "--update-weights-interval pushes less often than the bound allows).")
        kept: list[list[Sample]] = []
        stats = {"rollout/async/dropped_stale_samples": 0.0, "rollout/async/masked_tokens": 0.0,
                 "rollout/async/masked_samples": 0.0}
        lost0, stale = self.filtered + self.refused, 0
        self.gen.progress = [0, a.rollout_batch_size * a.n_samples_per_prompt]
        while len(kept) < a.rollout_batch_size:
            while not self.finished:
                await self._wait()
                lost = self.filtered + self.refused - lost0 + stale
                if lost > MAX_SUBMITS * a.rollout_batch_size:  # as over-sampling: not forever
                    raise SlimeLiteError(
                        f"--fully-async rollout {rollout_id}: only {len(kept)} of --rollout-batch-size "
                        f"{a.rollout_batch_size} groups kept after {lost} groups were dropped by "
                        "--dynamic-sampling-filter-path, refused by the engines or dropped as staler than "
                        "--max-weight-staleness: the filter is too strict for this model/data, the engines abort "
                        "requests, or the weight pushes do not reach some engines.")
            take, self.finished = self.finished[: a.rollout_batch_size - len(kept)], \
                self.finished[a.rollout_batch_size - len(kept):]
            self.room.set()
            groups, counts = apply_staleness(take, rollout_id, a.max_weight_staleness, a.max_weight_staleness_mode)
            stale += len(take) - len(groups)
            kept += groups
            for k, v in counts.items():
                stats[k] += v
            self.gen.progress[0] = sum(len(g) for g in kept)
        samples = []
        for gi, group in enumerate(kept):
            for s in group:
                s.group_index, s.index = gi, len(samples)
                samples.append(s)
        stats.update(lag_metrics(samples, rollout_id))
        await asyncio.sleep(0.01)  # the background loop refills what this take freed: the groups generating now
        stats["rollout/async/queued_groups"] = float(len(self.finished))
        stats["rollout/async/in_flight_groups"] = float(len(self.in_flight))
        # since the last rollout's metrics: the loop generates (and drops) while the trainer trains, too
        stats["rollout/async/regenerated_groups"] = float(self.failed - self.logged[1])
        stats["rollout/async/refused_groups"] = float(self.refused - self.logged[2])
        if self.gen.filter_fn is not None:
            stats["rollout/dynamic_filter/dropped_groups"] = float(self.filtered - self.logged[0])
        self.logged = (self.filtered, self.failed, self.refused)
        self.gen.over.requested.clear()  # the over-sampler's per-rollout record, unused here
        if engine_version is not None:
            stats["rollout/weight_version"] = float(engine_version)
        return samples, stats

    async def _engine_versions(self) -> list[int]:
        """The weight version each engine serves now (asked of each engine, not of a router)."""
        infos = await asyncio.gather(*(asyncio.to_thread(request_json, u, "/get_model_info", timeout=30.0,
                                                         method="GET") for u in self.gen.over.engine_urls()))
        return [version_number(str(i.get("weight_version"))) for i in infos if isinstance(i, dict)]

    async def stop(self) -> None:
        """End the loop and the requests it has in flight."""
        tasks = ([self.task] if self.task is not None else []) + list(self.in_flight)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
