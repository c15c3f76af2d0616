"""User-facing errors: the CLI prints these without a traceback and exits non-zero."""

from __future__ import annotations


class SlimeLiteError(Exception):
    """A problem with the user's input (flag, file, environment) that names what is wrong and the fix."""


class DumpError(SlimeLiteError):
    """A rollout dump file that cannot be used (missing, truncated, wrong schema, unsafe)."""


class EngineError(SlimeLiteError):
    """A rollout engine that failed, died or could not be reached."""
