"""Over-sampling with abort and --partial-rollout, through the real Generator and OverSampler against a FAKE engine
client (no engine here decodes slowly enough to abort on cue): aborted samples are never trained, carried samples
continue from exactly their tokens, every token keeps the weight version that generated it across several pushes,
and the carried samples survive a checkpoint."""

from __future__ import annotations

import asyncio
import copy
from dataclasses import dataclass

import pytest
import torch

from slime_lite.args import parser_defaults
from slime_lite.errors import SlimeLiteError
from slime_lite.rollout.data import Prompt, PromptSource
from slime_lite.rollout.generate import Generator
from slime_lite.tokenizer import load_tokenizer
from slime_lite.types import FINISHED_BEFORE, TOKEN_VERSIONS, Status

STEP_S = 0.002  # the fake's seconds per decode step
SHORT, LONG = 4, 400  # response tokens of a short and a long prompt's samples


def next_token(last: int) -> int:
    return (last * 7 + 3) % 90 + 5


def token_logprob(token: int) -> float:
    return -0.01 * (token % 13) - 0.05


class FakeEngine:
    """FAKE engine client: SGLang's /generate shape (one prompt, or a list of prompts with one result each), one
    token per STEP_S per request, the next token a function of the last one (so a continued request goes on exactly
    as an uninterrupted one), a response ends ("stop") once it has ``lengths[first input id]`` tokens counted from
    the prompt, ``max_new_tokens`` ends it with "length". /abort_request {"abort_all": true} ends every request in
    flight with "abort" and what it generated; a request arriving later runs normally, as on a real engine. Every
    request is logged: (input ids, tokens generated, version)."""

    def __init__(self, prompt_lens: dict[int, int], lengths: dict[int, int]) -> None:
        self.urls = ["http://127.0.0.1:9"]  # nothing listens: the manager's step-counter reads find no engine
        self.prompt_lens, self.lengths = prompt_lens, lengths  # first id -> prompt length / response length
        self.version = "0"
        self.inflight: set[int] = set()
        self.cut: set[int] = set()
        self.log: list[tuple[list[int], int, str]] = []
        self.aborts = 0
        self._ids = 0

    async def _one(self, ids: list[int], params: dict) -> dict:
        rid, self._ids = self._ids, self._ids + 1
        self.inflight.add(rid)
        want = self.prompt_lens[ids[0]] + self.lengths[ids[0]] - len(ids)
        out: list[int] = []
        finish = "stop"
        try:
            while True:
                if rid in self.cut:
                    finish = "abort"
                    break
                if len(out) >= want:
                    break
                if len(out) >= params["max_new_tokens"]:
                    finish = "length"
                    break
                await asyncio.sleep(STEP_S)
                out.append(next_token((ids + out)[-1]))
        finally:
            self.inflight.discard(rid)
            self.cut.discard(rid)
        self.log.append((list(ids), len(out), self.version))
        return {"text": "".join(chr(97 + t % 26) for t in out), "output_ids": out,
                "meta_info": {"finish_reason": {"type": finish}, "weight_version": self.version,
                              "output_token_logprobs": [[token_logprob(t), t, None] for t in out],
                              "prompt_tokens": len(ids), "cached_tokens": 0}}

    async def generate(self, body: dict) -> list[dict] | dict:
        params = body["sampling_params"]
        if isinstance(params, dict):  # one prompt (a generate hook's request)
            return await self._one(body["input_ids"], params)
        return list(await asyncio.gather(*(self._one(ids, p) for ids, p in zip(body["input_ids"], params))))

    async def post(self, url: str, route: str, body: dict) -> None:
        assert route == "/abort_request" and body == {"abort_all": True}
        self.aborts += 1
        self.cut |= self.inflight


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(str(tiny_model_dir))


