"""--fully-async without Ray: the background loop of the real Generator against a real in-process engine (tiny
model) across a weight push that lands while groups generate, the --max-weight-staleness bound (drop and mask), a
checkpoint that loses no prompt, and the flags refused before Ray starts."""

from __future__ import annotations

import asyncio
import sys
from types import SimpleNamespace
from pathlib import Path

import pytest

from slime_lite.args import parse_args, parser_defaults
from slime_lite.engine_client import AsyncEngineClient
from slime_lite.errors import SlimeLiteError
from slime_lite.rollout.data import Prompt, PromptSource
from slime_lite.rollout.fully_async import FullyAsyncWorker, apply_staleness, lag_metrics
from slime_lite.rollout.generate import Generator
from slime_lite.rollout.oversample import OverSampler
from slime_lite.tokenizer import load_tokenizer
from slime_lite.types import TOKEN_VERSIONS, Sample

sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))
from engine_helpers import http, start_engine  # noqa: E402


def sample(versions: list[int]) -> Sample:
    return Sample(response_length=len(versions), loss_mask=[1] * len(versions),
                  metadata={TOKEN_VERSIONS: list(versions)})


def test_staleness_drop_leaves_out_whole_groups_and_mask_zeroes_only_old_tokens():
    fresh, old = [sample([3, 3]), sample([2, 3])], [sample([1, 2, 3]), sample([3])]
    kept, counts = apply_staleness([fresh, old], trainer_version=3, max_staleness=1, mode="drop")
    assert kept == [fresh] and counts["rollout/async/dropped_stale_samples"] == 2.0  # the whole group: GRPO
    fresh, old = [sample([3, 3]), sample([2, 3])], [sample([1, 2, 3]), sample([3])]
    kept, counts = apply_staleness([fresh, old], trainer_version=3, max_staleness=1, mode="mask")
    assert kept == [fresh, old] and old[0].loss_mask == [0, 1, 1] and old[1].loss_mask == [1]
    assert counts["rollout/async/masked_tokens"] == 1.0 and counts["rollout/async/masked_samples"] == 1.0
    assert fresh[1].loss_mask == [1, 1]  # 1 behind: within the bound
    kept, counts = apply_staleness([old], trainer_version=9, max_staleness=None, mode="drop")  # no bound
    assert kept == [old] and counts["rollout/async/dropped_stale_samples"] == 0.0
    assert lag_metrics([sample([1, 2]), sample([3])], 3) == {
        "rollout/async/lag_mean": 1.0, "rollout/async/lag_max": 2.0, "rollout/async/newest_lag": 0.0}


BASE = ["--hf-checkpoint", "m", "--prompt-data", "p.jsonl"]


@pytest.mark.parametrize("extra, says", [
    (["--fully-async", "--max-weight-staleness", "-1"], None),  # argparse: names the flag, exit 2
    (["--max-weight-staleness", "2"], "only --fully-async does"),
    (["--fully-async", "--max-weight-staleness-mode", "mask"], "--max-weight-staleness-mode mask has no effect"),
    # the advice names every flag the run needs: following it is not refused again
    (["--max-weight-staleness-mode", "mask"], "add --fully-async and add --max-weight-staleness K"),
    (["--async", "--max-policy-version-lag", "1"], "drop --async and add --fully-async"),
    (["--fully-async", "--colocate"], "--fully-async: --colocate"),
    (["--fully-async", "--debug-train-only"], "--debug-train-only"),
    (["--fully-async", "--debug-rollout-only"], "--debug-rollout-only"),
    (["--fully-async", "--deterministic-mode"], "--deterministic-mode"),
    (["--fully-async", "--async"], "drop --async"),
    (["--fully-async", "--rollout-function-path", "m.f"], "--rollout-function-path m.f"),
    # a LoRA push unloads the old adapter, which SGLang holds for the requests the push keeps paused: a hang
    (["--fully-async", "--lora-rank", "8", "--rollout-backend", "sglang"], "--fully-async: --lora-rank on SGLang"),
])
def test_bad_fully_async_flags_are_refused_before_ray_starts(extra, says, capsys):
    if says is None:
        with pytest.raises(SystemExit):
            parse_args(BASE + extra)
        assert "--max-weight-staleness/--max-policy-version-lag: must be >= 0, got -1" in capsys.readouterr().err
        return
    with pytest.raises(SlimeLiteError) as exc:
        parse_args(BASE + extra)
    assert says in str(exc.value)


