"""validate_args: every rule on flags and their combinations is a clear error (naming the flags) before anything starts."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest

from slime_lite import config
from slime_lite.config import EngineConfig, TrainSideConfig
from slime_lite.args import (
    RM_TYPES,
    build_parser,
    parse_args,
    parser_defaults,
    split_sglang_args,
)
from slime_lite.errors import SlimeLiteError

PKG = Path(__file__).resolve().parents[1] / "slime_lite"


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


def test_global_batch_and_steps_must_agree(base):
    batch = ["--rollout-batch-size", "4", "--n-samples-per-prompt", "4"]
    args = parse_args(base + batch + ["--global-batch-size", "8", "--num-steps-per-rollout", "2"])
    assert (args.global_batch_size, args.num_steps_per_rollout) == (8, 2)
    args = parse_args(base + batch + ["--num-steps-per-rollout", "4"])
    assert (args.global_batch_size, args.num_steps_per_rollout) == (4, 4)
    args = parse_args(base + batch)
    assert (args.global_batch_size, args.num_steps_per_rollout) == (16, 1)
    msg = err(base + batch + ["--global-batch-size", "8", "--num-steps-per-rollout", "4"])
    assert "--global-batch-size 8" in msg and "--num-steps-per-rollout 4" in msg and "2 steps" in msg
    assert parse_args(base + ["--debug-rollout-only"]).num_steps_per_rollout == 1


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


@pytest.mark.parametrize("argv, named", [
    (["--tis-mode", "mask"], "--use-tis"),  # a correction flag without its switch would silently do nothing
    (["--rs-veto-threshold", "1e-4"], "--use-rs"),
    (["--mismatch-top-k", "3"], "--get-mismatch-metrics"),
    (["--use-tis", "--tis-clip-low", "3"], "--tis-clip-low"),
    (["--use-tis", "--tis-mode", "mask", "--tis-clip", "1.0"], "--tis-clip"),
    (["--use-rs", "--rs-upper-bound", "0.5"], "--rs-lower-bound"),
    (["--use-rs", "--rs-veto-threshold", "2"], "--rs-veto-threshold"),
    (["--get-mismatch-metrics", "--mismatch-ratio-bound", "1"], "--mismatch-ratio-bound"),
    (["--get-mismatch-metrics", "--debug-rollout-only"], "--debug-rollout-only"),
])
def test_correction_and_mismatch_flags_refused(base, argv, named):
    assert named in err(base + argv)


def test_correction_flags_accepted(base):
    args = parse_args(base + ["--use-tis", "--tis-level", "geometric", "--tis-mode", "mask", "--use-rs",
                              "--rs-level", "sequence", "--rs-veto-threshold", "1e-4", "--get-mismatch-metrics"])
    cfg = config.LossConfig.from_args(args)
    assert (cfg.tis_level, cfg.tis_mode, cfg.rs_level, cfg.rs_veto_threshold) == ("geometric", "mask", "sequence",
                                                                                    1e-4)


def test_the_weight_check_is_refused_with_sglang_engines(base):
    """It stopped the run at the first push (an SGLang server has no /get_weights_checksum)."""
    msg = err(base + ["--check-weight-update-equal", "--rollout-backend", "sglang"])  # before Ray starts
    assert "--check-weight-update-equal" in msg and "--rollout-backend embedded" in msg


@pytest.mark.parametrize("argv", [
    ["--use-fault-tolerance", "--rollout-external-engine-addrs", "127.0.0.1:30000"],
    ["--use-fault-tolerance", "--debug-train-only"],
    ["--debug-inject-fault", "kill-engine", "--rollout-external-engine-addrs", "127.0.0.1:1"],
])
def test_fault_tolerance_needs_engines_this_job_starts(base, argv):
    msg = err(base + argv)  # before Ray starts
    assert all(flag in msg for flag in (argv[0], argv[-2] if argv[-1][0].isdigit() else argv[-1]))


@pytest.mark.parametrize("argv, named", [
    (["--partial-rollout"], ["--partial-rollout", "--over-sampling-batch-size"]),
    (["--partial-rollout", "--rollout-batch-size", "4", "--over-sampling-batch-size", "4"],
     ["--partial-rollout", "--over-sampling-batch-size 4", "--rollout-batch-size 4"]),
    (["--partial-rollout", "--over-sampling-batch-size", "64", "--debug-train-only"],
     ["--partial-rollout", "--debug-train-only"]),
    (["--partial-rollout", "--over-sampling-batch-size", "64", "--load-debug-rollout-data", "/tmp/d_{rollout_id}.pt"],
     ["--partial-rollout", "--load-debug-rollout-data"]),
    (["--partial-rollout", "--over-sampling-batch-size", "64", "--deterministic-mode"],
     ["--partial-rollout", "--deterministic-mode"]),
    (["--mask-offpolicy-in-partial-rollout"], ["--mask-offpolicy-in-partial-rollout", "--partial-rollout"]),
    (["--rollout-batch-size", "8", "--over-sampling-batch-size", "4"],
     ["--over-sampling-batch-size 4", "--rollout-batch-size 8"]),
])
def test_partial_rollout_and_over_sampling_bad_input_names_the_flags(base, argv, named):
    msg = err(base + argv)  # before Ray starts
    assert all(flag in msg for flag in named), msg


def test_over_sampling_flags_with_a_custom_rollout_function_are_named_in_a_warning(base, caplog):
    """They act in the default rollout function only: a --rollout-function-path that replaces it is told so."""
    with caplog.at_level(logging.WARNING):
        parse_args(base + ["--rollout-batch-size", "4", "--over-sampling-batch-size", "6", "--partial-rollout",
                           "--rollout-function-path", "my_mod.rollout"])
    assert "--over-sampling-batch-size / --partial-rollout act in the default rollout function only" in caplog.text
    assert "--rollout-function-path my_mod.rollout" in caplog.text


def test_a_kl_loss_coef_without_use_kl_loss_is_named_in_a_warning(base, caplog):
    with caplog.at_level(logging.WARNING):
        parse_args(base + ["--kl-loss-coef", "0.1"])
    assert "--kl-loss-coef 0.1 has no effect without --use-kl-loss" in caplog.text


def test_a_kl_in_the_reward_and_one_in_the_loss_are_refused_together(base):
    """slime's rule: --kl-coef (the reward) and --kl-loss-coef (the loss) would count the KL twice."""
    msg = err(base + ["--advantage-estimator", "ppo", "--kl-coef", "0.01", "--use-kl-loss", "--kl-loss-coef", "0.1"])
    assert "--kl-coef 0.01 and --kl-loss-coef 0.1: only one KL may be set" in msg, msg
    parse_args(base + ["--advantage-estimator", "ppo", "--kl-coef", "0.01", "--use-kl-loss", "--kl-loss-coef", "0"])