def make(tokenizer, tiny_model_dir, kinds: str, **flags):
    """A Generator over prompts of the given kinds ('s' short, 'l' long, 'x' longer still) and its fake engine."""
    texts = [f"{chr(65 + i)}{k}=?" for i, k in enumerate(kinds)]  # a distinct first character each
    prompts = [Prompt(i, t, "3", {}) for i, t in enumerate(texts)]
    first = {}
    for t in texts:
        ids = tokenizer(t, add_special_tokens=False)["input_ids"]
        first[ids[0]] = (len(ids), {"s": SHORT, "l": LONG, "x": 3 * LONG}[t[1]])
    engine = FakeEngine({k: v[0] for k, v in first.items()}, {k: v[1] for k, v in first.items()})
    flags = {"rollout_batch_size": 2, "n_samples_per_prompt": 2, "over_sampling_batch_size": 4,
             "rollout_max_response_len": 4 * LONG, **flags}
    args = parser_defaults(hf_checkpoint=str(tiny_model_dir), rm_type="addition", **flags)
    return Generator(args, tokenizer, engine), PromptSource(prompts, shuffle=False, seed=0), engine


def expected_response(prompt_ids: list[int], n: int) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        out.append(next_token((prompt_ids + out)[-1]))
    return out


def rollout(gen, source, rollout_id):
    return asyncio.run(gen.rollout(rollout_id, source))


def test_over_sampling_aborts_the_unfinished_groups_and_never_trains_them(tokenizer, tiny_model_dir) -> None:
    gen, source, engine = make(tokenizer, tiny_model_dir, "ssllssll")
    samples, stats = rollout(gen, source, 0)
    assert len(samples) == 4 and {s.metadata["prompt_index"] for s in samples} == {0, 1}
    assert all(s.status is Status.COMPLETED and s.response_length == SHORT for s in samples)
    assert [s.index for s in samples] == [0, 1, 2, 3] and [s.group_index for s in samples] == [0, 0, 1, 1]
    assert engine.aborts >= 1 and not engine.inflight
    cut = [n for ids, n, _ in engine.log if engine.lengths[ids[0]] == LONG]
    assert len(cut) == 4 and all(n < LONG for n in cut)  # the long groups were stopped, not waited for
    assert stats["rollout/over_sampling/aborted_groups"] == 2.0
    assert stats["rollout/over_sampling/tokens_wasted"] == float(sum(cut))
    assert not gen.over.carried and "rollout/partial/samples_carried" not in stats
    # without --partial-rollout the next rollout takes new prompts: the aborted ones are gone
    samples, _ = rollout(gen, source, 1)
    assert {s.metadata["prompt_index"] for s in samples} == {4, 5}


def request_chains(logged, sent, final):
    """Every chain of logged requests (input ids, tokens generated, version) that starts at ``sent``, each one
    continuing from exactly the tokens the one before left, and ends at ``final``."""
    if sent == final:
        yield []
    for r in logged:
        ids, n, _ = r
        after = ids + expected_response(ids, n)
        if ids == sent and n > 0 and final[:len(after)] == after:
            for rest in request_chains(logged, after, final):
                yield [r, *rest]