def test_groups_generate_across_a_push_and_a_checkpoint_loses_no_prompt(tiny_model_dir):
    server = start_engine(tiny_model_dir, max_running_requests=4)
    tokenizer = load_tokenizer(str(tiny_model_dir))
    prompts = [Prompt(i, f"{i}+1=", "3", {}) for i in range(40)]
    args = parser_defaults(hf_checkpoint=str(tiny_model_dir), rm_type="addition", fully_async=True,
                           rollout_batch_size=2, n_samples_per_prompt=2, rollout_max_response_len=48,
                           max_weight_staleness=0, max_weight_staleness_mode="mask")

    def push(version: str) -> None:  # what the driver does (rollout/side.py), the same weights as a new version
        assert http(server.url, "/pause_generation", {"mode": "retract"})[0] == 200
        http(server.url, "/update_weights_from_disk", {"model_path": str(tiny_model_dir), "weight_version": version})
        assert http(server.url, "/continue_generation", {})[0] == 200

    async def run():
        http(server.url, "/update_weights_from_disk", {"model_path": str(tiny_model_dir), "weight_version": "0"})
        client = AsyncEngineClient([server.url], timeout=60)
        source = PromptSource(prompts, shuffle=False, seed=0)
        worker = FullyAsyncWorker(Generator(args, tokenizer, client), source)
        try:
            samples0, m0 = await worker.rollout(0)
            await asyncio.to_thread(push, "1")
            samples1, m1 = await worker.rollout(1)
            while not worker.finished:  # a group finished and waits for the next rollout
                await asyncio.sleep(0.01)
            state = await worker.state()
            await worker.stop()
            # resumed from that checkpoint: the finished groups it kept are trained first, as they were
            source = PromptSource(prompts, shuffle=False, seed=0)
            source.load_state(state["source"])
            worker = FullyAsyncWorker(Generator(args, tokenizer, client), source)
            worker.load_state(state["carried"])
            resumed, _ = await worker.rollout(1)
        finally:
            await worker.stop()
            await client.close()
        return samples0, m0, samples1, m1, state, resumed

    try:
        samples0, m0, samples1, m1, state, resumed = asyncio.run(run())
    finally:
        server.stop()
    assert len(samples0) == len(samples1) == 4 and m0["rollout/weight_version"] == 0 == m0["rollout/async/lag_max"]
    assert m1["rollout/weight_version"] == 1
    # --ci-test reads that version: a push that never reached the engine is caught at the next rollout
    from slime_lite.checks.ci import rollout_checks
    from slime_lite.config import CiConfig

    cfg = CiConfig.from_args(parser_defaults(hf_checkpoint=str(tiny_model_dir), ci_test=True))
    def served(record: dict) -> bool:
        return next(c for c in rollout_checks(cfg, record, False, 1) if c.name == "weight_version_served").passed

    assert served(m1) and not served(m0)  # m0: the engine still on version 0 at rollout 1
    for s in samples0 + samples1:
        assert len(s.metadata[TOKEN_VERSIONS]) == s.response_length == len(s.loss_mask)
    # mask with K = 0 at rollout 1: exactly the tokens of version 0 are out of the loss
    for s in samples1:
        assert s.loss_mask == [int(v == 1) for v in s.metadata[TOKEN_VERSIONS]]
    assert m1["rollout/async/masked_tokens"] == sum(v == 0 for s in samples1 for v in s.metadata[TOKEN_VERSIONS])
    # every prompt drawn from the source so far is trained or in the checkpoint, none twice
    trained = [s.metadata["prompt_index"] for s in samples0 + samples1][::2]
    carried = [g[0]["metadata"]["prompt_index"] for g in state["carried"]]
    assert carried and sorted(trained + carried) == list(range(state["source"]["offset"]))
    finished = [g for g in state["carried"] if all(d["status"] != "pending" for d in g)]
    assert finished  # saved as they are; the groups in flight, as their prompts (no response)
    assert all(d["response_length"] == 0 for g in state["carried"] if g not in finished for d in g)
    for group, d in zip([resumed[i:i + 2] for i in range(0, 4, 2)], finished):
        assert [s.tokens for s in group] == [x["tokens"] for x in d]


