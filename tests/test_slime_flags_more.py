"""The rest of slime's flags: the few implemented do what slime's do (a CI threshold alias, the KL checker switch,
the eval context bound, the train processes' environment); the others are honoured as what slime-lite always does
or refused by name with the reason, typed as slime types them. Config-only checkpoints: no weights, no Ray."""
from __future__ import annotations

import inspect
import json

import pytest

from slime_lite import slime_flags
from slime_lite.args import parser_defaults
from slime_lite.backends.megatron import group
from slime_lite.checks import ci as cc
from slime_lite.config import CiConfig
from slime_lite.errors import SlimeLiteError
from slime_lite.rollout import agent_endpoint, calc_task
from slime_lite.rollout.multi_turn import TurnLimits, context_bound
from slime_lite.slime_flags_refused import REFUSED
from tests.test_slime_compat_flags import run  # noqa: F401 - the fixture: a minimal valid run


def test_slimes_logprob_threshold_name_is_an_alias_with_one_default(run):
    assert run().ci_logprob_diff_threshold is None  # slime-lite's default: by the precisions in use
    assert run("--ci-train-rollout-logprob-abs-diff-threshold", "1e-6").ci_logprob_diff_threshold == 1e-6
    assert run("--ci-logprob-diff-threshold", "0.2").ci_logprob_diff_threshold == 0.2


def test_ci_disable_kl_checker_leaves_out_only_the_zero_kl_checks():
    record = {"rollout/log_probs_ref_max_abs_diff": 0.5, "train/first_step/ppo_kl": 0.1,
              "train/train_rollout_logprob_abs_diff": 1e-4, "train/first_step/grad_norm": 3.0}

    def names(**kw):
        cfg = CiConfig.from_args(parser_defaults(ci_logprob_diff_threshold=1e-3, rollout_device="cpu", **kw))
        return {c.name for c in cc.rollout_checks(cfg, record, first=True)}

    assert {"step1_kl_zero", "first_step_ppo_kl_zero"} <= names()
    assert names(ci_disable_kl_checker=True) == {"train_rollout_logprob_diff", "grad_norm_finite"}
    # --lora-dropout: the train step's forward drops adapter inputs the old log-probs' forward kept, so its first
    # ppo_kl is not zero by design (it failed the run at rollout 1); the step-1 KL of the log-probs stays checked
    assert names(lora_dropout=0.3) == names() - {"first_step_ppo_kl_zero"}
    cfg = CiConfig.from_args(parser_defaults(ci_logprob_diff_threshold=1e-3, ci_disable_kl_checker=True))
    cc.enforce(cfg, record, 0, first=True)  # the KL of 0.5 no longer stops the run


def test_eval_max_context_len_bounds_eval_samples_and_defaults_to_the_rollouts(run):
    args = run("--rollout-max-context-len", "100", "--eval-max-context-len", "200")
    assert (context_bound(args), context_bound(args, evaluation=True)) == (100, 200)
    assert TurnLimits.from_args(args, evaluation=True).max_context_len == 200
    args = run("--rollout-max-context-len", "100")
    assert args.eval_max_context_len == 100 and context_bound(args, evaluation=True) == 100  # slime's default
    assert context_bound(run(), evaluation=True) == 32767  # the model's context, as for rollouts
    for hook in (calc_task.generate, agent_endpoint.openai_agent(lambda url, sample: None)):
        assert "evaluation" in inspect.signature(hook).parameters  # the generator passes evaluation= to them


def test_train_env_vars_go_to_the_train_processes_only(run, monkeypatch, capsys):
    assert run().train_env_vars == {}
    args = run("--train-env-vars", '{"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "N": 2}')
    assert group.train_env(args) == {"runtime_env": {"env_vars": {"PYTORCH_CUDA_ALLOC_CONF":
                                                                  "expandable_segments:True", "N": "2"}}}
    assert group.train_env(run()) == {}
    options = []

    class Fake:
        def options(self, **kw):
            options.append(kw)
            return self

        def remote(self, *a):
            return self

    monkeypatch.setattr(group.ray, "remote", lambda cls: Fake())
    monkeypatch.setattr(group, "bundle_options", lambda pg, b, share=1.0: {"num_cpus": share})
    group.TrainGroup(args, None, [0, 1], "actor", "m", "TrainActor")
    assert [o["runtime_env"]["env_vars"]["N"] for o in options] == ["2", "2"]
    with pytest.raises(SystemExit):
        run("--train-env-vars", "[1]")
    # a name Ray cannot set hung the run (its workers kept dying): refused while the flags are read
    for bad, said in (('{"A=B": "x"}', "'A=B' is not an environment variable name"),
                      ('{"": "x"}', "'' is not an environment variable name"),
                      ('{"N": null}', "the value of 'N' is null")):
        with pytest.raises(SystemExit):
            run("--train-env-vars", bad)
        assert said in capsys.readouterr().err


