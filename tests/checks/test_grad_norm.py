"""--ci-save-grad-norm / --ci-load-grad-norm (slime's flags): every step's grad-norm written as JSON, and a later
run stopped at the first step whose grad-norm moved by more than --ci-grad-norm-rtol."""

from __future__ import annotations

import json

import pytest

from slime_lite.args import parser_defaults
from slime_lite.checks.grad_norm import GradNormCI, GradNormMismatch


def ci(tmp_path, **kw):
    args = parser_defaults(hf_checkpoint=str(tmp_path), **kw)
    return GradNormCI.from_args(args)


def test_saved_norms_are_json_per_role_rollout_and_step(tmp_path):
    path = tmp_path / "gn.json"
    saver = ci(tmp_path, ci_save_grad_norm=str(path))
    saver.update("actor", 0, [1.5, 0.25])
    saver.update("critic", 0, [3.0, 2.0])
    saver.update("actor", 1, [0.5, 0.125])
    records = json.loads(path.read_text())["grad_norms"]
    assert [(r["role"], r["rollout_id"], r["step"], r["grad_norm"]) for r in records] == [
        ("actor", 0, 0, 1.5), ("actor", 0, 1, 0.25), ("actor", 1, 0, 0.5), ("actor", 1, 1, 0.125),
        ("critic", 0, 0, 3.0), ("critic", 0, 1, 2.0)]


def test_slime_placeholders_split_the_files(tmp_path):
    saver = ci(tmp_path, ci_save_grad_norm=str(tmp_path / "{role}_{rollout_id}_{step_id}.json"))
    saver.update("actor", 3, [1.0, 2.0])
    assert sorted(p.name for p in tmp_path.glob("actor_*")) == ["actor_3_0.json", "actor_3_1.json"]
    loader = ci(tmp_path, ci_load_grad_norm=str(tmp_path / "{role}_{rollout_id}_{step_id}.json"))
    loader.update("actor", 3, [1.0, 2.0])  # passes


def test_first_differing_step_fails_with_both_values(tmp_path):
    path = tmp_path / "gn.json"
    ci(tmp_path, ci_save_grad_norm=str(path)).update("actor", 0, [1.0, 2.0, 3.0])
    loader = ci(tmp_path, ci_load_grad_norm=str(path))
    assert loader.rtol == 1e-4  # float32 default
    loader.update("actor", 0, [1.0, 2.0 * (1 + 5e-5), 3.0])  # within 1e-4: passes
    with pytest.raises(GradNormMismatch) as err:
        ci(tmp_path, ci_load_grad_norm=str(path)).update("actor", 0, [1.0, 2.002, 3.5])
    msg = str(err.value)
    assert "actor rollout 0 step 1: grad_norm 2.002 differs from the saved 2.0" in msg
    assert "--ci-grad-norm-rtol 0.0001" in msg
    assert ci(tmp_path, ci_load_grad_norm=str(path), bf16=True).rtol == 2e-2
    ci(tmp_path, ci_load_grad_norm=str(path), ci_grad_norm_rtol=1e-2).update("actor", 0, [1.0, 2.002, 3.0])


def test_an_infinite_grad_norm_matches_only_the_same_infinity(tmp_path):
    """|inf - b| <= rtol x inf held for any b: an infinite norm against a finite saved one passed."""
    path = tmp_path / "gn.json"
    ci(tmp_path, ci_save_grad_norm=str(path)).update("actor", 0, [1.25, 0.9, float("inf")])
    with pytest.raises(GradNormMismatch, match="step 1: grad_norm inf differs from the saved 0.9"):
        ci(tmp_path, ci_load_grad_norm=str(path)).update("actor", 0, [1.25, float("inf"), float("inf")])
    with pytest.raises(GradNormMismatch, match="step 2: grad_norm 3.0 differs from the saved inf"):
        ci(tmp_path, ci_load_grad_norm=str(path)).update("actor", 0, [1.25, 0.9, 3.0])
    ci(tmp_path, ci_load_grad_norm=str(path)).update("actor", 0, [1.25, 0.9, float("inf")])  # the same: passes


def test_a_step_the_saved_run_did_not_have(tmp_path):
    path = tmp_path / "gn.json"
    ci(tmp_path, ci_save_grad_norm=str(path)).update("actor", 0, [1.0])
    with pytest.raises(GradNormMismatch, match="no saved grad-norm for actor rollout 0 step 1"):
        ci(tmp_path, ci_load_grad_norm=str(path)).update("actor", 0, [1.0, 1.0])


def test_resume_keeps_the_saved_rollouts_before_it(tmp_path):
    path = tmp_path / "gn.json"
    ci(tmp_path, ci_save_grad_norm=str(path)).update("actor", 0, [1.0])
    ci(tmp_path, ci_save_grad_norm=str(path)).update("actor", 1, [2.0])  # a fresh run: the file starts over
    assert [r["rollout_id"] for r in json.loads(path.read_text())["grad_norms"]] == [1]
    resumed = GradNormCI.from_args(parser_defaults(hf_checkpoint=str(tmp_path), ci_save_grad_norm=str(path)),
                                   start=2)
    resumed.update("actor", 2, [3.0])
    assert [r["rollout_id"] for r in json.loads(path.read_text())["grad_norms"]] == [1, 2]


@pytest.mark.parametrize("extra, needle", [
    (["--ci-save-grad-norm", "g.json", "--ci-load-grad-norm", "g.json"], "name the same file"),
    (["--ci-grad-norm-rtol", "1e-3"], "--ci-grad-norm-rtol has no effect without --ci-load-grad-norm"),
    (["--ci-load-grad-norm", "g.json", "--debug-rollout-only"], "--debug-rollout-only trains nothing"),
])
def test_flag_rules(tiny_model_dir, tmp_path, extra, needle):
    from slime_lite.args import parse_args
    from slime_lite.errors import SlimeLiteError

    base = ["--hf-checkpoint", str(tiny_model_dir), "--prompt-data", str(tiny_model_dir / "config.json"),
            "--rm-type", "addition"]
    with pytest.raises(SlimeLiteError, match=needle):
        parse_args(base + extra)
