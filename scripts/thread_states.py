#!/usr/bin/env python3
"""Sample the recorder's threads from /proc while it runs: for each thread, its name, state,
scheduling policy, niceness, CPU time and where it sleeps (wchan), one line per sample.

Made to see why a consumer did not drain (docs/overhead.md, "How the consumer keeps up"): a
SCHED_IDLE thread that stays runnable (`R`) with its CPU time standing still is starved; one asleep
in `do_epoll_wait` is waiting to be woken. Run it beside a benchmark or a recording:

    sudo .venv/bin/python scripts/thread_states.py --seconds 120 -o /tmp/threads.txt &
    sudo .venv/bin/python scripts/bench_sustained.py --pairs 1 --seconds 30 --record-args='--sched idle'

It follows every process whose command line holds `--match` (default: the recorder's
`sparseety_prof.cli record`), and each new one as it starts. Lines:
    <seconds since start> <pid> <tid>:<name>:<state>:<policy>:n<nice>:u<utime>:s<stime>:<wchan> | ...
with the policy by name (other, fifo, rr, batch, idle) and CPU times in clock ticks.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import TextIO

_POLICIES = {0: "other", 1: "fifo", 2: "rr", 3: "batch", 5: "idle", 6: "deadline"}
# /proc/<pid>/task/<tid>/stat, counted from the field after ") " (the name may hold spaces and
# parentheses): state, utime, stime, nice, policy are the stat(5) fields 3, 14, 15, 19 and 41
_STATE, _UTIME, _STIME, _NICE, _POLICY = 0, 11, 12, 16, 38


def _read(path: Path, limit: int = 4096) -> str:
    """A small /proc file's text ('' once the task is gone)."""
    try:
        with open(path, "rb") as f:
            return f.read(limit).decode(errors="replace").strip()
    except OSError:
        return ""


def matching_pids(match: str) -> list[int]:
    own = os.getpid()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == own:
            continue
        cmd = _read(Path("/proc", entry, "cmdline")).replace("\0", " ")
        if match in cmd:
            found.append(int(entry))
    return sorted(found)


def thread_line(pid: int) -> str | None:
    """One sample of every thread of `pid`, or None once the process is gone."""
    try:
        tids = sorted(os.listdir(f"/proc/{pid}/task"), key=int)
    except OSError:
        return None
    parts = []
    for tid in tids:
        task = Path("/proc", str(pid), "task", tid)
        stat = _read(task / "stat")
        if not stat:
            continue
        f = stat[stat.rfind(")") + 2 :].split()
        name = "".join(c if c.isprintable() else "?" for c in _read(task / "comm"))
        wchan = _read(task / "wchan") or "-"
        policy = _POLICIES.get(int(f[_POLICY]), f[_POLICY])
        parts.append(f"{tid}:{name}:{f[_STATE]}:{policy}:n{f[_NICE]}:u{f[_UTIME]}:s{f[_STIME]}:{wchan}")
    return " | ".join(parts)


def sample(match: str, seconds: float, interval: float, out: TextIO) -> int:
    """Sample for `seconds`; returns the lines written."""
    t0 = time.monotonic()
    lines = 0
    while (now := time.monotonic()) - t0 < seconds:
        for pid in matching_pids(match):
            line = thread_line(pid)
            if line:
                out.write(f"{now - t0:8.2f} {pid} {line}\n")
                lines += 1
        out.flush()
        time.sleep(interval)
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--match", default="sparseety_prof.cli record", help="a substring of the command line")
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--interval", type=float, default=0.05, help="between samples (s)")
    ap.add_argument("-o", "--output", type=Path, help="default: standard output")
    a = ap.parse_args(argv)
    if a.interval <= 0 or a.seconds <= 0:
        ap.error("--seconds and --interval must be positive")
    if a.output is None:
        n = sample(a.match, a.seconds, a.interval, sys.stdout)
    else:
        with open(a.output, "w", encoding="utf-8") as out:
            n = sample(a.match, a.seconds, a.interval, out)
    print(f"thread_states: {n} samples", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
