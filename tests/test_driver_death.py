"""Driver death (issue 15 item 9): kill -9 of ``slime-lite train`` leaves no process of its tree behind within 10 s
(Ray's processes, the engine and train actors, anything they launched): driver_watch.watch follows the driver's
process tree from a process of its own and kills what is left once the driver is gone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from slime_lite.driver_watch import descendants, proc_table

GRACE_S = 10.0


def _tree(pid: int) -> dict[int, int]:
    table = proc_table()
    return {p: s for p, s in descendants({pid: table[pid][1]}, table).items() if p != pid}


def _left_after_grace(tree: dict[int, int]) -> list[str]:
    """The processes of ``tree`` still running GRACE_S after now (their command lines)."""
    deadline = time.monotonic() + GRACE_S
    while True:
        table = proc_table()
        left = [p for p, start in tree.items() if table.get(p, (0, None))[1] == start]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    out = []
    for p in left:
        try:
            out.append(f"{p}: " + Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200])
        except OSError:
            pass
    return out


def test_a_killed_driver_takes_its_detached_descendants_with_it():
    """Processes that left the driver's session and process group (as Ray's do) are killed with it, and so is one
    orphaned while the driver lived (its parent, a launcher, exited: it is no descendant of the driver any more)."""
    script = textwrap.dedent("""
        import subprocess, sys, time
        from slime_lite.driver_watch import start
        start()
        # like raylet and its workers: a long-lived child in a session of its own, and its own detached child
        subprocess.Popen([sys.executable, "-c", "import subprocess, time; "
                          "subprocess.Popen(['sleep', '300'], start_new_session=True); time.sleep(300)"],
                         start_new_session=True)
        # a launcher that starts a server and exits 2 s later
        subprocess.Popen([sys.executable, "-c", "import subprocess, time; "
                          "subprocess.Popen(['sleep', '301'], start_new_session=True); time.sleep(2)"])
        print("ready", flush=True)
        time.sleep(300)
    """)
    driver = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert driver.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 60
        while len(tree := _tree(driver.pid)) < 5:  # the watch, the two children, their children
            assert time.monotonic() < deadline, tree
            time.sleep(0.1)
        time.sleep(4.0)  # the launcher has exited; the watch (every 0.25 s) has polled since
    finally:
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait()
    assert _left_after_grace(tree) == []


@pytest.mark.slow
def test_kill_9_of_train_mid_run_leaves_no_process_behind(tiny_model_dir, tmp_path):
    from slime_lite.tasks import make_data

    data = tmp_path / "addition.jsonl"
    make_data("addition", str(data), n_train=64, n_eval=4, seed=0)
    metrics = tmp_path / "m.jsonl"
    argv = ["--hf-checkpoint", str(tiny_model_dir), "--prompt-data", str(data), "--rm-type", "addition",
            "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "6",
            "--num-rollout", "100", "--metrics-path", str(metrics)]
    with open(tmp_path / "train.log", "w") as log:
        driver = subprocess.Popen([sys.executable, "-m", "slime_lite.cli", "train", *argv], stdout=log,
                                  stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not (metrics.exists() and metrics.read_text().strip()):  # rollout 0 trained: rollout 1 is running
            assert driver.poll() is None, (tmp_path / "train.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no rollout finished within 120 s"
            time.sleep(0.1)
        tree = _tree(driver.pid)
        assert len(tree) >= 3, "expected Ray, engine and trainer processes under the driver"
    finally:
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait()
    left = _left_after_grace(tree)
    assert left == [], "still running 10 s after kill -9 of the driver:\n" + "\n".join(left)


def test_a_watch_that_does_not_start_is_reported(monkeypatch, caplog):
    from slime_lite import driver_watch

    monkeypatch.setattr(driver_watch, "__file__", "/nonexistent/driver_watch.py")  # its process exits at once
    with caplog.at_level("WARNING", logger="slime_lite.driver_watch"):
        driver_watch.start()
    assert "the driver watch did not start" in caplog.text


def test_the_watch_starts_in_a_driver_with_more_than_1024_files_open(caplog):
    """select() takes no descriptor past 1,023; a driver that holds many files (Ray, sockets, logs) still starts."""

    import resource

    from slime_lite import driver_watch

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if max(soft, hard if hard != resource.RLIM_INFINITY else 4096) < 1200:
        pytest.skip("this machine allows fewer than 1,200 open files")
    if soft < 1200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1200, hard))
    held = []
    try:
        while not held or held[-1] < 1100:
            held.append(os.open(os.devnull, os.O_RDONLY))
        with caplog.at_level("WARNING", logger="slime_lite.driver_watch"):
            driver_watch.start()
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert "the driver watch did not start" not in caplog.text