def test_partial_rollout_continues_carried_samples_from_their_tokens_with_per_token_versions(
        tokenizer, tiny_model_dir) -> None:
    """Rollout 0 aborts the long groups (version 0), rollout 1 (version 1) continues and aborts them again, rollout
    2 (version 2) finishes them: each request sends exactly the tokens the sample has, the response is the one an
    uninterrupted request gives, and every token carries the version that generated it."""
    gen, source, engine = make(tokenizer, tiny_model_dir, "ssllssxx", partial_rollout=True)
    first, _ = rollout(gen, source, 0)
    assert {s.metadata["prompt_index"] for s in first} == {0, 1}
    carried = [s for g in gen.over.carried for s in g]
    assert len(carried) == 4 and all(s.status is Status.ABORTED and s.reward is None for s in carried)
    assert all(s.metadata["start_rollout_id"] == 0 for s in carried if s.response_length)
    for version, rollout_id in (("1", 1), ("2", 2)):
        engine.version = version  # the weight push between rollouts
        logged_before = len(engine.log)
        samples, stats = rollout(gen, source, rollout_id)
        # what perf/rollout_tokens_per_s counts: the tokens this rollout's requests generated (aborted ones too),
        # not the trained samples' carried tokens
        assert stats["perf/rollout_generated_tokens"] == float(sum(n for _, n, _ in engine.log[logged_before:]))
    assert {s.metadata["prompt_index"] for s in samples} == {2, 3}  # the carried groups, none lost
    assert stats["rollout/partial/samples_carried"] == 4.0 and stats["rollout/partial/age_max"] == 2.0
    carried_tokens = 0
    logged = [r for k, r in enumerate(engine.log) if r not in engine.log[:k]]
    for s in samples:
        prompt = tokenizer(s.metadata["prompt_text"], add_special_tokens=False)["input_ids"]
        assert s.tokens[len(prompt):] == expected_response(prompt, LONG)  # as if never interrupted
        assert s.status is Status.COMPLETED and s.response_length == LONG
        # the logged requests that made the sample: each sent exactly the tokens the sample had, and their versions
        # are its tokens' (the two samples of a group may be cut a token apart: the chain that gives its versions)
        chains = [c for c in request_chains(logged, prompt, s.tokens)
                  if [int(v) for _, n, v in c for _ in range(n)] == s.metadata[TOKEN_VERSIONS]]
        assert chains and [v for *_, v in chains[0]] == ["0", "1", "2"], (s.metadata[TOKEN_VERSIONS], logged)
        assert s.rollout_log_probs == [token_logprob(t) for t in s.tokens[len(prompt):]]
        assert s.weight_versions == ["0", "1", "2"] and s.loss_mask == [1] * LONG and s.reward is not None
        carried_tokens += sum(n for _, n, v in chains[0] if v != "2")
    assert stats["rollout/partial/tokens_carried"] == float(carried_tokens)
    assert stats["rollout/partial/carried_token_share"] == carried_tokens / (4 * LONG)


def test_mask_offpolicy_masks_the_tokens_of_older_weights_only(tokenizer, tiny_model_dir) -> None:
    gen, source, engine = make(tokenizer, tiny_model_dir, "ssllxxxx", partial_rollout=True,
                               mask_offpolicy_in_partial_rollout=True)
    rollout(gen, source, 0)
    engine.version = "1"
    samples, stats = rollout(gen, source, 1)
    assert {s.metadata["prompt_index"] for s in samples} == {2, 3}
    for s in samples:
        versions = s.metadata[TOKEN_VERSIONS]
        assert 0 in versions and 1 in versions
        assert s.loss_mask == [int(v == 1) for v in versions]
    assert stats["rollout/partial/age_mean"] == 1.0


def test_a_group_aborted_in_the_queue_before_its_first_token_gets_the_versions_that_generate_it(
        tokenizer, tiny_model_dir) -> None:
    """An engine that reports one version per request (SGLang's): a group still queued at the abort comes back with
    no token but version 0; continued under version 1, each token it writes is version 1's, so
    --mask-offpolicy-in-partial-rollout masks none of them and the rollout is not counted a version behind."""
    gen, source, engine = make(tokenizer, tiny_model_dir, "slxxxx", partial_rollout=True,
                               mask_offpolicy_in_partial_rollout=True, rollout_batch_size=1, over_sampling_batch_size=2)
    queued, served = tokenizer("Bl=?", add_special_tokens=False)["input_ids"][0], engine._one

    async def one(ids, params):  # the fake engine, with prompt 1 waiting in its queue until the abort in rollout 0
        if engine.version == "0" and ids[0] == queued:
            while not engine.aborts:
                await asyncio.sleep(0.001)
            return {"text": "", "output_ids": [], "meta_info": {
                "finish_reason": {"type": "abort"}, "weight_version": engine.version, "output_token_logprobs": [],
                "prompt_tokens": len(ids)}}
        return await served(ids, params)

    engine._one = one
    rollout(gen, source, 0)
    assert [(s.metadata["prompt_index"], s.response_length, s.weight_versions) for s in gen.over.carried[0]] == \
        [(1, 0, ["0"])] * 2
    engine.version = "1"
    samples, stats = rollout(gen, source, 1)
    assert [s.metadata["prompt_index"] for s in samples] == [1, 1]
    for s in samples:
        assert s.response_length > 0 and s.metadata[TOKEN_VERSIONS] == [1] * s.response_length
        assert s.loss_mask == [1] * s.response_length
    assert stats["rollout/async/newest_lag"] == 0.0


