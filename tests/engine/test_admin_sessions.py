"""Ends of the admin routes' sessions racing with other requests (admin_routes.py): a weight update still in flight
(its body being read, queued for the model thread, or recording its version) when its weight-update session ends,
and two clients stopping (or starting) one profile at once. A FAKE model thread
(``ModelThread``: it runs the queued calls when the test says, or at once) and FAKE requests; the interleavings are
forced by the test, not left to timing."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
from types import SimpleNamespace

import pytest

from slime_lite.engine.admin_routes import _Admin
from slime_lite.engine.http_json import BadRequest
from slime_lite.engine.weights import WeightError
from slime_lite.types import PARTIAL_VERSION


class ModelThread:
    """FAKE: the scheduler's model thread. ``hold``: calls wait in ``queued`` until the test runs them (in order)."""

    def __init__(self) -> None:
        self.weight_version = "6"
        self.queued: list = []
        self.hold = False
        self.loaded: list[str] = []
        self.weights = SimpleNamespace(drop_pending_adapters=lambda: None, pending_adapters=lambda: [],
                                       load_from_disk=self.load_from_disk)

    def load_from_disk(self, path: str) -> int:
        if path.startswith("/refused"):
            raise WeightError(f"{path}: no such checkpoint")
        self.loaded.append(path)
        return 1

    def call(self, fn, *args) -> concurrent.futures.Future:
        done: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            if not done.set_running_or_notify_cancel():  # as the scheduler: a cancelled call does not run
                return
            try:
                done.set_result(fn(*args))
            except Exception as exc:  # noqa: BLE001 - the caller's future raises it
                done.set_exception(exc)

        self.queued.append(run)
        if not self.hold:
            self.queued.pop()()
        return done

    def run_queued(self) -> None:
        while self.queued:
            self.queued.pop(0)()


class Request:
    """FAKE: a POST with a JSON body."""

    method = "POST"
    query: dict = {}

    def __init__(self, body: dict | None = None) -> None:
        self.raw = json.dumps(body).encode() if body else b""

    async def read(self) -> bytes:
        return self.raw


async def _queued(admin_call, model: ModelThread) -> asyncio.Future:
    """``admin_call`` started and waiting in the model thread (held)."""
    model.hold = True
    task = asyncio.ensure_future(admin_call)
    await asyncio.sleep(0)
    assert model.queued, "the call did not reach the model thread"
    model.hold = False
    return task


@pytest.mark.parametrize("into_next", [False, True], ids=["after-its-end", "inside-the-next-session"])
def test_an_update_refused_after_its_session_ended_fails_no_other_session(tmp_path, into_next):
    """A bucket sent inside session 1 is still queued when session 1 ends (its client gave up waiting and closed
    the session), and is refused afterwards. Session 1's version named weights the engine never got: the engine
    serves "partial". The refusal is session 1's: a session 2 begun meanwhile by the next push, complete, ends
    as a success naming its own version (it used to end with a 400 "an update of this session failed")."""

    async def scenario() -> list:
        model = ModelThread()
        admin = _Admin(model, str(tmp_path), lambda *a: None)
        from_disk = admin.in_session(admin.update_weights_from_disk)
        assert (await admin.begin_weight_update(Request())).status == 200
        assert (await from_disk(Request({"model_path": "/ckpt/a", "weight_version": "7"}))).status == 200
        late = await _queued(from_disk(Request({"model_path": "/refused/b", "weight_version": "7"})), model)
        assert (await admin.end_weight_update(Request())).status == 200  # nothing refused yet: a success
        assert model.weight_version == "7"
        if into_next:
            assert (await admin.begin_weight_update(Request())).status == 200
        model.run_queued()
        assert (await late).status == 400
        seen = [model.weight_version]  # "partial": bucket b of version 7 never arrived
        if into_next:
            assert (await from_disk(Request({"model_path": "/ckpt/c", "weight_version": "8"}))).status == 200
            end = await admin.end_weight_update(Request())
            seen += [end.status, json.loads(end.text)["message"], model.weight_version]
        return seen

    expected = [PARTIAL_VERSION] + ([200, "Success", "8"] if into_next else [])
    assert asyncio.run(scenario()) == expected