def test_a_checkpoints_unfinished_groups_are_generated_again_not_trained():
    """load_state: a group is trained as it is only once every sample finished (complete(): an ABORTED sample, e.g.
    carried by --partial-rollout in the run that saved it, is continued; a hook's sample with a reward and no
    status is finished)."""

    from slime_lite.types import Status

    def group(status, reward):
        return [Sample(index=j, tokens=[5, 6, 7], response_length=1, loss_mask=[1], status=status,
                       reward=reward).to_dict() for j in range(2)]

    worker = FullyAsyncWorker(SimpleNamespace(config=SimpleNamespace(rollout_batch_size=2)), None)
    worker.load_state([group(Status.ABORTED, None), group(Status.COMPLETED, 1.0), group(Status.PENDING, 0.0),
                       group(Status.PENDING, None)])
    assert [g[0].status for g in worker.finished] == [Status.COMPLETED, Status.PENDING]
    assert [(g[0].status, g[0].response_length) for g in worker.pending] == [(Status.ABORTED, 1), (Status.PENDING, 1)]


def filtered_worker(tiny_model_dir, kinds: str, filter_path: str) -> FullyAsyncWorker:
    """A worker over test_oversample's FAKE engine (prompts of ``kinds``) with a dynamic-sampling filter; the
    engines serve version 0."""
    from tests.rollout.test_oversample import make

    gen, source, _ = make(load_tokenizer(str(tiny_model_dir)), tiny_model_dir, kinds, fully_async=True,
                          over_sampling_batch_size=None, dynamic_sampling_filter_path=filter_path)
    worker = FullyAsyncWorker(gen, source)

    async def engine_versions():
        return [0]

    worker._engine_versions = engine_versions
    return worker


def test_a_filter_that_keeps_nothing_stops_a_fully_async_rollout_naming_it(tiny_model_dir):
    """As without --fully-async (rollout/oversample.py MAX_SUBMITS): the run stops with the flag named instead of
    generating forever (the FAKE engine of test_oversample; its samples agree: zero reward std)."""
    worker = filtered_worker(tiny_model_dir, "s" * 8, "slime_lite.rollout.filters.check_reward_nonzero_std")

    async def run():
        try:
            await asyncio.wait_for(worker.rollout(0), timeout=30)  # before the fix: forever
        finally:
            await worker.stop()

    with pytest.raises(SlimeLiteError, match=r"--fully-async rollout 0: only 0 of --rollout-batch-size 2 groups "
                                             r"kept .* --dynamic-sampling-filter-path"):
        asyncio.run(run())


def test_groups_dropped_while_the_trainer_trains_are_counted_in_the_next_rollout(tiny_model_dir):
    """The loop generates (and the filter drops) between two rollouts too: every drop is in some rollout's
    rollout/dynamic_filter/dropped_groups, once."""
    worker = filtered_worker(tiny_model_dir, "s" * 16, "tests.rollout.test_oversample.odd_prompts")

    async def run():
        try:
            _, m0 = await worker.rollout(0)
            await asyncio.sleep(0.3)  # "training": the loop refills, dropping the even prompts
            between = worker.filtered
            _, m1 = await worker.rollout(1)
            return m0, m1, between, worker.filtered
        finally:
            await worker.stop()

    m0, m1, between, total = asyncio.run(run())
    assert between > m0["rollout/dynamic_filter/dropped_groups"]  # some were dropped between the rollouts
    assert m0["rollout/dynamic_filter/dropped_groups"] + m1["rollout/dynamic_filter/dropped_groups"] == total


