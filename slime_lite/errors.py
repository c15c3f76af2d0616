"""User-facing errors: the CLI prints these without a traceback and exits non-zero."""

from __future__ import annotations

import sys
from collections.abc import Callable


class SlimeLiteError(Exception):
    """A problem with the user's input (flag, file, environment) that names what is wrong and the fix."""


class DumpError(SlimeLiteError):
    """A rollout dump file that cannot be used (missing, truncated, wrong schema, unsafe)."""


class EngineError(SlimeLiteError):
    """A rollout engine that failed, died or could not be reached."""


class EngineUnreachable(EngineError):
    """No answer from an engine at all (refused, reset, timed out): ``url``, ``route`` and the socket's ``reason``."""

    def __init__(self, message: str, url: str, route: str, reason: object) -> None:
        super().__init__(message)
        self.url, self.route, self.reason = url, route, reason


class EngineTimeout(EngineError):
    """An engine request that got no answer within its timeout (``--rollout-request-timeout``)."""


def run_main(fn: Callable[[list[str] | None], int], argv: list[str] | None = None) -> int:
    """Run a command's ``main``: a SlimeLiteError becomes ``error: ...`` on stderr and exit code 2, an interrupt
    exit code 130 (every ``slime-lite`` command, and each module run as ``python -m``)."""
    try:
        return int(fn(argv) or 0)
    except SlimeLiteError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
