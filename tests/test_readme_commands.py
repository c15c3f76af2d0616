"""The README's command examples run as written, in a short form (2 rollouts).

Every command in README.md (lines of its bash blocks, and inline code spans that start with slime-lite, bash,
python, ray or name a script) is either in RUN (what runs, in README order, in a sandbox copy of the repository's
scripts with the session's tiny model as runs/tiny/model) or in SKIP with the reason. A README command in neither
table fails the fast test, so a new example gets a decision.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VENV = Path(sys.prefix)  # the venv running the tests: ROOT/.venv under scripts/test.sh
SHORT = "--num-rollout 2"  # appended to every training script: argparse keeps the last value
FEW = "--rollout-batch-size 4 --n-samples-per-prompt 4 --micro-batch-size 8 --rollout-max-response-len 96"

REPLAY = "bash scripts/run-tiny-replay.sh"
MOE = (".venv/bin/slime-lite make-tiny-model --out /tmp/tiny-moe --arch qwen3_moe --num-experts 4 --num-experts-per-tok 2 "
       "--warm-start-steps 0")
RUN = {  # README command -> the command run in the sandbox
    "bash scripts/quickstart.sh": f"bash scripts/quickstart.sh {SHORT}",  # the .venv install is a no-op here
    "run-tiny-ppo.sh": f"bash scripts/run-tiny-ppo.sh {SHORT}",
    "run-tiny-reinforce.sh": f"bash scripts/run-tiny-reinforce.sh {SHORT}",
    "python bench/breakdown.py runs/tiny/grpo/metrics.jsonl": "python bench/breakdown.py runs/tiny/grpo/metrics.jsonl",
    # the --metrics-path example's arguments ride on this run (one GRPO run less): m.jsonl and its plot are checked
    "bash scripts/run-tiny-grpo.sh --lora-rank 8 --lora-alpha 16 --lr 1e-3":
        f"bash scripts/run-tiny-grpo.sh --lora-rank 8 --lora-alpha 16 --lr 1e-3 --num-rollout 5 --metrics-path m.jsonl "
        f"{SHORT}",
    "bash scripts/run-tiny-rollout-only.sh": f"bash scripts/run-tiny-rollout-only.sh {SHORT}",
    # the rollout-only dumps just written, replayed through the GRPO script's trainer (its --ci-test on): as written
    REPLAY: REPLAY,
    # the session's tiny model stands in for the tool model (its warm start takes minutes): the loop, the hooks, the
    # agent endpoint and the dump check run, on a model that rarely calls the tool, with fewer and shorter samples
    "bash scripts/run-tiny-tool-grpo.sh": f"bash scripts/run-tiny-tool-grpo.sh {SHORT} {FEW} --eval-interval 2",
    "bash scripts/run-tiny-agent-grpo.sh": f"bash scripts/run-tiny-agent-grpo.sh {SHORT} {FEW} --eval-interval 2",
    MOE: MOE,
}

_SAME_AS_QUICKSTART = "quickstart.sh (run above) runs exactly this script with the same arguments"
SKIP = {
    "bash scripts/test.sh": "runs this test suite",
    "bash scripts/test.sh -n 0": "runs this test suite (in one process)",
    "scripts/setup.sh": "the installer: scripts/test.sh runs it before the tests, and every script run here calls it",
    "slime-lite make-tiny-model": "named without its required --out; prepare-tiny.sh runs it, but its warm start takes "
                                  "minutes, so the sandbox gets the session's tiny model (tests/test_tiny_model.py)",
    "scripts/run-tiny-grpo.sh": _SAME_AS_QUICKSTART,
    "bash scripts/run-tiny-grpo.sh --num-rollout 5 --metrics-path m.jsonl": "its arguments are appended to the LoRA "
                                                                            "command's run here (the same script and "
                                                                            "argument handling); m.jsonl and its plot "
                                                                            "are checked",
    "bash scripts/run-tiny-grpo.sh": _SAME_AS_QUICKSTART,
    "slime-lite make-data --task tool_math": "named without its required --out; run-tiny-tool-grpo.sh, run here, "
                                             "runs it with one",
    "slime-lite make-tiny-model --task tool_math": "named without its required --out; run-tiny-tool-grpo.sh runs "
                                                   "it, but its warm start takes minutes (tests/rollout/"
                                                   "test_calc_task.py warm-starts a small one)",
    "slime-lite plot-metrics": "named without its required flags; every run-tiny-*.sh run here calls it with them",
    "slime-lite train ...": "placeholder flags; every training script run here is this command",
    "slime-lite train": "a name; every training script run here is this command",
    "python -m slime_lite.train": "another spelling of `slime-lite train` (the flags go after it)",
    "ray job submit": "needs a running Ray cluster",
    "slime-lite serve --model-path DIR --port P": "placeholders, and a server that does not exit "
                                                  "(tests/engine/test_openai_and_cli.py starts it)",
    "slime-lite doctor [train flags]": "placeholder flags (tests/debug/test_doctor.py)",
    "slime-lite display-rollouts --load-debug-rollout-data T": "placeholder T; run-tiny-rollout-only.sh, run here, "
                                                               "calls it on its dumps",
    "slime-lite replay-reward": "named without its flags (tests/debug/test_replay_reward.py)",
    "slime-lite compare-runs A.jsonl B.jsonl": "placeholder files; tests/debug/test_compare_runs.py runs it on "
                                               "written files, tests/test_loop.py on two real runs' metrics",
    "slime-lite explain --rollout-dump out/data_3.pt --train-dump out/train_3_*.pt --sample 5":
        "placeholder dumps; tests/debug/test_explain.py runs it on written dumps, tests/test_loop.py on a real run's",
    "RAY_AUTH_MODE=disabled .venv/bin/ray start --head --num-cpus 8 --resources '{\"slot\": 4}'":
        "starts a standalone Ray cluster that outlives the command",
    "RAY_AUTH_MODE=disabled RAY_ADDRESS=http://127.0.0.1:8265 bash scripts/run-tiny-grpo.sh":
        "needs the Ray cluster started by the command before it",
    "bash scripts/test-gpu.sh": "the gpu-marked tests, on a CUDA machine",
    "slime-lite ima-bisect [train flags]": "placeholder flags; SGLang on a GPU (tests/debug/test_ima_bisect.py)",
    "scripts/run-qwen2.5-0.5B-grpo.sh": "a GPU node with SGLang and the Qwen2.5-0.5B weights",
    "scripts/run-rollout-only-sglang.sh": "a GPU node with SGLang",
    "ray start --head": "starts a Ray cluster",
    "ray start --address": "joins a Ray cluster",
    "slime-lite serve --disable-cuda-graph": "a CUDA option, shown without --model-path",
    "bash scripts/run-tiny-moe-grpo.sh": "warm-starts a tiny MoE model first (a minute); tests/test_loop.py runs the "
                                          "MoE loop with routing replay under --ci-test",
    "slime-lite serve --enable-return-routed-experts": "an MoE server option, shown without --model-path "
                                                        "(tests/engine/test_moe_engine.py runs the engine with it)",
}


def readme_commands(text: str) -> list[str]:
    """Commands of the README, in order, without repeats: bash-block lines (comments dropped) and inline code spans
    whose first word (after VAR=value assignments) is slime-lite, bash, python or ray, or a *.sh script."""
    fenced = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
    found = []
    for m in fenced.finditer(text):
        if m.group(1) in ("bash", "sh", "shell"):
            found += [re.sub(r"\s+#.*$", "", line).strip() for line in m.group(2).splitlines()]
    found += [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", fenced.sub("", text))]
    out: list[str] = []
    for cmd in found:
        if _is_command(cmd) and cmd not in out:
            out.append(cmd)
    return out


def _is_command(text: str) -> bool:
    words = text.split()
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
        words.pop(0)
    program = words[0].rsplit("/", 1)[-1] if words else ""
    return program in ("slime-lite", "bash", "python", "ray") or program.endswith(".sh")


def test_every_readme_command_is_run_or_skipped_with_a_reason():
    commands = readme_commands((ROOT / "README.md").read_text())
    unknown = [c for c in commands if c not in RUN and c not in SKIP]
    assert not unknown, f"README commands neither run nor skipped in {Path(__file__).name}: {unknown}"
    stale = [c for c in [*RUN, *SKIP] if c not in commands]
    assert not stale, f"no longer in the README: {stale}"
    assert not set(RUN) & set(SKIP)


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory, tiny_model_dir) -> Path:
    """A copy of scripts/ (they cd to their parent) next to the real .venv and bench/, with a ready tiny model."""
    want = subprocess.run(["sha256sum", str(ROOT / "pyproject.toml")], capture_output=True, text=True).stdout[:16]
    stamps = [VENV / f".slime-lite-installed{extra}" for extra in ("", "-dev")]
    if not any(p.exists() and p.read_text().strip() == want for p in stamps):  # scripts/setup.sh's own test
        pytest.skip("scripts/setup.sh has not installed this pyproject.toml: the scripts would reinstall .venv")
    root = tmp_path_factory.mktemp("readme")
    shutil.copytree(ROOT / "scripts", root / "scripts")
    shutil.copy(ROOT / "pyproject.toml", root / "pyproject.toml")
    (root / ".venv").symlink_to(VENV)
    (root / "bench").symlink_to(ROOT / "bench")
    (root / "runs" / "tiny").mkdir(parents=True)
    (root / "runs" / "tiny" / "model").symlink_to(tiny_model_dir)
    (root / "runs" / "tiny" / "tool_model").symlink_to(tiny_model_dir)
    shutil.copytree(ROOT / "examples", root / "examples")
    return root


@pytest.mark.slow
def test_readme_commands_exit_0(sandbox):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # no `ray job submit` to a cluster
    env["PATH"] = f"{VENV / 'bin'}{os.pathsep}{env.get('PATH', '')}"  # `python` is the .venv's
    order = readme_commands((ROOT / "README.md").read_text())
    failed = []
    for readme_cmd in [c for c in order if c in RUN]:
        t0 = time.monotonic()
        proc = subprocess.run(RUN[readme_cmd], shell=True, cwd=sandbox, env=env, capture_output=True, text=True,
                              timeout=600)
        print(f"{time.monotonic() - t0:6.1f}s exit {proc.returncode}  {RUN[readme_cmd]}")  # shown with -rP / -s
        if proc.returncode != 0:
            failed.append(f"$ {RUN[readme_cmd]}\nexit {proc.returncode}\n{proc.stdout[-1500:]}\n{proc.stderr[-3000:]}")
    assert not failed, "\n\n".join(failed)
    # the README's own example writes and plots where it was told to
    assert (sandbox / "m.jsonl").exists() and (sandbox / "reward.png").exists()
    # the replay trains into its own folder: the quickstart's GRPO metrics are still there
    assert len((sandbox / "runs/tiny/replay/metrics.jsonl").read_text().splitlines()) == 2
    assert (sandbox / "runs/tiny/grpo/metrics.jsonl").read_text().strip()
