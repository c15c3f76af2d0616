"""State the embedded engine's scheduler keeps between requests (prefix cache, slots, pause modes) must not change
what a later request gets: driven on the ``Scheduler`` itself (no HTTP), on CPU."""

from __future__ import annotations

import threading

import pytest
import torch

from slime_lite.engine.request import Request, RequestOutput
from slime_lite.engine.sampling import SamplingParams


@pytest.fixture()
def scheduler(tiny_model_dir):
    from slime_lite.engine.scheduler import Scheduler

    sch = Scheduler(str(tiny_model_dir), device="cpu", max_running_requests=4)
    sch.start()
    yield sch
    sch.stop()


def submit(sch, ids: list[int], on_token=None, **kw) -> tuple[Request, threading.Event, dict]:
    """Submit a request (keyword arguments: ``sampling_params`` fields, ``return_logprob``, ...); returns it, an
    event set when it finished and a box whose ``out`` is then its final ``RequestOutput``."""
    req_fields = {k: kw.pop(k) for k in ("return_logprob", "logprob_start_len", "top_logprobs_num",
                                        "token_ids_logprob") if k in kw}
    params = SamplingParams.from_dict(kw)
    done, box = threading.Event(), {}

    def on_output(out: RequestOutput) -> None:
        if on_token is not None:
            on_token(out)
        if out.finish_reason is not None:
            box["out"] = out
            done.set()

    req = Request(rid=f"r{id(done)}", input_ids=ids, params=params, seed=sch.derive_seed(params.sampling_seed, None),
                  stream=on_token is not None, on_output=on_output, **req_fields)
    sch.prepare(req)
    sch.submit(req)
    return req, done, box


def result(sch, ids: list[int], **kw) -> RequestOutput:
    _, done, box = submit(sch, ids, **kw)
    assert done.wait(60)
    return box["out"]


def test_a_request_running_across_a_weight_update_leaves_no_stale_prefix(scheduler):
    """Its prompt's K/V is the old weights': a later prompt that starts the same way must not reuse it."""
    sch = scheduler
    prompt = list(range(1, 30))
    started = threading.Event()
    _, done, box = submit(sch, prompt, lambda out: started.set(), max_new_tokens=300, temperature=0.0,
                          ignore_eos=True)
    assert started.wait(30)
    sch.call(sch.pause, "in_place").result(10)  # between two decode steps, as --fully-async pushes
    gen = torch.Generator().manual_seed(0)
    new = {n: t + 0.05 * torch.randn(t.shape, generator=gen) for n, t in sch.weights.params.named.items()}
    sch.call(sch.weights.load_named, new).result(10)
    sch.call(sch.resume).result(10)
    assert done.wait(60) and box["out"].finish_reason["type"] == "length"
    sp = {"max_new_tokens": 4, "temperature": 0.0, "return_logprob": True}
    after = result(sch, prompt + [5, 6], **sp)
    sch.call(sch.flush_cache).result(10)
    fresh = result(sch, prompt + [5, 6], **sp)
    assert after.cached_tokens == 0 and fresh.cached_tokens == 0
    assert after.output_ids == fresh.output_ids
    assert max(abs(a - b) for a, b in zip(after.output_logprobs, fresh.output_logprobs)) < 1e-5
    # a request that ran under the new weights only is cached as before
    assert result(sch, prompt + [5, 6, 7], **sp).cached_tokens == len(prompt) + 2


def test_a_model_thread_that_dies_answers_every_request_and_reports_itself_dead(tiny_model_dir):
    """An error outside a decode step (handling a message) ends the model thread: its requests were left waiting
    for it and the engine actor still said alive, so a run found it only by --rollout-request-timeout. Now every
    request is answered at once (HTTP 503 with the error: not an answer of a live engine), and the actor's liveness
    (what --use-fault-tolerance polls) is False."""
    import time
    from types import SimpleNamespace

    from engine_helpers import http, start_engine

    from slime_lite.rollout.engines import EngineActor

    server = start_engine(tiny_model_dir, max_running_requests=2)
    try:
        sch = server.scheduler
        handle = sch._handle

        def fails_once(msg):
            sch._handle = handle
            raise RuntimeError("an error while handling a message")

        sch._handle = fails_once
        t0 = time.monotonic()
        body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 3}}
        first, later = http(server.url, "/generate", body), http(server.url, "/generate", body)
        assert time.monotonic() - t0 < 10
        for status, out in (first, later):
            assert status == 503 and "an error while handling a message" in out["error"]["message"], out
        actor = SimpleNamespace(config=SimpleNamespace(rollout_backend="embedded"), server=server)
        assert not sch.alive and EngineActor.alive(actor) is False
    finally:
        server.stop()
