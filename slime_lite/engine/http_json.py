"""JSON in and out of the engine's routes (server.py, admin_routes.py, openai_api.py): request bodies, responses,
and the 400 error every route raises for a request it refuses."""

from __future__ import annotations

import json
import math
import re
from typing import Any

from aiohttp import web


class BadRequest(ValueError):
    """A request the engine refuses (HTTP 400 with {"error": {"message": ...}})."""


def _finite(value: Any) -> Any:
    """``value`` with every NaN or infinite float replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def dumps(data: Any) -> str:
    """Standard JSON text of ``data``: a NaN or infinite float (NaN weights give NaN log-probs) is null, as SGLang's
    orjson writes it, never the ``NaN`` / ``Infinity`` that JSON parsers refuse."""
    try:
        return json.dumps(data, allow_nan=False)
    except ValueError:  # a non-finite float somewhere: the rare case pays for the walk
        return json.dumps(_finite(data), allow_nan=False)


def json_response(data: Any, status: int = 200):
    return web.Response(text=dumps(data), status=status, content_type="application/json")


def error_response(message: str, status: int = 400):
    return json_response({"error": {"message": message}}, status)


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # how JSON spells a UTF-16 surrogate
_SURROGATE = re.compile("[\ud800-\udfff]")


def _lone_surrogate(value: Any, path: str) -> str | None:
    """The path of the first string (key or value) holding a lone UTF-16 surrogate: JSON's ``\\ud800`` escapes
    decode to one, which is not text (no tokenizer or encoder takes it)."""
    if isinstance(value, str):
        return path if _SURROGATE.search(value) else None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        where = f"{path}.{key}" if isinstance(key, str) else f"{path}[{key}]"
        if isinstance(key, str) and _SURROGATE.search(key):
            return where
        found = _lone_surrogate(item, where)
        if found:
            return found
    return None


async def read_body(request) -> dict[str, Any]:
    """The request's JSON object (a GET without a body: its query parameters); an empty body is ``{}``. Text that
    is not valid Unicode (a lone surrogate, escaped or encoded) is refused, naming the field where JSON escaped it."""
    raw = await request.read()
    if request.method == "GET" and not raw.strip():
        data: Any = dict(request.query)
    elif not raw.strip():
        return {}
    else:
        try:  # strict UTF-8 first: json.loads on bytes would let an encoded lone surrogate (b"\xed\xa0\x80") through
            text = raw.decode("utf-8-sig")  # (a leading BOM dropped, as json.loads on bytes drops it)
        except UnicodeDecodeError as exc:
            raise BadRequest(f"body is not UTF-8 text: {exc}; send the JSON encoded as UTF-8") from None
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as exc:  # bad JSON; nesting deeper than the parser goes
            raise BadRequest(f"body is not valid JSON: {type(exc).__name__}: {exc}") from None
        if not isinstance(data, dict):
            raise BadRequest("body must be a JSON object")
        if not _SURROGATE_ESCAPE.search(raw):  # no surrogate escape: every string is valid Unicode
            return data
    try:
        where = _lone_surrogate(data, "")
    except RecursionError:
        raise BadRequest("body is nested too deeply") from None
    if where:
        raise BadRequest(f"{where.lstrip('.')}: text is not valid Unicode (a lone UTF-16 surrogate)")
    return data
