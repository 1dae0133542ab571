"""Just enough ELF reading to place uprobes well: virtual address -> file bytes."""

from __future__ import annotations

import struct
from pathlib import Path


def load_segments(path: Path) -> list[tuple[int, int, int]]:
    """PT_LOAD segments as (vaddr, file offset, file size)."""
    with path.open("rb") as f:
        ehdr = f.read(64)
        if ehdr[:4] != b"\x7fELF" or ehdr[4] != 2:
            raise ValueError(f"{path} is not a 64-bit ELF file")
        (e_phoff,) = struct.unpack_from("<Q", ehdr, 0x20)
        e_phentsize, e_phnum = struct.unpack_from("<HH", ehdr, 0x36)
        f.seek(e_phoff)
        ph = f.read(e_phentsize * e_phnum)
    segs = []
    for i in range(e_phnum):
        p_type, _flags, p_offset, p_vaddr, _paddr, p_filesz = struct.unpack_from(
            "<IIQQQQ", ph, i * e_phentsize
        )
        if p_type == 1:
            segs.append((p_vaddr, p_offset, p_filesz))
    return segs


def read_at_vaddr(path: Path, vaddr: int, n: int) -> bytes:
    for seg_vaddr, seg_off, seg_size in load_segments(path):
        if seg_vaddr <= vaddr < seg_vaddr + seg_size:
            with path.open("rb") as f:
                f.seek(seg_off + vaddr - seg_vaddr)
                return f.read(n)
    raise ValueError(f"address {vaddr:#x} is not in a loaded segment of {path}")


ENDBR64 = b"\xf3\x0f\x1e\xfa"


def cheap_probe_offset(code: bytes) -> int:
    """Offset inside a function where a uprobe is cheap and arguments are still intact.

    The kernel emulates `push reg` (0.5-0.7 us per hit) but single-steps `endbr64` (9-14 us).
    When a function starts `endbr64; push reg`, probing at +4 skips the single-step while every
    argument register and the return address at [rsp] are still as they were at entry.
    """
    if code.startswith(ENDBR64):
        rest = code[4:]
        if rest[:1] and 0x50 <= rest[0] <= 0x57:
            return 4
        if len(rest) >= 2 and rest[0] == 0x41 and 0x50 <= rest[1] <= 0x57:
            return 4
    return 0
