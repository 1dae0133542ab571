"""Where the recorder's threads run (`--recorder-cpus auto|none|LIST`).

Production hosts often leave the engine a core short of the machine (a CPU affinity: taskset,
cpuset, a container's cpus, systemd's CPUAffinity=). The recorder then runs best on a core the
engine may not use: it never takes the engine's CPU, and it is not starved by it either. `auto`
reads the engine's affinity, its threads' own (a thread may be pinned apart from its process),
and the cores its threads ran on last; it pins every thread of the recorder to the cores the
recorder may use that no engine thread may. When the engine may run everywhere the recorder
may, nothing is pinned and the recorder relies on its low priority (`--nice`, `--sched idle`:
session/sched.py). The cores the engine ran on last are recorded as evidence only: an unpinned
thread moves, so a core it left a moment ago is no free core.

Threads made later take the affinity of the thread that makes them (clone keeps it), so the
recorder's main thread is pinned first and every thread then present once more after attaching.
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparseety_prof.checks import Check
from sparseety_prof.errors import UsageError
from sparseety_prof.session.thread_priority import thread_ids

#: --recorder-cpus values other than a list of cores
PLACEMENT_MODES = ("auto", "none")
# /proc/PID/task/TID/stat: fields after the command's ")" start at field 3; "processor" is 39
_PROCESSOR_FIELD = 39 - 3


def parse_cpu_list(text: str) -> frozenset[int]:
    """A kernel CPU list ("0-2,5", as in Cpus_allowed_list or taskset -c) as a set of cores;
    ValueError for anything else."""
    cores: set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            raise ValueError(f"empty item in CPU list {text!r}")
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"not a CPU list item: {part!r}")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise ValueError(f"descending CPU range {part!r}")
        cores.update(range(first, last + 1))
    return frozenset(cores)


def cpu_list_text(cores: frozenset[int] | set[int] | tuple[int, ...]) -> str:
    """The kernel's compact form of a set of cores ({0, 1, 2, 5} -> "0-2,5")."""
    out: list[str] = []
    run: list[int] = []
    for c in sorted(cores):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [c]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def parse_recorder_cpus(text: str) -> str:
    """--recorder-cpus checked: "auto", "none" or a CPU list (kept as text, normalised);
    UsageError otherwise."""
    if text in PLACEMENT_MODES:
        return text
    try:
        cores = parse_cpu_list(text)
    except ValueError as e:
        raise UsageError(f"--recorder-cpus must be auto, none or a CPU list such as 1 or 2-3: {e}") from None
    return cpu_list_text(cores)


@dataclass(frozen=True)
class EngineCpus:
    """The cores an engine process may run on and ran on last."""

    process: frozenset[int]  # the process's affinity (its main thread's)
    threads: frozenset[int]  # every core one of its threads may run on (their affinities' union)
    ran_on: frozenset[int]  # the cores its threads ran on last (/proc/.../stat "processor")
    n_threads: int


def read_engine_cpus(pid: int) -> EngineCpus:
    """The engine's affinities as the kernel holds them now; OSError when the process is gone or
    not ours to read. A thread that ends while it is read is left out."""
    process = frozenset(os.sched_getaffinity(pid))
    allowed: set[int] = set()
    ran_on: set[int] = set()
    n = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError, ValueError, IndexError):
            status = (task / "status").read_text()
            stat = (task / "stat").read_text()
            line = next(ln for ln in status.splitlines() if ln.startswith("Cpus_allowed_list:"))
            allowed |= parse_cpu_list(line.split(":", 1)[1])
            ran_on.add(int(stat.rsplit(")", 1)[1].split()[_PROCESSOR_FIELD]))
            n += 1
    return EngineCpus(process, frozenset(allowed) or process, frozenset(ran_on), n)


