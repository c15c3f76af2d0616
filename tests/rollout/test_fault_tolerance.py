"""--use-fault-tolerance in the rollout's engine client: without the flag a dead engine stops the rollout with the
client's error (today's clean stop); with it, a request whose engine died waits for the engine the driver restarts,
then goes to it. The engines here are FAKE /generate servers on 127.0.0.1 (an aiohttp app each): only the client's
behaviour is under test; tests/test_loop.py kills a real engine mid-run."""

from __future__ import annotations

import asyncio
import socket
import threading

import pytest

from slime_lite import engine_client
from slime_lite.engine_client import AsyncEngineClient
from slime_lite.errors import EngineError, EngineUnreachable
from slime_lite.io import free_port

BODY = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}


async def fake_engine(name: str, seconds: float = 0.0, healthy: bool = True, errors: list[int] | None = None,
                      error_text: str = "Retracted under decode memory pressure. Retry later."):
    """A FAKE engine answering /generate with its name after ``seconds`` (first with the HTTP ``errors``, one per
    request, when given, saying ``error_text``), and /health (200, or 503 when not ``healthy``); returns (url,
    runner)."""
    from aiohttp import web

    async def generate(request):
        await asyncio.sleep(seconds)
        if errors:  # SGLang's shape of an HTTPException: {"detail": ...}
            return web.json_response({"detail": error_text}, status=errors.pop(0))
        return web.json_response({"text": name, "output_ids": [3], "meta_info": {}})

    async def health(request):
        return web.Response(status=200 if healthy else 503)

    app = web.Application()
    app.router.add_post("/generate", generate)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return f"http://127.0.0.1:{port}", runner


_HELD: list[socket.socket] = []


