"""validate_args: every rule of SPEC 3/5 is a clear error (naming the flags) before anything starts."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest

from slime_lite.args import RM_TYPES, parse_args, split_sglang_args
from slime_lite.errors import SlimeLiteError


@pytest.fixture()
def base(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "1+1=", "label": "2"}\n')
    return ["--hf-checkpoint", str(model), "--prompt-data", str(data), "--rm-type", "addition"]


def err(argv) -> str:
    with pytest.raises(SlimeLiteError) as info:
        parse_args(argv)
    return str(info.value)


def test_rollout_only_and_train_only_exclusive(base):
    msg = err(base + ["--debug-rollout-only", "--debug-train-only"])
    assert "--debug-rollout-only" in msg and "--debug-train-only" in msg


def test_load_implies_train_only_and_logs(base, caplog):
    with caplog.at_level(logging.INFO):
        args = parse_args(base + ["--load-debug-rollout-data", "/tmp/x_{rollout_id}.pt"])
    assert args.debug_train_only
    assert "--debug-train-only" in caplog.text


@pytest.mark.parametrize("flag", ["--save-debug-rollout-data", "--load-debug-rollout-data"])
def test_template_needs_rollout_id(base, flag):
    extra = ["--debug-rollout-only"] if flag.startswith("--save") else []
    msg = err(base + extra + [flag, "/tmp/data.pt"])
    assert flag in msg and "{rollout_id}" in msg


def test_save_and_load_paths_differ(base):
    msg = err(base + ["--save-debug-rollout-data", "d_{rollout_id}.pt", "--load-debug-rollout-data", "d_{rollout_id}.pt"])
    assert "different paths" in msg


@pytest.mark.parametrize("ratio", ["0", "1.5", "-0.1"])
def test_subsample_range(base, ratio):
    msg = err(base + ["--load-debug-rollout-data", "d_{rollout_id}.pt", "--load-debug-rollout-data-subsample", ratio])
    assert "--load-debug-rollout-data-subsample" in msg


def test_subsample_ok(base):
    args = parse_args(base + ["--load-debug-rollout-data", "d_{rollout_id}.pt", "--load-debug-rollout-data-subsample", "0.5"])
    assert args.load_debug_rollout_data_subsample == 0.5


def test_rollout_only_turns_off_colocate_and_offload(base, caplog):
    with caplog.at_level(logging.INFO):
        args = parse_args(base + ["--debug-rollout-only", "--colocate", "--offload-train", "--offload-rollout"])
    assert not (args.colocate or args.offload_train or args.offload_rollout)
    assert "--colocate" in caplog.text and "no training memory" in caplog.text


def test_dump_details_sets_rollout_dump(base, tmp_path):
    args = parse_args(base + ["--debug-rollout-only", "--dump-details", str(tmp_path / "d")])
    assert args.save_debug_rollout_data == str(tmp_path / "d" / "rollout_data" / "{rollout_id}.pt")


def test_missing_files_named(base, tmp_path):
    assert "--prompt-data" in err(base + ["--prompt-data", str(tmp_path / "nope.jsonl")])
    assert "--hf-checkpoint" in err(["--hf-checkpoint", str(tmp_path / "none"), "--rm-type", "addition"])


def test_batch_must_divide(base):
    msg = err(base + ["--rollout-batch-size", "3", "--n-samples-per-prompt", "2", "--global-batch-size", "4"])
    assert "--global-batch-size" in msg
    msg = err(base + ["--rollout-batch-size", "4", "--actor-num-gpus-per-node", "2", "--micro-batch-size", "3",
                      "--global-batch-size", "4"])
    assert "--micro-batch-size" in msg
    msg = err(base + ["--actor-num-gpus-per-node", "3", "--tensor-model-parallel-size", "2"])
    assert "--tensor-model-parallel-size" in msg


def test_global_batch_sets_steps(base):
    args = parse_args(base + ["--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--global-batch-size", "8"])
    assert args.num_steps_per_rollout == 2


def test_unknown_estimator_and_negative_sizes_exit_nonzero(base):
    for bad in (["--advantage-estimator", "dpo"], ["--rollout-batch-size", "-2"]):
        proc = subprocess.run([sys.executable, "-m", "slime_lite.cli", "train", *base, *bad],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2
        assert bad[0] in proc.stderr
        assert "Traceback" not in proc.stderr


def test_cli_user_error_has_no_traceback(base):
    proc = subprocess.run([sys.executable, "-m", "slime_lite.cli", "train", *base, "--debug-rollout-only",
                           "--debug-train-only"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: ") and "Traceback" not in proc.stderr


def test_sglang_passthrough_split():
    rest, sg = split_sglang_args(["--lr", "1e-6", "--sglang-disable-cuda-graph", "--sglang-mem-fraction-static",
                                  "0.7", "--sglang-log-level=debug"])
    assert rest == ["--lr", "1e-6"]
    assert sg == ["--disable-cuda-graph", "--mem-fraction-static", "0.7", "--log-level", "debug"]


def test_sglang_flags_need_sglang_backend(base):
    assert "--rollout-backend" in err(base + ["--sglang-disable-cuda-graph"])


def test_engine_compile_needs_cuda_graphs(base):
    msg = err(base + ["--engine-enable-torch-compile", "--engine-disable-cuda-graph"])
    assert "--engine-enable-torch-compile" in msg and "--engine-disable-cuda-graph" in msg
    assert "--rollout-device cpu" in err(base + ["--engine-enable-torch-compile", "--rollout-device", "cpu"])


def test_reward_needed_for_generation(tmp_path, base):
    argv = [a for a in base if a not in ("--rm-type", "addition")]
    assert "--rm-type" in err(argv)


def test_rm_types_match_rewards_module():
    from slime_lite.rollout import rewards

    assert tuple(RM_TYPES) == tuple(rewards.RM_TYPES)


def test_help_is_fast_and_grouped():
    proc = subprocess.run([sys.executable, "-m", "slime_lite.cli", "train", "--help"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0
    for group in ("cluster:", "rollout:", "algorithm:", "debug:", "parallelism:"):
        assert group in proc.stdout
    code = "import sys, slime_lite.cli, slime_lite.args; print(any(m in sys.modules for m in ('torch','ray','megatron')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout
    assert out.strip() == "False"
