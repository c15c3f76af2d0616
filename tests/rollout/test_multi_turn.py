"""Multi-turn samples against a real in-process embedded engine (no Ray): turns sent as token ids reuse the prefix
cache (cached_tokens grows turn by turn), masks and log-probs stay aligned, and the limits end samples TRUNCATED or
FAILED (tool raising, tool hanging) while the rollout goes on, with the rollout/ metrics that count them."""

from __future__ import annotations

import json
import textwrap

import pytest

from slime_lite.args import parser_defaults
from slime_lite.types import Status
from tests.engine.engine_helpers import start_engine

HOOK = """
import asyncio
import time
from slime_lite.rollout import multi_turn as mt
from slime_lite.tokenizer import load_tokenizer

TOKENIZER = None


def calculator(expression):
    if "boom" in expression:
        raise ValueError("cannot parse " + expression)
    if "hang" in expression:
        time.sleep(5)
    return "=42;"


async def generate(args, sample, sampling_params):
    global TOKENIZER
    TOKENIZER = TOKENIZER or load_tokenizer(args.hf_checkpoint)
    limits = mt.TurnLimits.from_args(args)
    params = dict(sampling_params, max_new_tokens=3, ignore_eos=True, stop=None)
    while mt.can_continue(sample, limits):
        await mt.model_turn(args, sample, params, limits)
        if not mt.can_continue(sample, limits):
            break
        try:
            out = await mt.call_tool(sample, calculator, sample.label or "", timeout=limits.tool_timeout)
        except mt.ToolError as exc:
            return mt.fail(sample, str(exc))
        mt.insert_turn(sample, TOKENIZER, out, limits)
    return sample
"""


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    server = start_engine(tiny_model_dir, max_running_requests=8)
    yield server
    server.stop()


def _manager(tiny_model_dir, engine, tmp_path, monkeypatch, labels, **flags):
    from slime_lite.rollout.manager import RolloutManager

    (tmp_path / "turn_hook.py").write_text(textwrap.dedent(HOOK))
    monkeypatch.syspath_prepend(str(tmp_path))
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "label": label}) + "\n"
                            for i, label in enumerate(labels)))
    args = parser_defaults(hf_checkpoint=str(tiny_model_dir), prompt_data=str(path), custom_rm_path="turn_rm.reward",
                           rollout_batch_size=len(labels), n_samples_per_prompt=1,
                           custom_generate_function_path="turn_hook.generate", **flags)
    (tmp_path / "turn_rm.py").write_text("def reward(args, sample):\n    return 1.0\n")
    return RolloutManager(args, [engine.url])


def test_turns_go_as_token_ids_and_reuse_the_prefix_cache(tiny_model_dir, engine, tmp_path, monkeypatch):
    manager = _manager(tiny_model_dir, engine, tmp_path, monkeypatch, ["1", "2"], max_turns=3)
    samples, metrics = manager.generate(0)
    manager.close()
    for s in samples:
        turns = s.metadata["turns"]
        assert [t["source"] for t in turns] == ["model", "tool", "model", "tool", "model"]
        assert s.loss_mask == [m for t in turns for m in [int(t["source"] == "model")] * t["length"]]
        assert len(s.rollout_log_probs) == s.response_length == len(s.tokens) - s.prompt_length
        assert all(lp == 0.0 for lp, m in zip(s.rollout_log_probs, s.loss_mask) if not m)
        assert all(lp < 0.0 for lp, m in zip(s.rollout_log_probs, s.loss_mask) if m)
        model = [t for t in turns if t["source"] == "model"]
        # each later turn finds the whole conversation before the previous turn's last token in the engine's cache:
        # it prefills only the previous turn's last token and the tool output
        for before, after in zip(model, model[1:]):
            assert after["cached_tokens"] >= before["prompt_tokens"] + before["length"] - 1, turns
            assert after["cached_tokens"] > before["cached_tokens"]
        # every turn stopped at its max_new_tokens: the status is the last turn's finish reason
        assert s.status == Status.TRUNCATED and "truncated_by" not in s.metadata and s.metadata["tool_calls"] == 2
    assert metrics["rollout/turns/mean"] == 3 and metrics["rollout/turns/max"] == 3
    generated = sum(sum(s.loss_mask) for s in samples)  # the engine's tokens only, not the tool output
    assert metrics["perf/rollout_tokens_per_s"] * metrics["perf/rollout_time"] == pytest.approx(generated)
    assert metrics["rollout/tool_calls"] == 4 and metrics["rollout/tool_errors"] == 0
    masked = sum(s.response_length - sum(s.loss_mask) for s in samples) / sum(s.response_length for s in samples)
    assert metrics["rollout/masked_token_share"] == pytest.approx(masked) and 0 < masked < 1