def test_a_group_the_engines_keep_cutting_short_is_dropped_after_a_few_tries_not_regenerated_forever(tiny_model_dir):
    """An engine that refuses one prompt (aborts it at once, every time; the FAKE engine of test_oversample): the
    loop generates its group again MAX_CUT times, then drops it and counts it; the other prompts train."""
    from slime_lite.rollout.fully_async import MAX_CUT
    from tests.rollout.test_oversample import make

    tok = load_tokenizer(str(tiny_model_dir))
    gen, source, engine = make(tok, tiny_model_dir, "s" * 16, fully_async=True, over_sampling_batch_size=None)
    refused = tok("As=?", add_special_tokens=False)["input_ids"][0]
    served, asked = engine._one, []

    async def one(ids, params):
        if ids[0] != refused:
            return await served(ids, params)
        asked.append(ids)
        await asyncio.sleep(0.01)
        return {"text": "", "output_ids": [], "meta_info": {"finish_reason": {"type": "abort", "message": "refused"},
                                                            "weight_version": "0", "output_token_logprobs": []}}

    engine._one = one
    worker = FullyAsyncWorker(gen, source)

    async def engine_versions():
        return [0]

    worker._engine_versions = engine_versions

    async def run():
        try:
            out = [await worker.rollout(r) for r in range(3)]
            return out
        finally:
            await worker.stop()

    out = asyncio.run(run())
    trained = {s.metadata["prompt_index"] for samples, _ in out for s in samples}
    assert 0 not in trained and len(trained) == 6
    assert sum(m["rollout/async/refused_groups"] for _, m in out) == 1.0
    assert sum(m["rollout/async/regenerated_groups"] for _, m in out) == MAX_CUT - 1  # not the refused one
    assert len(asked) == MAX_CUT * 2  # its two samples, MAX_CUT times, then no more


def test_staleness_mask_counts_only_the_tokens_it_takes_out_of_the_loss():
    """A multi-turn sample's tool tokens are out of the loss already: masking them again is not counted."""
    tool = sample([1, 1, 3])
    tool.loss_mask = [0, 1, 1]  # token 0: a tool's output
    only_tool = sample([1, 3])
    only_tool.loss_mask = [0, 1]
    kept, counts = apply_staleness([[tool, only_tool]], trainer_version=3, max_staleness=1, mode="mask")
    assert tool.loss_mask == [0, 0, 1] and only_tool.loss_mask == [0, 1]
    assert counts["rollout/async/masked_tokens"] == 1.0 and counts["rollout/async/masked_samples"] == 1.0


def test_a_staleness_bound_over_samples_without_versions_says_it_cannot_apply(caplog, monkeypatch):
    """A generate hook that records no weight version: the bound cannot judge its samples; the run says so (once)
    instead of keeping them silently."""
    import slime_lite.rollout.fully_async as fa

    monkeypatch.setattr(fa, "_UNVERSIONED", [])
    bare = Sample(response_length=2, loss_mask=[1, 1])
    kept, counts = apply_staleness([[bare], [sample([0, 0])]], trainer_version=3, max_staleness=1, mode="drop")
    assert kept == [[bare]] and counts["rollout/async/dropped_stale_samples"] == 1.0
    assert caplog.text.count("carries no weight version") == 1
    apply_staleness([[Sample(response_length=1)]], trainer_version=3, max_staleness=1, mode="drop")
    assert caplog.text.count("carries no weight version") == 1  # once


def seed_recorder(worker: FullyAsyncWorker) -> list[int]:
    """The sampling seed of every request the worker's (FAKE) engine gets, in order."""
    engine, seeds = worker.gen.args.engine_client, []
    inner = engine.generate

    async def generate(body: dict):
        params = body["sampling_params"]
        seeds.extend(p["sampling_seed"] for p in (params if isinstance(params, list) else [params]))
        return await inner(body)

    engine.generate = generate
    return seeds


