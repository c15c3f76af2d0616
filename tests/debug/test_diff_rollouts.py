from __future__ import annotations

from pathlib import Path

from slime_lite.debug.diff import first_difference, main
from slime_lite.rollout.dumps import save_rollout_dump
from slime_lite.types import Status


def _pair(tmp_path: Path, samples_factory, edit=None) -> tuple[str, str]:
    a, b = str(tmp_path / "a.pt"), str(tmp_path / "b.pt")
    save_rollout_dump(a, 0, samples_factory())
    other = samples_factory()
    if edit:
        edit(other)
    save_rollout_dump(b, 0, other)
    return a, b


def test_identical_dumps_exit_0(tmp_path: Path, samples_factory, capsys) -> None:
    a, b = _pair(tmp_path, samples_factory)
    assert main([a, b]) == 0
    out = capsys.readouterr().out
    assert "IDENTICAL" in out and "A 4, B 4" in out and "samples differ" not in out
    assert "rollout log-probs max |A-B| │ 0 " in out


def test_finds_first_differing_token_and_other_fields(tmp_path: Path, samples_factory, capsys) -> None:
    def edit(samples):
        s = samples[2]
        s.tokens = s.tokens[:4] + [99, s.tokens[5]]  # response token 1 (token 4 overall) changes: 21 -> 99
        s.response = "answer-2-changed"
        s.rollout_log_probs = [s.rollout_log_probs[0] + 0.5, -7.0, -7.0]  # only position 0 is comparable
        samples[3].reward = 0.0
        samples[0].status = Status.ABORTED

    a, b = _pair(tmp_path, samples_factory, edit)
    assert main([a, b]) == 1
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if "1/2" in line)
    assert "token 4 (response): 21 vs 99" in row and "differs" in row and "0.5" in row
    assert "1.0 / 0.0" in next(line for line in out.splitlines() if "1/3" in line)
    assert "completed / aborted" in next(line for line in out.splitlines() if "0/0" in line)
    assert "3 of 4 samples differ" in out and "DIFFERENT" in out
    assert "IDENTICAL" not in out


def test_a_loss_mask_difference_is_counted_when_log_probs_are_in_one_dump_only(tmp_path, samples_factory, capsys):
    def edit(samples):
        samples[1].loss_mask = [1, 0, 1][:samples[1].response_length]
        for s in samples:
            s.rollout_log_probs = None  # B has none: its note is that one

    a, b = _pair(tmp_path, samples_factory, edit)
    assert main([a, b]) == 1
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("│ loss masks differ"))
    assert "│ 1 (first: sample 1, loss_mask differs from response token 1" in row, row


def test_no_loss_mask_is_every_token_in_the_loss(tmp_path, samples_factory, capsys):
    """A sample's loss_mask None (slime's default: all trained) equals an all-ones mask and differs from any other."""
    def none(samples):
        for s in samples:
            s.loss_mask = None

    def ones(samples):
        for s in samples:
            s.loss_mask = [1] * s.response_length

    def cut(samples):
        ones(samples)
        samples[1].loss_mask[-1] = 0

    for a_edit, b_edit, rc in ((none, ones, 0), (none, cut, 1)):
        a, b = str(tmp_path / "a.pt"), str(tmp_path / "b.pt")
        for path, edit in ((a, a_edit), (b, b_edit)):
            samples = samples_factory()
            edit(samples)
            save_rollout_dump(path, 0, samples)
        assert main([a, b]) == rc
        out = capsys.readouterr().out
        assert ("loss_mask differs from response token" in out) == bool(rc), out


def test_small_logprob_noise_within_atol(tmp_path: Path, samples_factory, capsys) -> None:
    def edit(samples):
        samples[1].rollout_log_probs = [x + 1e-4 for x in samples[1].rollout_log_probs]

    a, b = _pair(tmp_path, samples_factory, edit)
    assert main([a, b]) == 1
    assert "0.0001" in capsys.readouterr().out
    assert main([a, b, "--atol", "1e-3"]) == 0


def test_a_nan_or_infinite_log_prob_on_one_side_differs(tmp_path: Path, samples_factory, capsys) -> None:
    """max() over differences holding a NaN, then NaN > atol, said IDENTICAL."""
    for bad in (float("nan"), float("inf")):
        def edit(samples, bad=bad):
            samples[1].rollout_log_probs = [bad] + list(samples[1].rollout_log_probs[1:])

        a, b = _pair(tmp_path, samples_factory, edit)
        assert main([a, b]) == 1, bad
        assert "IDENTICAL" not in capsys.readouterr().out


def test_same_weight_noise_agrees_by_default_and_the_tolerance_is_printed(tmp_path: Path, samples_factory,
                                                                          capsys) -> None:
    """Greedy eval dumps of identical weights differ by ~1.25e-6 in a log-prob (another batch composition): the
    default tolerance calls them identical, and says which tolerance it used."""
    def edit(samples):
        samples[1].rollout_log_probs = [x + 1.25e-6 for x in samples[1].rollout_log_probs]

    a, b = _pair(tmp_path, samples_factory, edit)
    assert main([a, b]) == 0
    assert "IDENTICAL (log-probs and rewards compared with atol 1e-05)" in capsys.readouterr().out
    assert main([a, b, "--atol", "1e-7"]) == 1


def test_length_mismatch_is_reported(tmp_path: Path, samples_factory, capsys) -> None:
    a, b = _pair(tmp_path, samples_factory, lambda samples: samples.pop())
    assert main([a, b]) == 1
    assert "A 4, B 3: length mismatch, compared the first 3" in capsys.readouterr().out


def test_bad_file_is_an_error(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a dump")
    assert main([str(bad), str(bad)]) == 2
    assert "bad.pt" in capsys.readouterr().err


def test_first_difference() -> None:
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2
