"""validate_args on checkpoints, resume and dumps: --load / --save / --ref-load, --update-weights-interval against
the save points, and the dump templates, each a clear error or warning naming the flags before anything starts."""

from __future__ import annotations

import json
import logging

import pytest

from slime_lite.args import parse_args, parser_defaults
from slime_lite.config import TrainSideConfig
from tests.test_args import base, err  # noqa: F401 - the shared fixture and helper


def test_load_implies_train_only_and_logs(base, caplog):
    with caplog.at_level(logging.INFO):
        args = parse_args(base + ["--load-debug-rollout-data", "/tmp/x_{rollout_id}.pt"])
    assert args.debug_train_only
    assert "--debug-train-only" in caplog.text


def test_load_without_a_checkpoint_starts_the_actor_from_ref_load(base, tmp_path, caplog):
    """slime's rule: with no checkpoint to resume (--load missing, empty or unset), the actor starts from --ref-load
    (said once in the log); without --ref-load, from --hf-checkpoint. tests/test_loop.py runs it."""
    ref = tmp_path / "ref"
    ref.mkdir()
    (ref / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    (tmp_path / "empty").mkdir()
    for load in (["--load", str(tmp_path / "empty")], ["--load", str(tmp_path / "missing")], []):
        caplog.clear()
        with caplog.at_level(logging.INFO):
            args = parse_args(base + load + ["--ref-load", str(ref)])
        assert args.load is None and TrainSideConfig.from_args(args).init_checkpoint == str(ref)
        assert len([r for r in caplog.records if f"the actor from --ref-load {ref}" in r.getMessage()
                    or f"the actor starts from --ref-load {ref}" in r.getMessage()]) == 1, caplog.text
    args = parse_args(base + ["--load", str(tmp_path / "empty")])
    assert args.load is None and TrainSideConfig.from_args(args).init_checkpoint == base[1]
    assert TrainSideConfig.from_args(parser_defaults(hf_checkpoint="m", ref_load="r")).init_checkpoint == "r"


def test_a_load_folder_holding_a_checkpoint_it_cannot_resume_is_refused_not_overwritten(base, tmp_path):
    """Without 'latest' a --load folder was a fresh start, even when it held iteration folders (their 'latest' lost,
    or a save killed before writing it) or slime's Megatron checkpoint: the run ignored them, and a --save to the
    same folder replaced them."""
    ckpt = tmp_path / "ckpt"
    (ckpt / "iter_0000009").mkdir(parents=True)
    (ckpt / ".tmp-iter_0000019").mkdir()
    msg = err(base + ["--load", str(ckpt), "--save", str(ckpt)])
    assert f"--load {ckpt} holds checkpoint(s) (iter_0000009) but no 'latest' file" in msg
    assert f"write its name into {ckpt / 'latest'} (e.g. iter_0000009)" in msg
    slime = tmp_path / "slime_ckpt"
    slime.mkdir()
    (slime / "latest_checkpointed_iteration.txt").write_text("10")
    assert "is a Megatron checkpoint (slime's torch_dist format)" in err(base + ["--load", str(slime)])
    (tmp_path / "fresh").mkdir()
    assert parse_args(base + ["--load", str(tmp_path / "fresh")]).load is None  # nothing saved yet: a fresh start
    # one iteration's folder (not the folder of its 'latest'), or an HF model: was a silent fresh start too
    (ckpt / "iter_0000009" / "rank_000.pt").write_bytes(b"")
    msg = err(base + ["--load", str(ckpt / "iter_0000009")])
    assert "is one iteration of a checkpoint (rank_*.pt): give --load the folder that holds it" in msg
    assert str(ckpt) in msg
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    assert "is a Hugging Face model folder: start from it with --hf-checkpoint" in err(base + ["--load", str(hf)])


def test_saving_over_a_checkpoint_the_run_does_not_resume_is_named(base, tmp_path, caplog):
    ckpt = tmp_path / "ckpt"
    (ckpt / "iter_0000003").mkdir(parents=True)
    (ckpt / "latest").write_text("iter_0000003")
    with caplog.at_level(logging.WARNING):
        parse_args(base + ["--save", str(ckpt)])
    assert f"--save {ckpt} holds a checkpoint ('latest') that this run does not resume" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        parse_args(base + ["--save", str(ckpt), "--load", str(ckpt)])
    assert "does not resume" not in caplog.text


def test_a_save_between_two_pushes_is_named(base, tmp_path, caplog):
    """Every save point counts: the interval's, and the last rollout's (a run extended later resumes from it)."""
    save = ["--update-weights-interval", "2", "--save", str(tmp_path / "c"), "--num-rollout", "7"]
    with caplog.at_level(logging.WARNING):
        parse_args(base + save + ["--save-interval", "3"])
    assert "--update-weights-interval 2: the checkpoints after rollouts 2, 6 fall between two pushes" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        parse_args(base + save + ["--save-interval", "2"])  # saves after 1, 3, 5 and the last, 6: no push after it
    assert "the checkpoints after rollouts 6 fall between" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        parse_args(base + save[:-1] + ["8", "--save-interval", "2"])
    assert "fall between two pushes" not in caplog.text


@pytest.mark.parametrize("flag", ["--save-debug-rollout-data", "--load-debug-rollout-data"])
def test_template_needs_rollout_id(base, flag):
    extra = ["--debug-rollout-only"] if flag.startswith("--save") else []
    msg = err(base + extra + [flag, "/tmp/data.pt"])
    assert flag in msg and "{rollout_id}" in msg


@pytest.mark.parametrize("flag", ["--save-debug-rollout-data", "--load-debug-rollout-data"])
@pytest.mark.parametrize("template", ["d_{rollout_id}_{rank}.pt", "d_{rollout_id}_{}.pt", "d_{rollout_id}_{.pt",
                                      "d_{rollout_id:03d}.pt", "d_{rollout_id.real}.pt", "d_{rollout_id[0]}.pt"])
def test_template_with_another_placeholder_is_refused_before_any_work(base, flag, template):
    """Not at the first dump (a KeyError after a whole rollout was generated; a format spec at the first eval dump,
    which fills the placeholder with 'eval_N'), nor as a traceback in preflight."""
    extra = ["--debug-rollout-only"] if flag.startswith("--save") else []
    msg = err(base + extra + [flag, template])
    assert f"{flag} {template!r} is not a valid template" in msg and "only the '{rollout_id}' placeholder" in msg


def test_a_glob_is_not_a_template(base):
    msg = err(base + ["--load-debug-rollout-data", "dumps/*.pt"])
    assert "'dumps/*.pt' is a glob, not a template" in msg and "dumps/data_{rollout_id}.pt" in msg
    assert "overwrite" not in err(base + ["--load-debug-rollout-data", "dumps/data.pt"])  # a replay reads them


def test_a_replay_train_dump_never_overwrites_the_dumps_it_replays(base):
    msg = err(base + ["--load-debug-rollout-data", "d/{rollout_id}.pt", "--save-debug-train-data",
                      "./d/{rollout_id}.pt"])
    assert "is the path of --load-debug-rollout-data too (d/{rollout_id}.pt)" in msg
    msg = err(base + ["--load-debug-rollout-data", "d/{rollout_id}_1.pt", "--save-debug-train-data",
                      "d/{rollout_id}_{rank}.pt", "--actor-num-gpus-per-node", "2"])  # rank 1's file
    assert "would overwrite a rollout dump" in msg
    msg = err(base + ["--load-debug-rollout-data", "d/{rollout_id}.pt", "--save-debug-train-data",
                      "t/{rollout_id.x}_{rank}.pt"])  # an AttributeError: named, not a traceback
    assert "--save-debug-train-data t/{rollout_id.x}_{rank}.pt: not a valid template (AttributeError" in msg


def test_save_and_load_paths_differ(base):
    msg = err(base + ["--save-debug-rollout-data", "d_{rollout_id}.pt", "--load-debug-rollout-data", "d_{rollout_id}.pt"])
    assert "different paths" in msg