@dataclass(frozen=True)
class Placement:
    """What --recorder-cpus decided: the cores the recorder's threads are pinned to (None: not
    pinned, left to the scheduler at the recorder's low priority), and why."""

    asked: str  # auto, none or a CPU list
    cores: frozenset[int] | None
    reason: str
    recorder_allowed: frozenset[int]
    engine: EngineCpus | None = None

    def to_meta(self) -> dict[str, Any]:
        e = self.engine
        return {
            "asked": self.asked,
            "pinned": None if self.cores is None else cpu_list_text(self.cores),
            "reason": self.reason,
            "recorder_allowed": cpu_list_text(self.recorder_allowed),
            "engine_allowed": None if e is None else cpu_list_text(e.process),
            "engine_threads_allowed": None if e is None else cpu_list_text(e.threads),
            "engine_ran_on": None if e is None else cpu_list_text(e.ran_on),
            "engine_threads": None if e is None else e.n_threads,
        }

    def line(self) -> str:
        """One line for the log and `doctor`."""
        where = "not pinned" if self.cores is None else f"on core(s) {cpu_list_text(self.cores)}"
        return f"recorder {where}: {self.reason}"


def decide(asked: str, recorder_allowed: frozenset[int], engine: EngineCpus | None) -> Placement:
    """The placement for `asked` (auto, none or a CPU list, as parse_recorder_cpus gives it),
    the cores this process may use and the engine's (None: unreadable). Pure: no system call."""
    if asked == "none":
        return Placement(asked, None, "--recorder-cpus none: left to the scheduler", recorder_allowed, engine)
    if asked != "auto":
        cores = parse_cpu_list(asked) & recorder_allowed
        if not cores:
            raise UsageError(
                f"--recorder-cpus {asked}: none of these cores is allowed to the recorder "
                f"(it may use {cpu_list_text(recorder_allowed)})"
            )
        shared = engine is not None and bool(cores & engine.threads)
        reason = "as asked" + ("; the engine may run there too" if shared else "")
        return Placement(asked, cores, reason, recorder_allowed, engine)
    if engine is None:
        return Placement(asked, None, "the engine's affinity is unreadable: low priority", recorder_allowed)
    free = recorder_allowed - engine.threads
    if free:
        why = f"no engine thread may run there (the engine's threads may use {cpu_list_text(engine.threads)})"
        return Placement(asked, free, why, recorder_allowed, engine)
    why = (
        f"the engine may run on every core the recorder may ({cpu_list_text(engine.threads)}): "
        "low priority instead"
    )
    return Placement(asked, None, why, recorder_allowed, engine)


class _AllowedAtStart:
    """The cores this process could use before it pinned itself: a follower (--follow) places
    itself again for each engine it attaches to, and must choose among the cores it had, not
    among those the last engine left it."""

    cores: frozenset[int] | None = None

    @classmethod
    def get(cls) -> frozenset[int]:
        if cls.cores is None:
            cls.cores = frozenset(os.sched_getaffinity(0))
        return cls.cores


def place_recorder(asked: str, pid: int) -> Placement:
    """Decide for the engine `pid` and pin this process's threads accordingly (back to the
    cores it started with when the decision pins nothing)."""
    try:
        engine: EngineCpus | None = read_engine_cpus(pid)
    except OSError:
        engine = None
    allowed = _AllowedAtStart.get()
    placement = decide(asked, allowed, engine)
    pin_threads(allowed if placement.cores is None else placement.cores)
    return placement


def pin_threads(cores: frozenset[int]) -> int:
    """Pin this thread first (the threads it makes from now on inherit it), then every other
    thread of this process; returns how many were pinned."""
    os.sched_setaffinity(0, cores)
    done = 1
    me = threading.get_native_id()
    for tid in thread_ids():
        if tid == me:
            continue
        with contextlib.suppress(OSError):  # (ended since)
            os.sched_setaffinity(tid, cores)
            done += 1
    return done


def placement_check(pid: int, asked: str = "auto") -> Check:
    """`doctor -p PID`: where `record` would place the recorder next to this engine. Never a
    failure: an engine on every core leaves the recorder its low priority, which works."""
    try:
        engine: EngineCpus | None = read_engine_cpus(pid)
    except OSError as e:
        engine = None
        why = f" (the engine's affinity is unreadable: {e.strerror or e})"
    else:
        why = ""
    p = decide(asked, frozenset(os.sched_getaffinity(0)), engine)
    fix = ""
    if p.cores is None and engine is not None:
        fix = (
            "to give the recorder a core of its own, leave the engine one short of the machine "
            "(taskset -c, systemd CPUAffinity=, a container's cpuset)"
        )
    return Check("recorder placement", True, f"{p.line()}{why}", fix)
