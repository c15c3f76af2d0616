"""File helpers: loading never runs code, a full disk is reported as such, atomic writes leave no partial files."""

from __future__ import annotations

import errno
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from slime_lite.errors import SlimeLiteError
from slime_lite.io import append_line, atomic_torch_save, load_plain, probe_folder
from slime_lite.metrics import MetricsLogger, check_finite_losses, train_steps_path
from slime_lite.args import parser_defaults
from tests.fakes.evil_pickle import Evil



def test_a_pickle_that_would_run_code_is_refused_and_never_runs(tmp_path: Path) -> None:
    path, marker = tmp_path / "model.pt", tmp_path / "marker"
    torch.save({"weights": torch.zeros(2), "x": Evil(str(marker))}, path)
    with pytest.raises(SlimeLiteError, match=r"checkpoint .*model\.pt is not a plain-tensor file.*nothing in it ran"):
        load_plain(str(path), "checkpoint")
    assert not marker.exists()


def test_plain_data_loads(tmp_path: Path) -> None:
    path = tmp_path / "ok.pt"
    atomic_torch_save({"t": torch.arange(3), "n": [1, 2.5, "s", None, (1, 2)]}, str(path))
    out = load_plain(str(path), "file")
    assert out["n"] == [1, 2.5, "s", None, (1, 2)] and out["t"].tolist() == [0, 1, 2]


