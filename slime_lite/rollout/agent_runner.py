"""How the agent endpoint's hook runs an agent: an ``async def`` agent as a task of the rollout's event loop, anything
else in a daemon thread of its own working on a copy of its sample (so an agent on the synchronous openai client
neither blocks the loop that answers its calls nor, left running past its timeout, changes the sample kept)."""

from __future__ import annotations

import asyncio
import copy
import inspect
import threading
from typing import Any, Callable

from slime_lite.rollout.multi_turn import no_exit
from slime_lite.types import Sample


def start_agent(run: Callable[[str, Sample], Any], base_url: str, sample: Sample) -> asyncio.Future:
    """``run(base_url, sample)`` as a future of this loop: an ``async def`` agent as a task; anything else (a plain
    ``def`` on the synchronous openai client, a lambda or wrapper returning an agent's coroutine) called in a thread
    of its own, so the loop goes on serving its calls, and what it returns awaited here when it is awaitable. The
    thread works on a copy of the sample, copied back only when the agent finishes: one left running past the
    timeout (a thread cannot be stopped; its calls are answered 404) changes nothing the rollout keeps. An agent
    that calls sys.exit() raises ExitCalled instead (a SystemExit would stop the rollout's event loop)."""
    if inspect.iscoroutinefunction(run) or inspect.iscoroutinefunction(getattr(run, "__call__", None)):
        return asyncio.ensure_future(no_exit(run(base_url, sample), "the agent"))
    loop = asyncio.get_running_loop()

    async def in_thread() -> Any:
        mine, done = copy.deepcopy(sample), loop.create_future()

        def body() -> None:
            try:
                out, error = run(base_url, mine), None
            except BaseException as exc:  # noqa: BLE001 - the agent's failure, raised in the loop
                out, error = None, exc
            try:
                loop.call_soon_threadsafe(_settle, done, out, error)
            except RuntimeError:  # the loop has closed: nobody waits for this agent any more
                pass

        # a daemon thread: an agent stuck on its own I/O does not hold the process at exit
        threading.Thread(target=body, name="slime-lite-agent", daemon=True).start()
        out = await done
        if inspect.isawaitable(out):  # a wrapper that returned an async agent's coroutine
            out = await out
        sample.__dict__.update(mine.__dict__)
        return out

    return asyncio.ensure_future(no_exit(in_thread(), "the agent"))


def _settle(future: asyncio.Future, out: Any, error: BaseException | None) -> None:
    if future.done():  # cancelled (the timeout)
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(out)
