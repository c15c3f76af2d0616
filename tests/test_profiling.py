"""Profiling flags (slime's names): the rules between them, the CPU refusal of CUDA memory snapshots, and the
driver timeline's Chrome trace. The traces of a real run are checked in tests/test_loop.py (deterministic mode)."""

from __future__ import annotations

import json

import pytest

from slime_lite.args import parse_args, parser_defaults
from slime_lite.errors import SlimeLiteError
from slime_lite.profiling import Timeline, profile_targets, profiled


def test_timeline_is_a_chrome_trace_with_one_row_per_phase(tmp_path):
    tl = Timeline(str(tmp_path / "t.json"))
    for rid in (0, 1):
        tl.rollout_id = rid
        with tl.span("rollout"):
            pass
        tl.add("train", 10.0, 0.5)
    tl.write()
    trace = json.loads((tmp_path / "t.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [(e["name"], e["args"]["rollout_id"]) for e in spans] == [("rollout", 0), ("train", 0), ("rollout", 1),
                                                                     ("train", 1)]
    assert {e["tid"] for e in spans if e["name"] == "train"} != {e["tid"] for e in spans if e["name"] == "rollout"}
    assert [e["dur"] for e in spans if e["name"] == "train"] == [5e5, 5e5]  # microseconds
    rows = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert rows == {"rollout", "train"}
    Timeline().write()  # disabled: writes nothing, raises nothing


def test_targets_and_window():
    args = parser_defaults(hf_checkpoint=".", use_pytorch_profiler=True)
    assert profile_targets(args) == {"train"}  # slime's default target
    args = parser_defaults(hf_checkpoint=".", profile_target=["train_overall", "driver"], profile_step_start=1,
                           profile_step_end=9, num_rollout=3)
    assert profile_targets(args) == {"train", "driver"}
    assert [profiled(args, r) for r in range(3)] == [(False, False), (True, False), (False, True)]  # end clamped


@pytest.mark.parametrize("extra, needle", [
    (["--profile-target", "train", "--profile-step-start", "2", "--profile-step-end", "2"], "need 0 <= start < end"),
    (["--profile-target", "rollout", "--profile-step-start", "3", "--profile-step-end", "5"], "past the last rollout"),
    (["--profile-target", "train", "--debug-rollout-only"], "starts no trainer"),
    (["--profile-target", "rollout", "--debug-train-only"], "start no engine"),
    (["--record-memory-history", "--memory-snapshot-num-steps", "4"], "no snapshot would be written"),
])
def test_flag_rules(tiny_model_dir, extra, needle):
    base = ["--hf-checkpoint", str(tiny_model_dir), "--prompt-data", str(tiny_model_dir / "config.json"),
            "--rm-type", "addition", "--num-rollout", "3"]
    with pytest.raises(SlimeLiteError, match=needle):
        parse_args(base + extra)


def test_memory_history_is_refused_without_cuda(tmp_path):
    import torch

    from slime_lite.preflight import check_profiling_device

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the snapshot itself is tests/backends/test_profiling_gpu.py")
    args = parser_defaults(hf_checkpoint=str(tmp_path), record_memory_history=True)
    with pytest.raises(SlimeLiteError, match="--record-memory-history records the CUDA allocator, and this "
                                             "machine has no CUDA device"):
        check_profiling_device(args)


class FakeGroup:
    """Records the profiling calls the driver makes on a train group (the real one forwards them to Ray actors)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def start_profile(self) -> None:
        self.calls.append(("start",))

    def stop_profile(self, folder: str) -> None:
        self.calls.append(("stop", folder))


@pytest.mark.parametrize("first", [0, 2])  # 2: a run resumed past --profile-step-start never opens the window
def test_the_driver_opens_the_window_once_and_closes_it(tmp_path, first):
    from slime_lite.profiling import DRIVER_TIMELINE, RunProfiler

    args = parser_defaults(hf_checkpoint=".", profile_target=["train", "driver"], profile_step_start=1,
                           profile_step_end=3, num_rollout=4, tensorboard_dir=str(tmp_path))
    group = FakeGroup()
    prof = RunProfiler(args, [group], [])
    for rid in range(first, 4):
        prof.before(rid)
        with DRIVER_TIMELINE.span("rollout"):
            pass
        prof.after(rid)
    assert group.calls == ([("start",), ("stop", str(tmp_path))] if first == 0 else [])
    spans = json.loads((tmp_path / "driver_timeline.json").read_text())["traceEvents"]
    assert [e["args"]["rollout_id"] for e in spans if e["ph"] == "X"] == list(range(first, 4))
