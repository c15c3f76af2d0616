"""--use-fault-tolerance edge cases found by review: an engine dead when the rollout reads the engines' weight
versions, or dead before an --offload-rollout resume; a router whose requests keep failing; the rollout's phase
times under a custom rollout function. The engines here are FAKES (an SGLang-shaped aiohttp server in a thread, and a
bound port nobody answers on); Ray, the engine actors, the manager and the router are fakes where named."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import types

import pytest

import slime_lite.rollout.recovery as rec
from slime_lite.args import parser_defaults
from slime_lite.errors import EngineError
from slime_lite.rollout.engines import EngineFleet

_HELD: list[socket.socket] = []


def dead_url() -> str:
    """A port bound and never listened on: connections are refused."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    _HELD.append(s)
    return f"http://127.0.0.1:{s.getsockname()[1]}"


class FakeEngine:
    """A fake SGLang server: /generate answers one token ("4", id 5) with an optional weight_version."""

    def __init__(self, weight_version: str | None = "3") -> None:
        self.weight_version, self.hits = weight_version, {}
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        threading.Thread(target=self._serve, args=(ready,), daemon=True).start()
        assert ready.wait(10)

    def _serve(self, ready: threading.Event) -> None:
        from aiohttp import web

        asyncio.set_event_loop(self.loop)

        async def answer(req):
            self.hits[req.path] = self.hits.get(req.path, 0) + 1
            if req.path == "/generate":
                ids = (await req.json())["input_ids"]
                meta = {"finish_reason": {"type": "stop"}, "output_token_logprobs": [[-0.5, 5, None]]}
                if self.weight_version is not None:
                    meta["weight_version"] = self.weight_version
                one = {"text": "4", "output_ids": [5], "meta_info": meta}
                return web.json_response([one] * len(ids) if ids and isinstance(ids[0], list) else one)
            if req.path == "/get_model_info":
                return web.json_response({"weight_version": self.weight_version or "default"})
            return web.json_response({"success": True})

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", answer)
        runner = web.AppRunner(app)
        self.loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        ready.set()
        self.loop.run_forever()


class Fn:  # a fake Ray actor method handle: .remote() runs it
    def __init__(self, fn) -> None:
        self.fn = fn

    def remote(self, *a):
        return self.fn(*a)


@pytest.fixture
def fake_ray(monkeypatch):
    monkeypatch.setattr(rec, "ray", types.SimpleNamespace(
        get=lambda x, timeout=None: x, wait=lambda refs, num_returns=1, timeout=None: (list(refs), []),
        exceptions=rec.ray.exceptions))


def _prompts(tmp_path, n: int) -> str:
    p = tmp_path / "p.jsonl"
    p.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "label": str(2 * i)}) + "\n" for i in range(n)))
    return str(p)


def test_a_dead_engine_does_not_fail_the_weight_version_read_from_the_engines(tiny_model_dir, tmp_path):
    """Samples without weight versions (a hook that records none): the version is read from the engines; one that
    died mid-rollout (its requests went to the live one) is left out, not a failed rollout."""
    from slime_lite.rollout.manager import RolloutManager

    live, dead = FakeEngine(weight_version=None), dead_url()
    args = parser_defaults(hf_checkpoint=str(tiny_model_dir), prompt_data=_prompts(tmp_path, 4), rm_type="addition",
                           rollout_batch_size=2, n_samples_per_prompt=2, rollout_max_response_len=4,
                           use_fault_tolerance=True, rollout_request_timeout=5.0)
    manager = RolloutManager(args, [dead, live.url])
    samples, metrics = manager.generate(0)
    assert len(samples) == 4 and manager.generator.client.failed() == [dead]
    assert metrics["rollout/weight_version"] == -1.0 and metrics["rollout/weight_version_from_engines"] == 1.0