def test_partial_rollout_with_over_sampling_is_accepted(base):
    args = parse_args(base + ["--rollout-batch-size", "4", "--over-sampling-batch-size", "6", "--partial-rollout",
                              "--mask-offpolicy-in-partial-rollout"])
    cfg = config.RolloutConfig.from_args(args)
    assert (cfg.over_sampling_batch_size, cfg.partial_rollout, cfg.mask_offpolicy_in_partial_rollout) == (6, True,
                                                                                                       True)


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
    """Without --rm-type every row must name its reward in an rm_type field: checked when the data is read,
    before the run starts (preflight)."""
    from slime_lite.rollout.rewards import check_data_rm_types

    args = parse_args([a for a in base if a not in ("--rm-type", "addition")])
    with pytest.raises(SlimeLiteError, match="prompt 0 has no rm_type field and no --rm-type is given"):
        check_data_rm_types(args, [{}], "--prompt-data data.jsonl")
    check_data_rm_types(args, [{"rm_type": "math"}], "--prompt-data data.jsonl")
    assert "--reward-key score" in err(base[:-1] + ["dapo"])


def test_rm_types_match_rewards_module():
    from slime_lite.rollout import rewards

    assert tuple(RM_TYPES) == tuple(rewards.RM_TYPES)


def test_help_is_fast_and_grouped():
    proc = subprocess.run([sys.executable, "-m", "slime_lite.cli", "train", "--help"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0
    for group in ("cluster:", "model and checkpoint:", "parallelism:", "rollout:", "data:", "eval:", "algorithm:",
                  "reward model:", "debug:", "CI:", "logging:", "SGLang and engines:"):
        assert group in proc.stdout
    code = "import sys, slime_lite.cli, slime_lite.args; print(any(m in sys.modules for m in ('torch','ray','megatron')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout
    assert out.strip() == "False"


def test_every_flag_has_help():
    missing = [a.option_strings[0] for a in build_parser()._actions if not a.help]
    assert not missing, f"flags without help text: {missing}"


def test_estimator_and_kl_names_come_from_rl_math():
    from slime_lite import rl_math, rollout_correction

    actions = build_parser()._option_string_actions
    assert tuple(actions["--advantage-estimator"].choices) == tuple(rl_math.ESTIMATORS)
    assert tuple(actions["--loss-type"].choices) == (*rl_math.POLICY_LOSSES, rl_math.CUSTOM_LOSS)
    assert tuple(actions["--kl-loss-type"].choices) == rl_math.KL_TYPES
    assert tuple(actions["--tis-level"].choices) == rollout_correction.IS_LEVELS


def test_an_estimator_registered_in_a_test_module_is_a_choice_places_its_critic_and_runs(base, monkeypatch, caplog):
    """Adding an estimator is one decorated function: the flag accepts it, the placement gives it a critic when it
    needs one, the group-size rule warns for it, and the advantages are its own."""
    import torch

    from slime_lite import rl_math
    from slime_lite.placement import plan_layout

    monkeypatch.setattr(rl_math, "ESTIMATORS", dict(rl_math.ESTIMATORS))  # the registration ends with the test

    @rl_math.register_estimator("sign_baseline", needs_critic=True, needs_groups=True)
    def sign_baseline(x):
        adv = [torch.full_like(lp, float(torch.sign(r - x.rewards.mean()))) for lp, r in zip(x.log_probs, x.rewards)]
        return adv, adv

    with caplog.at_level(logging.WARNING, logger="slime_lite.args"):
        args = parse_args(base + ["--advantage-estimator", "sign_baseline", "--n-samples-per-prompt", "1"])
    assert "compares the samples of a prompt" in caplog.text
    assert plan_layout(args).critic and TrainSideConfig.from_args(args).has_critic
    logp = [torch.zeros(2), torch.zeros(3)]
    adv, _ = rl_math.compute_advantages_and_returns("sign_baseline", [1.0, 0.0], logp, None, None,
                                                    [torch.ones(2), torch.ones(3)], group_size=2)
    assert [a.tolist() for a in adv] == [[1.0, 1.0], [-1.0, -1.0, -1.0]]
    with pytest.raises(SystemExit):  # not registered outside this test: an unknown choice
        monkeypatch.undo()
        parse_args(base + ["--advantage-estimator", "sign_baseline"])


@pytest.mark.parametrize("cls", [config.LossConfig, config.CiConfig, config.RolloutConfig, config.EngineConfig])
def test_config_groups_are_read_from_the_parsed_flags(base, cls):
    dests = {a.dest for a in build_parser()._actions} | {"sglang_args"}
    assert {f.name for f in dataclasses.fields(cls)} <= dests
    args = parse_args(base)
    cfg = cls.from_args(args)
    assert all(getattr(cfg, f.name) == getattr(args, f.name) for f in dataclasses.fields(cls))
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(cfg, dataclasses.fields(cls)[0].name, None)


def test_checkpoints_every_save_interval_and_after_the_last_rollout(base, tmp_path):
    cfg = TrainSideConfig.from_args(parse_args(base + ["--save", str(tmp_path), "--save-interval", "3",
                                                       "--num-rollout", "7"]))
    assert [r for r in range(7) if cfg.saves_after(r)] == [2, 5, 6]  # as slime: the run's end is saved too


def test_config_keeps_no_defaults_of_its_own():
    """A flag's default lives in the parser only: a namespace without the flag is an error, not a silent default."""
    assert all(f.default is dataclasses.MISSING for cls in (config.LossConfig, config.CiConfig,
               config.RolloutConfig, config.EngineConfig) for f in dataclasses.fields(cls))
    with pytest.raises(AttributeError):
        config.LossConfig.from_args(argparse.Namespace(eps_clip=0.2))
    assert config.LossConfig.from_args(parser_defaults()).kl_loss_type == "k1"  # slime's default
    assert parser_defaults(eps_clip=0.3).eps_clip_high == 0.3  # implied defaults filled as validate_args does
    with pytest.raises(TypeError, match="not_a_flag"):
        parser_defaults(not_a_flag=1)


def test_no_getattr_with_a_default_on_args():
    pattern = re.compile(r"getattr\((?:self\.)?args, *[\"'][a-z_]+[\"'], ")
    hits = [f"{p.relative_to(PKG)}:{i}" for p in PKG.rglob("*.py")
            for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not hits, f"getattr(args, name, default) repeats a parser default: {hits}"


def test_engine_batch_slots_default_to_a_whole_rollout_on_cuda_within_memory():
    """--engine-max-running-requests unset: the embedded engine gets every request of a rollout at once on CUDA
    (a colocated 32 x 8 rollout decoded in 4 waves of 64 with the old fixed default), bounded by memory."""
    from types import SimpleNamespace

    import torch

    from slime_lite.engine.kv_cache import (
        AUTO_KV_MEMORY_FRACTION,
        auto_max_running,
        kv_bytes_per_token,
    )

    a = parser_defaults(rollout_batch_size=32, n_samples_per_prompt=8)
    assert a.engine_max_running_requests is None and EngineConfig.from_args(a).requests_per_engine == 256
    two = parser_defaults(rollout_batch_size=32, n_samples_per_prompt=8, over_sampling_batch_size=40,
                          rollout_num_gpus=4, rollout_num_gpus_per_engine=2)
    assert EngineConfig.from_args(two).requests_per_engine == 160  # 40 x 8 prompts' samples over 2 engines
    # --deterministic-mode sends a wave to one engine in one call: each is sized for the whole wave (sized by the
    # engine count, the first ran it in smaller batches, so more engines gave other log-probs on a GPU)
    det = parser_defaults(rollout_batch_size=32, n_samples_per_prompt=8, rollout_num_gpus=4, deterministic_mode=True)
    assert EngineConfig.from_args(det).requests_per_engine == 256
    kv = 2 * 24 * 2 * 64 * 2  # bytes per token: Qwen2.5-0.5B shape, bf16
    qwen05 = SimpleNamespace(config=SimpleNamespace(num_hidden_layers=24, num_attention_heads=14,
                                                    num_key_value_heads=2, hidden_size=896),
                             parameters=lambda: iter([torch.zeros(1, dtype=torch.bfloat16)]))
    assert kv_bytes_per_token(qwen05) == kv
    h200 = 141 * 2**30
    assert auto_max_running(None, 256, 4096, kv) == 64  # CPU: as before
    assert auto_max_running(h200, 256, 4096, kv) == 256
    assert auto_max_running(h200, 8, 4096, kv) == 64  # never below the old default where it fits
    big = 2 * 80 * 8 * 128 * 2  # a 70B-like model: memory bounds the slots
    fit = int(AUTO_KV_MEMORY_FRACTION * h200) // (4096 * big)
    assert auto_max_running(h200, 256, 4096, big) == fit < 64
    assert auto_max_running(h200, 256, 4096, kv, kv_cache_tokens=100 * 4096) == 100  # the given cache bounds them


def test_parsed_flags_are_read_only_and_travel_to_ray_actors_as_they_are(base):
    """Nothing writes to the flags after validation (the loop tests run every mode with them frozen); they pickle
    (to Ray actors) and copy with their values, and stay read-only there."""
    import copy
    import pickle

    args = parse_args(base)
    with pytest.raises(AttributeError, match="read-only after validation.*'engine_client'"):
        args.engine_client = object()
    with pytest.raises(AttributeError, match="read-only"):
        del args.lr
    for back in (pickle.loads(pickle.dumps(args)), copy.copy(args), copy.deepcopy(args)):
        assert vars(back) == vars(args)
        with pytest.raises(AttributeError):
            back.lr = 1.0


def test_hooks_get_a_read_only_view_with_slimes_router_address():
    """A slime-style hook reads the flags and sglang_router_ip/port from its args; the address follows the client
    (a restarted engine), and the view refuses writes."""
    from types import SimpleNamespace

    from slime_lite.hooks import HookArgs

    client = SimpleNamespace(urls=["http://10.0.0.2:30001", "http://10.0.0.3:30002"])
    view = HookArgs(parser_defaults(rollout_max_response_len=7), client)
    assert (view.sglang_router_ip, view.sglang_router_port) == ("10.0.0.2", 30001)
    assert view.rollout_max_response_len == 7 and view.engine_client is client
    client.urls[0] = "http://10.0.0.9:31000"
    assert (view.sglang_router_ip, view.sglang_router_port) == ("10.0.0.9", 31000)
    with pytest.raises(AttributeError, match="read-only"):
        view.rollout_max_response_len = 8


def test_eval_interval_0_turns_eval_off_even_appended_to_a_scripts_flags(base, tmp_path):
    from slime_lite.config import RolloutSideConfig

    evals = ["--eval-prompt-data", "add", base[3], "--eval-interval", "5"]
    on = RolloutSideConfig.from_args(parse_args(base + evals))
    assert on.evaluates_after(-1) and on.evaluates_after(4) and not on.evaluates_after(3)
    off = RolloutSideConfig.from_args(parse_args(base + evals + ["--eval-interval", "0"]))
    assert not any(off.evaluates_after(r) for r in range(-1, 10))
    parse_args(base + ["--eval-interval", "0"])  # nothing to evaluate, nothing asked for
    with pytest.raises(SystemExit):
        parse_args(base + ["--eval-interval", "-1"])


MOE_CONFIG = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "num_hidden_layers": 4,
              "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 384,
              "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 96, "norm_topk_prob": True}


def test_moe_layouts_and_flags_contradicting_the_model_are_refused_naming_flag_value_and_fix(base, tmp_path):
    """Before Ray starts: an MoE flag config.json contradicts, EP not dividing the experts, TP > 1 without sequence
    parallelism on an MoE model, EP or routing replay on a dense model, routing replay with PP and recompute; the
    script's layout of a matching model passes."""
    (tmp_path / "model" / "config.json").write_text(json.dumps(MOE_CONFIG))
    gpus = ["--actor-num-gpus-per-node", "4"]
    args = parse_args(base + gpus + ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--num-experts", "8",
                                     "--moe-router-topk", "2", "--moe-ffn-hidden-size", "96", "--moe-layer-freq",
                                     "([1]*4)", "--expert-model-parallel-size", "4", "--expert-tensor-parallel-size",
                                     "1", "--moe-token-dispatcher-type", "alltoall", "--moe-grouped-gemm"])
    assert (args.expert_model_parallel_size, args.expert_tensor_parallel_size) == (4, 1)
    msg = err(base + ["--num-experts", "16", "--moe-router-pre-softmax"])
    assert "--num-experts 16 contradicts" in msg and "means --num-experts 8" in msg
    assert "--moe-router-pre-softmax given contradicts" in msg and "norm_topk_prob" in msg
    assert "--moe-layer-freq" in err(base + ["--moe-layer-freq", "2"])  # every second layer dense: not this model
    msg = err(base + gpus + ["--expert-model-parallel-size", "3"])
    assert "--expert-model-parallel-size 3 must divide the model's num_experts (8)" in msg
    msg = err(base + gpus + ["--tensor-model-parallel-size", "2"])
    assert "--tensor-model-parallel-size 2 with an MoE model" in msg and "add --sequence-parallel" in msg
    msg = err(base + ["--actor-num-gpus-per-node", "2", "--expert-model-parallel-size", "4"])
    assert "--expert-model-parallel-size 4 x --expert-tensor-parallel-size 1 must divide the 2 ranks" in msg
    msg = err(base + ["--actor-num-gpus-per-node", "2", "--pipeline-model-parallel-size", "2",
                      "--use-rollout-routing-replay", "--recompute-granularity", "selective"])
    assert "--use-rollout-routing-replay with --pipeline-model-parallel-size 2 and --recompute-granularity" in msg
    assert parse_args(base + ["--use-rollout-routing-replay"]).use_rollout_routing_replay
    (tmp_path / "model" / "config.json").write_text(json.dumps({"model_type": "qwen3", "num_hidden_layers": 4}))
    msg = err(base + ["--use-rollout-routing-replay"])
    assert "--use-rollout-routing-replay: the model (qwen3) has no experts to route; drop" in msg
    msg = err(base + ["--actor-num-gpus-per-node", "2", "--expert-model-parallel-size", "2"])
    assert "--expert-model-parallel-size 2: the model (qwen3) has no experts; drop" in msg
    assert "--num-experts 8 contradicts" in err(base + ["--num-experts", "8"])


def test_num_epoch_saves_and_evaluates_at_each_epochs_end(tmp_path):
    """As slime's periodic actions: with --num-epoch, the end of each epoch saves and evaluates too (8 prompts, 2 a
    rollout, 2 epochs: epoch 1 ends after rollout 3, which --save-interval 3 alone skips)."""
    from slime_lite.args_check import fill_num_epoch
    from slime_lite.config import RolloutSideConfig, TrainSideConfig

    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i}", "label": "1"}) + "\n" for i in range(8)))
    args = parser_defaults(hf_checkpoint="/m", prompt_data=str(data), num_epoch=2, rollout_batch_size=2,
                           save="/ckpt", save_interval=3, eval_interval=3, eval_prompt_data=["e", str(data)])
    args.num_rollout = None
    fill_num_epoch(args)
    train, rollout = TrainSideConfig.from_args(args), RolloutSideConfig.from_args(args)
    assert args.num_rollout == 8 and args.num_rollout_per_epoch == 4
    assert [i for i in range(8) if train.saves_after(i)] == [2, 3, 5, 7]
    assert [i for i in range(8) if rollout.evaluates_after(i)] == [2, 3, 5, 7]
    args.num_rollout_per_epoch = None  # --num-rollout given: no epochs
    assert [i for i in range(8) if TrainSideConfig.from_args(args).saves_after(i)] == [2, 5, 7]


def test_a_zero_moe_layer_freq_is_refused_by_the_parser(base, capsys):
    with pytest.raises(SystemExit):  # it was a ZeroDivisionError
        parse_args(base + ["--moe-layer-freq", "0"])
    assert "argument --moe-layer-freq: '0': expected N >= 1" in capsys.readouterr().err


def test_any_rollout_seed_gives_sampling_seeds_within_int64() -> None:
    """SGLang (and the embedded engine) refuse a sampling_seed outside int64: a --rollout-seed of 10^13 failed every
    request; the seeds of a small seed are what they were."""
    from slime_lite.rollout.generate import seed_base

    assert seed_base(42, 3 * 100_003) == 42 * 1_000_003 + 3 * 100_003
    for seed in (10**13, -(10**13), 2**70):
        assert 0 <= seed_base(seed, 7 * 100_003) + 10_000 < 2**63


def test_a_critic_layout_the_batch_or_tp_cannot_split_is_refused_before_ray(base):
    """The critic has its own GPUs (--critic-num-*) with the actor's TP/PP and batch: a layout that does not split
    failed after Ray, the engines and rollout 0 (a ValueError from the critic actor)."""
    ppo = base + ["--advantage-estimator", "ppo", "--rollout-batch-size", "3", "--n-samples-per-prompt", "1"]
    parse_args(ppo + ["--critic-num-gpus-per-node", "1"])
    msg = err(ppo + ["--critic-num-gpus-per-node", "2"])
    assert "--global-batch-size 3 is not divisible by the critic's data-parallel size 2" in msg
    assert "--critic-num-nodes x --critic-num-gpus-per-node = 2" in msg
    msg = err(base + ["--advantage-estimator", "ppo", "--actor-num-gpus-per-node", "2", "--tensor-model-parallel-size",
                      "2", "--critic-num-gpus-per-node", "1", "--sequence-parallel"])
    assert "--critic-num-nodes x --critic-num-gpus-per-node = 1 (the critic of --advantage-estimator ppo) is not " \
           "divisible by --tensor-model-parallel-size 2" in msg
