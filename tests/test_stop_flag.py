"""The stop request set from signal handlers (session/stop_flag.py): a Ctrl-C that lands while
the main thread waits on it never hangs the recorder (threading.Event did, now and then: the
handler waited for a lock the interrupted wait held)."""

from __future__ import annotations

import os
import random
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from sparseety_prof.session.stop_flag import StopFlag

ROOT = Path(__file__).resolve().parent.parent

# Rounds of: the recorder's drain loop (short waits on a fresh flag), and a Ctrl-C from outside
# a random moment after the round began. A deadlock leaves a round unfinished. (With
# threading.Event in StopFlag's place, this hung within the first ~20 rounds when measured.)
_LOOP = textwrap.dedent(
    """
    import signal
    from sparseety_prof.session.stop_flag import StopFlag
    while True:
        flag = StopFlag()
        signal.signal(signal.SIGINT, lambda *_: flag.set())
        print("ready", flush=True)
        while not flag.is_set():
            flag.wait(0.00001)
        flag.close()
    """
)


def test_a_signal_landing_inside_the_wait_never_deadlocks() -> None:
    proc = subprocess.Popen([sys.executable, "-c", _LOOP], stdout=subprocess.PIPE, cwd=ROOT)
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    try:
        for n in range(1500):
            line = b""
            while not line.endswith(b"\n"):
                ready, _, _ = select.select([fd], [], [], 10)
                assert ready, f"round {n}: the signal handler deadlocked"
                line += os.read(fd, 64)
            assert line == b"ready\n"
            time.sleep(random.uniform(0, 0.002))
            proc.send_signal(signal.SIGINT)
    finally:
        proc.kill()
        proc.wait()


def test_wait_returns_at_once_when_set_and_after_the_timeout_otherwise() -> None:
    flag = StopFlag()
    t0 = time.monotonic()
    assert flag.wait(0.05) is False
    assert time.monotonic() - t0 >= 0.04
    flag.set()
    flag.set()  # twice: the pipe's pending byte is enough
    t0 = time.monotonic()
    assert flag.wait(5) is True
    assert flag.is_set()
    assert time.monotonic() - t0 < 1
    flag.close()
    flag.set()  # after close: nothing to wake, no error
    assert flag.is_set()


def test_set_from_another_thread_wakes_the_waiter() -> None:
    import threading

    flag = StopFlag()
    threading.Timer(0.05, flag.set).start()
    t0 = time.monotonic()
    assert flag.wait(10) is True
    assert time.monotonic() - t0 < 5
    flag.close()
