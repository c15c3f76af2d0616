"""make-data: deterministic prompt/label JSONL with disjoint train and eval splits."""

from __future__ import annotations

import json

import pytest

from slime_lite.errors import SlimeLiteError
from slime_lite.tasks import TASKS, main, make_data


def read(path) -> list[dict]:
    return [json.loads(line) for line in open(path)]


@pytest.mark.parametrize("task", TASKS)
def test_make_data_writes_disjoint_train_and_eval(tmp_path, task):
    train_path, eval_path = make_data(task, tmp_path / "d.jsonl", n_train=500, n_eval=100)
    assert eval_path == str(tmp_path / "d_eval.jsonl")
    train, evals = read(train_path), read(eval_path)
    assert len(train) == 500 and len(evals) == 100
    assert all(set(row) == {"prompt", "label"} for row in train + evals)
    prompts = [r["prompt"] for r in train + evals]
    assert len(set(prompts)) == len(prompts)  # no duplicates, no prompt in both splits


@pytest.mark.parametrize("task", TASKS)
def test_labels_are_the_true_answers(tmp_path, task):
    train_path, _ = make_data(task, tmp_path / "d.jsonl", n_train=300, n_eval=10)
    for row in read(train_path):
        assert row["prompt"].endswith("=")
        assert set(row["prompt"][:-1]) <= set("0123456789+-*")
        assert int(row["label"]) == eval(row["prompt"][:-1])


def test_same_seed_same_bytes_other_seed_other_data(tmp_path):
    a, _ = make_data("addition", tmp_path / "a.jsonl", n_train=200, n_eval=20, seed=3)
    b, _ = make_data("addition", tmp_path / "b.jsonl", n_train=200, n_eval=20, seed=3)
    c, _ = make_data("addition", tmp_path / "c.jsonl", n_train=200, n_eval=20, seed=4)
    assert open(a).read() == open(b).read()
    assert open(a).read() != open(c).read()


def test_eval_split_does_not_depend_on_n_train(tmp_path):
    _, e1 = make_data("math", tmp_path / "x.jsonl", n_train=50, n_eval=30)
    _, e2 = make_data("math", tmp_path / "y.jsonl", n_train=900, n_eval=30)
    assert read(e1) == read(e2)


def test_too_many_problems_is_a_clear_error(tmp_path):
    with pytest.raises(SlimeLiteError, match="--n-train"):
        make_data("addition", tmp_path / "d.jsonl", n_train=20_000, n_eval=10)


def test_cli_writes_files_and_rejects_bad_input(tmp_path, capsys):
    assert main(["--task", "addition", "--out", str(tmp_path / "add.jsonl"), "--n-train", "40", "--n-eval", "8"]) == 0
    assert len(read(tmp_path / "add.jsonl")) == 40 and len(read(tmp_path / "add_eval.jsonl")) == 8
    assert main(["--task", "addition", "--out", str(tmp_path), "--n-train", "4"]) != 0
    assert "--out" in capsys.readouterr().err  # an error goes to stderr, as every command's does
    with pytest.raises(SystemExit):
        main(["--task", "sudoku", "--out", str(tmp_path / "s.jsonl")])


def test_out_must_be_a_jsonl_path(tmp_path):
    """Training reads a prompt file by its suffix: JSONL written as x.parquet would fail only when the run reads it."""
    with pytest.raises(SlimeLiteError, match=r"make-data writes JSONL; give a path ending in .jsonl"):
        make_data("addition", tmp_path / "add.parquet", n_train=10, n_eval=2)
    assert not (tmp_path / "add.parquet").exists()
