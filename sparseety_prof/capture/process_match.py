"""Which running processes `--follow NAME` means: the rule, and one cheap pass over /proc; and
which processes an engine's are (`descendants`: vLLM and SGLang run the GPU in worker processes).

The rule (docs/usage.md: following a restarting engine): a process matches when its name, the kernel's
/proc/PID/comm (the executable's file name, at most 15 bytes, as `pgrep -x` and `ps -o comm` show
it), is exactly NAME, AND both its real and effective user ids are the followed user's. A name
is no proof of identity: any user can start a program called `llama-server`, and the recorder
(root) would read that process's memory and record what it says. The user id is the trust
boundary; it is the invoking user's by default (the sudo user under sudo).

One pass reads one small file per process (comm) and, for the few whose name matches, their
status and stat; nothing here holds a /proc entry open between passes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["COMM_MAX", "Candidate", "ProcessRule", "matching_processes"]

COMM_MAX = 15  # TASK_COMM_LEN - 1: the kernel truncates longer executable names to this


@dataclass(frozen=True)
class ProcessRule:
    name: str  # exact /proc/PID/comm
    uid: int  # real and effective user id the process must run as


@dataclass(frozen=True, order=True)
class Candidate:
    """A matching process. Ordered oldest first: by start time (clock ticks since boot), then PID.
    (pid, start_ticks) names one process for good: a PID reused later has another start time."""

    start_ticks: int
    pid: int


def matching_processes(
    rule: ProcessRule, proc: Path = Path("/proc"), exclude: int | None = None
) -> list[Candidate]:
    """Every live process the rule matches, oldest first; `exclude`: a PID never matched (the
    recorder itself). Processes that vanish during the pass are skipped."""
    want = rule.name.encode()
    found = []
    try:
        entries = os.scandir(proc)
    except OSError:
        return []
    with entries:
        for entry in entries:
            if not entry.name.isdigit():
                continue
            pid = int(entry.name)
            if pid == exclude:
                continue
            comm = _read(proc / entry.name / "comm")
            if comm is None or comm.rstrip(b"\n") != want:
                continue
            cand = _candidate(proc / entry.name, pid, rule.uid)
            if cand is not None:
                found.append(cand)
    return sorted(found)


def _candidate(d: Path, pid: int, uid: int) -> Candidate | None:
    status = _read(d / "status")
    stat = _read(d / "stat")
    if status is None or stat is None:
        return None
    uids = _status_ids(status, b"Uid:")
    if uids is None or uids[0] != uid or uids[1] != uid:
        return None
    # the fields after the last ')': the name in parentheses may hold spaces and ')' itself
    fields = stat.rsplit(b")", 1)[-1].split()
    if len(fields) < 20 or fields[0] == b"Z":  # a zombie has exited; it runs nothing
        return None
    try:
        return Candidate(start_ticks=int(fields[19]), pid=pid)
    except ValueError:
        return None


def _status_ids(status: bytes, key: bytes) -> list[int] | None:
    for row in status.splitlines():
        if row.startswith(key):
            try:
                return [int(x) for x in row[len(key) :].split()]
            except ValueError:
                return None
    return None


def _read(path: Path) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read(4096)
    except OSError:  # the process exited, or it is not ours to read
        return None


def descendants(pid: int, proc: Path = Path("/proc")) -> list[int]:
    """`pid` and every live descendant (engine workers inherit CUDA_INJECTION64_PATH), from /proc/*/stat."""
    children: dict[int, list[int]] = {}
    for d in proc.iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        # The command name is in parentheses and may contain spaces: the ppid follows the last ')'.
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out
