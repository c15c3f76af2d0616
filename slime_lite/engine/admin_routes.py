"""Control, weight and memory routes of the embedded engine (SGLang's names and shapes).

Every operation runs in the model thread between two generation steps (``Scheduler.call``), except joining a weight
update group, which waits for the trainer in a worker thread. Weight routes answer SGLang's
``{"success": bool, "message": str}``, with HTTP 400 when the update was refused (nothing changed then). Fields
are checked (``validate``) before anything runs: a wrong type or range is a 400 naming the field.
"""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from aiohttp import web

from slime_lite import weight_reader, weight_wire
from slime_lite.engine import validate as check
from slime_lite.engine.control import PAUSE_ABORT, EngineBusy
from slime_lite.engine.http_json import (
    BadRequest,
    error_response,
    json_response,
    read_body,
)
from slime_lite.engine.weights import WeightError
from slime_lite.profiling import TorchProfile
from slime_lite.types import PARTIAL_VERSION
from slime_lite.weight_transport import check_group_address

if TYPE_CHECKING:
    from slime_lite.engine.scheduler import Scheduler

logger = logging.getLogger(__name__)

GROUP = "weight_update_group"

# the weight-update session an update route's request came in (``_Admin.in_session`` sets it for the request)
_ENTERED: contextvars.ContextVar[int | None] = contextvars.ContextVar("weight_session_entered")


def _field(fn: Callable[..., Any], body: dict[str, Any], key: str, default: Any, *args: Any) -> Any:
    """``fn(body[key], key, *args)`` (a ``validate`` check), ``default`` when absent or null; BadRequest if wrong."""
    value = body.get(key)
    if value is None:
        return default
    try:
        return fn(value, key, *args)
    except ValueError as exc:
        raise BadRequest(str(exc)) from None


