"""Rollout-only runs through Ray: dumps for train and eval, metrics, and no Megatron in any rollout-side process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from slime_lite.rollout.dumps import load_rollout_dump

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def task_data(tmp_path_factory) -> Path:
    from slime_lite.tasks import make_data

    out = tmp_path_factory.mktemp("data") / "addition.jsonl"
    make_data("addition", str(out), n_train=64, n_eval=8, seed=0)
    return out


def test_rollout_only_run_dumps_and_never_imports_megatron(tiny_model_dir, task_data, tmp_path):
    out = tmp_path / "run"
    argv = [
        "--debug-rollout-only", "--hf-checkpoint", str(tiny_model_dir), "--prompt-data", str(task_data),
        "--rm-type", "addition", "--num-rollout", "2", "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
        "--rollout-max-response-len", "6", "--eval-interval", "1",
        "--eval-prompt-data", "addition", str(task_data.with_name("addition_eval.jsonl")),
        "--save-debug-rollout-data", str(out / "data_{rollout_id}.pt"), "--metrics-path", str(out / "m.jsonl"),
    ]
    code = (
        "import sys, json\n"
        "from slime_lite.errors import run_main\n"
        "from slime_lite.logging_setup import setup_logging\n"
        "from slime_lite.train import main\n"
        "setup_logging()\n"
        f"rc = run_main(main, {argv!r})\n"
        "print('DRIVER_MEGATRON', any(m.split('.')[0] == 'megatron' for m in sys.modules))\n"
        "sys.exit(rc)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "DRIVER_MEGATRON False" in proc.stdout

    for rid in (0, 1):
        dump = load_rollout_dump(str(out / f"data_{rid}.pt"))
        assert dump.rollout_id == rid and len(dump.samples) == 8
        assert dump.meta["n_samples_per_prompt"] == 2 and dump.meta["rollout_batch_size"] == 4
        for s in dump.samples:
            assert s.response_length > 0 and len(s.rollout_log_probs) == s.response_length
            assert s.reward in (0.0, 1.0) and s.status.value in ("completed", "truncated")
    for eid in (0, 1, 2):  # before training, then after each rollout
        assert (out / f"data_eval_{eid}.pt").exists()

    records = [json.loads(line) for line in (out / "m.jsonl").read_text().splitlines()]
    train_records = [r for r in records if r["rollout_id"] >= 0]
    assert [r["rollout_id"] for r in train_records] == [0, 1]
    for key in ("rollout/raw_reward", "rollout/response_len/mean", "rollout/truncated_ratio", "perf/rollout_time",
                "perf/step_time", "eval/addition"):
        assert key in train_records[0], key
    # perf/rollout/*: the parts of perf/rollout_time (rollout/timing.py); the engine's own counters, from its
    # /get_server_info step_stats
    r0 = train_records[0]
    parts = ("prepare_time", "generate_time", "reward_time")
    assert abs(sum(r0[f"perf/rollout/{p}"] for p in parts) - r0["perf/rollout_time"]) < 1e-6
    assert r0["perf/rollout/generate_time"] > 0 and r0["perf/rollout/engine_busy_time"] > 0
    assert r0["perf/rollout/engine_decode_steps"] > 0 and r0["perf/rollout/engine_tokens_per_s"] > 0
    assert r0["perf/rollout/engine_cuda_graph_captures"] == 0.0  # CPU: nothing to capture


def test_rollout_processes_do_not_import_megatron(tiny_model_dir, task_data, monkeypatch):
    import ray

    from slime_lite.args import parse_args
    from slime_lite.engine_client import API_KEY_ENV
    from slime_lite.placement import create_placement_group, init_ray, plan_layout
    from slime_lite.rollout.engines import start_engines
    from slime_lite.rollout.manager import RolloutManager

    args = parse_args([
        "--debug-rollout-only", "--hf-checkpoint", str(tiny_model_dir), "--prompt-data", str(task_data),
        "--rm-type", "addition", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
        "--rollout-max-response-len", "4",
    ])
    layout = plan_layout(args)
    monkeypatch.setenv(API_KEY_ENV, "")  # init_ray sets this run's key in os.environ: restored after the test
    init_ray(args, layout.num_bundles)
    try:
        pg = create_placement_group(layout)
        fleet = start_engines(args, pg, layout.rollout)
        engines = fleet.engines
        manager = ray.remote(RolloutManager).remote(args, fleet.urls)
        samples, metrics = ray.get(manager.generate.remote(0))
        assert len(samples) == 4 and "rollout/raw_reward" in metrics
        for actor in [manager, *engines]:
            modules = ray.get(actor.imported_modules.remote())
            assert not [m for m in modules if m.split(".")[0] == "megatron"]
            assert "slime_lite.backends.megatron" not in modules
    finally:
        ray.shutdown()