def test_frozen_parameter_patterns_parse_as_slimes_lists(run):
    args = run("--freeze-params-name-list", "embedding", "output_layer")
    assert (args.freeze_params_name_list, args.only_train_params_name_list) == (["embedding", "output_layer"], None)
    assert run("--only-train-params-name-list").only_train_params_name_list == []  # nargs="*": nothing frozen
    with pytest.raises(SlimeLiteError, match="give one of them"):
        run("--freeze-params-name-list", "a", "--only-train-params-name-list", "b")


# one slime-typed value per refused flag (nargs, JSON, ints, choices as slime's parser takes them)
VALUES = {"--buffer-filter-path": ["m.f"], "--custom-config-path": ["c.yaml"], "--data-source-path": ["m.C"],
          "--mtp-num-layers": ["1"], "--mtp-loss-scaling-factor": ["0.2"], "--eval-config": ["e.yaml"],
          "--fetch-trajectory-retry-times": ["-1"], "--min-batch-collection-ratio": ["1"],
          "--rollout-buffer-url": ["http://b"], "--rollout-task-type": ["math"],
          "--load-forge-rollout-data": ["/d/{rollout_id}.pt"], "--megatron-config-path": ["m.yaml"],
          "--megatron-deepgemm-forward-layers": ["0", "1"], "--megatron-deepgemm-forward-modules": ["linear_fc1"],
          "--megatron-deepgemm-moe-forward-layers": ["2"], "--megatron-deepgemm-moe-forward-modules": ["mlp.experts"],
          "--multimodal-keys": ['{"image": "image_file"}'], "--opd-type": ["sglang"], "--opd-kl-coef": ["1.0"],
          "--opd-teacher-load": ["/t"], "--opd-teacher-ckpt-step": ["3"], "--opsm-delta": ["1e-4"],
          "--qwen-gdn-backend": ["fla"], "--ref-ckpt-step": ["5"], "--rollout-data-postprocess-path": ["m.f"],
          "--rollout-sample-hook-path": ["m.f"], "--update-weight-delta-checksum": ["xxh3-128"],
          "--update-weight-delta-encoding": ["xor"], "--update-weight-disk-dir": ["/w"],
          "--update-weight-local-checkpoint-dir": ["/l"], "--custom-megatron-before-log-prob-hook-path": ["m.f"],
          "--custom-megatron-before-train-step-hook-path": ["m.f"], "--custom-megatron-init-path": ["m.f"],
          "--custom-model-provider-path": ["m.f"], "--custom-update-weight-post-write-path": ["m.f"]}


def test_every_new_refused_flag_parses_slimes_values_and_is_refused_with_its_reason(run):
    assert set(REFUSED) <= set(slime_flags.NOT_SUPPORTED)
    flags = [a for flag, (kw, _) in REFUSED.items() for a in (flag, *VALUES.get(flag, []))
             if kw.get("action") == "store_true" or flag in VALUES]
    assert len({f for f in flags if f.startswith("--")}) == len(REFUSED)  # each flag has a value, or is a switch
    with pytest.raises(SlimeLiteError) as info:
        run(*flags)
    lines = str(info.value).splitlines()[1:]
    assert sorted(line.split(":")[0].strip() for line in lines) == sorted(REFUSED)
    assert all(len(line.split("not supported yet: ", 1)[1]) > 30 for line in lines)


@pytest.mark.parametrize("flags", [["--update-weight-mode", "full"], ["--rollout-data-transport", "object-store"],
                                   ["--num-critic-only-steps", "0"]])
def test_what_slime_lite_always_does_is_accepted(run, flags):
    run(*flags)


@pytest.mark.parametrize("flags, error", [(["--update-weight-mode", "delta"], "every weight pushed in full"),
                                          (["--rollout-data-transport", "nixl"], "Ray's object store"),
                                          (["--num-critic-only-steps", "2"], "from the first rollout")])
def test_other_values_are_refused(run, flags, error):
    with pytest.raises(SlimeLiteError, match=error):
        run(*flags)


def test_every_flag_of_slimes_parser_is_a_flag_here():
    """slime's whole argument parser (its option strings, recorded in tests/data/slime_parser_flags.json): a slime
    script never dies with argparse's "unrecognized arguments"; each flag is implemented, honoured at slime-lite's
    only value, or refused by name with a reason."""
    from pathlib import Path

    from slime_lite.args import build_parser

    recorded = json.loads((Path(__file__).parent / "data" / "slime_parser_flags.json").read_text())["flags"]
    ours = {s for action in build_parser()._actions for s in action.option_strings}
    assert len(recorded) == 223 and not [f for f in recorded if f not in ours]