def _strings(value: Any, name: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
        raise ValueError(f"{name} must be a list of strings")
    return value


def _shapes(value: Any, name: str) -> list[list[int]]:
    if not isinstance(value, list) or not all(isinstance(s, list) for s in value):
        raise ValueError(f"{name} must be a list of shapes (lists of sizes)")
    return [[check.integer(d, name, 0) for d in shape] for shape in value]


def add_admin_routes(app: Any, scheduler: Scheduler, profile_dir: str,
                     abort_waiting: Callable[[str, str], None] = lambda rid, message: None) -> None:
    """``profile_dir``: the only folder /start_profile writes under; ``abort_waiting(rid, message)``: the server's
    abort of requests not submitted yet (the rest of a batch waiting for its turn)."""
    admin = _Admin(scheduler, profile_dir, abort_waiting)
    posts = {
        "/flush_cache": admin.flush_cache, "/abort_request": admin.abort_request,
        "/pause_generation": admin.pause_generation, "/continue_generation": admin.continue_generation,
        "/update_weight_version": admin.update_weight_version,
        "/update_weights_from_disk": admin.update_weights_from_disk,
        "/update_weights_from_tensor": admin.update_weights_from_tensor,
        "/init_weights_update_group": admin.init_weights_update_group,
        "/update_weights_from_distributed": admin.update_weights_from_distributed,
        "/destroy_weights_update_group": admin.destroy_weights_update_group,
        "/begin_weight_update": admin.begin_weight_update, "/end_weight_update": admin.end_weight_update,
        "/release_memory_occupation": admin.release_memory, "/resume_memory_occupation": admin.resume_memory,
        "/start_profile": admin.start_profile, "/stop_profile": admin.stop_profile,
    }
    for path in ("/update_weights_from_disk", "/update_weights_from_tensor", "/update_weights_from_distributed"):
        posts[path] = admin.in_session(posts[path])
    for path, handler in posts.items():
        app.router.add_post(path, handler)
    for path in ("/release_memory_occupation", "/resume_memory_occupation", "/start_profile", "/stop_profile"):
        app.router.add_get(path, posts[path])  # SGLang takes GET too (a GET's JSON body or its query parameters)
    for path, handler in (("/get_weights_by_name", admin.get_weights_by_name),
                          ("/get_weights_checksum", admin.get_weights_checksum),
                          ("/weights_checker", admin.weights_checker)):
        app.router.add_get(path, handler)
        app.router.add_post(path, handler)




class _Admin:
    def __init__(self, scheduler: Scheduler, profile_dir: str, abort_waiting: Callable[[str, str], None]) -> None:
        self.scheduler, self.abort_waiting = scheduler, abort_waiting
        self.profile_dir = Path(profile_dir).resolve()
        self.weight_session = False  # between /begin_weight_update and /end_weight_update (SGLang's session)
        self.session_id = 0  # which session is (or was last) open: an update queued in one may apply after its end
        # in a session: the version its updates name, set at its end only if none of them failed (a push of many
        # buckets is one version: a failed bucket leaves old and new weights mixed, served as "partial")
        self.session_version: str | None = None
        self.session_failed = False
        self.profile = TorchProfile()  # /start_profile .. /stop_profile, in the model thread
        self.profile_path = ""  # the running profile's trace (set by /start_profile, emptied by /stop_profile)
        self.weights_snapshot: dict[str, str] | None = None  # /weights_checker action=snapshot

    def _current_session(self) -> int | None:
        """The open weight-update session's id; None outside one."""
        return self.session_id if self.weight_session else None

    def in_session(self, handler: Callable[..., Any]) -> Callable[..., Any]:
        """A weight update route that, refused or failed inside a session, marks that session failed (its earlier
        updates may have applied: the session's end then serves the weights as "partial"). The session is the one
        the request came in; when it has ended before the refusal, the engine serves "partial" at once (its end
        named a version this update's weights never reached) and a session begun since is not marked."""
        async def route(request):
            session = self._current_session()
            token = _ENTERED.set(session)
            try:
                response = await handler(request)
            except BaseException:
                self._update_failed(session)
                raise
            finally:
                _ENTERED.reset(token)
            if response.status != 200:
                self._update_failed(session)
            return response

        return route

    def _update_failed(self, session: int | None) -> None:
        if session is None:
            return
        if self._current_session() == session:
            self.session_failed = True
        else:
            self._name_weights(PARTIAL_VERSION)

    def _name_weights(self, version: str) -> asyncio.Future:
        """``weight_version`` becomes ``version`` between two steps of the model thread (every token of a step
        carries one version; the event loop's own write could fall in the middle of a step's labels)."""
        return self.run_in_model_thread(setattr, self.scheduler, "weight_version", version)

    def run_in_model_thread(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future:
        """``fn(*args)`` queued for the model thread now; await the returned future for its result (cancelling it
        takes the call out of the queue if it has not run yet)."""
        return asyncio.wrap_future(self.scheduler.call(fn, *args))

    async def _weight_op(self, fn: Callable[..., Any], *args: Any, version: Any = None,
                         extra: dict[str, Any] | None = None, model_thread: bool = True):
        """Run a weight operation in the model thread (or, ``model_thread=False``, in a worker thread: an operation
        that touches no weights and may wait), then set ``weight_version`` if given: outside a session in the model
        thread (the next step's outputs name it), inside one as the session's version. The session's state is read
        and written in the event loop only, as begin and end do, so an end cannot fall between an update's check of
        its session and its record there."""

        session = _ENTERED.get(self._current_session())  # the session the request came in

        def op():
            result = fn(*args)
            if version is not None and session is None:
                self.scheduler.weight_version = str(version)
            elif version is not None and self._current_session() != session:  # its session ended before it applied
                # (an ended session never reopens): "partial" from the next step on, as the event loop records below
                self.scheduler.weight_version = PARTIAL_VERSION
            return result

        try:
            if model_thread:
                result = await self.run_in_model_thread(op)
            else:
                result = await asyncio.get_running_loop().run_in_executor(None, op)
        except (WeightError, ValueError, RuntimeError) as exc:
            logger.error("weight operation refused: %s", exc)
            return json_response({"success": False, "message": str(exc)}, 400)
        if version is not None and session is not None:
            if self._current_session() == session:
                self.session_version = str(version)
            else:  # its session ended (committed or not) before it applied: old and new weights mixed
                await self._name_weights(PARTIAL_VERSION)
        msg = f"Succeeded ({result} tensors)" if isinstance(result, int) else "Succeeded"
        return json_response({"success": True, "message": msg, **(extra or {})})

    def _maybe_abort(self, body: dict[str, Any]) -> None:
        """Abort every request when asked; first checks the update's ``weight_version`` (a string, as SGLang's
        request objects take) and ``abort_all_requests``, so a bad field aborts nothing."""
        _field(check.string, body, "weight_version", None)
        if _field(check.boolean, body, "abort_all_requests", False):
            self.scheduler.abort(None, "aborted for a weight update")

    # ---- control -------------------------------------------------------------------------------------------
    async def flush_cache(self, request):
        try:
            await self.run_in_model_thread(self.scheduler.flush_cache)
        except EngineBusy as exc:
            return error_response(str(exc))
        return json_response({"success": True, "message": "Cache flushed."})

    async def abort_request(self, request):
        body = await read_body(request)
        rid = _field(check.string, body, "rid", "")
        if _field(check.boolean, body, "abort_all", False):
            self.scheduler.abort(None)
        elif rid:
            self.scheduler.abort(rid)
            self.abort_waiting(rid, "aborted by /abort_request")
        else:
            raise BadRequest("send {'rid': ...} or {'abort_all': true}")
        return web.Response(status=200)

    async def pause_generation(self, request):
        body = await read_body(request)
        mode = _field(check.string, body, "mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            raise BadRequest(f"mode {mode!r}: expected abort, retract or in_place")
        if mode == "abort":  # requests made from now on wait for /continue_generation
            self.scheduler.count_abort_all(PAUSE_ABORT)
        await self.run_in_model_thread(self.scheduler.pause, mode)
        return json_response({"success": True, "message": f"paused ({mode})"})

    async def continue_generation(self, request):
        await self.run_in_model_thread(self.scheduler.resume)
        return json_response({"success": True, "message": "continued"})

    async def update_weight_version(self, request):
        body = await read_body(request)
        version = _field(check.string, body, "new_version", None)
        if version is None:
            raise BadRequest("'new_version' is required")
        if _field(check.boolean, body, "abort_all_requests", True):
            self.scheduler.abort(None, "aborted by /update_weight_version")
        return await self._weight_op(lambda: None, version=version)

    # ---- weights -------------------------------------------------------------------------------------------
    async def update_weights_from_disk(self, request):
        body = await read_body(request)
        path = _field(check.string, body, "model_path", "")
        if not path:
            raise BadRequest("'model_path' is required")
        self._maybe_abort(body)

        def load() -> int:
            n = self.scheduler.weights.load_from_disk(path)
            self.scheduler.model_path = str(path)
            return n

        return await self._weight_op(load, version=body.get("weight_version"), extra={"num_paused_requests": 0})

    async def update_weights_from_tensor(self, request):
        """SGLang's payloads (``slime_lite.weight_wire``): CUDA IPC / shared-memory handles or tensors by value,
        read by ``slime_lite.weight_reader``'s restricted unpickler (any global but the tensor-rebuild ones is a 400
        naming it); names, shapes and dtypes are checked against the model before a byte is copied."""

        body = await read_body(request)
        data = body.get("serialized_named_tensors")
        if isinstance(data, str):
            data = [data]
        if not isinstance(data, list) or len(data) != 1 or not isinstance(data[0], str):
            raise BadRequest("'serialized_named_tensors' must be a list with one base64 string per TP rank "
                             "(tp_size is 1)")
        load_format = body.get("load_format")
        if load_format not in weight_wire.LOAD_FORMATS:
            raise BadRequest(f"load_format {load_format!r} is not supported (use null, 'direct' or "
                             "'flattened_bucket')")

        def read() -> dict:
            return dict(weight_reader.named_tensors(weight_reader.deserialize(data[0]), load_format))

        try:
            named = await asyncio.get_running_loop().run_in_executor(None, read)
            self.scheduler.weights.check_update(named)
        except (ValueError, RuntimeError) as exc:  # UnsafePayload, a malformed payload, a mismatch with the model
            logger.error("update_weights_from_tensor refused: %s", exc)
            return json_response({"success": False, "message": f"serialized_named_tensors: {exc}"}, 400)
        self._maybe_abort(body)
        return await self._weight_op(self.scheduler.weights.load_named, named, version=body.get("weight_version"))

    async def begin_weight_update(self, request):
        """SGLang's weight-update session. The embedded engine needs none (updates apply between two steps of the
        model thread either way), but it keeps SGLang's rules: one session at a time, end only after begin."""
        await read_body(request)
        if self.weight_session:
            return json_response({"success": False, "message": "a weight-update session is already open; call "
                                  "end_weight_update() first"}, 400)
        self.weight_session, self.session_version, self.session_failed = True, None, False
        self.session_id += 1
        await self.run_in_model_thread(self.scheduler.weights.drop_pending_adapters)
        return json_response({"success": True, "message": "Success"})

    async def end_weight_update(self, request):
        await read_body(request)
        session = self._current_session()
        # a LoRA adapter half whose other half never came (asked before the session closes, so that the close and
        # the version it commits happen at once, with no update's record in between): that weight still serves its
        # earlier adapter
        half = await self.run_in_model_thread(self.scheduler.weights.pending_adapters) if session is not None else []
        if session is None or self._current_session() != session:  # none open, or another end closed it meanwhile
            return json_response({"success": False, "message": "no weight-update session is open; call "
                                  "begin_weight_update() first"}, 400)
        self.weight_session = False
        if self.session_failed or half:  # some of this session's weights are new, some old: no version names them
            await self._name_weights(PARTIAL_VERSION)
            why = (f"the LoRA adapters of {', '.join(half[:5])}{' ...' if len(half) > 5 else ''} came with one half "
                   "(lora_A or lora_B) and not the other" if half else "an update of this weight-update session failed")
            return json_response({"success": False, "message": f"{why}: the engine holds old and new weights "
                                  f"(weight_version {PARTIAL_VERSION!r}) until a complete push"}, 400)
        if self.session_version is not None:
            await self._name_weights(self.session_version)
        return json_response({"success": True, "message": "Success"})

    async def init_weights_update_group(self, request):
        body = await read_body(request)
        missing = [k for k in ("master_address", "master_port", "world_size") if body.get(k) is None]
        if missing:
            raise BadRequest(f"init_weights_update_group needs {', '.join(missing)}")
        world_size = _field(check.integer, body, "world_size", 0, 2, 1 << 16)
        address = _field(check.string, body, "master_address", "")
        try:
            check_group_address(address)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        args = (address,
                _field(check.integer, body, "master_port", 0, 1, 65535),
                _field(check.integer, body, "rank_offset", 1, 1, world_size - 1), world_size,
                _field(check.string, body, "group_name", GROUP), _field(check.string, body, "backend", "nccl"))
        return await self._weight_op(self.scheduler.weights.init_group, *args, model_thread=False)

    async def update_weights_from_distributed(self, request):
        body = await read_body(request)
        names, dtypes = _field(_strings, body, "names", None), _field(_strings, body, "dtypes", None)
        shapes = _field(_shapes, body, "shapes", None)
        if names is None or dtypes is None or shapes is None:
            raise BadRequest("'names', 'dtypes' and 'shapes' are required")
        load_format = body.get("load_format")
        if load_format not in (None, "direct", "flattened_bucket"):
            raise BadRequest(f"load_format {load_format!r} is not supported (use null, 'direct' or "
                             "'flattened_bucket')")
        self._maybe_abort(body)
        group = _field(check.string, body, "group_name", GROUP)
        return await self._weight_op(self.scheduler.weights.update_from_distributed, names, dtypes, shapes, group,
                                     load_format == "flattened_bucket", version=body.get("weight_version"))

    async def destroy_weights_update_group(self, request):
        body = await read_body(request)
        return await self._weight_op(self.scheduler.weights.destroy_group,
                                     _field(check.string, body, "group_name", GROUP))

    async def get_weights_by_name(self, request):
        body = await read_body(request)
        name = _field(check.string, body, "name", "")
        if not name:
            raise BadRequest("'name' is required")
        size = body.get("truncate_size")
        if isinstance(size, str) and size.isdigit():  # a GET query parameter
            size = int(size)
        size = _field(check.integer, {"truncate_size": size}, "truncate_size", 100, 0)
        try:
            values = await self.run_in_model_thread(self.scheduler.weights.get_by_name, name, size)
        except WeightError as exc:
            raise BadRequest(str(exc)) from None
        return json_response(values)

    async def get_weights_checksum(self, request):
        """``{hf_name: digest}`` of every parameter (or of ``names``), in the engine's dtype: our route (SGLang has
        none by this name); each digest is ``weight_checksum.tensor_checksums``'s (32 hex digits)."""
        body = await read_body(request)
        try:
            sums = await self.run_in_model_thread(self.scheduler.weights.checksums,
                                                  _field(_strings, body, "names", None))
        except WeightError as exc:
            raise BadRequest(str(exc)) from None
        return json_response(sums)

    async def weights_checker(self, request):
        """SGLang's ``/weights_checker`` over the engine's per-parameter checksums (HF names; ``weights.checksums``,
        a checksum of the bytes): ``action`` ``checksum`` (one rank's ``ChecksumInfo`` plus ``per_engine_checksum``,
        combined as SGLang does), ``snapshot`` (remember the checksums) or ``compare`` (the weights against the
        snapshot; a 400 naming the changed parameters). ``skip_tensor_list``: name substrings left out.
        ``reset_tensors`` (overwrite every weight with noise) is refused; there is no draft model."""

        body = await read_body(request)
        action = _field(check.string, body, "action", "checksum")
        skip = _field(_strings, body, "skip_tensor_list", None) or []
        _field(check.boolean, body, "allow_quant_error", False)  # no quantized weights: nothing to allow
        selector = _field(check.string, body, "selector", "all")
        if selector not in ("target", "draft", "all"):
            raise BadRequest(f"selector={selector!r}: expected target, draft or all")
        if action not in ("checksum", "snapshot", "compare") or selector == "draft":
            why = (f"action={action!r} is not supported by the embedded engine (checksum, snapshot, compare)"
                   if selector != "draft" else "selector='draft': the embedded engine has no draft model")
            return json_response({"success": False, "message": why}, 400)
        sums = await self.run_in_model_thread(self.scheduler.weights.checksums)
        sums = {n: h for n, h in sums.items() if not any(p in n for p in skip)}
        if action == "snapshot":
            self.weights_snapshot = sums
        elif action == "compare":
            if self.weights_snapshot is None:
                return json_response({"success": False, "message": "no snapshot: send action=snapshot first"}, 400)
            changed = sorted(n for n in sums if n in self.weights_snapshot and sums[n] != self.weights_snapshot[n])
            if changed:
                return json_response({"success": False, "message": f"{len(changed)} parameter(s) differ from the "
                                      f"snapshot: {changed[:5]}"}, 400)
        if action != "checksum":
            return json_response({"success": True, "message": "Success."})
        per_gpu = hashlib.sha256(b"".join(n.encode() + sums[n].encode() for n in sorted(sums))).hexdigest()
        placement = {"role": "target", "tp_rank": 0, "tp_size": 1, "dp_rank": 0, "dp_size": 1, "pp_rank": 0,
                     "pp_size": 1, "rank": 0, "size": 1}
        ranks = [{"checksums": sums, "per_gpu_checksum": per_gpu, "parallelism_info": [placement]}]
        return json_response({"success": True, "message": "Success.", "ranks": ranks,
                              "per_engine_checksum": hashlib.sha256(per_gpu.encode()).hexdigest()})

    # ---- memory --------------------------------------------------------------------------------------------
    async def release_memory(self, request):
        tags = _field(_strings, await read_body(request), "tags", None)
        try:
            await self.run_in_model_thread(self.scheduler.release_memory, tags)
        except EngineBusy as exc:
            return error_response(str(exc))
        return json_response(None)

    async def resume_memory(self, request):
        tags = _field(_strings, await read_body(request), "tags", None)
        await self.run_in_model_thread(self.scheduler.resume_memory, tags)
        return json_response(None)

    # ---- profiling (SGLang's routes; a PyTorch profiler trace of the model thread) ------------------------------
    async def start_profile(self, request):
        body = await read_body(request)
        for key in ("num_steps", "start_step"):
            if body.get(key) is not None:
                raise BadRequest(f"{key}: the embedded engine profiles until /stop_profile; leave {key} out")
        folder = self._profile_folder(_field(check.string, body, "output_dir", ""))
        prefix = _field(check.string, body, "profile_prefix", "") or "engine"
        # checked now: a name /stop_profile cannot write would lose the trace after the profiler stopped
        if "/" in prefix or "\0" in prefix or prefix.startswith(".") or len(prefix.encode()) > 200:
            raise BadRequest(f"profile_prefix={prefix!r:.60} must be a plain file-name prefix (no '/', no NUL, not "
                             "starting with '.', at most 200 bytes)")
        shapes = _field(check.boolean, body, "record_shapes", True)
        stack = _field(check.boolean, body, "with_stack", False)
        if self.profile_path:
            raise BadRequest("a profile is already running: call /stop_profile first")
        # the profile is this request's from here (the event loop's state): a second /start_profile is refused
        # while this one waits for the model thread
        path = self.profile_path = os.path.join(folder, f"{prefix}-{int(time.time())}.trace.json")
        try:  # shielded: a client that leaves does not take the start out of the model thread's queue
            await asyncio.shield(self.run_in_model_thread(self.profile.start, shapes, stack))
        except asyncio.CancelledError:  # the start still runs: the claim stays, for a /stop_profile to stop it
            raise
        except Exception:  # it did not start
            if self.profile_path == path:
                self.profile_path = ""
            raise
        return web.Response(text="Start profiling.\n")

    def _profile_folder(self, output_dir: str) -> str:
        """``output_dir`` (relative ones under the profile folder) when it lies in the server's profile folder,
        created and writable; a 400 naming it otherwise (nothing is created outside the folder)."""
        try:
            target = (self.profile_dir / output_dir).resolve()
        except (ValueError, OSError) as exc:  # a NUL byte, a symlink loop
            raise BadRequest(f"output_dir {output_dir!r}: not a usable path ({exc})") from None
        if not target.is_relative_to(self.profile_dir):
            raise BadRequest(f"output_dir {output_dir!r} is outside this server's profile folder {self.profile_dir} "
                             "(traces are written only under it; 'slime-lite serve --profile-dir' sets it)")
        try:
            target.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise BadRequest(f"output_dir {output_dir!r}: cannot create {target} ({exc.strerror})") from None
        if not os.access(target, os.W_OK | os.X_OK):
            raise BadRequest(f"output_dir {output_dir!r}: {target} is not writable by the server")
        return str(target)

    async def stop_profile(self, request):
        """Stops the profile this request takes (the event loop's ``profile_path``, emptied here): a second
        /stop_profile while the first waits for the model thread is refused. Shielded: a client that leaves does
        not take the stop out of the model thread's queue (the profiler would run on with no path to stop it)."""
        path, self.profile_path = self.profile_path, ""
        written = await asyncio.shield(self.run_in_model_thread(self.profile.stop, path)) if path else None
        if written is None:  # none started, or its start failed
            raise BadRequest("no profile is running: call /start_profile first")
        return web.Response(text=f"Stop profiling. Trace written to {written}\n")
