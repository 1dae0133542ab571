"""scripts/thread_states.py, run as a user runs it: the threads of a process as /proc shows them,
on a process whose threads take known policies (one SCHED_IDLE and starved of nothing, one asleep
in epoll)."""

from __future__ import annotations

import subprocess
import sys
import time

from conftest import ROOT

SCRIPT = ROOT / "scripts" / "thread_states.py"

CHILD = r"""
import os, select, sys, threading
os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # the main thread: SCHED_IDLE
os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
ep = select.epoll()
def sleeper():
    os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    ep.poll()
threading.Thread(target=sleeper, daemon=True).start()
print("ready", flush=True)
sys.stdin.read()
"""


def test_each_thread_with_its_policy_niceness_and_wait() -> None:
    marker = "thread-states-test-marker"
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, marker], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        time.sleep(0.1)
        r = subprocess.run(
            [sys.executable, str(SCRIPT), "--match", marker, "--seconds", "0.25", "--interval", "0.05"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        child.kill()
        child.wait()
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) >= 2 and r.stderr == f"thread_states: {len(lines)} samples\n"
    fields = lines[-1].split(maxsplit=2)
    assert int(fields[1]) == child.pid
    threads = [t.strip().split(":") for t in fields[2].split("|")]
    by_tid = {int(t[0]): t for t in threads}
    main = by_tid[child.pid]
    assert main[3:5] == ["idle", "n10"]
    (sleeper,) = [t for t in threads if "epoll" in t[7]]  # (Python 3.11 does not name OS threads)
    assert int(sleeper[0]) != child.pid and sleeper[2] == "S" and sleeper[3:5] == ["other", "n10"]