def dead_url() -> str:
    """A port bound for the whole session and never listened on: connections are refused, as after kill -9, and no
    other socket (the fake engines') can take it meanwhile."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    _HELD.append(s)
    return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_without_the_flag_a_dead_engine_stops_the_rollout():
    async def run():
        client = AsyncEngineClient([dead_url()], timeout=5)
        try:
            with pytest.raises(EngineError, match="all engines failed"):
                await client.generate(BODY)
        finally:
            await client.close()

    asyncio.run(run())


@pytest.mark.parametrize("ft", [False, True])
def test_a_request_that_outlasts_the_timeout_on_a_live_engine_names_the_flag_and_kills_no_engine(ft):
    """A long generation on a busy but healthy engine passes --rollout-request-timeout: the engine answers /health,
    so it stays in rotation (not sent again elsewhere to time out there too, nor restarted by
    --use-fault-tolerance) and the error names the flag to raise. An engine that does not answer /health either is
    taken out of rotation as before."""
    async def run():
        slow, slow_runner = await fake_engine("slow", seconds=2.0)
        stuck, stuck_runner = await fake_engine("stuck", seconds=2.0, healthy=False)
        client = AsyncEngineClient([slow], timeout=0.5, wait_for_replacement=ft)
        try:
            with pytest.raises(EngineError, match=r"did not answer within --rollout-request-timeout 0.5s.* alive "
                                                  r".* raise --rollout-request-timeout"):
                await client.generate(BODY)
            assert client.failed() == [] and not client.dead
            await client.close()
            client = AsyncEngineClient([stuck], timeout=0.5, max_retries=0)
            with pytest.raises(EngineError, match="did not answer within --rollout-request-timeout"):
                await client.generate(BODY)
            assert client.failed() == [stuck]
        finally:
            await client.close()
            await slow_runner.cleanup()
            await stuck_runner.cleanup()

    asyncio.run(run())


def test_with_the_flag_a_request_waits_for_the_restarted_engine_and_goes_to_it():
    async def run():
        dead = dead_url()
        client = AsyncEngineClient([dead], timeout=5, wait_for_replacement=True)
        url, runner = await fake_engine("restarted")
        try:
            request = asyncio.ensure_future(client.generate(BODY))
            for _ in range(100):  # the driver sees the failed engine...
                if client.failed() == [dead]:
                    break
                await asyncio.sleep(0.02)
            assert client.failed() == [dead] and not request.done()  # ...while the request waits
            client.replace(dead, url)  # the driver restarted it
            out = await asyncio.wait_for(request, 10)
            assert out["text"] == "restarted" and client.failed() == [] and client.urls == [url]
        finally:
            await client.close()
            await runner.cleanup()

    asyncio.run(run())


def test_with_the_flag_requests_of_a_dead_engine_go_to_a_live_one_at_once():
    async def run():
        dead = dead_url()
        url, runner = await fake_engine("live")
        client = AsyncEngineClient([dead, url], timeout=5, wait_for_replacement=True)
        client.inflight[url] = 1  # the least-loaded pick goes to the dead engine first
        try:
            out = await asyncio.wait_for(client.generate(BODY), 10)
            assert out["text"] == "live" and client.failed() == [dead]
        finally:
            await client.close()
            await runner.cleanup()

    asyncio.run(run())


def test_an_engine_that_answers_5xx_is_alive_the_request_is_sent_again_and_no_engine_is_taken_out(monkeypatch):
    """SGLang answers 503 "Retracted ... Retry later" under memory pressure, 500 for a request it aborted: the engine
    answered, so it stays in rotation (not handed to --use-fault-tolerance) and the request goes again after a
    pause; one that keeps answering 5xx fails the request after ANSWERED_5XX_RETRIES, still not taken out (under
    --use-fault-tolerance it is then handed to the restarts: a router over a dead engine answers 5xx too)."""
    # raising=False: a client without the retry fails this test on behaviour, not on the missing constant
    monkeypatch.setattr(engine_client, "ANSWERED_5XX_BACKOFF_S", 0.01, raising=False)

    async def run():
        url, runner = await fake_engine("ok", errors=[503, 500])
        failing, failing_runner = await fake_engine("never", errors=[500] * 100)
        client = AsyncEngineClient([url], timeout=5, max_retries=0)
        try:
            out = await client.generate(BODY)
            assert out["text"] == "ok" and not client.dead and client.failed() == []
            assert (await client.generate(BODY))["text"] == "ok"  # later requests still go to it
            await client.close()
            client = AsyncEngineClient([failing], timeout=5, wait_for_replacement=False)
            with pytest.raises(EngineError, match=r"answered HTTP 500.*sent 6 times"):
                await client.generate(BODY)
            assert not client.dead and client.failed() == []
            await client.close()
            # under --use-fault-tolerance an engine that answers nothing but 5xx is restarted in the end
            client = AsyncEngineClient([failing], timeout=5, wait_for_replacement=True)
            request = asyncio.ensure_future(client.generate(BODY))
            for _ in range(200):
                if client.failed() == [failing]:
                    break
                await asyncio.sleep(0.02)
            client.replace(failing, url)
            assert (await asyncio.wait_for(request, 10))["text"] == "ok"
        finally:
            await client.close()
            await runner.cleanup()
            await failing_runner.cleanup()

    asyncio.run(run())


def test_an_engine_whose_model_thread_is_down_is_dead_and_the_request_goes_elsewhere(monkeypatch):
    """The embedded engine whose model thread stopped (a sticky device error) answers /generate with a 503 saying
    ENGINE_DOWN: not an engine that is alive and busy, so the client takes it out at once (no retries on it) and the
    request goes to the live one. The engines are FAKES."""
    monkeypatch.setattr(engine_client, "ANSWERED_5XX_BACKOFF_S", 0.01)
    down = engine_client.ENGINE_DOWN + "engine error: the model thread stopped (RuntimeError: CUDA error)"

    async def run():
        broken, broken_runner = await fake_engine("never", healthy=False, errors=[503] * 100, error_text=down)
        url, runner = await fake_engine("live")
        client = AsyncEngineClient([broken, url], timeout=5, max_retries=1)
        client.inflight[url] = 1  # the least-loaded pick goes to the broken engine first
        try:
            out = await asyncio.wait_for(client.generate(BODY), 10)
            assert out["text"] == "live" and client.failed() == [broken]
        finally:
            await client.close()
            await runner.cleanup()
            await broken_runner.cleanup()

    asyncio.run(run())


async def scripted_engine(answer):
    """A FAKE engine whose /generate answers ``answer(body)`` (a dict, or a list for a batched body) and records the
    bodies it got; returns (url, runner, bodies)."""
    from aiohttp import web

    bodies: list[dict] = []

    async def generate(request):
        body = await request.json()
        bodies.append(body)
        return web.json_response(answer(body))

    app = web.Application()
    app.router.add_post("/generate", generate)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return f"http://127.0.0.1:{port}", runner, bodies


def _answer(name: str, ids: list[int], message: str | None = None) -> dict:
    reason = {"type": "stop"} if message is None else {"type": "abort", "message": message}
    return {"text": name, "output_ids": [ids[-1]], "meta_info": {"finish_reason": reason}}


def test_a_request_the_engine_failed_goes_again_to_another_engine_and_only_the_failed_prompts_of_a_batch():
    """A step that raised (a device error) aborts its requests with an ``ENGINE_ERROR`` message: the engine answered
    (it stays in rotation), and the client sends those requests again, to another live engine where there is one,
    the prompts of a batch that did not fail kept as they are; a client's own abort (over-sampling's) is not sent
    again, nor one the engine failed for its own sake (a "request error"); a request that keeps failing comes back
    aborted after ENGINE_ERROR_RETRIES more tries. FAKE engines."""
    failing = engine_client.ENGINE_ERROR + "RuntimeError: CUDA error: an illegal memory access was encountered"

    def broken_answer(body):  # fails the prompts whose last token is 7; aborts those ending in 9 as a client asked
        def one(ids):
            return _answer("broken", ids, failing if ids[-1] == 7 else "Abort requested" if ids[-1] == 9
                           else "request error: ValueError: its stop rules" if ids[-1] == 8 else None)
        return [one(ids) for ids in body["input_ids"]] if isinstance(body["input_ids"][0], list) \
            else one(body["input_ids"])

    def live_answer(body):
        return [_answer("live", ids) for ids in body["input_ids"]] if isinstance(body["input_ids"][0], list) \
            else _answer("live", body["input_ids"])

    async def run():
        broken, broken_runner, broken_bodies = await scripted_engine(broken_answer)
        live, live_runner, live_bodies = await scripted_engine(live_answer)
        client = AsyncEngineClient([broken, live], timeout=5)
        client.inflight[live] = 1  # the least-loaded pick goes to the broken engine first
        try:
            out = await client.generate({"input_ids": [1, 7], "sampling_params": {"max_new_tokens": 1}})
            assert out["text"] == "live" and len(broken_bodies) == len(live_bodies) == 1 and not client.dead
            batch = {"input_ids": [[1, 2], [1, 7], [1, 9], [3, 7]], "rid": "g", "extra_key": ["a", "b", "c", "d"],
                     "sampling_params": [{"max_new_tokens": k} for k in range(1, 5)], "return_logprob": True,
                     "token_ids_logprob": [5, 6, 7, 8]}  # a flat list: every prompt's, though 4 long
            outs = await client.generate(batch)
            assert [o["text"] for o in outs] == ["broken", "live", "broken", "live"]
            assert outs[2]["meta_info"]["finish_reason"]["message"] == "Abort requested"  # not sent again
            assert live_bodies[-1] == {"input_ids": [[1, 7], [3, 7]], "rid": ["g_1", "g_3"], "extra_key": ["b", "d"],
                                       "return_logprob": True, "token_ids_logprob": [5, 6, 7, 8],
                                       "sampling_params": [{"max_new_tokens": 2}, {"max_new_tokens": 4}]}
            sent = len(broken_bodies)
            out = await client.generate({"input_ids": [1, 8], "sampling_params": {"max_new_tokens": 1}})
            assert out["text"] == "broken" and len(broken_bodies) == sent + 1  # its own error: not sent again
            await client.close()
            client = AsyncEngineClient([broken], timeout=5)  # nowhere else to go: it comes back aborted
            out = await client.generate({"input_ids": [1, 7], "sampling_params": {"max_new_tokens": 1}})
            assert engine_client.engine_failed(out) and out["meta_info"]["finish_reason"]["message"] == failing
            assert len(broken_bodies) == sent + 2 + engine_client.ENGINE_ERROR_RETRIES and not client.dead
        finally:
            await client.close()
            await broken_runner.cleanup()
            await live_runner.cleanup()

    asyncio.run(run())


def test_an_engine_that_dies_while_answering_is_no_answer_naming_it():
    """The connection closes before the body the engine announced is complete (its process died mid-answer):
    ``request_json`` and ``SentRequest`` both raise EngineUnreachable naming the engine, not http.client's
    IncompleteRead. The engine is a FAKE: a raw socket that sends half an answer and closes."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)

    def serve() -> None:
        for _ in range(2):
            conn, _ = listener.accept()
            # the whole request first (headers, then the body they announce): a close with unread bytes resets the
            # connection, which the client would see as a reset before any answer instead of a cut-off one
            raw = b""
            while b"\r\n\r\n" not in raw:
                raw += conn.recv(65536)
            head, _, body = raw.partition(b"\r\n\r\n")
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:")))
            while len(body) < length:
                body += conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"su")
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    try:
        for call in (lambda: engine_client.request_json(url, "/update_weights_from_tensor", {"x": 1}, timeout=5),
                     lambda: engine_client.SentRequest(url, "/update_weights_from_tensor", {"x": 1}).result()):
            with pytest.raises(EngineUnreachable, match=rf"engine {url}/update_weights_from_tensor did not answer "
                                                         r"\(IncompleteRead"):
                call()
    finally:
        listener.close()


