"""Driver death: a detached process follows the driver's process tree and, once the driver is gone (kill -9
included), SIGKILLs every process of it still running (Ray's own, the actors, launched servers).

Standard library only and run as a script (``python -P driver_watch.py PID START``), so it starts in a fraction of a
second whatever the driver's working directory and imports; the driver waits until the watch has read the process
table once, so a driver killed right after starting its cluster is still followed.
"""

from __future__ import annotations

import logging
import os
import selectors
import signal
import subprocess
import sys
import time

POLL_S = 0.25
READY_TIMEOUT_S = 30.0


def proc_table() -> dict[int, tuple[int, int]]:
    """``{pid: (ppid, start time in clock ticks)}`` of every live process (Linux /proc; zombies left out)."""

    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if fields[0] != "Z":
                    table[int(entry)] = (int(fields[1]), int(fields[19]))
            except (OSError, IndexError, ValueError):  # gone, or torn down while read
                continue
    return table


def start_time(pid: int) -> int | None:
    return proc_table().get(pid, (0, None))[1]


def descendants(roots: dict[int, int], table: dict[int, tuple[int, int]]) -> dict[int, int]:
    """``roots`` ({pid: start time}) still alive as the same processes, and all their descendants."""

    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found = {pid: start for pid, start in roots.items() if table.get(pid, (0, None))[1] == start}
    todo = list(found)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found[child] = table[child][1]
                todo.append(child)
    return found


def watch(driver_pid: int, driver_start: int, poll_s: float = POLL_S) -> None:
    """Follow the driver's tree while it lives (orphans are re-parented away from it, so the tree is remembered),
    then kill what is left of it."""

    me = os.getpid()
    tree: dict[int, int] = {}
    ready = False
    while True:
        table = proc_table()
        if table.get(driver_pid, (0, None))[1] != driver_start:
            break
        tree = descendants({**tree, driver_pid: driver_start}, table)  # orphans of the tree stay in it
        tree.pop(driver_pid, None)
        tree.pop(me, None)
        if not ready:
            try:
                print("ready", flush=True)
                sys.stdout.close()
            except OSError:  # the driver stopped waiting (it still is followed)
                pass
            ready = True
        time.sleep(poll_s)
    for _ in range(3):  # a process forked while we kill is caught on the next pass
        left = descendants(tree, proc_table())
        left.pop(me, None)
        if not left:
            return
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        tree = left
        time.sleep(poll_s)


def start() -> None:
    """Start ``watch`` for this process in a detached process and wait until it has seen the process table
    (Linux; nothing elsewhere)."""

    if not os.path.isdir("/proc/self"):
        return
    me = os.getpid()
    # -P: the script's folder (slime_lite/, whose io.py and types.py would shadow the standard library's) is not
    # put on sys.path
    proc = subprocess.Popen([sys.executable, "-P", os.path.abspath(__file__), str(me), str(start_time(me))],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            start_new_session=True, close_fds=True)
    try:
        # a selector, not select.select: a driver with 1,024 files open gets descriptors select() cannot take
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            ready = bool(sel.select(READY_TIMEOUT_S)) and proc.stdout.readline().strip() == b"ready"
    finally:
        proc.stdout.close()
    if not ready:
        logging.getLogger(__name__).warning(
            "the driver watch did not start (no word from it within %.0f s): if this driver is killed (kill -9), "
            "its Ray processes may stay behind", READY_TIMEOUT_S)


if __name__ == "__main__":
    watch(int(sys.argv[1]), int(sys.argv[2]))
