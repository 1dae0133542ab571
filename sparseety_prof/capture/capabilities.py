"""The Linux capabilities the recorder needs when it does not run as root, what each one buys, and
which of them this process holds (the effective set, /proc/self/status CapEff).

Found by running `record` as a non-root user against an engine of another user, with one
capability taken away at a time (docs/privileges.md has the commands and what failed):
- CAP_SYS_ADMIN: placing a uprobe. Kernels with the fix "perf: Require CAP_SYS_ADMIN for uprobes"
  (stable backports of 2025) refuse the uprobe PMU to CAP_PERFMON alone, and BCC's fallback,
  tracefs's uprobe_events, is root's. CAP_SYS_ADMIN also passes the kernel's CAP_BPF and
  CAP_PERFMON checks (loading the programs, the perf ring) and opens /proc/PID/map_files.
- CAP_SYS_PTRACE: reading /proc/PID/{maps,exe,fd,mem} of a process of another user (the ptrace
  access check).
- CAP_DAC_READ_SEARCH: opening /proc/PID/mem, a file of the engine's user with mode 0600, and a
  model file the recorder's user may not read.
CAP_SYS_NICE is optional: without it, threads the consumer lowered (`--nice`) stay low.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "CAPABILITIES",
    "Capability",
    "capability_names",
    "effective_capabilities",
    "engine_uid",
    "has_capability",
]


@dataclass(frozen=True)
class Capability:
    name: str
    bit: int
    #: what the recorder does with it
    needed_for: str
    #: what is lost without it
    cost: str
    #: needed only to trace an engine of another user
    other_user_only: bool = False
    #: False: the recorder works without it, only worse
    required: bool = True


CAP_DAC_READ_SEARCH = Capability(
    "CAP_DAC_READ_SEARCH",
    2,
    "opening /proc/PID/mem (mode 0600, the engine's user's) and a model file only that user reads",
    "attach fails: the ggml_tensor layout, logits rows and sparse decisions are read from the "
    "engine's memory",
    other_user_only=True,
)
CAP_SYS_PTRACE = Capability(
    "CAP_SYS_PTRACE",
    19,
    "reading /proc/PID/maps, exe, fd and mem of an engine of another user (ptrace access check)",
    "attach fails for an engine of another user: its libraries and model cannot be found",
    other_user_only=True,
)
CAP_SYS_ADMIN = Capability(
    "CAP_SYS_ADMIN",
    21,
    "placing uprobes (the uprobe PMU needs it on current kernels; it also covers CAP_BPF and "
    "CAP_PERFMON) and opening /proc/PID/map_files",
    "attach fails: no uprobe can be placed, so no layer is recorded",
)
CAP_SYS_NICE = Capability(
    "CAP_SYS_NICE",
    23,
    "raising the recorder's threads back after --nice lowered them",
    "only speed: threads the consumer lowered stay low while it catches up",
    required=False,
)

CAPABILITIES: list[Capability] = [CAP_SYS_ADMIN, CAP_SYS_PTRACE, CAP_DAC_READ_SEARCH, CAP_SYS_NICE]

#: capability names by bit (linux/capability.h)
_NAMES = [
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_DAC_READ_SEARCH",
    "CAP_FOWNER",
    "CAP_FSETID",
    "CAP_KILL",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETPCAP",
    "CAP_LINUX_IMMUTABLE",
    "CAP_NET_BIND_SERVICE",
    "CAP_NET_BROADCAST",
    "CAP_NET_ADMIN",
    "CAP_NET_RAW",
    "CAP_IPC_LOCK",
    "CAP_IPC_OWNER",
    "CAP_SYS_MODULE",
    "CAP_SYS_RAWIO",
    "CAP_SYS_CHROOT",
    "CAP_SYS_PTRACE",
    "CAP_SYS_PACCT",
    "CAP_SYS_ADMIN",
    "CAP_SYS_BOOT",
    "CAP_SYS_NICE",
    "CAP_SYS_RESOURCE",
    "CAP_SYS_TIME",
    "CAP_SYS_TTY_CONFIG",
    "CAP_MKNOD",
    "CAP_LEASE",
    "CAP_AUDIT_WRITE",
    "CAP_AUDIT_CONTROL",
    "CAP_SETFCAP",
    "CAP_MAC_OVERRIDE",
    "CAP_MAC_ADMIN",
    "CAP_SYSLOG",
    "CAP_WAKE_ALARM",
    "CAP_BLOCK_SUSPEND",
    "CAP_AUDIT_READ",
    "CAP_PERFMON",
    "CAP_BPF",
    "CAP_CHECKPOINT_RESTORE",
]


def effective_capabilities(status: Path = Path("/proc/self/status")) -> int:
    """The effective capability set, as a bit mask (0 when the line is missing)."""
    for line in status.read_text().splitlines():
        if line.startswith("CapEff:"):
            return int(line.split()[1], 16)
    return 0


def has_capability(mask: int, cap: Capability) -> bool:
    return bool(mask >> cap.bit & 1)


def capability_names(mask: int) -> list[str]:
    """Names of the set bits of `mask` (CAP_<bit> for a capability this module does not name)."""
    return [_NAMES[bit] if bit < len(_NAMES) else f"CAP_{bit}" for bit in range(64) if mask >> bit & 1]


def engine_uid(pid: int) -> int | None:
    """The real user id of process `pid` (None when it is gone)."""
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None
