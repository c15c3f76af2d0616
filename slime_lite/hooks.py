"""User hooks given as dotted paths (``module.function``), as slime's ``--*-path`` flags name them: loading them, and
the read-only ``args`` they are called with."""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from typing import Any, Callable

from slime_lite.errors import SlimeLiteError


def load_function(path: str, flag: str) -> Callable[..., Any]:
    """Import ``module.function`` (module importable from the working directory or PYTHONPATH).

    ``flag`` is the command-line flag that named the hook, used in the error message.
    """
    module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise SlimeLiteError(f"{flag} {path!r}: expected a dotted path 'module.function', e.g. 'my_rm.reward'.")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise SlimeLiteError(
            f"{flag} {path!r}: cannot import module {module_name!r} ({exc}). "
            "Put it in the working directory or on PYTHONPATH."
        ) from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise SlimeLiteError(f"{flag} {path!r}: module {module_name!r} has no function {attr!r}.")
    return fn


async def call_maybe_async(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call a hook that may be a plain function or a coroutine function."""
    result = fn(*args, **kwargs)
    if inspect.isawaitable(result):
        result = await result
    return result


class HookArgs:
    """The ``args`` a user hook is called with (slime's hooks take the run's args): every flag, read-only, plus what
    slime's hooks read that is not a flag: ``sglang_router_ip`` / ``sglang_router_port`` (where /generate goes: the
    router, else the first engine; they follow a restarted engine) and ``engine_client``, slime_lite's async client
    over every engine (``await args.engine_client.generate(body)``: retries, fails over, follows restarts)."""

    def __init__(self, flags: Any, engine_client: Any = None) -> None:
        object.__setattr__(self, "_flags", flags)
        object.__setattr__(self, "engine_client", engine_client)

    def _address(self) -> tuple[str, int | None]:
        if self.engine_client is None:
            return "", None
        host, _, port = self.engine_client.urls[0].rsplit("/", 1)[-1].partition(":")
        return host, int(port) if port else None

    @property
    def sglang_router_ip(self) -> str:
        return self._address()[0]

    @property
    def sglang_router_port(self) -> int | None:
        return self._address()[1]

    def __getattr__(self, name: str) -> Any:
        if name == "_flags":  # not yet set (a copy being built)
            raise AttributeError(name)
        return getattr(self._flags, name)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"a hook's args are read-only (tried to set {name!r}); keep a hook's own state in the "
                             "sample's metadata or in the hook's module")
