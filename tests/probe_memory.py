"""Where a uprobe sits in a process's memory, and the byte there (0xcc: int3, the breakpoint the
kernel puts in while any uprobe is attached at that instruction). Used by the duty cycle's test
and scripts/bench_probe_switch.py to see whether a probe is really out of the engine's code."""

from __future__ import annotations

import os
from pathlib import Path

from sparseety_prof.capture.bpf_loader import AttachedProbe
from sparseety_prof.capture.elf import load_segments

INT3 = b"\xcc"


def runtime_address(pid: int, p: AttachedProbe) -> int:
    """The address of the probed instruction in process `pid`'s memory."""
    lib = os.path.realpath(p.library)
    file_offset = next(
        off + p.address - vaddr
        for vaddr, off, size in load_segments(Path(lib))
        if vaddr <= p.address < vaddr + size
    )
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        f = line.split()
        if len(f) >= 6 and os.path.realpath(f[5]) == lib:
            lo, hi = (int(x, 16) for x in f[0].split("-"))
            map_offset = int(f[2], 16)
            if map_offset <= file_offset < map_offset + hi - lo:
                return lo + file_offset - map_offset
    raise LookupError(f"{lib} offset {file_offset:#x} is not mapped in {pid}")


def byte_at(pid: int, address: int) -> bytes:
    """The byte at `address` in process `pid`'s memory now (unbuffered: a buffered reader would
    answer a later read within its buffer from memory)."""
    with open(f"/proc/{pid}/mem", "rb", buffering=0) as m:
        m.seek(address)
        return m.read(1)
