"""JSON in and out of the engine's routes (server.py, admin_routes.py, openai_api.py): request bodies, responses,
and the 400 error every route raises for a request it refuses."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web


class BadRequest(ValueError):
    """A request the engine refuses (HTTP 400 with {"error": {"message": ...}})."""


def json_response(data: Any, status: int = 200):
    return web.Response(text=json.dumps(data), status=status, content_type="application/json")


def error_response(message: str, status: int = 400):
    return json_response({"error": {"message": message}}, status)


async def read_body(request) -> dict[str, Any]:
    """The request's JSON object (a GET without a body: its query parameters); an empty body is ``{}``."""
    raw = await request.read()
    if request.method == "GET" and not raw.strip():
        return dict(request.query)
    if not raw.strip():
        return {}
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # bad JSON or encoding; nesting deeper than the parser goes
        raise BadRequest(f"body is not valid JSON: {type(exc).__name__}: {exc}") from None
    if not isinstance(data, dict):
        raise BadRequest("body must be a JSON object")
    return data