def test_a_resumed_run_never_repeats_a_sampling_seed(tiny_model_dir, tmp_path):
    """The checkpoint (the rollout manager's state, through a weights_only load) keeps the next sample index: a
    resumed run numbers its new samples on from it, so its sampling seeds differ from every seed the run it resumes
    sent (before the fix it started again at index 0: the same seeds, and sample indices, as the first run)."""
    from types import SimpleNamespace

    import torch

    from slime_lite.rollout.manager import RolloutManager

    def manager_with(worker: FullyAsyncWorker) -> RolloutManager:
        manager = RolloutManager(worker.gen.args._flags, [])
        manager.generator, manager.source, manager.worker = worker.gen, worker.source, worker
        return manager

    def stop(manager: RolloutManager) -> None:  # the loop, its requests, and what they waited on
        manager._run(manager.worker.stop())
        rest = asyncio.all_tasks(manager.loop)
        for task in rest:
            task.cancel()
        manager.loop.run_until_complete(asyncio.gather(*rest, return_exceptions=True))

    worker = filtered_worker(tiny_model_dir, "s" * 16, None)
    first = seed_recorder(worker)
    manager = manager_with(worker)
    manager.generate(0)
    torch.save(manager.state(), tmp_path / "state.pt")
    stop(manager)
    state = torch.load(tmp_path / "state.pt", weights_only=True)

    resumed = filtered_worker(tiny_model_dir, "s" * 16, None)
    again = seed_recorder(resumed)
    manager2 = manager_with(resumed)
    manager2.load_state(state)
    manager2.generate(1)
    stop(manager2)
    assert first and again and not set(first) & set(again), sorted(set(first) & set(again))
    assert state["next_index"] == worker.next_index > 4  # the rollout's groups and the ones queued behind them
    assert min(again) == min(first) + state["next_index"]  # numbered on from the saved run's next index
    # a checkpoint saved without the index: the resumed run goes on after the newest index of its groups
    old = FullyAsyncWorker(SimpleNamespace(config=SimpleNamespace(rollout_batch_size=2)), None)
    old.load_state(state["carried"])
    assert old.next_index == state["next_index"]