def test_carried_samples_survive_a_checkpoint(tokenizer, tiny_model_dir, tmp_path) -> None:
    """The rollout manager's state holds the carried samples as plain data (a weights_only load reads it back); a
    resumed manager continues them in its first rollout, with their tokens and versions."""
    from slime_lite.rollout.manager import RolloutManager

    gen, source, engine = make(tokenizer, tiny_model_dir, "ssllxxxx", partial_rollout=True)
    manager = RolloutManager(gen.args._flags, [])
    manager.generator, manager.source = gen, source
    manager.generate(0)
    path = tmp_path / "state.pt"
    torch.save(manager.state(), path)
    before = [[(s.tokens, s.metadata.get(TOKEN_VERSIONS)) for s in g] for g in gen.over.carried]
    assert len(before) == 2

    resumed, source2, engine2 = make(tokenizer, tiny_model_dir, "ssllxxxx", partial_rollout=True)
    manager2 = RolloutManager(resumed.args._flags, [])
    manager2.generator, manager2.source = resumed, source2
    manager2.load_state(torch.load(path, weights_only=True))
    assert [[(s.tokens, s.metadata.get(TOKEN_VERSIONS)) for s in g] for g in resumed.over.carried] == before
    engine2.version = "1"
    samples, metrics = manager2.generate(1)
    assert {s.metadata["prompt_index"] for s in samples} == {2, 3}  # the carried prompts, trained
    assert {s.metadata["prompt_index"] for g in resumed.over.carried for s in g} == {4, 5}  # the new ones, carried
    assert source2.state() == {"epoch": 0, "offset": 6}  # no prompt skipped or served twice
    assert metrics["rollout/partial/samples_carried"] == 4.0


def odd_prompts(args, group) -> bool:  # a --dynamic-sampling-filter-path hook for the test below
    return group[0].metadata["prompt_index"] % 2 == 1


def test_groups_the_filter_drops_are_replaced_by_more_prompts(tokenizer, tiny_model_dir) -> None:
    gen, source, _ = make(tokenizer, tiny_model_dir, "s" * 16, rollout_batch_size=3,
                               dynamic_sampling_filter_path="tests.rollout.test_oversample.odd_prompts")
    samples, stats = rollout(gen, source, 0)
    kept = [s.metadata["prompt_index"] for s in samples[::2]]
    assert len(kept) == 3 and all(i % 2 for i in kept) and {1, 3} <= set(kept)
    assert stats["rollout/over_sampling/submitted_groups"] == 8.0  # 4, then 4 more once 2 of them were dropped
    assert stats["rollout/dynamic_filter/dropped_groups"] >= 2 and all(s.status is Status.COMPLETED for s in samples)


FILTERED: list[int] = []


def counting_filter(args, group) -> bool:  # keeps every group, recording which it saw
    FILTERED.append(group[0].metadata["prompt_index"])
    return True


