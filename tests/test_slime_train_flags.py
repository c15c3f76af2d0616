"""slime's --update-weights-interval, --ref-update-interval, --reset-optimizer-states, --save-hf and --no-save-optim:
their rules before anything starts, when the driver pushes, and the weight version --ci-test then expects (a push
the interval skips is no alarm, a push that was due and did not land still is). The workers' side:
tests/backends/test_train_flags_worker.py; the whole loop: tests/test_loop.py."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest

from slime_lite.args import parse_args, parser_defaults
from slime_lite.checks.ci import CiCheckFailed, enforce
from slime_lite.config import CiConfig, RolloutSideConfig
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


def test_defaults_are_slimes():
    args = parser_defaults()
    assert args.update_weights_interval == 1 and args.ref_update_interval is None
    assert not args.no_save_optim and not args.reset_optimizer_states and args.save_hf is None


def test_rules_name_the_flag_and_the_fix(base, tmp_path):
    kl = ["--use-kl-loss"]
    assert "add --save DIR and --save-interval N" in err(base + ["--save-hf", "/x/{rollout_id}"])
    save = ["--save", str(tmp_path / "ckpt"), "--save-interval", "1"]
    assert "only placeholder it takes is {rollout_id}" in err(base + save + ["--save-hf", "/x/{step}"])
    for bad in ("/x/{rollout_id.x}", "/x/{rollout_id[1]}"):  # AttributeError / TypeError: named, no traceback
        assert "only placeholder it takes is {rollout_id}" in err(base + save + ["--save-hf", bad])
    assert "which is or holds --hf-checkpoint" in err(base + save + ["--save-hf", base[1]])
    # an export replaces its folder: never one that is or holds the checkpoints or a model the run reads
    assert f"writes {tmp_path / 'ckpt'}, which is or holds --save" in err(base + save + ["--save-hf",
                                                                                          str(tmp_path / "ckpt")])
    model_parent = os.path.dirname(os.path.realpath(base[1]))
    assert "which is or holds --hf-checkpoint" in err(base + save + ["--save-hf", model_parent])
    # {rollout_id} at a save point naming the checkpoint folder (--num-rollout 3, a save after every rollout)
    said = err(base + save + ["--num-rollout", "3", "--save-hf", str(tmp_path / "{rollout_id}"),
                              "--save", str(tmp_path / "2")])
    assert f"writes {tmp_path / '2'}, which is or holds --save" in said
    parse_args(base + save + ["--save-hf", str(tmp_path / "hf_{rollout_id}")])
    parse_args(base + save + ["--save-hf", str(tmp_path / "ckpt" / "hf_{rollout_id}")])  # inside --save: no harm
    # nor the data, the metrics or the dumps the run reads or writes
    exp = tmp_path / "exp"
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "d.jsonl").write_text('{"prompt": "1+1=", "label": "2"}\n')
    assert "which is or holds --prompt-data" in err(base + save + ["--prompt-data", str(tmp_path / "data" / "d.jsonl"),
                                                                    "--save-hf", str(tmp_path / "data")])
    for sliced in ("--prompt-data", "--eval-prompt-data"):  # slime's PATH@[a:b] reads PATH
        extra = [sliced] + (["e"] if sliced == "--eval-prompt-data" else []) + [
            f"{tmp_path / 'data' / 'd.jsonl'}@[0:1]"] + (["--eval-interval", "1"] if sliced != "--prompt-data" else [])
        assert f"which is or holds {sliced}" in err(base + save + extra + ["--save-hf",
                                                                           str(tmp_path / "data" / "d.jsonl")])
    for extra, flag, folder in (
            (["--metrics-path", str(exp / "m.jsonl")], "--metrics-path", exp),
            (["--save-debug-rollout-data", str(exp / "d" / "data_{rollout_id}.pt")], "--save-debug-rollout-data", exp),
            (["--eval-prompt-data", "e", str(tmp_path / "data" / "d.jsonl"), "--eval-interval", "1"],
             "--eval-prompt-data", tmp_path / "data")):
        assert f"which is or holds {flag}" in err(base + save + extra + ["--save-hf", str(folder)])
    # an existing folder is replaced only when it is an earlier export: nothing else in it is deleted
    exp.mkdir()
    (exp / "notes.txt").write_text("mine")
    (exp / "config.json").write_text("{}")
    said = err(base + save + ["--save-hf", str(exp)])
    assert f"holds {exp / 'notes.txt'}, which no export writes" in said and (exp / "notes.txt").exists()
    (exp / "notes.txt").unlink()
    (exp / "model.safetensors").write_text("")
    parse_args(base + save + ["--save-hf", str(exp)])  # config.json and weights only: an earlier export
    assert "keeps none (no --use-kl-loss" in err(base + ["--ref-update-interval", "2"])
    assert "with --lora-rank is not supported" in err(base + kl + ["--ref-update-interval", "2", "--lora-rank", "4"])
    assert parse_args(base + kl + ["--ref-update-interval", "2"]).ref_update_interval == 2
    assert "must be a positive integer" in str(pytest.raises(SystemExit, parse_args, base + [
        "--update-weights-interval", "0"]).value.__context__)
    assert "--reset-optimizer-states with --optimizer-cpu-offload" in err(base + [
        "--reset-optimizer-states", "--optimizer-cpu-offload", "--use-precision-aware-optimizer"])
    n = ["--update-weights-interval", "2"]
    for extra, named in ((["--async"], "--async already generates"), (["--fully-async"], "--fully-async already"),
                         (["--colocate"], "--colocate releases the engines' weights"),
                         (["--offload-rollout"], "--offload-rollout releases"),
                         (["--use-fault-tolerance"], "--use-fault-tolerance gives a restarted engine")):
        assert err(base + n + extra).startswith(f"--update-weights-interval 2: {named}"), extra
    assert parse_args(base + n + ["--offload-train"]).update_weights_interval == 2


def test_pushes_every_n_rollouts_and_before_every_eval():
    every = RolloutSideConfig.from_args(parser_defaults(num_rollout=5))
    assert all(every.pushes_after(r) for r in range(5))
    three = RolloutSideConfig.from_args(parser_defaults(num_rollout=7, update_weights_interval=3))
    assert [three.pushes_after(r) for r in range(7)] == [False, False, True, False, False, True, False]
    assert [three.served_version(r, 0) for r in range(7)] == [0, 0, 0, 3, 3, 3, 6]
    assert [three.served_version(r, 4) for r in range(4, 7)] == [4, 4, 6]  # resumed: the initial push's version
    evals = RolloutSideConfig.from_args(parser_defaults(num_rollout=3, update_weights_interval=3, eval_interval=2,
                                                        eval_prompt_data=["add", "x.jsonl"]))
    assert [evals.pushes_after(r) for r in range(3)] == [False, True, True]  # eval after 2 trained, and the end
    assert [evals.served_version(r, 0) for r in range(3)] == [0, 0, 2]


def test_the_driver_skips_the_pushes_the_interval_leaves_out():
    from slime_lite.rollout.recovery import NoRecovery
    from slime_lite.rollout.side import RolloutSide

    side = RolloutSide.__new__(RolloutSide)
    side.config = RolloutSideConfig.from_args(parser_defaults(num_rollout=4, update_weights_interval=2))
    side.fleet, side.recovery, side.manager = SimpleNamespace(urls=["http://e"]), NoRecovery(), None
    pushed = []
    for r in range(4):
        side.push_weights(lambda urls, version: pushed.append(version), r + 1, {})
    assert pushed == [2, 4]


def test_a_fully_async_push_retracts_the_running_requests(monkeypatch):
    """--fully-async pushes while the engines generate: the running requests are retracted (prefilled again under
    the new weights), not kept in place over K/V the old weights wrote; generation continues after the push."""
    from slime_lite.rollout import side as rollout_side
    from slime_lite.rollout.recovery import NoRecovery
    from slime_lite.rollout.side import RolloutSide

    side = RolloutSide.__new__(RolloutSide)
    side.config = RolloutSideConfig.from_args(parser_defaults(num_rollout=2, fully_async=True))
    side.fleet, side.recovery, side.manager = SimpleNamespace(urls=["http://e"]), NoRecovery(), None
    sent = []
    monkeypatch.setattr(rollout_side, "engines_request", lambda urls, route, body: sent.append((route, body)))
    side.push_weights(lambda urls, version: sent.append(("push", version)), 1, {})
    assert sent == [("/pause_generation", {"mode": "retract"}), ("push", 1), ("/continue_generation", {})]


def test_ci_test_expects_the_version_of_the_last_push():
    from slime_lite.train_async import RolloutSchedule

    args = parser_defaults(num_rollout=4, update_weights_interval=2, ci_test=True)
    schedule = RolloutSchedule(args, None, lambda ref, r: ref, 0, get=lambda ref: ref)
    assert [schedule.expected_version(r) for r in range(4)] == [0, 0, 2, 2]
    assert RolloutSchedule(parser_defaults(num_rollout=4), None, None, 0, get=lambda ref: ref).expected_version(3) == 3
    cfg = CiConfig.from_args(args)
    # rollout 1 generated with version 0 (the push after rollout 0 was skipped): no alarm, and the train/rollout
    # log-prob check, which compares the trainer's moved weights with older ones, is left out
    stale = {"rollout/weight_version": 0.0, "train/train_rollout_logprob_abs_diff": 0.3}
    checks = enforce(cfg, stale, 1, first=False, expected_version=schedule.expected_version(1))
    assert [c.name for c in checks] == ["weight_version_served"] and checks[0].passed
    # rollout 2 still with version 0: the push after rollout 1 was due and did not land
    with pytest.raises(CiCheckFailed, match=r"weight_version_served failed at rollout 2: value 0.0, expected == 2"):
        enforce(cfg, stale, 2, first=False, expected_version=schedule.expected_version(2))


def test_the_doctor_pushes_after_every_rollout():
    from slime_lite.debug.doctor import train_argv

    argv = train_argv(["--hf-checkpoint", "m", "--update-weights-interval", "3", "--save-hf", "/o/{rollout_id}"],
                      "/tmp/doctor-out")
    assert "--update-weights-interval" not in argv and "--save-hf" not in argv and argv[:2] == ["--hf-checkpoint", "m"]


def test_save_without_an_interval_is_told_it_writes_no_checkpoint(base, tmp_path, caplog):
    """As in slime, --save alone writes no checkpoint: said at the start, not found out after the run."""
    import logging

    with caplog.at_level(logging.WARNING):
        parse_args(base + ["--save", str(tmp_path / "ckpt")])
    assert "without --save-interval writes no checkpoint" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        parse_args(base + ["--save", str(tmp_path / "ckpt"), "--save-interval", "2"])
    assert "writes no checkpoint" not in caplog.text


def test_external_engine_addresses_are_host_and_port_or_urls(base):
    """slime's --rollout-external-engine-addrs: a bad entry was found out after the trainer was built."""
    for good in ("127.0.0.1:30000", "a:1, b:2", "http://h:30000/", "https://engine.example"):
        parse_args(base + ["--rollout-external-engine-addrs", good])
    for bad in ("foo", "a:1,", "host:port"):
        assert f"{bad.split(',')[-1]!r} is not host:port" in err(base + ["--rollout-external-engine-addrs", bad])


