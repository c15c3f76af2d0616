"""slime flags beyond its example scripts: each is implemented (and does what slime's does), honoured as what
slime-lite always does, or refused by name with its reason; none is argparse's "unrecognized arguments" and none is
taken and ignored. Config-only checkpoints: no weights, no Ray."""
from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

from slime_lite import slime_flags
from slime_lite.args import parse_args, parser_defaults
from slime_lite.errors import SlimeLiteError
from slime_lite.metrics import MetricsLogger

QWEN3 = {"model_type": "qwen3", "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
         "vocab_size": 151936, "max_position_embeddings": 32768, "hidden_size": 2560, "intermediate_size": 9728,
         "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
         "tie_word_embeddings": True, "attention_bias": False}


@pytest.fixture
def run(tmp_path):
    """parse_args of a minimal valid run (a config-only Qwen3 checkpoint, 10 prompts) plus the given flags."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN3))
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "label": str(i + 1)}) + "\n" for i in range(10)))

    def parse(*flags: str):
        return parse_args(["--hf-checkpoint", str(model), "--prompt-data", str(data), "--rm-type", "math",
                           "--rollout-batch-size", "4", *flags])
    return parse


def test_llama3_rope_scaling_flags_are_checked_against_the_config(tmp_path):
    """slime's Llama 3.x model scripts: --use-rope-scaling and --rotary-scaling-factor state config.json's llama3
    RoPE scaling."""
    model = tmp_path / "llama"
    model.mkdir()
    cfg = {**QWEN3, "model_type": "llama", "max_position_embeddings": 131072, "rope_scaling": {
        "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}}
    (model / "config.json").write_text(json.dumps(cfg))
    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=", "label": "2"}) + "\n")
    base = ["--hf-checkpoint", str(model), "--prompt-data", str(data), "--rm-type", "math"]
    parse_args(base + ["--use-rope-scaling", "--rotary-scaling-factor", "32.0", "--max-position-embeddings",
                       "131072"])
    with pytest.raises(SlimeLiteError, match="--rotary-scaling-factor 8.0 contradicts .* means "
                                             "--rotary-scaling-factor 32.0"):
        parse_args(base + ["--use-rope-scaling", "--rotary-scaling-factor", "8"])


def test_offload_is_offload_train_and_offload_rollout(run):
    args = run("--offload")
    assert args.offload_train and args.offload_rollout
    assert not run().offload_train
    colocated = run("--colocate")  # on under --colocate unless turned off by name, as slime
    assert colocated.offload_train and colocated.offload_rollout
    kept = run("--colocate", "--no-offload-train", "--no-offload-rollout")  # slime's AMD script
    assert kept.offload_train is False and kept.offload_rollout is False
    # --async's rule sees what --offload turned on, and names the flag given
    with pytest.raises(SlimeLiteError, match=r"--offload releases the engines' memory.*drop --offload\.$"):
        run("--offload", "--async")


@pytest.mark.parametrize("flags, rollouts", [(["--num-epoch", "3"], 6), (["--num-epoch", "3", "--num-rollout", "5"], 5),
                                             ([], 1)])
def test_num_epoch_counts_the_rollouts_from_the_data_as_slime(run, flags, rollouts):
    assert run(*flags).num_rollout == rollouts  # 10 prompts // 4 per rollout = 2 per epoch


def test_num_epoch_counts_the_prompts_left_after_the_length_filter_as_slime(tiny_model_dir, tmp_path):
    data = tmp_path / "p.jsonl"
    rows = [{"prompt": "1+1=", "label": "2"}] * 5 + [{"prompt": "1+" * 40 + "1=", "label": "41"}] * 5
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    flags = ["--hf-checkpoint", str(tiny_model_dir), "--prompt-data", str(data), "--rm-type", "math",
             "--rollout-batch-size", "2", "--num-epoch", "2"]
    assert parse_args(flags).num_rollout == 10  # 10 prompts // 2, twice
    assert parse_args(flags + ["--rollout-max-prompt-len", "40"]).num_rollout == 4  # the 5 short ones // 2, twice


def test_num_epoch_without_data_to_count_is_refused(run):
    with pytest.raises(SlimeLiteError, match="--num-epoch 2 counts .* give --num-rollout"):
        run("--num-epoch", "2", "--debug-train-only")
    with pytest.raises(SlimeLiteError, match="fewer prompts than one rollout"):
        run("--num-epoch", "1", "--rollout-batch-size", "16")


def test_tb_project_and_experiment_name_the_tensorboard_folder(run):
    assert run("--tb-project-name", "p", "--tb-experiment-name", "e").tensorboard_dir == "tensorboard_log/p/e"
    assert run("--tb-project-name", "p").tensorboard_dir.startswith("tensorboard_log/p/20")  # the start time
    with pytest.raises(SlimeLiteError, match="both name the TensorBoard folder"):
        run("--tb-project-name", "p", "--tensorboard-dir", "tb")
    with pytest.raises(SlimeLiteError, match="--tb-experiment-name e names a folder under --tb-project-name"):
        run("--tb-experiment-name", "e")


def test_num_gpus_per_node_keeps_each_engine_on_one_node(run):
    assert run("--num-gpus-per-node", "8").num_gpus_per_node == 8
    with pytest.raises(SlimeLiteError, match="--rollout-num-gpus-per-engine 2 must divide --num-gpus-per-node 3"):
        run("--num-gpus-per-node", "3", "--rollout-num-gpus-per-engine", "2", "--rollout-num-gpus", "2",
            "--rollout-backend", "sglang")


def test_distributed_timeout_minutes(run):
    assert run().distributed_timeout_minutes == 30 and run("--distributed-timeout-minutes", "5") \
        .distributed_timeout_minutes == 5
    src = (Path(slime_flags.__file__).parent / "backends/megatron/worker.py").read_text()
    assert "timeout_s=60.0 * a.distributed_timeout_minutes" in src  # the train ranks' process group gets it


@pytest.mark.parametrize("flags", [["--train-backend", "megatron"], ["--distributed-backend", "nccl"],
                                   ["--log-probs-chunk-size", "1024"], ["--recompute-loss-function"],
                                   ["--memory-recorder", "torch"], ["--data-pad-size-multiplier", "1"],
                                   ["--log-probs-chunk-size", "16384"], ["--log-probs-chunk-size", "-1"],
                                   ["--data-pad-size-multiplier", "128"],  # slime's default and its glm5 scripts
                                   ["--padded-vocab-size", "151936"], ["--model-name", "qwen3"],
                                   ["--model-name", "Qwen3Config"], ["--max-position-embeddings", "32768"],
                                   ["--seq-length", "4096"], ["--seq-length", "32768"]])
def test_values_slime_lite_runs_with_are_accepted(run, flags):
    run(*flags)


@pytest.mark.parametrize("flags, error", [
    (["--train-backend", "fsdp"], "--train-backend fsdp: not supported yet: slime-lite runs with Megatron-core"),
    (["--log-probs-chunk-size", "0"], "--log-probs-chunk-size 0: not supported yet.*a value it takes"),
    (["--data-pad-size-multiplier", "0"], "--data-pad-size-multiplier 0: not supported yet.*padding changes no"),
    (["--memory-recorder", "memray"], "--memory-recorder memray: not supported yet"),
    (["--padded-vocab-size", "152064"], "--padded-vocab-size 152064 contradicts .*vocab_size"),
    (["--model-name", "glm4"], "--model-name glm4 contradicts .*model_type 'qwen3'"),
    (["--max-position-embeddings", "131072"], "--max-position-embeddings 131072 contradicts .* means "
                                              "--max-position-embeddings 32768"),
    (["--seq-length", "32769"], "--seq-length 32769 is more than .*max_position_embeddings 32768"),
    (["--use-rope-scaling"], "--use-rope-scaling given contradicts .*means --use-rope-scaling not given"),
    (["--rotary-scaling-factor", "32"], "--rotary-scaling-factor 32.0 contradicts .*not given"),
])
def test_other_values_are_refused_with_the_reason(run, flags, error):
    with pytest.raises(SlimeLiteError, match=error):
        run(*flags)


NEW_REFUSED = {"--use-rollout-entropy": [], "--keep-old-actor": [], "--loss-mask-type": ["qwen3_5"],
               "--start-rollout-id": ["3"], "--rollout-skip-special-tokens": [],
               "--rollout-health-check-interval": ["30"], "--rollout-health-check-timeout": ["30"],
               "--rollout-health-check-first-wait": ["0"], "--http-proxy": ["http://proxy:3128"],
               "--log-multi-turn": [], "--log-correct-samples": []}


def test_unsupported_slime_flags_are_refused_together_each_with_its_reason(run):
    assert set(NEW_REFUSED) <= set(slime_flags.NOT_SUPPORTED)
    with pytest.raises(SlimeLiteError) as info:
        run(*[a for flag, values in NEW_REFUSED.items() for a in (flag, *values)])
    lines = str(info.value).splitlines()[1:]
    assert sorted(line.split(":")[0].strip() for line in lines) == sorted(NEW_REFUSED)
    assert all(len(line.split("not supported yet: ", 1)[1]) > 30 for line in lines)  # each with its reason


class _FakeWandb(types.ModuleType):
    def __init__(self):
        super().__init__("wandb")
        self.calls = []

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda *a, **kw: self.calls.append((name, a, kw)) or self

    def called(self, name):
        return [kw for n, _, kw in self.calls if n == name]


@pytest.fixture
def fake_wandb(monkeypatch):
    fake = _FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    for name in ("WANDB_MODE", "WANDB_BASE_URL"):  # restored after the test (absent or not): the logger sets them
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    return fake


def test_wandb_mode_key_run_id_name_and_train_step(fake_wandb):
    logger = MetricsLogger(parser_defaults(use_wandb=True, wandb_mode="online", wandb_key="KEY", wandb_host="h",
                                           wandb_run_id="run7", wandb_group="g", wandb_random_suffix=False,
                                           wandb_always_use_train_step=True, num_steps_per_rollout=4))
    import os

    assert os.environ["WANDB_MODE"] == "online"
    assert fake_wandb.called("login") == [{"key": "KEY", "host": "h"}]
    init = fake_wandb.called("init")[0]
    assert (init["id"], init["resume"], init["name"], init["group"]) == ("run7", "allow", "g", "g")
    logger.log({"train/loss": 0.5}, 2)
    assert [a[0] for n, a, _ in fake_wandb.calls if n == "log"] == [{"train/loss": 0.5, "rollout_id": 2,
                                                                     "train_step": 8}]
    assert _axes(fake_wandb) == {"train_step": None, "train/step": None, "train/loss": "train_step"}


def test_wandb_defaults_offline_no_login_and_wandbs_own_run_name(fake_wandb):
    logger = MetricsLogger(parser_defaults(use_wandb=True, wandb_key="KEY"))
    import os

    assert os.environ["WANDB_MODE"] == "offline" and not fake_wandb.called("login")
    init = fake_wandb.called("init")[0]
    assert "id" not in init and "name" not in init
    # plotted against rollout_id (an eval before training is -1), not wandb's count of log calls
    logger.log({"train/loss": 0.5}, 2)
    assert [a[0] for n, a, _ in fake_wandb.calls if n == "log"] == [{"train/loss": 0.5, "rollout_id": 2}]
    assert _axes(fake_wandb) == {"rollout_id": None, "train/step": None, "train/loss": "rollout_id"}


def _axes(fake) -> dict:
    """Each name wandb was told of, and its x axis (None: an axis itself)."""
    return {a[0]: kw.get("step_metric") for n, a, kw in fake.calls if n == "define_metric"}


def test_each_optimizer_step_goes_to_wandb_against_train_step_as_slime_logs_it(fake_wandb):
    """Two optimizer steps a rollout: wandb gets each step's train/ values at train/step (slime's axis and count),
    and the rollout's record the rest at rollout_id, not the steps' mean under the same names."""
    logger = MetricsLogger(parser_defaults(use_wandb=True, num_steps_per_rollout=2))
    steps = [{"train/loss": 0.5, "train/grad_norm": 2.0}, {"train/loss": 0.25, "train/grad_norm": 1.0}]
    logger.log_train_steps(steps, 3)
    logger.log({"train/loss": 0.375, "train/grad_norm": 1.5, "train/first_step/grad_norm": 2.0,
                "rollout/raw_reward": 0.5}, 3)
    assert [a[0] for n, a, _ in fake_wandb.calls if n == "log"] == [
        {"train/loss": 0.5, "train/grad_norm": 2.0, "train/step": 6},
        {"train/loss": 0.25, "train/grad_norm": 1.0, "train/step": 7},
        {"train/first_step/grad_norm": 2.0, "rollout/raw_reward": 0.5, "rollout_id": 3}]
    assert _axes(fake_wandb) == {"rollout_id": None, "train/step": None, "train/loss": "train/step",
                                 "train/grad_norm": "train/step", "train/first_step/grad_norm": "rollout_id",
                                 "rollout/raw_reward": "rollout_id"}


def test_wandb_flags_without_use_wandb_are_said_to_do_nothing(run, caplog):
    with caplog.at_level("WARNING", logger="slime_lite.args"):
        run("--wandb-mode", "offline", "--disable-wandb-random-suffix")
    assert "--wandb-mode, --disable-wandb-random-suffix: no effect without --use-wandb" in caplog.text