def test_the_served_version_is_asked_of_every_engine_not_of_the_router():
    """Behind --use-sglang-router the client knows the router's URL only; the oldest served version (what
    --ci-test's weight_version_served checks) comes from each engine's /get_model_info (FAKE engines: two HTTP
    servers answering it, one a push behind, and a router that answers like the first)."""
    import json as _json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    def serve(version):
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                body = _json.dumps({"weight_version": version}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return server, f"http://127.0.0.1:{server.server_address[1]}"

    servers = [serve(v) for v in ("3", "2", "3")]
    router, engines = servers[0][1], [servers[1][1], servers[2][1]]
    try:
        gen = SimpleNamespace(client=SimpleNamespace(urls=[router]), config=SimpleNamespace(rollout_batch_size=2))
        gen.over = OverSampler(gen)
        gen.over.abort_urls = engines  # as the rollout manager sets them
        worker = FullyAsyncWorker(gen, None)
        assert sorted(asyncio.run(worker._engine_versions())) == [2, 3]  # the router alone says 3: a missed push
        # unseen
    finally:
        for server, _ in servers:
            server.shutdown()


def stale_worker(tiny_model_dir, served: list[int], **flags) -> FullyAsyncWorker:
    """A worker over test_oversample's FAKE engine, which generates at weight version 0 (no push reaches it), while
    ``/get_model_info`` is made to report ``served``."""
    from tests.rollout.test_oversample import make

    gen, source, _ = make(load_tokenizer(str(tiny_model_dir)), tiny_model_dir, "s" * 16, fully_async=True,
                          over_sampling_batch_size=None, **flags)
    worker = FullyAsyncWorker(gen, source)

    async def engine_versions():
        await asyncio.sleep(0.02)  # as the HTTP calls: the loop sends meanwhile
        return list(served)

    worker._engine_versions = engine_versions
    return worker


def run_rollouts(worker, ids):
    async def run():
        try:
            return [await asyncio.wait_for(worker.rollout(r), timeout=60) for r in ids]  # before the fix: forever
        finally:
            await worker.stop()

    return asyncio.run(run())


@pytest.mark.parametrize("mode, lost", [("drop", "dropped"), ("mask", "masked")])
def test_engines_too_stale_for_the_bound_stop_the_rollout_naming_the_push(tiny_model_dir, mode, lost):
    """--max-weight-staleness 0 with every engine still at version 0 while the trainer trains rollout 1
    (--debug-inject-fault skip-weight-push): in drop mode every group would be dropped and generated again at
    version 0, forever; in mask mode every token masked, a rollout that trains nothing. The rollout stops at once
    saying why."""
    worker = stale_worker(tiny_model_dir, [0], max_weight_staleness=0, max_weight_staleness_mode=mode)
    with pytest.raises(SlimeLiteError, match=r"rollout 1: every engine serves weight version 0 or older, more than "
                                             rf"--max-weight-staleness 0 behind .* would be {lost}.* push did not "
                                             "reach the engines"):
        run_rollouts(worker, [0, 1])


def test_groups_dropped_as_stale_count_toward_the_rollouts_loss_bound(tiny_model_dir):
    """One engine answers version 1 but the groups keep coming back at version 0 (a push that reached only some of
    the engines): the stale drops count with the filter's and the refused ones, so the rollout stops instead of
    dropping groups forever."""
    worker = stale_worker(tiny_model_dir, [0, 1], max_weight_staleness=0)
    with pytest.raises(SlimeLiteError, match=r"rollout 1: only 0 of --rollout-batch-size 2 groups kept after \d+ "
                                             r"groups .* dropped as staler than --max-weight-staleness"):
        run_rollouts(worker, [0, 1])


def test_the_rollouts_first_request_counts_in_its_generate_time(tiny_model_dir):
    """perf/rollout/*: the requests the loop sends while the rollout asks the engines' versions are this rollout's
    (RolloutManager.generate resets the times before the call): generate_time is not folded into prepare_time."""
    import time

    worker = stale_worker(tiny_model_dir, [0])
    gen, engine = worker.gen, worker.gen.client
    received, served = [], engine._one

    async def one(ids, params):
        received.append(time.monotonic())
        return await served(ids, params)

    engine._one = one
    gen.first_sent = gen.last_back = None  # as RolloutManager.generate
    run_rollouts(worker, [0])
    assert received and gen.first_sent is not None and gen.first_sent <= min(received)


def test_a_hooks_turns_keep_their_own_versions_so_the_bound_sees_the_oldest_token():
    """A slime-style multi-turn hook grows its sample with append_response_tokens, one request per turn; a push
    between its turns leaves the first turn's tokens older: the staleness bound and the lag read those, not the
    last request's version stamped on every token."""
    from slime_lite.rollout.oversample import stamp_versions
    from slime_lite.types import TOKEN_VERSIONS

    s = Sample(tokens=[1, 2, 3], response_length=0)
    s.append_response_tokens(None, tokens=[10, 11, 12], log_probs=[-0.1] * 3,
                             meta_info={"finish_reason": {"type": "stop"}, "weight_version": "1"})
    s.append_response_tokens(None, tokens=[20, 21], trainable=False)  # a tool's output: the turn before's version
    s.append_response_tokens(None, tokens=[30, 31], log_probs=[-0.1] * 2,
                             meta_info={"finish_reason": {"type": "stop"}, "weight_version": "3",
                                        "output_token_weight_versions": [2, 3]})  # in flight across a push
    stamp_versions(s)
    assert s.metadata[TOKEN_VERSIONS] == [1, 1, 1, 1, 1, 2, 3]
    kept, counts = apply_staleness([[s]], trainer_version=3, max_staleness=1, mode="drop")
    assert kept == [] and counts["rollout/async/dropped_stale_samples"] == 1.0
    assert lag_metrics([s], 3)["rollout/async/lag_max"] == 2.0
    # a hook that grew the sample with no versions per token but recorded its requests': all take the oldest
    bare = Sample(tokens=[1, 2, 3, 4], response_length=2, weight_versions=["3", "1"])
    stamp_versions(bare)
    assert bare.metadata[TOKEN_VERSIONS] == [1, 1]