def test_a_tool_that_raises_or_hangs_fails_its_sample_and_the_rollout_goes_on(tiny_model_dir, engine, tmp_path,
                                                                              monkeypatch):
    manager = _manager(tiny_model_dir, engine, tmp_path, monkeypatch, ["boom", "hang", "3"], max_turns=2,
                       tool_call_timeout=2.0)
    samples, metrics = manager.generate(0)
    manager.close()
    boom, hang, ok = samples
    assert boom.status == hang.status == Status.FAILED and ok.status == Status.TRUNCATED  # (its last turn's length)
    assert boom.metadata["failure"] == "tool calculator raised ValueError: cannot parse boom"
    assert hang.metadata["failure"] == "tool calculator did not return within --tool-call-timeout 2 s"
    assert metrics["rollout/failed_ratio"] == pytest.approx(2 / 3)
    assert metrics["rollout/tool_errors"] == 2 and metrics["rollout/tool_calls"] == 3


def test_the_context_bound_ends_a_sample_truncated_and_inserted_turns_are_cut(tiny_model_dir, engine, tmp_path,
                                                                              monkeypatch):
    manager = _manager(tiny_model_dir, engine, tmp_path, monkeypatch, ["1"], max_turns=8,
                       max_inserted_tokens_per_turn=2, rollout_max_context_len=14)
    (s,), metrics = manager.generate(0)
    manager.close()
    assert s.status == Status.TRUNCATED and s.metadata["truncated_by"] == "--rollout-max-context-len"
    assert len(s.tokens) <= 14
    tools = [t for t in s.metadata["turns"] if t["source"] == "tool"]
    assert tools and all(t["length"] <= 2 for t in tools) and tools[0]["text"] == "=4"  # "=42;" cut to 2 tokens
    assert metrics["rollout/truncated_ratio"] == 1.0


def test_a_turn_at_the_models_context_ends_the_sample_truncated_not_refused(tiny_model_dir, engine):
    """Default bound (the model's max_position_embeddings, 512): the engine, as SGLang, refuses input +
    max_new_tokens reaching the context, so a turn near it is given one token less and the sample ends TRUNCATED
    (not an engine error ending the rollout)."""
    import asyncio
    from types import SimpleNamespace

    from slime_lite.engine_client import AsyncEngineClient
    from slime_lite.rollout import multi_turn as mt
    from slime_lite.types import Sample

    async def main():
        client = AsyncEngineClient([engine.url])
        args = SimpleNamespace(engine_client=client, use_rollout_routing_replay=False,
                               hf_checkpoint=str(tiny_model_dir), rollout_max_context_len=None,
                               max_turns=4, max_inserted_tokens_per_turn=8, tool_call_timeout=5.0)
        sample = Sample(index=0, prompt="x", tokens=[60 + i % 30 for i in range(500)])
        try:
            await mt.model_turn(args, sample, {"max_new_tokens": 100, "ignore_eos": True},
                                mt.TurnLimits.from_args(args))
        finally:
            await client.close()
        return sample

    sample = asyncio.run(main())
    assert sample.status == Status.TRUNCATED and sample.metadata["truncated_by"] == "--rollout-max-context-len"
    assert len(sample.tokens) == 511


