"""Load user hooks given as dotted paths (``module.function``), as slime's ``--*-path`` flags do."""

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
