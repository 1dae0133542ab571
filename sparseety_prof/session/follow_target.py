"""What `--follow` follows: processes by name (capture/process_match.py), or the main process of
a systemd unit (`--follow-unit UNIT`).

A unit's main process is asked of systemd each poll (`systemctl show -p MainPID --value UNIT`,
which never blocks on the unit's state); without systemctl (a container), the unit's cgroup
(/sys/fs/cgroup/system.slice/UNIT/cgroup.procs) names its processes and the oldest is taken. A
unit's main process is whoever the unit runs as: --follow-user narrows it to one user."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from sparseety_prof.capture.process_match import Candidate, ProcessRule, matching_processes

__all__ = ["FollowTarget", "NamedProcesses", "UnitMainProcess", "as_target", "process_candidate"]

CGROUP_ROOT = Path("/sys/fs/cgroup/system.slice")
SYSTEMCTL_TIMEOUT_S = 5.0


class FollowTarget(Protocol):
    def find(self, proc: Path, exclude: int) -> list[Candidate]:
        """The live processes to follow, oldest first."""
        ...

    @property
    def label(self) -> str:
        """What the messages call it: the name, or the unit."""
        ...

    def describe(self) -> str: ...

    def to_meta(self) -> dict[str, Any]:
        """follow.json "follow"."""
        ...


@dataclass(frozen=True)
class NamedProcesses:
    rule: ProcessRule

    def find(self, proc: Path, exclude: int) -> list[Candidate]:
        return matching_processes(self.rule, proc, exclude=exclude)

    @property
    def label(self) -> str:
        return self.rule.name

    def describe(self) -> str:
        return f"a process named {self.rule.name!r} of user id {self.rule.uid}"

    def to_meta(self) -> dict[str, Any]:
        return {"name": self.rule.name, "match": "comm", "uid": self.rule.uid}


@dataclass(frozen=True)
class UnitMainProcess:
    unit: str
    uid: int | None = None  # --follow-user: only a main process of this user
    cgroup_root: Path = CGROUP_ROOT

    def find(self, proc: Path, exclude: int) -> list[Candidate]:
        pids = [p for p in self._pids() if p > 0 and p != exclude]
        found = [c for p in pids if (c := process_candidate(proc, p, self.uid)) is not None]
        return sorted(found)[:1]

    @property
    def label(self) -> str:
        return self.unit

    def describe(self) -> str:
        who = f" of user id {self.uid}" if self.uid is not None else ""
        return f"the main process of systemd unit {self.unit!r}{who}"

    def to_meta(self) -> dict[str, Any]:
        return {"unit": self.unit, "match": "unit", "uid": self.uid}

    def _pids(self) -> list[int]:
        systemctl = shutil.which("systemctl")
        if systemctl is not None:
            try:
                out = subprocess.run(
                    [systemctl, "show", "-p", "MainPID", "--value", "--", self.unit],
                    capture_output=True,
                    text=True,
                    timeout=SYSTEMCTL_TIMEOUT_S,
                    check=False,
                )
                if out.returncode == 0 and out.stdout.strip().isdigit():
                    return [int(out.stdout.strip())]  # 0: the unit runs nothing now
            except (OSError, subprocess.TimeoutExpired):
                pass
        try:
            text = (self.cgroup_root / self.unit / "cgroup.procs").read_text()
        except OSError:
            return []
        return [int(x) for x in text.split() if x.isdigit()]


def as_target(what: ProcessRule | FollowTarget) -> FollowTarget:
    return NamedProcesses(what) if isinstance(what, ProcessRule) else what


def process_candidate(proc: Path, pid: int, uid: int | None) -> Candidate | None:
    """Process `pid` as a Candidate (None when gone, a zombie, or not of user `uid`)."""
    try:
        status = (proc / str(pid) / "status").read_bytes()
        stat_text = (proc / str(pid) / "stat").read_bytes()
    except OSError:
        return None
    if uid is not None:
        uids = next((r.split()[1:3] for r in status.splitlines() if r.startswith(b"Uid:")), None)
        if uids is None or [int(x) for x in uids] != [uid, uid]:
            return None
    fields = stat_text.rsplit(b")", 1)[-1].split()
    if len(fields) < 20 or fields[0] == b"Z":
        return None
    try:
        return Candidate(start_ticks=int(fields[19]), pid=pid)
    except ValueError:
        return None
