"""The consumer's CPU slice: how long it may run, once it has the CPU, before a waiting engine
thread gets it back.

On a machine whose cores the engine keeps busy, every slice the consumer takes delays one engine
thread, and llama.cpp's threads meet at a barrier after every graph node, so that delay stalls the
whole step. The kernel's EEVDF scheduler (Linux 6.12 and later) lets a SCHED_OTHER thread ask for
another slice with sched_setattr's `sched_runtime` (0.1-100 ms); its CPU share is unchanged (its
niceness sets that). A short slice spreads the consumer's CPU over more steps, but EEVDF also runs
a short-slice thread sooner (an earlier virtual deadline), so it preempts the engine more often:
on this project's saturated 2-core VM, a short slice cost the engine more than the kernel's
default (docs/overhead.md), which stays the default (`--slice-us 0`). Older kernels ignore the
field or refuse it.
"""

from __future__ import annotations

import ctypes
import os
import platform
import struct

# sched_setattr(2) / sched_getattr(2): not in the os module
_SYSCALLS = {"x86_64": (314, 315), "aarch64": (274, 275)}
# struct sched_attr, SCHED_ATTR_SIZE_VER1: size, policy, flags, nice, priority, runtime, deadline,
# period, util_min, util_max
_ATTR = struct.Struct("IIQiIQQQII")
SLICE_MIN_US = 100  # the kernel's bounds for a fair task's custom slice
SLICE_MAX_US = 100_000

_libc: ctypes.CDLL | None = None


def _syscall() -> tuple[ctypes.CDLL, int, int] | None:
    global _libc
    nums = _SYSCALLS.get(platform.machine())
    if nums is None:
        return None
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc, nums[0], nums[1]


def thread_slice_us(tid: int) -> int | None:
    """The slice the kernel holds for thread `tid` (its own default when none was asked for), in
    µs; None when it cannot be read."""
    sc = _syscall()
    if sc is None:
        return None
    libc, _, get_nr = sc
    buf = ctypes.create_string_buffer(_ATTR.size)
    if libc.syscall(get_nr, tid, buf, _ATTR.size, 0) != 0:
        return None
    return int(_ATTR.unpack(buf.raw)[5]) // 1000


def set_thread_slice(tid: int, slice_us: int) -> bool:
    """Ask for a `slice_us` slice (clamped to the kernel's bounds; 0: the kernel's default) for
    SCHED_OTHER thread `tid`, keeping its niceness. False where the kernel refuses it or the thread
    is not SCHED_OTHER (SCHED_IDLE has no such slice)."""
    sc = _syscall()
    if sc is None:
        return False
    try:
        if os.sched_getscheduler(tid) != os.SCHED_OTHER:
            return False
        nice = os.getpriority(os.PRIO_PROCESS, tid)  # Linux: a TID reads one thread's niceness
    except OSError:
        return False
    libc, set_nr, _ = sc
    runtime_ns = min(max(slice_us, SLICE_MIN_US), SLICE_MAX_US) * 1000 if slice_us > 0 else 0
    attr = _ATTR.pack(_ATTR.size, os.SCHED_OTHER, 0, nice, 0, runtime_ns, 0, 0, 0, 0)
    return bool(libc.syscall(set_nr, tid, ctypes.create_string_buffer(attr, _ATTR.size), 0) == 0)
