"""slime-lite plot-metrics: a resumed run's curves (rollouts logged twice), a file cut short by a dead run, a
one-rollout run and rewards outside [0, 1]."""

from __future__ import annotations

import json

import pytest

from slime_lite.errors import SlimeLiteError
from slime_lite.plot import main, plot, read_records


def drawn(records, tmp_path, monkeypatch):
    """The lines ``plot`` drew (the figure kept instead of closed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    plot(records, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 0
    return {line.get_label(): line for line in figures[0].axes[0].lines}, figures[0].axes[0]


def test_a_resumed_run_draws_one_point_per_rollout_the_last_logged(tmp_path, monkeypatch):
    first = [{"rollout_id": r, "rollout/raw_reward": 0.1 * r, "eval/addition": 0.2} for r in range(4)]
    resumed = [{"rollout_id": r, "rollout/raw_reward": 0.5 + 0.1 * r, "eval/addition": 0.3} for r in (2, 3, 4)]
    lines, _ = drawn(first + resumed, tmp_path, monkeypatch)
    reward, ev = lines["rollout reward"], lines["eval/addition (held out)"]
    assert list(reward.get_xdata()) == [0, 1, 2, 3, 4]  # not 0, 1, 2, 3, 2, 3, 4
    assert list(reward.get_ydata()) == pytest.approx([0.0, 0.1, 0.7, 0.8, 0.9])
    assert list(ev.get_xdata()) == [1, 2, 3, 4, 5] and ev.get_color() != reward.get_color()


def test_a_one_rollout_run_shows_its_reward_and_custom_rewards_stay_in_view(tmp_path, monkeypatch):
    lines, ax = drawn([{"rollout_id": -1, "eval/addition": 0.3},
                       {"rollout_id": 0, "rollout/raw_reward": -1.0, "eval/addition": 2.0}], tmp_path, monkeypatch)
    assert lines["rollout reward"].get_marker() not in (None, "None", "", " ")  # one point: a marker, not a line
    lo, hi = ax.get_ylim()
    assert lo < -1.0 and hi > 2.0


def test_a_record_cut_short_at_the_end_is_left_out_one_inside_is_an_error(tmp_path, capsys):
    good = json.dumps({"rollout_id": 0, "rollout/raw_reward": 0.5})
    path = tmp_path / "m.jsonl"
    path.write_text(good + "\n" + '{"rollout_id": 1, "rollout/raw_re')
    assert read_records(str(path)) == [json.loads(good)]
    assert "last record is cut short" in capsys.readouterr().err
    assert main(["--metrics-path", str(path), "--out", str(tmp_path / "p.png")]) == 0
    path.write_text('{"rollout_id": 1, "rollout/raw_re\n' + good + "\n")
    with pytest.raises(SlimeLiteError, match=r"m.jsonl: record 1 is not JSON"):
        read_records(str(path))


def test_bad_files_and_outputs_are_clear_errors_before_drawing(tmp_path):
    good = tmp_path / "m.jsonl"
    good.write_text(json.dumps({"rollout_id": 0, "rollout/raw_reward": 0.5}) + "\n")
    binary = tmp_path / "b.jsonl"
    binary.write_bytes(b"\x80\x81\xfe\n")
    no_id = tmp_path / "n.jsonl"
    no_id.write_text('{"rollout/raw_reward": 0.5}\n[1, 2]\n')
    for argv, says in (([str(binary), "p.png"], "not a text file"), ([str(no_id), "p.png"], "record 1 is not a "
                       "metrics record"), ([str(good), "p.pgn"], "name a .png file"),
                       ([str(good), "nowhere/p.png"], "does not exist; create it first")):
        metrics, out = argv
        with pytest.raises(SlimeLiteError, match=says):
            main(["--metrics-path", metrics, "--out", str(tmp_path / out)])
    assert not list(tmp_path.glob("*.png"))