# ---- on a GPU (scripts/test-gpu.sh): colocated, engine and trainer on one GPU, the engine killed mid-rollout -------
def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs CUDA")
def test_a_colocated_engine_killed_on_a_gpu_is_restarted_there_with_the_trained_weights(tiny_model_dir, tmp_path):
    """The GPU case of tests/test_loop.py's fault test: the engine shares the trainer's GPU (--colocate, so the
    trainer is offloaded while it generates); the new engine starts on that GPU, gets weights version 1 (checked
    equal) and the run ends with rollout 1 sampled from them."""
    import json
    import subprocess
    import sys

    from slime_lite.tasks import make_data

    data = tmp_path / "addition.jsonl"
    make_data("addition", str(data), n_train=64, n_eval=8, seed=0)
    argv = ["--hf-checkpoint", str(tiny_model_dir), "--prompt-data", str(data), "--rm-type", "addition",
            "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "6",
            "--lr", "3e-3", "--entropy-coef", "0.01", "--num-rollout", "2", "--colocate", "--use-fault-tolerance",
            "--debug-inject-fault", "kill-engine", "--metrics-path", str(tmp_path / "m.jsonl")]
    proc = subprocess.run([sys.executable, "-m", "slime_lite.cli", "train", *argv], capture_output=True, text=True,
                          timeout=900, check=False)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert "engine 0 restarted at http://" in log and "weights version 1 pushed, weight check passed" in log
    rows = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["rollout/engine_restarts"] for r in rows] == [0.0, 1.0]
    assert rows[1]["rollout/weight_version"] == 1.0 and rows[1]["train/train_rollout_logprob_abs_diff"] < 1e-3