@pytest.mark.parametrize("checkpoint", [False, True])
def test_a_group_carried_finished_is_filtered_and_counted_once(tokenizer, tiny_model_dir, checkpoint) -> None:
    """--partial-rollout carries a group that finished after the rollout had its groups; it passed the filter when
    it came back, so the next rollout trains it without filtering (a random filter could drop a group it kept) or
    counting it again; also after a checkpoint between the two rollouts (the carried groups read back as data)."""
    FILTERED.clear()
    gen, source, engine = make(tokenizer, tiny_model_dir, "s" * 32, partial_rollout=True,
                               dynamic_sampling_filter_path="tests.rollout.test_oversample.counting_filter")
    served, together = engine._one, []

    async def at_once(ids, params):  # rollout 0's 8 requests answer together: 2 groups finish after the 2 kept
        out = await served(ids, params)
        if not together:
            together.append(asyncio.Barrier(8))
        await together[0].wait()
        return out

    engine._one = at_once
    generated, carried_finished = 0, 0
    for rollout_id in range(3):
        samples, stats = rollout(gen, source, rollout_id)
        engine._one = served
        assert not any("passed_dynamic_filter" in s.metadata for s in samples)  # a checkpoint's mark only
        if checkpoint:  # what a resumed run's manager loads: new Sample objects from the checkpoint's plain data
            gen.over.load_state(gen.over.carried_state())
        generated += stats["rollout/dynamic_filter/generated_groups"]
        carried_finished += sum(FINISHED_BEFORE in s.metadata for s in samples)
    assert carried_finished == 4  # rollout 1 trained the two groups that finished late in rollout 0
    assert len(FILTERED) == len(set(FILTERED)) == generated


@dataclass
class FilterOutput:  # the shape of slime's DynamicFilterOutput
    keep: bool
    reason: str | None = None


def odd_prompts_slime_style(args, group) -> FilterOutput:  # slime's filters return an object, always true
    keep = group[0].metadata["prompt_index"] % 2 == 1
    return FilterOutput(keep=keep, reason=None if keep else "even")


def test_a_filter_returning_slimes_filter_output_is_read_by_its_keep_field(tokenizer, tiny_model_dir) -> None:
    gen, source, _ = make(tokenizer, tiny_model_dir, "s" * 16, rollout_batch_size=3,
                          dynamic_sampling_filter_path="tests.rollout.test_oversample.odd_prompts_slime_style")
    samples, stats = rollout(gen, source, 0)
    assert all(s.metadata["prompt_index"] % 2 for s in samples) and len(samples) == 6
    assert stats["rollout/dynamic_filter/dropped_groups"] >= 2


def test_a_filter_that_keeps_nothing_stops_the_rollout_naming_it(tokenizer, tiny_model_dir) -> None:
    gen, source, _ = make(tokenizer, tiny_model_dir, "s" * 8,  # the fake's samples agree: zero reward std
                          dynamic_sampling_filter_path="slime_lite.rollout.filters.check_reward_nonzero_std")
    with pytest.raises(SlimeLiteError, match=r"rollout 0: only 0 of --rollout-batch-size 2 groups finished after "
                                             r"100 batches .* --dynamic-sampling-filter-path"):
        rollout(gen, source, 0)


def carried_copy(group):
    """A finished group as --partial-rollout carries one (it finished after the rollout had its groups)."""
    return [copy.deepcopy(s) for s in group]


def test_ages_count_the_rollouts_weights_when_every_trained_sample_finished_earlier(tokenizer, tiny_model_dir) -> None:
    """Rollout 1 trains only a group that finished under version 0 (carried complete), while the engine serves
    version 1 (the carried long group's request this rollout reports it): the age metrics say 1 behind, and
    --mask-offpolicy-in-partial-rollout leaves the finished samples as they are (as slime: only a continued sample's
    older tokens are masked)."""
    gen, source, engine = make(tokenizer, tiny_model_dir, "slssss", partial_rollout=True,
                               mask_offpolicy_in_partial_rollout=True, rollout_batch_size=1,
                               over_sampling_batch_size=2)
    first, _ = rollout(gen, source, 0)
    assert [s.metadata["prompt_index"] for s in first] == [0, 0] and len(gen.over.carried) == 1
    gen.over.carried.insert(0, carried_copy(first))
    engine.version = "1"
    samples, stats = rollout(gen, source, 1)
    assert [s.metadata["prompt_index"] for s in samples] == [0, 0]
    assert all(s.metadata[TOKEN_VERSIONS] == [0] * SHORT for s in samples)
    assert engine.log[-1][2] == "1"  # the carried long group was sent (and aborted) under version 1
    assert all(s.loss_mask in (None, [1] * SHORT) for s in samples)
    assert all(s.metadata[FINISHED_BEFORE] == 1 for s in samples)
    assert stats["rollout/partial/age_max"] == 1.0 and stats["rollout/partial/age_mean"] == 1.0
    assert stats["rollout/weight_version"] == 1.0  # what --ci-test's weight_version_served reads: not 0
    # no trained token is of the rollout's weights: the train/rollout log-prob check must skip this batch
    assert stats["rollout/async/newest_lag"] == 1.0


