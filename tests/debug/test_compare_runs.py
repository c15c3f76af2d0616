"""slime-lite compare-runs: the metrics of two --metrics-path files that differ, where they first do, and an exit
status a script can test."""

from __future__ import annotations

import json

from slime_lite.debug.compare_runs import compare, main

ROWS = [
    {"rollout_id": -1, "eval/add": 0.25, "perf/eval_time": 0.7},
    {"rollout_id": 0, "train/loss": 0.5, "train/grad_norm": 1.25, "perf/step_time": 3.0},
    {"rollout_id": 1, "train/loss": 0.4, "train/grad_norm": 1.5, "perf/step_time": 2.0},
    {"rollout_id": 1, "eval/add": 0.5, "perf/eval_time": 0.9},
]


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_identical_runs_with_other_timings_agree(tmp_path, capsys):
    other = [{k: (v * 2 if k.startswith("perf/") else v) for k, v in r.items()} for r in ROWS]
    assert main([write(tmp_path / "a.jsonl", ROWS), write(tmp_path / "b.jsonl", other)]) == 0
    assert "no metric differs" in capsys.readouterr().out
    assert main([str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl"), "--include-timings"]) == 1


def test_reports_first_differing_step_both_values_and_relative_diff(tmp_path, capsys):
    other = [dict(r) for r in ROWS]
    other[2]["train/grad_norm"] = 1.5 * (1 + 1e-3)  # a changed lr shows up in step 1's grad-norm
    other[3]["eval/add"] = 0.75
    diffs = compare(ROWS, other)
    assert [(d.key, d.step, d.a, d.b) for d in diffs] == [("eval/add", 1, 0.5, 0.75),
                                                         ("train/grad_norm", 1, 1.5, 1.5 * (1 + 1e-3))]
    assert abs(diffs[1].rel - 1e-3 / (1 + 1e-3)) < 1e-9
    assert [d.key for d in compare(ROWS, other, rtol=1e-2)] == ["eval/add"]
    assert main([write(tmp_path / "a.jsonl", ROWS), write(tmp_path / "b.jsonl", other), "--rtol", "1e-2"]) == 1
    out = capsys.readouterr().out
    assert "eval/add" in out and "0.75" in out and "train/grad_norm" not in out


def test_an_infinite_value_on_one_side_differs():
    """inf / inf is NaN, which no tolerance caught: an infinite grad-norm against a finite one was no difference."""
    other = [dict(r) for r in ROWS]
    other[2]["train/grad_norm"] = float("inf")
    assert [(d.key, d.step) for d in compare(ROWS, other, rtol=0.5)] == [("train/grad_norm", 1)]
    assert compare(other, other) == []


def test_missing_metric_and_a_run_that_stopped_early(tmp_path, capsys):
    short = [dict(r) for r in ROWS[:2]]
    del short[1]["train/grad_norm"]
    assert [(d.key, d.a, d.b) for d in compare(ROWS, short)] == [("train/grad_norm", 1.25, None)]
    assert main([write(tmp_path / "a.jsonl", ROWS), write(tmp_path / "b.jsonl", short)]) == 1
    out = capsys.readouterr().out
    assert "rollout_id only in A (1 step(s)): 1" in out and "missing" in out


def test_not_a_metrics_file_is_a_clear_error(tmp_path):
    import pytest

    from slime_lite.errors import SlimeLiteError

    (tmp_path / "bad.jsonl").write_text("[1, 2]\n")
    with pytest.raises(SlimeLiteError, match="bad.jsonl: not a metrics JSONL file"):
        main([str(tmp_path / "bad.jsonl"), str(tmp_path / "bad.jsonl")])
    with pytest.raises(SlimeLiteError, match="is a folder: give the metrics file in it .*metrics.jsonl"):
        main([str(tmp_path), str(tmp_path / "bad.jsonl")])  # the run's folder instead of its metrics file


def test_a_step_key_no_record_has_and_a_nan_rtol_are_errors(tmp_path):
    import pytest

    from slime_lite.errors import SlimeLiteError

    other = [dict(r) for r in ROWS]
    other[1]["train/loss"] = 9.0  # differs at rollout 0 only: with every row under one step the last would win
    a, b = write(tmp_path / "a.jsonl", ROWS), write(tmp_path / "b.jsonl", other)
    assert main([a, b]) == 1
    with pytest.raises(SlimeLiteError, match="a.jsonl: no record has --step-key 'step'"):
        main([a, b, "--step-key", "step"])
    with pytest.raises(SlimeLiteError, match="--rtol nan must be a number >= 0"):
        main([a, b, "--rtol", "nan"])


def test_list_and_object_metrics_are_compared_entry_by_entry_within_the_tolerance(tmp_path):
    """mismatch/worst_tokens (a list of objects with floats): float noise is within rtol, as for scalars; a token
    that differs, or a list of another length, is a difference."""
    worst = [{"sample": 0, "token": "7", "abs_diff": 1e-7}, {"sample": 2, "token": "+", "abs_diff": 5e-8}]
    noisy = [dict(w, abs_diff=w["abs_diff"] * (1 + 1e-7)) for w in worst]
    rows = lambda w: [{"rollout_id": 0, "mismatch/worst_tokens": w}]  # noqa: E731
    assert compare(rows(worst), rows(noisy), rtol=1e-5) == []
    assert [d.key for d in compare(rows(worst), rows([dict(worst[0], token="8"), worst[1]]), rtol=1e-5)] == [
        "mismatch/worst_tokens"]
    assert compare(rows(worst), rows(worst[:1]), rtol=1e-5)[0].rel == float("inf")


def test_float32_noise_between_runs_that_should_agree_passes_by_default(tmp_path, capsys):
    """A TP=1 vs TP=2 float32 replay differs by ~1e-7 relative in many metrics: the default rtol calls it agreeing,
    prints the tolerance, and --rtol 0 still finds every difference."""
    other = [{k: (v * (1 + 1e-7) if k != "rollout_id" and isinstance(v, float) else v) for k, v in r.items()}
             for r in ROWS]
    a, b = write(tmp_path / "a.jsonl", ROWS), write(tmp_path / "b.jsonl", other)
    assert main([a, b]) == 0
    assert "no metric differs by more than rtol 1e-05" in capsys.readouterr().out
    assert main([a, b, "--rtol", "0"]) == 1


def test_runs_as_a_module_too(tmp_path):
    """`python -m slime_lite.debug.compare_runs` runs the tool (it did nothing and exited 0), a user error is one line
    and exit status 2, as from `slime-lite compare-runs`."""
    import subprocess
    import sys

    a = write(tmp_path / "a.jsonl", ROWS)
    run = [sys.executable, "-m", "slime_lite.debug.compare_runs"]
    proc = subprocess.run(run + [a, a], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "no metric differs" in proc.stdout, proc.stderr
    proc = subprocess.run(run + [a, str(tmp_path / "missing.jsonl")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and "missing.jsonl" in proc.stderr
    assert "Traceback" not in proc.stderr
