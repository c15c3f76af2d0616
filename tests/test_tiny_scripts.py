"""The tiny run scripts' own logic, with `slime-lite` and the model build stubbed: a resumed run keeps its metrics."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def sandbox(tmp_path: Path) -> Path:
    """scripts/ with lib.sh and the run scripts; prepare-tiny.sh and setup.sh no-ops; .venv/bin/slime-lite records
    its calls; .venv/bin/python runs a -c program with slime_lite (lib.sh names the steps file so), else reads its
    script and does nothing."""
    (tmp_path / "scripts").mkdir()
    for name in ("lib.sh", "run-tiny-grpo.sh", "run-tiny-ppo.sh", "run-tiny-reinforce.sh", "run-tiny-replay.sh",
                 "run-tiny-tool-grpo.sh"):
        shutil.copy(ROOT / "scripts" / name, tmp_path / "scripts" / name)
    for name in ("prepare-tiny.sh", "setup.sh"):
        (tmp_path / "scripts" / name).write_text("exit 0\n")
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    python = (f'[ "$1" = -c ] && PYTHONPATH={ROOT} exec {sys.executable} "$@"\n'
              "cat > /dev/null")
    for name, body in (("slime-lite", 'echo "$@" >> calls.txt'), ("python", python)):
        fake = tmp_path / ".venv" / "bin" / name
        fake.write_text(f"#!/bin/sh\n{body}\n")
        fake.chmod(0o755)
    (tmp_path / "dumps").mkdir()
    (tmp_path / "dumps" / "data_0.pt").write_text("a dump")  # what run-tiny-replay.sh looks for
    return tmp_path


def _run(sandbox: Path, script: str, *args: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"DUMPS": str(sandbox / "dumps")}
    proc = subprocess.run(["bash", f"scripts/{script}", *args], cwd=sandbox, env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("script", ["run-tiny-grpo.sh", "run-tiny-ppo.sh", "run-tiny-reinforce.sh",
                                    "run-tiny-replay.sh", "run-tiny-tool-grpo.sh"])
def test_a_resumed_run_appends_to_its_metrics_a_fresh_one_starts_them_anew(sandbox: Path, script: str) -> None:
    """The scripts removed the --metrics-path file before every run: resuming with --load lost the metrics of
    every rollout before the checkpoint (and the plot showed only the rest). The optimizer steps' file beside it
    goes and stays with it (else a fresh run's steps would follow the last run's)."""
    metrics, steps, ckpt = sandbox / "m.jsonl", sandbox / "m.train_steps.jsonl", sandbox / "ckpt"
    ckpt.mkdir()
    metrics.write_text('{"rollout_id": 0}\n')
    steps.write_text('{"train/step": 0}\n')
    _run(sandbox, script, "--metrics-path", str(metrics), "--load", str(ckpt))  # no checkpoint yet: a fresh start
    assert not metrics.exists() and not steps.exists()
    (ckpt / "latest").write_text("iter_0000049")
    metrics.write_text('{"rollout_id": 49}\n')
    steps.write_text('{"train/step": 49}\n')
    _run(sandbox, script, "--metrics-path", str(metrics), "--load", str(ckpt))  # a resume: appended to
    assert metrics.read_text() == '{"rollout_id": 49}\n' and steps.read_text() == '{"train/step": 49}\n'
    _run(sandbox, script, "--metrics-path", str(metrics))
    assert not metrics.exists() and not steps.exists()
    assert (sandbox / "calls.txt").read_text().count("train ") == 3


@pytest.mark.parametrize("script", ["run-tiny-grpo.sh", "run-rollout-only-sglang.sh"])
def test_with_ray_address_the_job_runs_in_the_scripts_folder(sandbox: Path, script: str) -> None:
    """`ray job submit` runs its entrypoint in a folder of Ray's: the job goes there with a `cd` to the folder the
    script runs in, so relative paths name the same files as without Ray (the SGLang scripts passed none). The
    `ray` commands are FAKES that run the entrypoint from / ."""
    shutil.copy(ROOT / "scripts" / script, sandbox / "scripts" / script)
    fake_ray = '#!/bin/sh\nfor last; do :; done\necho "ray $*" >> calls.txt\ncd / && bash -c "$last"\n'
    bin_dir = sandbox / "bin"
    bin_dir.mkdir()
    for ray in (sandbox / ".venv" / "bin" / "ray", bin_dir / "ray"):
        ray.write_text(fake_ray)
        ray.chmod(0o755)
    slime_lite = sandbox / ".venv" / "bin" / "slime-lite"
    slime_lite.write_text(f'#!/bin/sh\necho "$(pwd) $*" >> {sandbox}/ran.txt\n')
    env = {k: v for k, v in os.environ.items()} | {
        "RAY_ADDRESS": "http://127.0.0.1:8265", "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "HF_CHECKPOINT": "model dir", "PROMPT_DATA": "p.jsonl", "SLIME_LITE": str(slime_lite)}
    proc = subprocess.run(["bash", f"scripts/{script}", "--metrics-path", "my m.jsonl"], cwd=sandbox, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    train = [line for line in (sandbox / "ran.txt").read_text().splitlines() if " train " in line]
    assert len(train) == 1 and train[0].startswith(f"{sandbox} ") and train[0].endswith("--metrics-path my m.jsonl")
    assert "ray job submit --address http://127.0.0.1:8265" in (sandbox / "calls.txt").read_text()