def _no_space(*_a, **_k):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_full_disk_while_saving_is_reported_and_leaves_the_old_file(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "d_0.pt"
    atomic_torch_save({"v": 1}, str(path))
    monkeypatch.setattr(os, "fsync", _no_space)  # the disk fills while the new version is written
    with pytest.raises(SlimeLiteError, match=rf"no space left writing {path}"):
        atomic_torch_save({"v": torch.zeros(1000)}, str(path))
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["d_0.pt"] and load_plain(str(path), "file") == {"v": 1}


@pytest.fixture
def tiny_disk(tmp_path: Path):
    """A real 64 KiB file system (tmpfs; needs root), so the disk is really full."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)],
                                           capture_output=True).returncode:
        pytest.skip("mounting a small tmpfs needs root")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_really_full_disk_is_no_space_left_and_no_partial_file(tiny_disk: Path) -> None:
    path = tiny_disk / "ckpt" / "rank_000.pt"
    with pytest.raises(SlimeLiteError, match=rf"no space left writing {path}"):
        atomic_torch_save({"w": torch.zeros(100_000)}, str(path))
    assert os.listdir(tiny_disk / "ckpt") == []
    fd = os.open(tiny_disk / "filler", os.O_WRONLY | os.O_CREAT)
    with pytest.raises(OSError):  # take every block that is left
        while True:
            os.write(fd, b"\0" * 4096)
    os.close(fd)
    with pytest.raises(SlimeLiteError, match="--save: no space left writing"):
        probe_folder(str(tiny_disk / "out"), "--save")


def test_a_full_disk_under_an_hf_export_is_no_space_left_and_leaves_no_folder(tiny_disk: Path, tmp_path: Path) -> None:
    """safetensors raises its own error class for a failed write (not an OSError): the export's temporary folder
    (config and tokenizer files) was left on the full disk, with safetensors' raw message."""
    from slime_lite.io import write_hf_folder

    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text('{"model_type": "qwen2", "torch_dtype": "float32"}')
    with pytest.raises(SlimeLiteError, match=rf"no space left writing {tiny_disk / 'hf'}"):
        write_hf_folder({"w": torch.zeros(100_000)}, str(base), str(tiny_disk / "hf"))
    assert os.listdir(tiny_disk) == []


def test_metrics_on_a_full_disk_name_the_file() -> None:
    with pytest.raises(SlimeLiteError, match="no space left writing /dev/full"):
        append_line("/dev/full", "{}")
    logger = MetricsLogger(parser_defaults(metrics_path="/dev/full"))
    with pytest.raises(SlimeLiteError, match="no space left writing /dev/full"):
        logger.log({"train/loss": 1.0}, 0, quiet=True)


def test_probe_creates_missing_folders_and_names_the_flag(tmp_path: Path) -> None:
    probe_folder(str(tmp_path / "a" / "b"), "--save")
    assert (tmp_path / "a" / "b").is_dir() and os.listdir(tmp_path / "a" / "b") == []
    (tmp_path / "file").write_text("x")
    with pytest.raises(SlimeLiteError, match=rf"--save: {tmp_path}/file exists but is not a folder"):
        probe_folder(str(tmp_path / "file"), "--save")
    with pytest.raises(SlimeLiteError, match=rf"--dump-details: cannot create the folder {tmp_path}/file/sub"):
        probe_folder(str(tmp_path / "file" / "sub"), "--dump-details")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to read-only folders")
def test_probe_of_a_read_only_folder(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    with pytest.raises(SlimeLiteError, match=rf"--metrics-path: the folder {ro} is not writable"):
        probe_folder(str(ro), "--metrics-path")


def test_non_finite_loss_stops_the_run_naming_the_rollout() -> None:
    check_finite_losses({"train/loss": 0.5, "train/grad_norm": float("nan"), "rollout/raw_reward": 1.0}, 3)
    for bad in (float("nan"), float("inf")):
        with pytest.raises(SlimeLiteError, match=rf"rollout 3: the training loss is not finite \(train/pg_loss={bad}"):
            check_finite_losses({"train/loss": 0.5, "train/pg_loss": bad}, 3)
    with pytest.raises(SlimeLiteError, match=r"train/critic-value_loss=nan"):
        check_finite_losses({"train/critic-value_loss": float("nan")}, 0)
    steps = [{"train/loss": 0.5}, {"train/loss": float("nan")}, {"train/loss": float("nan")}]  # the mean: nan
    with pytest.raises(SlimeLiteError, match=r"rollout 2: the training loss is not finite from its optimizer step 1 "
                                             r"of 3 on \(train/loss=nan\)"):
        check_finite_losses({"train/loss": float("nan")}, 2, steps)


def test_the_summary_line_names_the_critics_value_loss_and_the_step(caplog) -> None:
    logger = MetricsLogger(parser_defaults())
    with caplog.at_level("INFO", logger="slime_lite.metrics"):
        logger.log({"train/loss": 0.5, "train/critic-value_loss": 0.25, "perf/step_time": 2.0}, 3)
    assert "rollout_id=3 loss=0.5000 v_loss=0.2500 step_s=2.0000" in caplog.text


def test_each_optimizer_step_is_a_line_beside_the_metrics_and_tensorboards_train_curve(tmp_path: Path) -> None:
    """--metrics-path m.jsonl: each optimizer step's metrics are a line of m.train_steps.jsonl at slime's train/step
    (rollout id x --num-steps-per-rollout + the step); a rollout that trained more steps than planned shifts the
    later ones instead of reusing a step, in a resumed run too (it reads the steps of the rollouts before it).
    TensorBoard's train/ curves are the steps', not the rollouts' means. Metrics sent to a device or stream write
    no steps file."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    path, tb = tmp_path / "m.jsonl", tmp_path / "tb"
    logger = MetricsLogger(parser_defaults(metrics_path=str(path), num_steps_per_rollout=2, use_tensorboard=True,
                                           tensorboard_dir=str(tb)))
    logger.log_train_steps([{"train/loss": 1.0}, {"train/loss": 0.5}], 0)
    logger.log({"train/loss": 0.75, "rollout/raw_reward": 0.25}, 0, quiet=True)
    logger.log_train_steps([{"train/loss": 0.4}, {"train/loss": 0.3}, {"train/loss": 0.2}], 1)  # one step more
    logger.log_train_steps([{"train/loss": 0.1}, {"train/loss": 0.0}], 2)
    logger.close()
    rows = [json.loads(line) for line in (tmp_path / "m.train_steps.jsonl").read_text().splitlines()]
    assert [(r["train/step"], r["rollout_id"], r["train/loss"]) for r in rows] == [
        (0, 0, 1.0), (1, 0, 0.5), (2, 1, 0.4), (3, 1, 0.3), (4, 1, 0.2), (5, 2, 0.1), (6, 2, 0.0)]
    assert json.loads(path.read_text())["train/loss"] == 0.75  # the rollout's record: the mean
    events = EventAccumulator(str(tb))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [
        (0, 1.0), (1, 0.5), (2, pytest.approx(0.4)), (3, pytest.approx(0.3)), (4, pytest.approx(0.2)),
        (5, pytest.approx(0.1)), (6, 0.0)]
    assert [(e.step, e.value) for e in events.Scalars("rollout/raw_reward")] == [(0, 0.25)]
    resumed = MetricsLogger(parser_defaults(metrics_path=str(path), num_steps_per_rollout=2))
    resumed.log_train_steps([{"train/loss": 0.1}], 2)  # resumed at rollout 2: after rollout 1's steps 2-4
    assert json.loads((tmp_path / "m.train_steps.jsonl").read_text().splitlines()[-1])["train/step"] == 5
    fresh = tmp_path / "fresh.jsonl"
    MetricsLogger(parser_defaults(metrics_path=str(fresh), num_steps_per_rollout=2)).log_train_steps([{}], 3)
    assert json.loads((tmp_path / "fresh.train_steps.jsonl").read_text())["train/step"] == 6  # resumed, no file
    for device in ("/dev/null", "/dev/stdout", "/proc/self/fd/1"):
        assert train_steps_path(device) is None, device
    assert train_steps_path("a/m.jsonl") == "a/m.train_steps.jsonl" and train_steps_path("m") == "m.train_steps.jsonl"
    MetricsLogger(parser_defaults(metrics_path="/dev/null")).log_train_steps([{"train/loss": 1.0}], 0)


def test_an_hf_export_says_the_dtype_of_its_tensors_so_transformers_loads_them_unchanged(tiny_model_dir, tmp_path):
    """A float32 export (training without --bf16) of a model whose config says bfloat16: transformers' default
    dtype="auto" read the config's dtype and rounded every weight to bfloat16."""
    import json
    import shutil

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from slime_lite.io import write_hf_folder

    base = tmp_path / "base"
    shutil.copytree(tiny_model_dir, base)
    config = json.loads((base / "config.json").read_text())
    config.update({k: "bfloat16" for k in ("torch_dtype", "dtype") if k in config} or {"dtype": "bfloat16"})
    (base / "config.json").write_text(json.dumps(config))
    named = {k: v.float() + 1e-4 for k, v in load_file(str(tiny_model_dir / "model.safetensors")).items()}
    write_hf_folder(named, str(base), str(tmp_path / "out"))
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert all(written[k] == "float32" for k in ("torch_dtype", "dtype") if k in written)
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    name, tensor = next(iter(named.items()))
    assert model.dtype == torch.float32 and torch.equal(model.state_dict()[name], tensor)
    # a second export replaces the first; a folder holding anything else is left whole and refused
    write_hf_folder(named, str(base), str(tmp_path / "out"))
    (tmp_path / "out" / "notes.txt").write_text("mine")
    with pytest.raises(SlimeLiteError, match="holds .*notes.txt, which no export writes"):
        write_hf_folder(named, str(base), str(tmp_path / "out"))
    assert (tmp_path / "out" / "notes.txt").read_text() == "mine" and (tmp_path / "out" / "model.safetensors").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-hf-")]


def test_an_ipv6_engine_host_gets_a_port_and_a_url_in_brackets(monkeypatch):
    """SLIME_LITE_ENGINE_HOST (or a Ray node IP) may be IPv6: the port was bound with an IPv4 socket (gaierror) and
    the URL written http://::1:port (no port could be read from it)."""
    import socket
    from urllib.parse import urlsplit

    from slime_lite.backends.sglang.launcher import engine_host
    from slime_lite.io import free_port, http_url

    try:
        socket.socket(socket.AF_INET6).bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback on this machine")
    for host in ("::1", "[::1]"):
        monkeypatch.setenv("SLIME_LITE_ENGINE_HOST", host)
        assert engine_host() == "::1"
        port = free_port(host)
        assert urlsplit(http_url(host, port)).port == port and http_url(host, port) == f"http://[::1]:{port}"
    assert http_url("10.0.0.2", 30000) == "http://10.0.0.2:30000" and free_port("127.0.0.1") > 0


def test_a_resumed_run_drops_a_record_cut_short_before_appending(tmp_path: Path, caplog) -> None:
    """A run killed mid-write leaves a cut last line: glued to the resumed run's first record, both would be lost and
    the file unreadable; the logger drops the fragment (the resume logs that rollout again)."""
    path = tmp_path / "m.jsonl"
    path.write_text('{"rollout_id": 0}\n{"rollout_id": 1, "rollout/raw_rew')
    logger = MetricsLogger(parser_defaults(metrics_path=str(path)))
    assert "its last record was cut short" in caplog.text
    logger.log({"rollout/raw_reward": 0.5}, 1, quiet=True)
    assert [json.loads(line)["rollout_id"] for line in path.read_text().splitlines()] == [0, 1]
    whole = path.read_text()
    MetricsLogger(parser_defaults(metrics_path=str(path)))  # a whole file is left as it is
    assert path.read_text() == whole
    (tmp_path / "cut.jsonl").write_text('{"rollout_id": 0, "x')  # no whole record at all
    MetricsLogger(parser_defaults(metrics_path=str(tmp_path / "cut.jsonl")))
    assert (tmp_path / "cut.jsonl").read_text() == ""