@pytest.mark.parametrize("hook", [None, "carry_hooks.again"])
def test_a_continued_group_the_engine_aborts_again_without_a_token_is_dropped_not_carried_forever(
        tokenizer, tiny_model_dir, caplog, tmp_path, monkeypatch, hook) -> None:
    """An engine that refuses one prompt (aborts it at once, every time: SGLang does so for an input it cannot
    serve): --partial-rollout carries the group once, and when its continuation comes back aborted with nothing
    new it is dropped (counted, named in a warning), not carried into every later rollout; so with a hook that
    generates carried samples again from their prompt (the multi-turn hooks), which is not blamed for it."""
    (tmp_path / "carry_hooks.py").write_text(HOOKS)
    monkeypatch.syspath_prepend(str(tmp_path))
    gen, source, engine = make(tokenizer, tiny_model_dir, "ssssssss", partial_rollout=True,
                               custom_generate_function_path=hook)
    refused = tokenizer("As=?", add_special_tokens=False)["input_ids"][0]
    served = engine._one

    async def one(ids, params):
        if ids[0] != refused:
            return await served(ids, params)
        engine.log.append((list(ids), 0, engine.version))
        return {"text": "", "output_ids": [], "meta_info": {"finish_reason": {"type": "abort", "message": "refused"},
                                                            "weight_version": engine.version,
                                                            "output_token_logprobs": [], "prompt_tokens": len(ids)}}

    engine._one = one
    first, _ = rollout(gen, source, 0)
    assert 0 not in {s.metadata["prompt_index"] for s in first}
    assert any(g[0].metadata["prompt_index"] == 0 for g in gen.over.carried)  # carried once: it may be a blip
    samples, stats = rollout(gen, source, 1)
    assert 0 not in {s.metadata["prompt_index"] for s in samples}
    assert not any(g[0].metadata["prompt_index"] == 0 for g in gen.over.carried)
    assert stats["rollout/over_sampling/refused_groups"] == 1.0 and "again without a new token" in caplog.text
    assert sum(1 for ids, _, _ in engine.log if ids[0] == refused) == 2 * 2  # two requests of two samples, no more
    assert all(s.status is Status.COMPLETED for s in first + samples)


def test_deterministic_waves_never_keep_a_group_the_engine_cut_short(tokenizer, tiny_model_dir) -> None:
    """--deterministic-mode's waves (nothing aborted by the rollout): a group the engine itself aborted is not
    kept (it has no reward), as over-sampling never keeps one; the rollout takes another wave."""
    gen, source, engine = make(tokenizer, tiny_model_dir, "ssssssss", deterministic_mode=True,
                               over_sampling_batch_size=None)
    served = engine.generate

    async def first_aborted(body):
        outs = await served(body)
        if not getattr(engine, "did", False):
            engine.did = True
            outs[0]["meta_info"]["finish_reason"] = {"type": "abort", "message": "engine-side abort"}
        return outs

    engine.generate = first_aborted
    samples, stats = rollout(gen, source, 0)
    assert len(samples) == 4 and all(s.status is Status.COMPLETED and s.reward is not None for s in samples)
    assert 0 not in {s.metadata["prompt_index"] for s in samples}
    assert stats["rollout/over_sampling/aborted_groups"] == 1.0


