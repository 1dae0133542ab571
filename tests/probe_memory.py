"""Where a uprobe sits in a process's memory, and the byte there (0xcc: int3, the breakpoint the
kernel puts in while any uprobe is attached at that instruction). Used by the duty cycle's test
and scripts/bench_probe_switch.py to see whether a probe is really out of the engine's code."""

from __future__ import annotations

import os
from pathlib import Path

from sparseety_prof.capture.bpf_loader import AttachedProbe
from sparseety_prof.capture.elf import load_segments
from sparseety_prof.capture.proc_maps import read_maps

INT3 = b"\xcc"


def runtime_address(pid: int, p: AttachedProbe) -> int:
    """The address of the probed instruction in process `pid`'s memory."""
    lib = os.path.realpath(p.library)
    file_offset = next(
        off + p.address - vaddr
        for vaddr, off, size in load_segments(Path(lib))
        if vaddr <= p.address < vaddr + size
    )
    for m in read_maps(pid):
        inside = m.offset <= file_offset < m.offset + m.end - m.start
        if inside and m.file_backed and os.path.realpath(m.path) == lib:
            return m.start + file_offset - m.offset
    raise LookupError(f"{lib} offset {file_offset:#x} is not mapped in {pid}")


def byte_at(pid: int, address: int) -> bytes:
    """The byte at `address` in process `pid`'s memory now (unbuffered: a buffered reader would
    answer a later read within its buffer from memory)."""
    with open(f"/proc/{pid}/mem", "rb", buffering=0) as m:
        m.seek(address)
        return m.read(1)