def test_a_custom_rollout_functions_phase_times_are_its_own(tiny_model_dir, tmp_path, monkeypatch):
    """A --rollout-function-path that runs groups through the generator: rollout 1's perf/rollout/* times are
    measured from its own first request, not rollout 0's (a negative prepare time)."""
    from slime_lite.rollout.manager import RolloutManager

    (tmp_path / "hooks_phase.py").write_text(
        "import asyncio\n"
        "from slime_lite.rollout.functions import RolloutFnTrainOutput\n"
        "from slime_lite.rollout.generate import sampling_params\n"
        "async def rollout(args, rollout_id, data_source, evaluation=False):\n"
        "    gen = data_source.generator\n"
        "    groups = data_source.get_samples(2)\n"
        "    await asyncio.sleep(0.3)\n"
        "    return RolloutFnTrainOutput(samples=[await gen.run_group(g, sampling_params(gen.config), 0)\n"
        "                                         for g in groups])\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    engine = FakeEngine()
    args = parser_defaults(hf_checkpoint=str(tiny_model_dir), prompt_data=_prompts(tmp_path, 8), rm_type="addition",
                           rollout_batch_size=2, n_samples_per_prompt=2, rollout_max_response_len=4,
                           rollout_function_path="hooks_phase.rollout")
    manager = RolloutManager(args, [engine.url])
    for rollout_id in (0, 1):
        _, metrics = manager.generate(rollout_id)
        phases = {k: v for k, v in metrics.items() if k.startswith("perf/rollout/") and k.endswith("_time")}
        assert phases and all(0 <= v <= metrics["perf/rollout_time"] for v in phases.values()), phases
        time.sleep(0.5)


def test_an_engine_dead_before_an_offload_resume_is_replaced_first(fake_ray, monkeypatch):
    """--offload-rollout: the push resumes the engines' weight memory; an engine that died since the rollout is
    restarted before (it would fail the resume and stop the run), and its replacement is not resumed (it never
    released anything)."""
    from slime_lite.rollout.side import RolloutSide

    live, fresh, dead = FakeEngine(), FakeEngine(), dead_url()
    restarted = []
    monkeypatch.setattr(rec, "restart_engine", lambda args, pg, bundles, old, rank: (
        restarted.append(rank) or types.SimpleNamespace(alive=Fn(lambda: True)), fresh.url))  # a fake restart: the fresh fake engine's URL
    fleet = EngineFleet([types.SimpleNamespace(alive=Fn(lambda: True)), types.SimpleNamespace(alive=Fn(lambda: False))],
                        [live.url, dead])  # engine 1's server process exited
    manager = types.SimpleNamespace(failed_engines=Fn(lambda: []), replace_engine=Fn(lambda o, n: None))
    side = object.__new__(RolloutSide)
    side.config = types.SimpleNamespace(offload_rollout=True, fully_async=False, names_lora_adapter=False,
                                        pushes_after=lambda r: True)
    side.fleet = fleet
    side.recovery = rec.EngineRecovery(types.SimpleNamespace(), None, [0, 1], fleet, manager, push=lambda u, v: {})
    pushed = []
    side.push_weights(lambda urls, v: pushed.append(list(urls)), 1, {})
    assert restarted == [1] and pushed == [[live.url, fresh.url]]
    assert live.hits.get("/resume_memory_occupation") == 1 and "/resume_memory_occupation" not in fresh.hits
    side.resume_memory({})  # after training: the KV cache and CUDA graphs back, again to the engine that released them
    assert live.hits.get("/resume_memory_occupation") == 2 and "/resume_memory_occupation" not in fresh.hits
    side.resume_memory({})  # the next rollout's resume reaches every engine, the new one too
    assert live.hits.get("/resume_memory_occupation") == 3 and fresh.hits.get("/resume_memory_occupation") == 1


def test_a_router_whose_requests_keep_failing_is_bounded_and_counted(fake_ray):
    class Router:  # a fake router: every launch gets a new URL
        launches = 0

        def __init__(self) -> None:
            self.url, self.worker_urls = "http://r0", []

        def stop(self) -> None:
            pass

        def start(self) -> str:
            Router.launches += 1
            self.url = f"http://r{Router.launches}"
            return self.url

    fleet = EngineFleet([types.SimpleNamespace(alive=Fn(lambda: True))], ["http://e0"], Router())
    manager = types.SimpleNamespace(failed_engines=Fn(lambda: [fleet.router.url]), replace_engine=Fn(lambda o, n: None))
    recovery = rec.EngineRecovery(types.SimpleNamespace(), None, [0], fleet, manager, push=None)
    for _ in range(rec.MAX_RESTARTS_PER_STEP):
        recovery.check()
    assert recovery.take_restarts() == {"rollout/engine_restarts": 0.0, "rollout/router_restarts": 3.0}
    for _ in range(rec.MAX_RESTARTS_PER_STEP):  # a new step: the bound starts again
        recovery.check()
    with pytest.raises(EngineError, match=r"requests to the router \(http://r6\) failed 4 times in one rollout step"):
        recovery.check()
    assert Router.launches == 6


