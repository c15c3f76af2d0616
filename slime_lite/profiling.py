"""Profiling (``--use-pytorch-profiler`` / ``--profile-target``, ``--record-memory-history``): PyTorch profiler
traces of the train workers and the engines, CUDA memory snapshots of the train workers, and the driver's timeline
of its phases. Everything is Chrome trace JSON (open in https://ui.perfetto.dev or chrome://tracing) except the
memory snapshots (pickles for https://pytorch.org/memory_viz). torch is imported only where a trace is taken.

Files, all under ``--tensorboard-dir`` (slime's folder for traces): ``train_<role>_rank<r>.trace.json`` per train
worker, ``rollout_engine<i>-*.trace.json`` per embedded engine (SGLang servers name theirs), ``driver_timeline.json``.
"""

from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager
from typing import Any, Iterator

from slime_lite.engine_client import request_json
from slime_lite.errors import SlimeLiteError
from slime_lite.io import atomic_write_text

# train_overall is slime's name of the whole train call (slime's train_actor / train_log_probs split it further)
PROFILE_TARGETS = ("train", "rollout", "driver", "train_overall")


def profile_targets(args: Any) -> set[str]:
    """The targets this run profiles: --profile-target (train_overall read as train), or train when only
    --use-pytorch-profiler is given, as in slime."""
    targets = set(args.profile_target or (["train"] if args.use_pytorch_profiler else []))
    if "train_overall" in targets:
        targets = (targets - {"train_overall"}) | {"train"}
    return targets


def trace_dir(args: Any) -> str:
    """Where traces go: --tensorboard-dir, else tensorboard/ under --save, else ./tensorboard (the TensorBoard
    logger's folder)."""
    return args.tensorboard_dir or os.path.join(args.save or ".", "tensorboard")


def profiled(args: Any, rollout_id: int) -> tuple[bool, bool]:
    """(start before this rollout, stop after it) for the torch-profiler window [start, end)."""
    last = min(args.profile_step_end, args.num_rollout) - 1
    return rollout_id == args.profile_step_start, rollout_id == last


class TorchProfile:
    """One PyTorch profiler window in this process (the thread that starts it): start(), then stop(path) writes
    the Chrome trace."""

    def __init__(self) -> None:
        self.prof = None

    def start(self, record_shapes: bool = True, with_stack: bool = False, profile_memory: bool = True) -> None:
        import torch  # torch: the flag parser reads this module

        if self.prof is not None:
            raise SlimeLiteError("a profiler is already running in this process; stop it first")
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.prof = torch.profiler.profile(activities=activities, record_shapes=record_shapes,
                                           with_stack=with_stack, profile_memory=profile_memory)
        self.prof.start()

    def stop(self, path: str) -> str | None:
        """Stop and write the trace to ``path``; None when nothing was running."""
        if self.prof is None:
            return None
        prof, self.prof = self.prof, None
        prof.stop()
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        prof.export_chrome_trace(tmp)
        os.replace(tmp, path)
        return path


def start_memory_history() -> None:
    """Record the CUDA caching allocator's events in this process, with the Python stack of each allocation; a
    snapshot is dumped at an out-of-memory and by ``dump_memory_snapshot``. Stacks of allocations only
    (context="alloc"): with stacks recorded at frees too (torch's default context="all") the first backward of a
    Megatron train step failed on an H200 (torch 2.11) with "run_backward returned NULL without setting an
    exception", with Python or C++ stacks alike; "alloc", "state" and no context passed there."""
    import torch  # torch: the flag parser reads this module

    if not torch.cuda.is_available():
        raise SlimeLiteError(
            "--record-memory-history records the CUDA allocator, and this train worker has no CUDA device; "
            "drop the flag on CPU (memory per process is in the metrics: perf/memory/*).")
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, context="alloc", stacks="python")


def dump_memory_snapshot(path: str) -> str:
    import torch  # torch: the flag parser reads this module

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    torch.cuda.memory._dump_snapshot(path)
    return path


def stop_memory_history() -> None:
    import torch  # torch: the flag parser reads this module

    torch.cuda.memory._record_memory_history(enabled=None)