def test_an_update_whose_body_arrives_after_its_session_ended_leaves_the_weights_partial(tmp_path):
    """An update comes in inside a session; its body (a bucket of tensors) is still being read when the session
    ends. It is that session's update, applied after the session's end: the engine serves "partial", not the
    update's version as if it had come in outside a session."""

    class SlowRequest(Request):  # FAKE: a body that arrives when the test says
        def __init__(self, body: dict, arrived: asyncio.Event) -> None:
            super().__init__(body)
            self.arrived = arrived

        async def read(self) -> bytes:
            await self.arrived.wait()
            return self.raw

    async def scenario() -> str:
        model = ModelThread()
        admin = _Admin(model, str(tmp_path), lambda *a: None)
        from_disk = admin.in_session(admin.update_weights_from_disk)
        assert (await admin.begin_weight_update(Request())).status == 200
        arrived = asyncio.Event()
        update = asyncio.ensure_future(from_disk(SlowRequest({"model_path": "/ckpt/a", "weight_version": "7"},
                                                             arrived)))
        await asyncio.sleep(0)  # in the route, reading its body
        assert (await admin.end_weight_update(Request())).status == 200
        arrived.set()
        assert (await update).status == 200
        assert model.loaded == ["/ckpt/a"]
        return model.weight_version

    assert asyncio.run(scenario()) == PARTIAL_VERSION


def test_a_session_end_while_the_model_thread_records_an_update_never_names_the_old_weights(tmp_path):
    """The model thread has applied an update of the open session, and the update's record in the session (in the
    server's event loop, another thread) has not run yet when the session's end arrives. The end must not commit
    what was recorded before it while the update's version goes into a closed session: the engine would name its
    old weights ("6") while it holds the update's. The end closes the session only after its own call to the model
    thread, queued behind the update, has come back, by which time the update's record in the session is done: it
    commits the update's version. A REAL second thread runs the model thread's calls; the event loop is held
    (``applied.wait``) between the update's apply and its record, and the end arrives there."""

    applied = threading.Event()  # the model thread is done with the update
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="model")
    model = SimpleNamespace(weight_version="6", weights=SimpleNamespace(drop_pending_adapters=lambda: None,
                                                                        pending_adapters=lambda: []))

    def call(fn, *args):
        future = pool.submit(fn, *args)
        future.add_done_callback(lambda _: applied.set())
        return future

    model.call = call

    async def scenario() -> None:
        admin = _Admin(model, str(tmp_path), lambda *a: None)
        assert (await admin.begin_weight_update(Request())).status == 200
        applied.clear()
        update = asyncio.ensure_future(admin._weight_op(lambda: 1, version="7"))
        await asyncio.sleep(0)  # submitted to the model thread
        assert applied.wait(10)  # (blocks the event loop: the update's record waits until the end has arrived)
        end = asyncio.ensure_future(admin.end_weight_update(Request()))
        assert (await end).status == 200
        assert (await update).status == 200
        assert model.weight_version == "7"  # the update's version, committed by the end: not "6"

    try:
        asyncio.run(scenario())
    finally:
        pool.shutdown(wait=True)


class Profiler:
    """FAKE: ``TorchProfile`` (start; stop(path) writes the trace, None when none was running)."""

    def __init__(self) -> None:
        self.prof = None

    def start(self, record_shapes: bool, with_stack: bool) -> None:
        if self.prof is not None:
            raise RuntimeError("a profiler is already running in this process; stop it first")
        self.prof = object()

    def stop(self, path: str) -> str | None:
        if self.prof is None:
            return None
        self.prof = None
        with open(path, "w") as f:
            f.write("{}")
        return path


def test_two_session_ends_at_once_end_it_once_and_a_half_adapter_fails_it(tmp_path):
    """Two clients send /end_weight_update at once (both waiting for the adapter check in the model thread): one
    ends the session, the other is told none is open. A session whose push left a LoRA adapter half without its
    other half is refused at its end, naming the weight, and the engine serves "partial"."""

    async def scenario() -> None:
        model = ModelThread()
        admin = _Admin(model, str(tmp_path), lambda *a: None)
        assert (await admin.begin_weight_update(Request())).status == 200
        admin.session_version = "7"  # an update of the session recorded its version
        first = await _queued(admin.end_weight_update(Request()), model)
        second = await _queued(admin.end_weight_update(Request()), model)
        model.run_queued()
        assert [(await first).status, (await second).status] == [200, 400]
        assert "no weight-update session is open" in json.loads((await second).text)["message"]
        assert model.weight_version == "7"
        model.weights.pending_adapters = lambda: ["model.layers.0.mlp.down_proj.weight"]  # its lora_B never came
        assert (await admin.begin_weight_update(Request())).status == 200
        admin.session_version = "8"
        end = await admin.end_weight_update(Request())
        assert end.status == 400 and "adapters of model.layers.0.mlp.down_proj.weight came with one half" in end.text
        assert model.weight_version == PARTIAL_VERSION and not admin.weight_session

    asyncio.run(scenario())