def test_a_turn_asked_for_no_tokens_generates_none(tiny_model_dir, engine):
    """A hook whose budget is spent sends max_new_tokens 0: that is 0 tokens, not "up to the context"."""
    import asyncio
    from types import SimpleNamespace

    from slime_lite.engine_client import AsyncEngineClient
    from slime_lite.rollout import multi_turn as mt
    from slime_lite.types import Sample

    async def main():
        client = AsyncEngineClient([engine.url])
        args = SimpleNamespace(engine_client=client, use_rollout_routing_replay=False,
                               hf_checkpoint=str(tiny_model_dir), rollout_max_context_len=None,
                               max_turns=4, max_inserted_tokens_per_turn=8, tool_call_timeout=5.0)
        sample = Sample(index=0, prompt="x", tokens=[60, 61, 62])
        try:
            await mt.model_turn(args, sample, {"max_new_tokens": 0, "ignore_eos": True}, mt.TurnLimits.from_args(args))
        finally:
            await client.close()
        return sample

    sample = asyncio.run(main())
    assert sample.response_length == 0 and sample.tokens == [60, 61, 62]
    assert sample.metadata["turns"][-1]["sampling_params"]["max_new_tokens"] == 0


def test_a_turn_with_less_room_than_the_eval_minimum_asks_for_what_fits(tiny_model_dir, engine):
    """--eval-min-new-tokens 4 in a turn whose room (the context bound) is 2: the minimum is cut to the turn's
    maximum (the engine refuses a minimum above it, which ended the whole eval)."""
    import asyncio
    from types import SimpleNamespace

    from slime_lite.engine_client import AsyncEngineClient
    from slime_lite.rollout import multi_turn as mt
    from slime_lite.types import Sample

    async def main():
        client = AsyncEngineClient([engine.url])
        args = SimpleNamespace(engine_client=client, use_rollout_routing_replay=False,
                               hf_checkpoint=str(tiny_model_dir), rollout_max_context_len=8,
                               max_turns=4, max_inserted_tokens_per_turn=8, tool_call_timeout=5.0)
        sample = Sample(index=0, prompt="x", tokens=[60, 61, 62, 63, 64, 65])  # room for 2
        try:
            await mt.model_turn(args, sample, {"max_new_tokens": 16, "min_new_tokens": 4},
                                mt.TurnLimits.from_args(args))
        finally:
            await client.close()
        return sample

    sample = asyncio.run(main())
    assert sample.response_length == 2 and sample.status == Status.TRUNCATED
    assert sample.metadata["turns"][-1]["sampling_params"]["min_new_tokens"] == 2


def test_call_tool_awaits_every_kind_of_async_tool_and_names_a_failure():
    """Plain, async, a lambda around an async call, an object with an async __call__: each returns its value (not a
    coroutine); a raise and a hang past the timeout are ToolErrors naming the tool, counted."""
    import asyncio

    from slime_lite.rollout import multi_turn as mt
    from slime_lite.types import Sample

    async def add(x):
        return x + 1

    class Tool:
        async def __call__(self, x):
            return x + 2

    async def hangs(x):
        await asyncio.sleep(5)

    def raises(x):
        raise ValueError("no")

    async def main():
        s = Sample(index=0)
        got = [await mt.call_tool(s, fn, 1, timeout=2.0) for fn in (lambda x: x * 10, add, lambda x: add(x), Tool())]
        errors = []
        for fn in (hangs, raises):
            try:
                await mt.call_tool(s, fn, 1, timeout=0.2)
            except mt.ToolError as exc:
                errors.append(str(exc))
        return s, got, errors

    s, got, errors = asyncio.run(main())
    assert got == [10, 2, 2, 3]
    assert errors == ["tool hangs did not return within --tool-call-timeout 0.2 s", "tool raises raised ValueError: no"]
    assert s.metadata["tool_calls"] == 6 and s.metadata["tool_errors"] == 2


