"""Control, weight and memory routes of the embedded engine (SGLang's names and shapes).

Every operation runs in the model thread between two generation steps (``Scheduler.call``). Weight routes answer
SGLang's ``{"success": bool, "message": str}``, with HTTP 400 when the update was refused (nothing changed then).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any, Callable

from slime_lite.engine.scheduler import EngineBusy
from slime_lite.engine.http_json import BadRequest, error_response, json_response, read_body
from slime_lite.engine.weights import WeightError

if TYPE_CHECKING:
    from slime_lite.engine.scheduler import Scheduler

logger = logging.getLogger(__name__)

GROUP = "weight_update_group"


def add_admin_routes(app: Any, scheduler: Scheduler) -> None:
    admin = _Admin(scheduler)
    posts = {
        "/flush_cache": admin.flush_cache, "/abort_request": admin.abort_request,
        "/pause_generation": admin.pause_generation, "/continue_generation": admin.continue_generation,
        "/update_weight_version": admin.update_weight_version,
        "/update_weights_from_disk": admin.update_weights_from_disk,
        "/update_weights_from_tensor": admin.update_weights_from_tensor,
        "/init_weights_update_group": admin.init_weights_update_group,
        "/update_weights_from_distributed": admin.update_weights_from_distributed,
        "/destroy_weights_update_group": admin.destroy_weights_update_group,
        "/release_memory_occupation": admin.release_memory, "/resume_memory_occupation": admin.resume_memory,
    }
    for path, handler in posts.items():
        app.router.add_post(path, handler)
    for path, handler in (("/get_weights_by_name", admin.get_weights_by_name),
                          ("/get_weights_checksum", admin.get_weights_checksum)):
        app.router.add_get(path, handler)
        app.router.add_post(path, handler)


class _Admin:
    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    async def run_in_model_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.wrap_future(self.scheduler.call(fn, *args))

    async def _weight_op(self, fn: Callable[..., Any], *args: Any, version: Any = None,
                         extra: dict[str, Any] | None = None):
        """Run a weight operation in the model thread, then set ``weight_version`` if given."""

        def op():
            result = fn(*args)
            if version is not None:
                self.scheduler.weight_version = str(version)
            return result

        try:
            result = await self.run_in_model_thread(op)
        except (WeightError, ValueError, RuntimeError) as exc:
            logger.error("weight operation refused: %s", exc)
            return json_response({"success": False, "message": str(exc)}, 400)
        msg = f"Succeeded ({result} tensors)" if isinstance(result, int) else "Succeeded"
        return json_response({"success": True, "message": msg, **(extra or {})})

    def _maybe_abort(self, body: dict[str, Any]) -> None:
        if body.get("abort_all_requests"):
            self.scheduler.abort(None, "aborted for a weight update")

    # ---- control -------------------------------------------------------------------------------------------
    async def flush_cache(self, request):
        try:
            await self.run_in_model_thread(self.scheduler.flush_cache)
        except EngineBusy as exc:
            return error_response(str(exc))
        return json_response({"success": True, "message": "Cache flushed."})

    async def abort_request(self, request):
        from aiohttp import web

        body = await read_body(request)
        if body.get("abort_all"):
            self.scheduler.abort(None)
        elif body.get("rid"):
            self.scheduler.abort(str(body["rid"]))
        else:
            raise BadRequest("send {'rid': ...} or {'abort_all': true}")
        return web.Response(status=200)

    async def pause_generation(self, request):
        body = await read_body(request)
        mode = body.get("mode") or "abort"
        if mode not in ("abort", "retract", "in_place"):
            raise BadRequest(f"mode {mode!r}: expected abort, retract or in_place")
        await self.run_in_model_thread(self.scheduler.pause, mode)
        return json_response({"success": True, "message": f"paused ({mode})"})

    async def continue_generation(self, request):
        await self.run_in_model_thread(self.scheduler.resume)
        return json_response({"success": True, "message": "continued"})

    async def update_weight_version(self, request):
        body = await read_body(request)
        if body.get("new_version") is None:
            raise BadRequest("'new_version' is required")
        if body.get("abort_all_requests", True):
            self.scheduler.abort(None, "aborted by /update_weight_version")
        return await self._weight_op(lambda: None, version=body["new_version"])

    # ---- weights -------------------------------------------------------------------------------------------
    async def update_weights_from_disk(self, request):
        body = await read_body(request)
        path = body.get("model_path")
        if not path:
            raise BadRequest("'model_path' is required")
        self._maybe_abort(body)

        def load() -> int:
            n = self.scheduler.weights.load_from_disk(path)
            self.scheduler.model_path = str(path)
            return n

        return await self._weight_op(load, version=body.get("weight_version"), extra={"num_paused_requests": 0})

    async def update_weights_from_tensor(self, request):
        from slime_lite.weight_transport import deserialize_named_tensors

        body = await read_body(request)
        data = body.get("serialized_named_tensors")
        if isinstance(data, str):
            data = [data]
        if not isinstance(data, list) or len(data) != 1:
            raise BadRequest("'serialized_named_tensors' must be a list with one entry per TP rank (tp_size is 1)")
        if body.get("load_format") not in (None, "direct"):
            raise BadRequest(f"load_format {body['load_format']!r} is not supported (use null or 'direct')")
        try:
            named = await asyncio.get_running_loop().run_in_executor(None, deserialize_named_tensors, data[0])
        except Exception as exc:  # noqa: BLE001 - any decoding failure is the sender's
            raise BadRequest(f"cannot decode serialized_named_tensors: {exc}") from None
        self._maybe_abort(body)
        return await self._weight_op(self.scheduler.weights.load_named, named, version=body.get("weight_version"))

    async def init_weights_update_group(self, request):
        body = await read_body(request)
        try:
            args = (str(body["master_address"]), int(body["master_port"]), int(body.get("rank_offset", 1)),
                    int(body["world_size"]), str(body.get("group_name") or GROUP), str(body.get("backend") or "nccl"))
        except (KeyError, TypeError, ValueError) as exc:
            raise BadRequest(f"init_weights_update_group needs master_address, master_port, world_size: {exc}")
        return await self._weight_op(self.scheduler.weights.init_group, *args)

    async def update_weights_from_distributed(self, request):
        body = await read_body(request)
        names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
        if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)):
            raise BadRequest("'names', 'dtypes' and 'shapes' must be lists")
        if body.get("load_format") not in (None, "direct"):
            raise BadRequest(f"load_format {body['load_format']!r} is not supported (use null or 'direct')")
        self._maybe_abort(body)
        return await self._weight_op(self.scheduler.weights.update_from_distributed, names, dtypes, shapes,
                                     str(body.get("group_name") or GROUP), version=body.get("weight_version"))

    async def destroy_weights_update_group(self, request):
        body = await read_body(request)
        return await self._weight_op(self.scheduler.weights.destroy_group, str(body.get("group_name") or GROUP))

    async def get_weights_by_name(self, request):
        body = await read_body(request)
        if not body.get("name"):
            raise BadRequest("'name' is required")
        try:
            values = await self.run_in_model_thread(self.scheduler.weights.get_by_name, str(body["name"]),
                                                    int(body.get("truncate_size", 100)))
        except WeightError as exc:
            raise BadRequest(str(exc)) from None
        return json_response(values)

    async def get_weights_checksum(self, request):
        """``{hf_name: sha256}`` of every parameter (or of ``names``), in the engine's dtype."""
        body = await read_body(request)
        try:
            sums = await self.run_in_model_thread(self.scheduler.weights.checksums, body.get("names"))
        except WeightError as exc:
            raise BadRequest(str(exc)) from None
        return json_response(sums)

    # ---- memory --------------------------------------------------------------------------------------------
    async def release_memory(self, request):
        tags = (await read_body(request)).get("tags")
        try:
            await self.run_in_model_thread(self.scheduler.release_memory, tags)
        except EngineBusy as exc:
            return error_response(str(exc))
        return json_response(None)

    async def resume_memory(self, request):
        await self.run_in_model_thread(self.scheduler.resume_memory, (await read_body(request)).get("tags"))
        return json_response(None)
