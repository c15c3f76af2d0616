"""On a GPU (scripts/test-gpu.sh): --record-memory-history writes a CUDA memory snapshot of every train worker,
--profile-target train records CUDA kernels, and a --deterministic-mode replay repeats bit for bit."""

from __future__ import annotations

import json
import pickle

import pytest


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _cuda(), reason="needs CUDA")]

REPLAY = ["--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--num-rollout", "2", "--use-kl-loss",
          "--kl-loss-coef", "0.1", "--lr", "1e-4", "--seed", "7", "--num-steps-per-rollout", "2"]


def replay(model, dumps, out, *extra):
    return ["--load-debug-rollout-data", dumps, "--hf-checkpoint", str(model), *REPLAY,
            "--metrics-path", str(out / "m.jsonl"), *extra]


def test_memory_snapshot_and_cuda_trace_of_the_train_worker(tiny_model_dir, replay_dumps, tmp_path, train_cli):
    snaps, traces = tmp_path / "snapshots", tmp_path / "traces"
    proc = train_cli(replay(tiny_model_dir, replay_dumps, tmp_path, "--record-memory-history",
                            "--memory-snapshot-dir", str(snaps), "--memory-snapshot-num-steps", "2",
                            "--profile-target", "train", "--profile-step-start", "1", "--profile-step-end", "2",
                            "--tensorboard-dir", str(traces)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    [snap] = list(snaps.glob("memory_snapshot_actor_rank0_rollout1.pickle"))
    with open(snap, "rb") as f:
        data = pickle.load(f)  # the format pytorch.org/memory_viz reads
    assert data["segments"] and any(data["device_traces"])  # allocations, with their history
    events = json.loads((traces / "train_actor_rank0.trace.json").read_text())["traceEvents"]
    assert any(e.get("cat") == "kernel" for e in events)  # CUDA kernels, not only CPU ops


def test_deterministic_replay_on_cuda_repeats_bitwise(tiny_model_dir, replay_dumps, tmp_path, train_cli):
    """--deterministic-mode makes the trainer's CUDA kernels deterministic (BENCHMARKS.md: what is and is not)."""
    from slime_lite.debug.compare_runs import main as compare_runs

    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        proc = train_cli(replay(tiny_model_dir, replay_dumps, tmp_path / name, "--deterministic-mode",
                                "--ci-save-grad-norm", str(tmp_path / name / "gn.json")))
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert compare_runs([str(tmp_path / "a" / "m.jsonl"), str(tmp_path / "b" / "m.jsonl"),
                         "--rtol", "0"]) == 0  # exact
    assert (tmp_path / "a" / "gn.json").read_bytes() == (tmp_path / "b" / "gn.json").read_bytes()