def test_hung_plain_tools_do_not_hold_up_the_next_samples_tools():
    """A plain tool runs in a thread of its own: tools hung past their timeout (more of them than asyncio's shared
    pool has threads) do not make a later instant call wait for a thread and time out."""
    import asyncio
    import threading

    from slime_lite.rollout import multi_turn as mt
    from slime_lite.types import Sample

    release = threading.Event()

    def hangs(x):
        release.wait(30)

    async def main():
        hung = await asyncio.gather(*(mt.call_tool(Sample(index=i), hangs, 1, timeout=0.2) for i in range(40)),
                                    return_exceptions=True)
        try:
            return hung, await mt.call_tool(Sample(index=99), lambda x: x + 1, 1, timeout=2.0)
        finally:
            release.set()

    hung, instant = asyncio.run(main())
    assert all(isinstance(h, mt.ToolError) and "did not return within" in str(h) for h in hung) and instant == 2


def test_a_tool_that_calls_sys_exit_fails_its_sample_and_the_rollout_goes_on():
    """sys.exit() in a tool (argparse exits on bad arguments), plain or async, is a ToolError naming the tool, as any
    raise is: a SystemExit out of its task would stop the rollout's whole event loop. KeyboardInterrupt still does."""
    import argparse
    import asyncio
    import sys

    from slime_lite.rollout import multi_turn as mt
    from slime_lite.types import Sample

    def cli(expr):
        parser = argparse.ArgumentParser(prog="cli")
        parser.add_argument("--n", type=int, required=True)
        return parser.parse_args(expr.split())

    async def quits(expr):
        sys.exit("bad input")

    async def one(fn):
        s = Sample(index=0)
        try:
            await mt.call_tool(s, fn, "--n x", timeout=5.0)
        except mt.ToolError as exc:
            return mt.fail(s, str(exc))
        return s

    async def other_sample():
        await asyncio.sleep(0.2)
        return "done"

    async def main():
        return await asyncio.gather(one(cli), one(quits), other_sample())

    plain, in_async, other = asyncio.run(main())
    assert plain.status == in_async.status == Status.FAILED and other == "done"
    assert plain.metadata["failure"] == "tool cli called sys.exit(2)" and plain.metadata["tool_errors"] == 1
    assert in_async.metadata["failure"] == "tool quits called sys.exit('bad input')"

    async def interrupted(expr):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        asyncio.run(one(interrupted))


def test_each_model_turn_of_a_seeded_sample_samples_with_its_own_seed():
    """The engine's random draws restart with every request: one sampling_seed sent on every turn (a hook written
    as the README's agent loop) gave each turn the first turn's draws. model_turn derives each turn's seed; the
    first keeps the given one. A FAKE engine client (no engine: only the bodies are looked at)."""
    import asyncio
    from types import SimpleNamespace

    from slime_lite.rollout import multi_turn as mt
    from slime_lite.types import Sample

    sent = []

    class Client:
        async def generate(self, body):
            sent.append(body["sampling_params"].get("sampling_seed"))
            return {"text": "a", "output_ids": [7], "meta_info": {"output_token_logprobs": [[-0.1, 7]],
                                                                  "finish_reason": {"type": "length"}}}

    args = SimpleNamespace(engine_client=Client(), use_rollout_routing_replay=False)
    sample = Sample(index=0, prompt="p", tokens=[1, 2])
    limits = mt.TurnLimits(max_turns=3, max_inserted_tokens=8, max_context_len=None, tool_timeout=1.0)

    async def run():
        for _ in range(3):
            await mt.model_turn(args, sample, {"sampling_seed": 123, "max_new_tokens": 1}, limits)

    asyncio.run(run())
    assert sent[0] == 123 and len(set(sent)) == 3
    assert sent == [mt.turn_seed(123, k) for k in range(3)]
