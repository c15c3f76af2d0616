"""--save-debug-train-data files and `slime-lite explain`: synthetic dumps written by the trainer's own writer join
with a rollout dump; the terminal view and the HTML page show the token whose log-probs differ; bad inputs are
clear errors; the page is rendered by a real headless Chromium and the highlight is on the screenshot.
(A real run's train dumps are joined in tests/test_loop.py::test_colocate_second_iteration.)"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from slime_lite.backends.megatron.train_dump import check_train_template, load_train_dump, save_train_dump
from slime_lite.cli import main as cli
from slime_lite.debug.explain import HOT
from slime_lite.errors import SlimeLiteError
from slime_lite.rollout.dumps import save_rollout_dump
from slime_lite.types import Sample, Status

ROLLOUT_LP = [-0.5, -1.0]
BAD_TRAIN_LP = -1.75  # sample 1's second response token ('6'): 0.75 away from the engine's log-prob


def samples(tokenizer, n: int = 4, rollout_id: int = 3) -> list[Sample]:
    prompt, response = (tokenizer.encode(t, add_special_tokens=False) for t in ("12+34=", "46"))
    return [Sample(group_index=i // 2, index=i, prompt="12+34=", tokens=prompt + response, response="46",
                   response_length=2, reward=1.0, loss_mask=[1, 1], rollout_log_probs=list(ROLLOUT_LP),
                   status=Status.COMPLETED) for i in range(n)]


def write_train_dumps(out: Path, batch: list[Sample], rollout_id: int = 3) -> list[str]:
    """Two data-parallel ranks, as the trainer writes them: rank 0 holds samples 0-1, rank 1 samples 2-3."""
    train_lp = [torch.tensor(ROLLOUT_LP) for _ in batch]
    train_lp[1] = torch.tensor([ROLLOUT_LP[0], BAD_TRAIN_LP])
    columns = {"log_probs": train_lp, "ref_log_probs": [t - 0.01 for t in train_lp],
               "rollout_log_probs": [torch.tensor(s.rollout_log_probs) for s in batch],
               "advantages": [torch.full((2,), 0.5) for _ in batch], "returns": [torch.full((2,), 0.5) for _ in batch],
               "loss_masks": [torch.ones(2) for _ in batch], "values": None,
               "entropy": {i: torch.tensor([1.25, 2.5]) for i in range(len(batch))}}
    half = len(batch) // 2
    return [save_train_dump(str(out / "train_{rollout_id}_{rank}.pt"), rollout_id, rank, batch, positions, columns)
            for rank, positions in ((0, range(half)), (1, range(half, len(batch))))]


@pytest.fixture(scope="module")
def dumps(tmp_path_factory, tiny_model_dir):
    from slime_lite.tokenizer import load_tokenizer

    out = tmp_path_factory.mktemp("explain")
    tok = load_tokenizer(tiny_model_dir)
    batch = samples(tok)
    save_rollout_dump(str(out / "data_3.pt"), 3, batch, {"model_path": str(tiny_model_dir)})
    return {"out": out, "rollout": str(out / "data_3.pt"), "train": write_train_dumps(out, batch), "tok": tok}


def explain(dumps, *extra: str, train: list[str] | None = None, rollout: str | None = None) -> list[str]:
    return ["explain", "--rollout-dump", rollout or dumps["rollout"], "--train-dump", *(train or dumps["train"]),
            *extra]


def test_train_dump_is_plain_data_keyed_by_sample_index(dumps):
    raw = torch.load(dumps["train"][1], weights_only=True)
    assert raw["rollout_id"] == 3 and raw["rank"] == 1
    assert raw["rollout_data"]["sample_indices"] == [2, 3]
    assert "values" not in raw["rollout_data"]  # no critic: no column
    dump = load_train_dump(dumps["train"][0])
    assert dump.rows[1]["log_probs"].tolist() == [ROLLOUT_LP[0], BAD_TRAIN_LP]
    assert dump.rows[1]["entropy"].tolist() == [1.25, 2.5]


def test_terminal_shows_the_sample_token_by_token(dumps, capsys):
    assert cli(explain(dumps, "--sample", "1")) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if "-0.7500" in line)  # the differing token's row
    assert "6" in row and "-1.7500" in row and "-1.0000" in row and "2.5000" in row
    assert "1 token(s) with |diff| > 0.05" in out and "max 0.75 at token 1 '6'" in out
    assert cli(explain(dumps, "--sample", "2")) == 0  # from rank 1's file, nothing over the threshold
    assert "0 token(s) with |diff| > 0.05" in capsys.readouterr().out


def test_a_continued_sample_shows_the_weight_version_of_each_token(dumps, tmp_path, capsys, tiny_model_dir):
    """--partial-rollout: a sample whose first token came from weights 2 and the second from weights 3 (rollout 3)."""
    batch = samples(dumps["tok"])
    batch[1].metadata.update(token_weight_versions=[2, 3], start_rollout_id=2)
    save_rollout_dump(str(tmp_path / "data_3.pt"), 3, batch, {"model_path": str(tiny_model_dir)})
    assert cli(["explain", "--rollout-dump", str(tmp_path / "data_3.pt"), "--train-dump", *dumps["train"],
                "--sample", "1"]) == 0
    out = capsys.readouterr().out
    assert "2 x1, 3 x1 (continued since rollout 2: --partial-rollout)" in out
    assert re.search(r"-1\.0000 .* 2\.5000 .* 3\b", next(line for line in out.splitlines() if "-0.7500" in line))
    from slime_lite.debug.display import main as display

    assert display(["--load-debug-rollout-data", str(tmp_path / "data_3.pt"), "--max-samples", "2"]) == 0
    assert "2 x1, 3 x1" in capsys.readouterr().out


def test_tokens_of_older_weights_are_not_highlighted_as_mismatches(dumps, tmp_path, capsys, tiny_model_dir):
    """Sample 1's differing token ('6') came from weights 2, the newest of the sample being 3: the trainer's
    weights did not sample it, so its difference is no fault (as the log-prob check reads the batch)."""
    batch = samples(dumps["tok"])
    batch[1].metadata.update(token_weight_versions=[3, 2])  # '6', the differing token, from the older weights 2
    save_rollout_dump(str(tmp_path / "data_3.pt"), 3, batch, {"model_path": str(tiny_model_dir)})
    assert cli(["explain", "--rollout-dump", str(tmp_path / "data_3.pt"), "--train-dump", *dumps["train"],
                "--sample", "1"]) == 0
    out = capsys.readouterr().out
    assert "0 token(s) with |diff| > 0.05" in out and "older weights" in out
    assert "the 1 tokens of older weights not compared" in out
    # the batch's newest decides, not the sample's: a sample all of older weights (--partial-rollout carried it
    # finished, or a lagging --fully-async batch) is not compared at all, as the trainer's check leaves it out
    batch[1].metadata.update(token_weight_versions=[2, 2])
    batch[0].metadata.update(token_weight_versions=[3, 3])
    save_rollout_dump(str(tmp_path / "data_3.pt"), 3, batch, {"model_path": str(tiny_model_dir)})
    assert cli(["explain", "--rollout-dump", str(tmp_path / "data_3.pt"), "--train-dump", *dumps["train"],
                "--sample", "1"]) == 0
    out = capsys.readouterr().out
    assert "0 token(s) with |diff| > 0.05" in out
    assert "not compared: all 2 tokens in the loss are of older weights than the rollout's newest" in out


def _fails(argv: list[str], capsys) -> str:
    assert cli(argv) == 2
    return capsys.readouterr().err


def test_clear_errors(dumps, capsys, tmp_path):
    out = dumps["out"]
    assert "rollout dump " + str(tmp_path / "nope.pt") + " does not exist" in _fails(
        explain(dumps, "--sample", "1", rollout=str(tmp_path / "nope.pt")), capsys)
    assert "train dump " + str(tmp_path / "nope.pt") + " does not exist" in _fails(
        explain(dumps, "--sample", "1", train=[str(tmp_path / "nope.pt")]), capsys)
    assert "sample 9 is not in rollout dump" in _fails(explain(dumps, "--sample", "9"), capsys)
    err = _fails(explain(dumps, "--sample", "3", train=dumps["train"][:1]), capsys)
    assert "sample 3 is in rollout dump" in err and "pass every rank's file of rollout 3" in err
    assert "Is it a rollout dump?" in _fails(explain(dumps, "--sample", "1", train=[dumps["rollout"]]), capsys)
    batch = samples(dumps["tok"])
    save_rollout_dump(str(tmp_path / "data_4.pt"), 4, batch)  # another rollout
    assert "is rollout 4 but train dump" in _fails(
        explain(dumps, "--sample", "1", rollout=str(tmp_path / "data_4.pt")), capsys)
    save_rollout_dump(str(tmp_path / "two.pt"), 3, batch[:2])  # another sample set
    assert "holds sample indices 2..3 that rollout dump" in _fails(
        explain(dumps, "--sample", "1", rollout=str(tmp_path / "two.pt")), capsys)
    batch[1].tokens = batch[1].tokens[:-1] + [batch[1].tokens[-2]]  # another response
    save_rollout_dump(str(tmp_path / "other.pt"), 3, batch)
    assert "sample 1 has other tokens" in _fails(
        explain(dumps, "--sample", "1", rollout=str(tmp_path / "other.pt")), capsys)
    assert "both hold sample index 0" in _fails(
        explain(dumps, "--sample", "1", train=[dumps["train"][0], dumps["train"][0]]), capsys)
    assert out.exists()


def test_train_template_checks():
    check_train_template("d/train_{rollout_id}_{rank}.pt", "d/data_{rollout_id}.pt", 2)
    check_train_template("d/train_{rollout_id}.pt", None, 1)  # one writing rank: no {rank} needed
    with pytest.raises(SlimeLiteError, match=r"no '\{rank\}' placeholder but 2 data-parallel"):
        check_train_template("d/train_{rollout_id}.pt", None, 2)
    with pytest.raises(SlimeLiteError, match=r"no '\{rollout_id\}' placeholder"):
        check_train_template("d/train_{rank}.pt", None, 1)
    with pytest.raises(SlimeLiteError, match="only {rollout_id} and {rank} can be used"):
        check_train_template("d/train_{step}_{rollout_id}.pt", None, 1)
    with pytest.raises(SlimeLiteError, match="is the path of --save-debug-rollout-data too"):
        check_train_template("d/{rollout_id}.pt", "d/{rollout_id}.pt", 1)


def test_train_dump_flag_rules(tmp_path):
    from slime_lite.args import parse_args
    from slime_lite.preflight import check_outputs

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    (tmp_path / "p.jsonl").write_text('{"prompt": "1+1=", "label": "2"}\n')
    base = ["--hf-checkpoint", str(tmp_path), "--prompt-data", str(tmp_path / "p.jsonl"), "--rm-type", "addition"]
    args = parse_args(base + ["--dump-details", str(tmp_path / "d")])  # as slime: --dump-details writes them too
    assert args.save_debug_train_data == str(tmp_path / "d" / "train_data" / "{rollout_id}_{rank}.pt")
    with pytest.raises(SlimeLiteError, match="--save-debug-train-data has nothing to save under --debug-rollout-only"):
        parse_args(base + ["--debug-rollout-only", "--save-debug-train-data", "t_{rollout_id}.pt"])
    with pytest.raises(SlimeLiteError, match=r"no '\{rank\}' placeholder but 2"):
        parse_args(base + ["--actor-num-gpus-per-node", "2", "--save-debug-train-data", "t_{rollout_id}.pt"])
    (tmp_path / "blocker").write_text("a file where a folder is needed")  # probed before Ray starts
    template = str(tmp_path / "blocker" / "t_{rollout_id}_{rank}.pt")
    with pytest.raises(SlimeLiteError, match=re.escape(f"--save-debug-train-data {template}: "
                                                       f"{tmp_path / 'blocker'} exists but is not a folder")):
        check_outputs(parse_args(base + ["--save-debug-train-data", template]))


def test_a_replay_with_the_original_runs_dump_details_is_refused_before_any_work(tmp_path):
    """A replay given the --dump-details folder of the run whose dumps it reads would write its train_data (and
    mismatch, args.json) over that run's: refused before Ray starts, in one line naming both flags and the fix; a
    folder of its own is fine."""
    from slime_lite.args import parse_args

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    details = tmp_path / "d"
    replay = ["--hf-checkpoint", str(tmp_path), "--load-debug-rollout-data",
              str(details / "rollout_data" / "{rollout_id}.pt")]
    for folder in (details, details / "x" / ".."):  # the same folder, however it is spelled
        with pytest.raises(SlimeLiteError) as exc:
            parse_args(replay + ["--dump-details", str(folder)])
        msg = str(exc.value)
        assert msg.startswith(f"--dump-details {folder} holds the dumps this replay reads "
                              f"(--load-debug-rollout-data {details}/rollout_data/{{rollout_id}}.pt)")
        assert "would overwrite the original run's; give the replay a --dump-details folder of its own" in msg
        assert "\n" not in msg
    args = parse_args(replay + ["--dump-details", str(tmp_path / "replay")])
    assert args.save_debug_train_data == str(tmp_path / "replay" / "train_data" / "{rollout_id}_{rank}.pt")


def test_html_page_is_self_contained(dumps, capsys):
    page = dumps["out"] / "s1.html"
    assert cli(explain(dumps, "--sample", "1", "--html", str(page))) == 0
    text = page.read_text()
    assert text.count('class="hot"') == 2  # the token in the strip and its table row
    assert HOT in text and "-0.7500" in text
    for fetch in ("http:", "https:", "<script", "<link", "src=", "@import"):
        assert fetch not in text


def _screenshot(page: Path, png: Path, size: tuple[int, int]) -> None:
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("Chromium is not installed: run `apt-get install -y chromium` as root (`bash scripts/setup.sh dev` "
                    "does it when it can), then rerun this test")
    argv = [chromium, "--headless", "--disable-gpu", "--hide-scrollbars", "--force-device-scale-factor=1",
            "--force-color-profile=srgb", f"--user-data-dir={png.parent / 'chromium-profile'}",
            f"--screenshot={png}", f"--window-size={size[0]},{size[1]}", page.resolve().as_uri()]
    if os.geteuid() == 0:
        argv.insert(1, "--no-sandbox")  # Chromium's sandbox refuses to run as root
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0 and png.exists(), proc.stderr[-2000:]


def test_page_renders_in_headless_chromium(dumps, tmp_path):
    """Sample 1 (a token differs) on the left, sample 2 (all agree) on the right, in one browser run."""
    import numpy as np
    from PIL import Image

    for sample in (1, 2):
        assert cli(explain(dumps, "--sample", str(sample), "--html", str(tmp_path / f"s{sample}.html"))) == 0
    (tmp_path / "both.html").write_text(
        '<!doctype html><body style="margin:0">'
        '<iframe src="s1.html" style="position:absolute;left:0;top:0;width:800px;height:600px;border:0"></iframe>'
        '<iframe src="s2.html" style="position:absolute;left:800px;top:0;width:800px;height:600px;border:0">'
        "</iframe></body>")
    png = tmp_path / "both.png"
    _screenshot(tmp_path / "both.html", png, (1600, 600))
    img = np.asarray(Image.open(png).convert("RGB"), dtype=np.int16)
    assert img.shape == (600, 1600, 3)
    hot = np.abs(img - np.array([int(HOT[i:i + 2], 16) for i in (1, 3, 5)])).max(-1) <= 6
    for side, half in (("left", img[:, :800]), ("right", img[:, 800:])):
        colours = len(np.unique(half.reshape(-1, 3), axis=0))
        assert colours > 20 and (half.sum(-1) < 240).sum() > 500, f"the {side} page rendered blank (no text)"
    assert hot[:, :800].sum() > 2000  # sample 1: the differing token and its row in the highlight colour
    assert hot[:, 800:].sum() == 0  # sample 2 agrees everywhere: no highlight


def test_a_quoted_train_dump_pattern_is_expanded(dumps, capsys):
    """The help's own example, 'out/train_3_*.pt', reaches explain unexpanded when quoted: it names every rank's
    file (it was 'does not exist'); a pattern that matches nothing names itself."""
    assert cli(explain(dumps, "--sample", "3", train=[str(dumps["out"] / "train_3_*.pt")])) == 0
    assert "0 token(s) with |diff| > 0.05" in capsys.readouterr().out  # sample 3: in rank 1's file
    err = _fails(explain(dumps, "--sample", "3", train=[str(dumps["out"] / "train_9_*.pt")]), capsys)
    assert f"--train-dump {dumps['out'] / 'train_9_*.pt'}: no file matches this pattern" in err


def test_runs_as_a_module_too(dumps):
    """`python -m slime_lite.debug.explain` runs the tool (it did nothing and exited 0); a user error is one line."""
    run = [sys.executable, "-m", "slime_lite.debug.explain", "--rollout-dump", dumps["rollout"], "--train-dump"]
    proc = subprocess.run(run + [*dumps["train"], "--sample", "1"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "1 token(s) with |diff| > 0.05" in proc.stdout, proc.stderr
    proc = subprocess.run(run + [dumps["rollout"], "--sample", "1"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and "Traceback" not in proc.stderr


def test_a_train_dump_with_token_lists_joins(dumps, tmp_path, capsys):
    """A train dump written by other code with plain lists of token ids (the trainer writes tensors) still joins."""
    raw = torch.load(dumps["train"][0], weights_only=True)
    raw["rollout_data"]["tokens"] = [t.tolist() for t in raw["rollout_data"]["tokens"]]
    torch.save(raw, tmp_path / "train_3_0.pt")
    assert cli(explain(dumps, "--sample", "1", train=[str(tmp_path / "train_3_0.pt"), dumps["train"][1]])) == 0
    assert "1 token(s) with |diff| > 0.05" in capsys.readouterr().out
