"""Debug tools that work on rollout dumps: display, replay-reward, diff, send-to-engine."""

from __future__ import annotations

import os
import sys
from typing import Any

from rich.console import Console

from slime_lite.errors import DumpError
from slime_lite.rollout.dumps import check_template, find_dumps


def select_dumps(template: str, rollout_id: int | None = None, flag: str = "--load-debug-rollout-data") -> list[
    tuple[str, int, str]
]:
    """Dumps named by ``template``: (kind 'train'|'eval', rollout id, path), optionally only one rollout id.

    A path without ``{rollout_id}`` is taken as one dump file (kind 'file', id -1).
    """

    if "{rollout_id}" not in template:
        if not os.path.exists(template):
            raise DumpError(f"{flag} {template}: no such file (a template needs a '{{rollout_id}}' placeholder).")
        return [("file", -1, template)]
    check_template(template, flag)  # e.g. a train dump's {rank}: one line, not a KeyError
    found = find_dumps(template, ids=None if rollout_id is None else [rollout_id])  # any id, past 999 too
    if not found:
        which = f"rollout id {rollout_id}" if rollout_id is not None else "rollout ids 0..999"
        raise DumpError(
            f"{flag} {template}: no train or eval dump found for {which} "
            f"(looked for e.g. {template.format(rollout_id=rollout_id or 0)} and "
            f"{template.format(rollout_id=f'eval_{rollout_id or 0}')}). Check the path and the placeholder."
        )
    return found


def make_console() -> Any:
    """A rich console; wide when not a terminal, so piped output keeps whole rows."""

    return Console(width=None if sys.stdout.isatty() else 160, highlight=False)


def shorten(text: Any, limit: int) -> str:
    """``text`` as a string, with the middle elided past ``limit`` characters (``limit <= 0``: unchanged)."""
    if isinstance(text, list):  # chat prompt
        text = "\n".join(f"{m.get('role', '?')}: {m.get('content', '')}" if isinstance(m, dict) else str(m) for m in text)
    text = "" if text is None else str(text)
    if limit <= 0 or len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]} [... {len(text) - 2 * half} chars ...] {text[-half:]}"