def test_deterministic_mode_with_a_generate_hook_aborts_nothing(tokenizer, tiny_model_dir, tmp_path,
                                                                monkeypatch) -> None:
    """--deterministic-mode runs over-sampled waves to their end with a generate hook too: no /abort_request,
    and the groups kept are the first that finish in prompt order, whatever the timing."""
    (tmp_path / "carry_hooks.py").write_text(HOOKS)
    monkeypatch.syspath_prepend(str(tmp_path))
    gen, source, engine = make(tokenizer, tiny_model_dir, "lsslss", deterministic_mode=True,
                               custom_generate_function_path="carry_hooks.again")
    samples, stats = rollout(gen, source, 0)
    assert engine.aborts == 0 and "rollout/over_sampling/aborted_groups" not in stats
    assert sorted({s.metadata["prompt_index"] for s in samples}) == [0, 1]  # the long first prompt is kept
    assert all(s.status is Status.COMPLETED and s.reward is not None for s in samples)


def test_off_policy_lag_counts_only_the_requests_of_the_rollout(tokenizer, tiny_model_dir) -> None:
    """A carried group that finished in an earlier rollout made no request in this one: --async's lag check
    (at most 1 behind) must not read its older version as this rollout's, or --async --partial-rollout stops."""
    from types import SimpleNamespace

    from slime_lite.train_async import off_policy_lag, record_lag

    gen, source, engine = make(tokenizer, tiny_model_dir, "sslls", partial_rollout=True)
    first, _ = rollout(gen, source, 0)
    gen.over.carried.insert(0, carried_copy(first[:2]))  # finished under version 0
    engine.version = "1"
    samples, stats = rollout(gen, source, 1)  # the carried finished group, and prompt 4 generated under version 1
    assert [s.metadata["prompt_index"] for s in samples] == [0, 0, 4, 4]
    assert [s.weight_versions[-1] for s in samples] == ["0", "0", "1", "1"]
    assert off_policy_lag(samples, 1) == 0
    assert stats["rollout/async/newest_lag"] == 0.0  # prompt 4's tokens are the rollout's weights'
    record: dict[str, float] = {}
    record_lag(SimpleNamespace(overlap=True), samples, 2, record)  # --async: trainer at 2, engines served 1
    assert record["rollout/off_policy_lag"] == 1.0


HOOKS = '''
import copy

from slime_lite.rollout.generate import default_generate
from slime_lite.rollout.turns import restart
from slime_lite.types import Status


async def again(args, sample, sampling_params):  # as the multi-turn hooks: a carried sample from its prompt
    if sample.status is Status.ABORTED:
        restart(sample)
    return await default_generate(args, sample, sampling_params)


async def again_in_two(args, sample, sampling_params):  # as the agent endpoint: then two parts of one index
    if sample.status is Status.ABORTED:
        restart(sample)
    other = copy.deepcopy(sample)
    first = await default_generate(args, sample, sampling_params)
    if first.status is Status.ABORTED:
        return first
    return [first, await default_generate(args, other, sampling_params)]


async def ignores(args, sample, sampling_params):  # a hook that does not know carried samples
    if sample.status is Status.ABORTED:
        return sample
    return await default_generate(args, sample, sampling_params)
'''


