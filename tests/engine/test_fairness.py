"""One client's request must not hurt another's: a stream read slower than its tokens come holds one output per
request (not one per token), a prompt whose log-probs fail (out of memory) ends alone, long prompts' log-probs are
computed in row chunks, and no request-supplied chat template runs in the server."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from engine_helpers import http
from slime_lite.engine import admission
from slime_lite.engine.request import Request
from slime_lite.engine.sampling import SamplingParams
from slime_lite.engine.scheduler import Scheduler
from slime_lite.engine.server import EngineServer


class _Out(SimpleNamespace):
    pass


def test_a_stream_read_slowly_gets_its_newest_output_not_a_backlog_of_one_per_token():
    """A fake scheduler (no model) emits 200 outputs of one request from its own thread while the reader sleeps:
    the reader then gets the newest (the finish), not 200 queued snapshots."""
    server = EngineServer.__new__(EngineServer)
    server._waiting_turn = {}

    class FakeScheduler:
        kv_cache_tokens, weight_version, abort_epoch = 10_000, "0", 0

        def submit(self, req):
            def emit():
                for n in range(1, 201):
                    done = None if n < 200 else {"type": "length"}
                    req.on_output(_Out(output_ids=list(range(n)), finish_reason=done))
            threading.Thread(target=emit).start()

        def cancel(self, reqs, message):
            pass

    server.scheduler = FakeScheduler()
    req = SimpleNamespace(rid="a", input_ids=[1], max_new=200, finish_reason=None, abort_epoch=0, on_output=None)

    async def main():
        got = []
        async for _, out in server.iter_outputs([req]):
            got.append(out)
            if len(got) == 1:
                await asyncio.sleep(0.5)  # a slow client: the engine writes every token meanwhile
        return got

    got = asyncio.run(main())
    assert got[-1].finish_reason == {"type": "length"} and len(got[-1].output_ids) == 200
    assert len(got) < 20, f"{len(got)} outputs were queued for one slow reader"


def _submit(sch: Scheduler, ids: list[int], **fields) -> tuple[Request, threading.Event]:
    done = threading.Event()
    sp = fields.pop("sampling_params")
    req = Request(rid=f"r{time.monotonic_ns()}", input_ids=list(ids), params=SamplingParams.from_dict(sp), seed=0,
                  on_output=lambda out: out.finish_reason is not None and done.set(), **fields)
    sch.prepare(req)
    sch.submit(req)
    return req, done


def test_a_prompt_whose_log_probs_fail_ends_alone_and_the_others_go_on(tiny_model_dir):
    """A prompt's log-probs take a [positions, vocabulary] log-softmax: when that fails (out of memory, injected)
    only its request ends, with the reason; the request already decoding runs to its length."""
    sch = Scheduler(tiny_model_dir, device="cpu", max_running_requests=4, kv_cache_tokens=1024)
    sch.start()
    try:
        victim, victim_done = _submit(sch, list(range(10, 20)),
                                      sampling_params={"max_new_tokens": 80, "ignore_eos": True})
        deadline = time.monotonic() + 30
        while len(victim.output_ids) < 3 and time.monotonic() < deadline:
            time.sleep(0.001)

        def fails(*a, **k):
            raise torch.OutOfMemoryError("injected: out of memory in the prompt log-probs")

        sch._input_logprobs = fails
        bad, bad_done = _submit(sch, list(range(30, 90)), return_logprob=True, logprob_start_len=0,
                                sampling_params={"max_new_tokens": 4})
        assert bad_done.wait(30) and victim_done.wait(60)
        assert bad.finish_reason["type"] == "abort" and "prompt log-probs failed" in bad.finish_reason["message"]
        assert victim.finish_reason == {"type": "length", "length": 80}
    finally:
        sch.stop()


def test_prompt_log_probs_in_row_chunks_are_those_of_one_pass(tiny_model_dir, monkeypatch):
    """The prompt's log-probs, top log-probs and token-id log-probs come out the same in chunks of 3 rows."""
    sch = Scheduler(tiny_model_dir, device="cpu", max_running_requests=2, kv_cache_tokens=512)
    sch.start()
    try:
        def run():
            req, done = _submit(sch, list(range(5, 25)), return_logprob=True, logprob_start_len=2,
                                top_logprobs_num=2, token_ids_logprob=[3, 7],
                                sampling_params={"max_new_tokens": 1, "temperature": 0.0})
            assert done.wait(30)
            return req.input_logprobs, req.input_top, req.input_ids_lp

        whole = run()
        monkeypatch.setattr(admission, "LOGPROB_ROWS", 3)
        chunked = run()
    finally:
        sch.stop()
    assert len(whole[0]) == 18 and whole[0][0] is None and whole[1][0] is None and whole[2][0] is None
    for a, b in zip(whole, chunked):
        assert a[0] is None and b[0] is None
        assert torch.allclose(torch.tensor(a[1:]).float(), torch.tensor(b[1:]).float(), atol=1e-5)


@pytest.mark.parametrize("route,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "max_tokens": 1}),
    ("/tokenize", {"messages": [{"role": "user", "content": "a"}]}),
])
def test_a_request_supplied_chat_template_is_refused(engine, route, body):
    """SGLang refuses chat_template_kwargs.chat_template (unless trusted): a client's Jinja would run in the
    server, holding every other client's request while it renders."""
    status, out = http(engine.url, route, {**body, "chat_template_kwargs": {"chat_template": "{{ 'x' * 9 }}"}})
    assert status == 400 and "chat_template_kwargs.chat_template" in out["error"]["message"]
    status, _ = http(engine.url, route, {**body, "chat_template_kwargs": {"enable_thinking": False}})
    assert status == 200