def test_discount_gae_and_critic_flags_the_estimator_does_not_read_are_told(base, caplog, tmp_path, monkeypatch):
    """slime takes --gamma or --critic-lr with GRPO and ignores them: said at the start here (not with an advantage
    hook, which may read them)."""
    import logging

    (tmp_path / "gamma_hook.py").write_text("def advantage(args, rollout_data):\n    return args.gamma\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    with caplog.at_level(logging.WARNING):
        parse_args(base + ["--gamma", "0.9", "--lambd=0.95", "--critic-lr", "1e-5"])
    assert "--gamma changes nothing with --advantage-estimator grpo (it is read by: ppo, reinforce_plus_plus)" in (
        caplog.text)
    assert "--lambd changes nothing with --advantage-estimator grpo (it is read by: ppo)" in caplog.text
    assert "--critic-lr changes nothing with --advantage-estimator grpo (it is read by: ppo)" in caplog.text
    hook = ["--custom-advantage-function-path", "gamma_hook.advantage", "--gamma", "0.9"]
    for used in (["--advantage-estimator", "ppo", "--gamma", "0.9", "--lambd", "0.95", "--value-clip", "0.1"],
                 ["--advantage-estimator", "reinforce_plus_plus", "--gamma", "0.9"], [], hook):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            parse_args(base + used)
        assert "change nothing" not in caplog.text, used