def test_a_hook_that_restarts_carried_samples_counts_their_tokens_wasted_and_one_that_ignores_them_is_named(
        tokenizer, tiny_model_dir, tmp_path, monkeypatch) -> None:
    (tmp_path / "carry_hooks.py").write_text(HOOKS)
    monkeypatch.syspath_prepend(str(tmp_path))
    gen, source, engine = make(tokenizer, tiny_model_dir, "ssllxxxx", partial_rollout=True,
                               custom_generate_function_path="carry_hooks.again")
    rollout(gen, source, 0)
    carried = [s for g in gen.over.carried for s in g]
    dropped = sum(s.response_length for s in carried)
    assert len(carried) == 4 and dropped > 0
    samples, stats = rollout(gen, source, 1)
    again = [s for s in samples if s.metadata["prompt_index"] in (2, 3)]
    assert len(again) == 4 and all(s.response_length == LONG and s.metadata["restarted_tokens"] for s in again)
    for s in again:  # generated from the prompt: the response an uninterrupted request gives
        prompt = tokenizer(s.metadata["prompt_text"], add_special_tokens=False)["input_ids"]
        assert s.tokens == prompt + expected_response(prompt, LONG)
    assert stats["rollout/over_sampling/tokens_wasted"] == float(dropped)
    assert stats["rollout/partial/samples_carried"] == 0.0 and stats["rollout/partial/tokens_carried"] == 0.0
    # split in two parts sharing the index: the restart's dropped tokens subtracted from neither part's count
    gen, source, engine = make(tokenizer, tiny_model_dir, "ssllxxxx", partial_rollout=True,
                               custom_generate_function_path="carry_hooks.again_in_two",
                               advantage_estimator="reinforce_plus_plus")
    rollout(gen, source, 0)
    logged_before = len(engine.log)
    samples, stats = rollout(gen, source, 1)
    assert len(samples) > 4 and stats["rollout/over_sampling/tokens_wasted"] > 0
    assert stats["perf/rollout_generated_tokens"] == float(sum(n for _, n, _ in engine.log[logged_before:]))

    gen, source, engine = make(tokenizer, tiny_model_dir, "ssllssss", partial_rollout=True,
                               custom_generate_function_path="carry_hooks.ignores")
    rollout(gen, source, 0)
    with pytest.raises(SlimeLiteError, match=r"carry_hooks.ignores returned sample \d+, which --partial-rollout "
                                             r"carried aborted, still aborted and unchanged.*restart\(sample\)"):
        rollout(gen, source, 1)


def test_a_carried_split_trajectory_keeps_a_rollout_id_no_sibling_can_take() -> None:
    """--partial-rollout renumbers carried samples: a trajectory split in rollout N kept its old index as rollout_id,
    which could be the new index of an aborted sibling split in rollout N+1, and the two trajectories would count as
    one (the group then refused for a group estimator). The carried parts follow their first part's new index."""
    from slime_lite.rollout.oversample import OverSampler
    from slime_lite.rollout.functions import check_group_sizes
    from slime_lite.rollout.generate import split_samples
    from slime_lite.types import Sample

    over = object.__new__(OverSampler)
    done = [Sample(group_index=0, index=i, rollout_id=6, status=Status.COMPLETED) for i in (6, 7)]  # split, kept
    aborted = Sample(group_index=0, index=8, status=Status.ABORTED)  # its new index is 6: the old rollout_id
    over.carried = [done + [aborted]]
    group, = over._take(1, first_index=4)
    assert [s.index for s in group] == [4, 5, 6] and [s.rollout_id for s in group] == [4, 4, None]
    continued = split_samples([aborted, copy.deepcopy(aborted)], aborted)  # the sibling splits in its turn
    assert {s.rollout_id for s in continued} == {6}
    check_group_sizes(group[:2] + continued, 2, "grpo")  # two trajectories


def test_aborts_reach_an_engine_that_replaced_a_dead_one_mid_abort(monkeypatch) -> None:
    """--use-fault-tolerance replaces a dead engine in place (the manager's abort URLs): a request retried on the new
    engine must be aborted there, or the rollout waits for it to run to its full length."""
    from slime_lite.rollout import oversample
    from slime_lite.rollout.oversample import OverSampler

    monkeypatch.setattr(oversample, "ABORT_RETRY_S", 0.01)
    over = object.__new__(OverSampler)
    over.abort_urls, over.aborting, posted = ["http://old:1"], False, []

    async def run() -> list:
        retried = asyncio.get_running_loop().create_future()  # the group whose request moved to the new engine

        async def abort_engine(url: str) -> None:
            posted.append(url)
            if url == "http://old:1":
                over.abort_urls[0] = "http://new:2"  # the dead engine replaced, its request retried there
            elif not retried.done():
                retried.set_result([])

        over._abort_engine = abort_engine
        return await asyncio.wait_for(over._abort({retried}), 5)

    assert asyncio.run(run()) == [[]] and posted[:2] == ["http://old:1", "http://new:2"]
