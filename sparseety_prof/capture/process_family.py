"""A process and its live descendants (vLLM and SGLang run the GPU in worker processes) as /proc
shows them now, read in one pass for the code that then acts on them (gpu/late_attach.py): each
one's mappings, the process tracing it, and whether it runs in another mount namespace."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from sparseety_prof.capture.proc_maps import MapsEntry, read_maps
from sparseety_prof.capture.process_match import descendants
from sparseety_prof.capture.untrusted_files import in_foreign_mount_ns
from sparseety_prof.errors import NoSuchProcess


@dataclass(frozen=True)
class ProcessView:
    pid: int
    maps: list[MapsEntry]  # in address order
    tracer_pid: int  # the process tracing it (a debugger), 0 for none
    foreign_mount_ns: bool  # in another mount namespace (a container): its paths name other files


def tracer_pid(pid: int, proc: Path = Path("/proc")) -> int:
    """The PID tracing `pid` (/proc/PID/status TracerPid), 0 for none or a process gone."""
    try:
        for line in (proc / str(pid) / "status").read_text().splitlines():
            if line.startswith("TracerPid:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def read_process(pid: int, proc: Path = Path("/proc")) -> ProcessView:
    """`pid` now; NoSuchProcess once it has exited (read_maps)."""
    return ProcessView(pid, read_maps(pid, proc), tracer_pid(pid, proc), in_foreign_mount_ns(pid, proc))


def read_family(pid: int, proc: Path = Path("/proc")) -> list[ProcessView]:
    """`pid` first, then its live descendants; one that exits while read is left out."""
    family = [read_process(pid, proc)]
    for q in descendants(pid, proc):
        if q == pid:
            continue
        try:
            family.append(read_process(q, proc))
        except NoSuchProcess:
            continue
    return family