class Timeline:
    """The driver's phases as Chrome trace "complete" events: one row per phase kind, a span per occurrence,
    its rollout id in the event's args. ``write`` rewrites the file, so a run that stops still leaves one."""

    def __init__(self, path: str | None = None) -> None:
        self.path = path
        self.rollout_id: int | None = None
        self.events: list[dict[str, Any]] = []
        self._t0 = time.monotonic()
        self._rows: dict[str, int] = {}

    @property
    def enabled(self) -> bool:
        return self.path is not None

    def add(self, name: str, start: float, seconds: float) -> None:
        """A span that began at ``start`` (time.monotonic()) and took ``seconds``."""
        if not self.enabled:
            return
        tid = self._rows.setdefault(name, len(self._rows) + 1)
        self.events.append({"name": name, "cat": "driver", "ph": "X", "pid": 1, "tid": tid,
                            "ts": round((start - self._t0) * 1e6, 1), "dur": round(seconds * 1e6, 1),
                            "args": {"rollout_id": self.rollout_id}})

    @contextmanager
    def span(self, name: str) -> Iterator[None]:
        t0 = time.monotonic()
        try:
            yield
        finally:
            self.add(name, t0, time.monotonic() - t0)

    def write(self) -> None:
        if not self.enabled:
            return

        names = [{"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": name}}
                 for name, tid in self._rows.items()]
        meta = [{"name": "process_name", "ph": "M", "pid": 1, "tid": 0, "args": {"name": "slime-lite driver"}}]
        atomic_write_text(json.dumps({"traceEvents": meta + names + self.events, "displayTimeUnit": "ms"}),
                          self.path)


DRIVER_TIMELINE = Timeline()  # the driver's phases; enabled by RunProfiler (--profile-target driver)


class RunProfiler:
    """The driver's side of profiling: opens the torch-profiler window of the train groups and the engines around
    rollouts [--profile-step-start, --profile-step-end), dumps the train workers' memory snapshots, and writes the
    driver timeline after every rollout."""

    def __init__(self, args: Any, trainers: list, urls: list[str]) -> None:
        self.args, self.trainers, self.urls = args, trainers, urls
        self.targets = profile_targets(args)
        self.dir = trace_dir(args)
        self.trained = 0
        self.active = False  # a torch-profiler window is open (a resumed run may start past its start)
        DRIVER_TIMELINE.__init__(os.path.join(self.dir, "driver_timeline.json") if "driver" in self.targets
                                 else None)

    def before(self, rollout_id: int) -> None:
        DRIVER_TIMELINE.rollout_id = rollout_id
        if not profiled(self.args, rollout_id)[0] or not self.targets - {"driver"}:
            return
        self.active = True
        if "train" in self.targets:
            for group in self.trainers:
                group.start_profile()
        if "rollout" in self.targets:
            for i, url in enumerate(self.urls):  # SGLang's route and fields; SGLang servers write .json.gz
                request_json(url, "/start_profile", {"output_dir": os.path.abspath(self.dir),
                                                     "profile_prefix": f"rollout_engine{i}"}, timeout=300)

    def after(self, rollout_id: int) -> None:
        if self.active and profiled(self.args, rollout_id)[1]:
            self.active = False
            if "train" in self.targets:
                for group in self.trainers:
                    group.stop_profile(os.path.abspath(self.dir))
            if "rollout" in self.targets:
                for url in self.urls:
                    request_json(url, "/stop_profile", {}, timeout=300)
        if self.args.record_memory_history and self.trainers:
            self.trained += 1
            if self.trained == self.args.memory_snapshot_num_steps:
                for group in self.trainers:
                    group.memory_snapshot(os.path.abspath(self.args.memory_snapshot_dir), rollout_id)
        DRIVER_TIMELINE.write()


def add_time(record: dict, key: str, t0: float) -> None:
    """Add the seconds since ``t0`` to ``record[key]``: the parts of a phase (perf/offload/engine_release_time and
    engine_resume_time are parts of perf/offload_time; the weights' resume, perf/update_weights/engine_resume_time,
    is a part of perf/update_weights_time)."""
    record[key] = record.get(key, 0.0) + time.monotonic() - t0


@contextmanager
def timed(record: dict, key: str) -> Iterator[None]:
    """Add the seconds the block takes to ``record[key]``, and a span to the driver timeline."""
    t0 = time.monotonic()
    yield
    record[key] = record.get(key, 0.0) + time.monotonic() - t0
    DRIVER_TIMELINE.add(key.removeprefix("perf/").removesuffix("_time"), t0, time.monotonic() - t0)