def test_two_stop_profiles_at_once_stop_the_profile_once(tmp_path):
    """Two clients send /stop_profile while the profile is still running (both queued for the model thread): one
    gets the trace; the other is refused, never answered "Trace written to None"."""

    async def scenario() -> None:
        model = ModelThread()
        admin = _Admin(model, str(tmp_path), lambda *a: None)
        admin.profile = Profiler()
        assert (await admin.start_profile(Request({"profile_prefix": "p"}))).status == 200
        first = await _queued(admin.stop_profile(Request()), model)
        model.hold = True
        second = asyncio.ensure_future(admin.stop_profile(Request()))
        await asyncio.sleep(0)
        model.hold = False
        model.run_queued()
        assert "Trace written to " + str(tmp_path) in (await first).text
        with pytest.raises(BadRequest, match="no profile is running"):
            await second

    asyncio.run(scenario())


def test_a_start_profile_while_another_starts_is_refused_and_leaves_its_trace_path(tmp_path):
    """Two clients send /start_profile at once (the first still queued for the model thread): the second is refused
    with a 400, and the first's trace is written where the first asked (its prefix), not the second's."""

    async def scenario() -> None:
        model = ModelThread()
        admin = _Admin(model, str(tmp_path), lambda *a: None)
        admin.profile = Profiler()
        first = await _queued(admin.start_profile(Request({"profile_prefix": "first"})), model)
        model.hold = True
        second = asyncio.ensure_future(admin.start_profile(Request({"profile_prefix": "second"})))
        await asyncio.sleep(0)
        model.hold = False
        model.run_queued()
        assert (await first).status == 200
        with pytest.raises(BadRequest, match="already running"):
            await second
        stopped = (await admin.stop_profile(Request())).text
        assert "/first-" in stopped and "/second-" not in stopped

    asyncio.run(scenario())


def test_a_stop_profile_whose_client_left_still_stops_the_profile(tmp_path):
    """The client of a /stop_profile still queued for the model thread disconnects (the server cancels its
    handler): the stop still runs, so the profiler does not record on with no path left to stop it."""

    async def scenario() -> None:
        model = ModelThread()
        admin = _Admin(model, str(tmp_path), lambda *a: None)
        admin.profile = Profiler()
        assert (await admin.start_profile(Request({"profile_prefix": "p"}))).status == 200
        model.hold = True
        stop = asyncio.ensure_future(admin.stop_profile(Request()))
        await asyncio.sleep(0)
        stop.cancel()
        await asyncio.sleep(0)
        model.hold = False
        model.run_queued()
        assert admin.profile.prof is None and list(tmp_path.glob("p-*.trace.json"))
        assert (await admin.start_profile(Request({"profile_prefix": "q"}))).status == 200

    asyncio.run(scenario())


def test_a_bucket_applied_after_its_session_ended_is_partial_from_the_next_step(tmp_path):
    """A bucket of an ended session applies in the model thread: the decode steps that run before the event loop
    records it already name "partial", not the version the end named."""

    async def scenario() -> list[str]:
        model = ModelThread()
        admin = _Admin(model, str(tmp_path), lambda *a: None)
        from_disk = admin.in_session(admin.update_weights_from_disk)
        assert (await admin.begin_weight_update(Request())).status == 200
        assert (await from_disk(Request({"model_path": "/ckpt/a", "weight_version": "7"}))).status == 200
        late = await _queued(from_disk(Request({"model_path": "/ckpt/b", "weight_version": "7"})), model)
        assert (await admin.end_weight_update(Request())).status == 200
        model.run_queued()
        seen = [model.weight_version]  # what the model thread's next step stamps, before the event loop runs
        assert (await late).status == 200
        return seen + [model.weight_version]

    assert asyncio.run(scenario()) == [PARTIAL_VERSION, PARTIAL_VERSION]


def test_a_session_end_names_its_version_between_two_steps_of_the_model_thread(tmp_path):
    """The end wrote ``weight_version`` from the event loop while the model thread labelled a step's tokens one by
    one: a step's tokens could carry two versions. It is written by a call of the model thread (held here, as a
    step in flight holds it), and the end answers once it is."""

    async def scenario() -> None:
        model = ModelThread()
        admin = _Admin(model, str(tmp_path), lambda *a: None)
        from_disk = admin.in_session(admin.update_weights_from_disk)
        assert (await admin.begin_weight_update(Request())).status == 200
        assert (await from_disk(Request({"model_path": "/ckpt/a", "weight_version": "7"}))).status == 200
        model.hold = True
        end = asyncio.ensure_future(admin.end_weight_update(Request()))
        for _ in range(3):
            await asyncio.sleep(0)
        model.run_queued()  # its question for LoRA halves left waiting
        for _ in range(3):
            await asyncio.sleep(0)
        assert model.weight_version == "6" and not end.done()  # the model thread is busy: not named yet
        model.run_queued()
        assert (await end).status == 200 and model.weight_version == "7"

    asyncio.run(scenario())
