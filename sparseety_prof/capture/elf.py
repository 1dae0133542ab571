"""Just enough ELF reading to place uprobes well: virtual address -> file bytes. The files are
the target's: opened as untrusted (capture/untrusted_files.py), never blocking, regular files only."""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import BinaryIO

from sparseety_prof.capture.untrusted_files import open_untrusted


def open_elf(path: Path) -> BinaryIO:
    """The file for reading, once it proved to be a regular file (no FIFO, no /dev/zero)."""
    fd, _ = open_untrusted(path)
    return os.fdopen(fd, "rb")


def load_segments(path: Path) -> list[tuple[int, int, int]]:
    """PT_LOAD segments as (vaddr, file offset, file size)."""
    with open_elf(path) as f:
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
            with open_elf(path) as f:
                f.seek(seg_off + vaddr - seg_vaddr)
                return f.read(n)
    raise ValueError(f"address {vaddr:#x} is not in a loaded segment of {path}")


ENDBR64 = b"\xf3\x0f\x1e\xfa"


def emulated(code: bytes) -> bool:
    """Instructions the x86 uprobe code emulates instead of single-stepping: push reg, nop,
    short/near jcc, jmp and call rel32."""
    if not code:
        return False
    b = code[0]
    if 0x50 <= b <= 0x57 or b in (0x90, 0xE8, 0xE9, 0xEB) or 0x70 <= b <= 0x7F:
        return True
    if len(code) >= 2 and b == 0x41 and 0x50 <= code[1] <= 0x57:  # push r8..r15
        return True
    return len(code) >= 2 and b == 0x0F and 0x80 <= code[1] <= 0x8F  # jcc rel32


def _harmless_len(code: bytes) -> int:
    """Length of a leading instruction that changes no argument register, no stack pointer and
    no memory, so probing after it sees the arguments as at entry; 0 if it is not one of those."""
    if code.startswith(ENDBR64):
        return 4
    # test r64, r64 (REX.W 85 /r, register form) and test r32, r32 (85 /r)
    if len(code) >= 3 and code[0] in (0x48, 0x49, 0x4C, 0x4D) and code[1] == 0x85 and code[2] >= 0xC0:
        return 3
    if len(code) >= 2 and code[0] == 0x85 and code[1] >= 0xC0:
        return 2
    return 0


# Registers of the first four integer arguments (rdi, rsi, rdx, rcx) by ModRM register number
# (REX bit 3 clear): the probes read at most these.
_ARG_REGS = {7, 6, 2, 1}


def _reg(rex: int, field: int, rex_bit: int) -> int:
    return field | (8 if rex & rex_bit else 0)


def _stack_realign_len(code: bytes) -> int:
    """Instructions of gcc's stack-realigning prologue (functions with 32-byte aligned locals) that
    leave the argument registers alone but move the stack pointer: only an entry probe (never a
    return probe, which needs the return address at [rsp]) may be placed after them.
      lea disp8(%rsp),%reg      REX.W 8D /r, mod=01, rm=100 (SIB), SIB base rsp
      and $imm8,%rsp            REX.W 83 /4 ib, rm=rsp
      mov %reg,%reg             REX.W 89 /r, mod=11
      push disp8(%reg)          [REX] FF /6, mod=01"""
    if (
        len(code) >= 5
        and code[0] & 0xF8 == 0x48
        and code[1] == 0x8D
        and code[2] & 0xC7 == 0x44
        and code[3] == 0x24
    ):
        return 5 if _reg(code[0], (code[2] >> 3) & 7, 4) not in _ARG_REGS else 0
    if len(code) >= 4 and code[0] == 0x48 and code[1] == 0x83 and code[2] == 0xE4:
        return 4
    if len(code) >= 3 and code[0] & 0xF8 == 0x48 and code[1] == 0x89 and code[2] >= 0xC0:
        return 3 if _reg(code[0], code[2] & 7, 1) not in _ARG_REGS else 0
    off = 1 if code[:1] and code[0] & 0xF0 == 0x40 else 0
    if len(code) >= off + 3 and code[off] == 0xFF and code[off + 1] & 0xF8 == 0x70:
        return off + 3
    return 0


def cheap_entry_probe_offset(code: bytes) -> int:
    """Like `cheap_probe_offset`, for entry-only probes: may also skip a stack-realigning prologue
    (lea/and/mov/push memory, all single-stepped, the costly kind of hit) up to the first
    `push reg`."""
    off = 0
    for _ in range(8):
        if emulated(code[off:]):
            return off
        n = _harmless_len(code[off:]) or _stack_realign_len(code[off:])
        if n == 0:
            break
        off += n
    return 0


def cheap_probe_offset(code: bytes) -> int:
    """Offset inside a function where a uprobe is cheap and arguments are still intact.

    The kernel emulates `push reg` or a branch (cheap) but single-steps anything else, e.g.
    `endbr64` or `test %rdi,%rdi` (an order of magnitude dearer per hit: docs/overhead.md). When a
    function starts with such a harmless instruction followed by an emulated one, probing at the
    second skips the single-step while every argument register and the return address at [rsp] are
    still as they were at entry.
    """
    off = 0
    for _ in range(2):
        if emulated(code[off:]):
            return off
        n = _harmless_len(code[off:])
        if n == 0:
            break
        off += n
    return 0