def test_kill_engine_behind_a_router_waits_for_the_engine_not_the_router(tiny_model_dir, tmp_path, monkeypatch):
    """--debug-inject-fault kill-engine with --use-sglang-router: /generate goes to the router, but the fault kills
    engine 0's server, so it must wait for engine 0's own URL to stop answering (a router keeps answering /health
    whatever its workers do: waiting on it ends in "still answers 30 s after SIGKILL"). The engine actor is a FAKE
    and the health probe is stubbed: nothing listens; only which URL is probed is under test."""
    from slime_lite.args import parser_defaults
    from slime_lite.rollout import manager as manager_mod

    class FakeEngineActor:
        class kill_server:  # noqa: N801 - the shape of a Ray actor method handle
            calls = 0

            @classmethod
            def remote(cls):
                cls.calls += 1

    probed = []

    def health(url, route, *a, **kw):
        probed.append(url)
        raise EngineError(f"engine {url}{route} did not answer")

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "1+1=", "label": "2"}\n')
    args = parser_defaults(hf_checkpoint=str(tiny_model_dir), prompt_data=str(prompts), rm_type="addition",
                           rollout_batch_size=1, n_samples_per_prompt=1, rollout_max_response_len=2)
    router, worker = "http://127.0.0.1:1111", "http://127.0.0.1:2222"
    manager = manager_mod.RolloutManager(args, [router], FakeEngineActor(), [worker])
    monkeypatch.setattr(manager_mod, "request_json", health)
    asyncio.run(manager.generator.kill_engine())
    assert FakeEngineActor.kill_server.calls == 1 and probed == [worker]


def test_stopping_the_fleet_stops_every_engine_and_the_router_past_a_dead_engine(monkeypatch):
    """Shutdown with a dead engine actor (its stop raises) and a stuck one (its stop never answers): the others and
    the router are still stopped, and the stuck one costs at most the timeout. The actors, their refs and the router
    are FAKES (ray.get is stubbed): only the fleet's order of stops is under test."""
    import slime_lite.rollout.engines as engines

    stopped: list[str] = []

    class Actor:
        def __init__(self, name: str) -> None:
            self.stop = type("M", (), {"remote": staticmethod(lambda: name)})

    def get(ref, timeout=None):
        assert timeout is not None  # a stuck engine must not hold the shutdown forever
        if ref == "dead":
            raise RuntimeError("ActorDiedError (fake)")
        if ref == "stuck":
            raise TimeoutError("GetTimeoutError (fake)")
        stopped.append(ref)

    monkeypatch.setattr(engines.ray, "get", get)
    router = type("Router", (), {"stop": lambda self: stopped.append("router")})()
    fleet = engines.EngineFleet([Actor("dead"), Actor("stuck"), Actor("e2")], ["u0", "u1", "u2"], router)
    fleet.stop(timeout=1.0)
    assert stopped == ["e2", "router"]
