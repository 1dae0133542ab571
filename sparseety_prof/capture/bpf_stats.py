"""What the probes cost the engine's threads: the kernel's run statistics of each BPF program.

With statistics on, the kernel counts each program's runs and the nanoseconds spent in them
(`run_cnt`, `run_time_ns` in the program's fdinfo). They are on while any process holds the fd
that the bpf(2) command BPF_ENABLE_STATS returns, so the recorder turns them on for its own
lifetime only (`--bpf-stats`) and the machine's setting (sysctl kernel.bpf_stats_enabled) is
never changed: closing the fd, or the recorder's death, ends them. They cost two clock reads per
program run, which is why they are not on by default.

The time counted is the programs' own: the uprobe's trap into the kernel and back (measured in
docs/overhead.md) comes on top of it."""

from __future__ import annotations

import ctypes
import os
import platform
import re

BPF_ENABLE_STATS = 32  # enum bpf_cmd
BPF_STATS_RUN_TIME = 0  # enum bpf_stats_type
# the bpf(2) syscall's number where the recorder runs (BCC's own architectures)
_SYS_BPF = {"x86_64": 321, "aarch64": 280, "ppc64le": 361, "s390x": 351}


def enable_run_stats() -> tuple[int | None, str]:
    """Turn the run statistics on for as long as the returned fd is open: (fd, "") or (None,
    why not)."""
    nr = _SYS_BPF.get(platform.machine())
    if nr is None:
        return None, f"no bpf(2) syscall number known for {platform.machine()}"
    libc = ctypes.CDLL(None, use_errno=True)
    attr = (ctypes.c_uint32 * 2)(BPF_STATS_RUN_TIME, 0)
    fd = libc.syscall(nr, BPF_ENABLE_STATS, ctypes.byref(attr), ctypes.sizeof(attr))
    if fd < 0:
        err = ctypes.get_errno()
        return None, f"BPF_ENABLE_STATS: {os.strerror(err)} (Linux 5.8 or later)"
    return fd, ""


def program_runs(fdinfo: str) -> tuple[int, int]:
    """(runs, nanoseconds) of a BPF program's fdinfo; (0, 0) where the kernel does not report them."""
    runs = re.search(r"^run_cnt:\s*(\d+)", fdinfo, flags=re.MULTILINE)
    ns = re.search(r"^run_time_ns:\s*(\d+)", fdinfo, flags=re.MULTILINE)
    return (int(runs.group(1)) if runs else 0, int(ns.group(1)) if ns else 0)
