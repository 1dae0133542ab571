"""Call a function inside a running process on one of its threads, as debuggers do (`gdb call`):
PTRACE_SEIZE + PTRACE_INTERRUPT the thread, save its registers (general purpose and the whole
x87/SSE/AVX state) and the stack bytes we write, set up `func(args)` with a return address of 0,
continue, catch the SIGSEGV at address 0, read rax, then restore registers and memory exactly and
detach. x86_64 Linux only (System V calling convention, `user_regs_struct` layout).

Only the stopped thread is traced: the process's other threads run on meanwhile, exactly as if
that thread had made the call itself. Used by gpu/late_attach.py to dlopen the injection library.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import platform
import signal
import time
from dataclasses import dataclass

PTRACE_CONT = 7
PTRACE_DETACH = 17
PTRACE_GETREGS = 12
PTRACE_SETREGS = 13
PTRACE_GETREGSET = 0x4204
PTRACE_SETREGSET = 0x4205
PTRACE_SEIZE = 0x4206
PTRACE_INTERRUPT = 0x4207
PTRACE_EVENT_STOP = 128
NT_PRFPREG = 2
NT_X86_XSTATE = 0x202
WALL = 0x40000000  # __WALL: wait for threads that are not the thread group leader too

#: bytes left untouched below the stopped thread's stack pointer (the System V red zone is 128)
RED_ZONE = 256
#: stack the call may use below what we write (dlopen runs constructors: be generous)
CALL_STACK = 256 << 10
#: largest XSAVE area asked for (AMX tiles make it ~11 KiB)
XSTATE_MAX = 32 << 10

_REG_NAMES = (
    *("r15", "r14", "r13", "r12", "rbp", "rbx", "r11", "r10", "r9", "r8", "rax", "rcx", "rdx", "rsi"),
    *("rdi", "orig_rax", "rip", "cs", "eflags", "rsp", "ss", "fs_base", "gs_base", "ds", "es", "fs", "gs"),
)


class UserRegs(ctypes.Structure):
    _fields_ = [(n, ctypes.c_ulonglong) for n in _REG_NAMES]


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


class PtraceFailed(OSError):
    """A ptrace request failed (errno set); EPERM on seize means tracing is not permitted."""


class CallFailed(Exception):
    """The injected call did not return normally (crashed, timed out, or the thread exited)."""


_libc = ctypes.CDLL(None, use_errno=True)
_ptrace = _libc.ptrace
_ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
_ptrace.restype = ctypes.c_long


def supported() -> bool:
    return platform.machine() == "x86_64"


def _req(request: int, tid: int, addr: int | None = None, data: object = None) -> None:
    ctypes.set_errno(0)
    if _ptrace(request, tid, addr, data) == -1:
        e = ctypes.get_errno()
        raise PtraceFailed(e, f"ptrace({request:#x}, {tid}): {os.strerror(e)}")


@dataclass
class CallResult:
    value: int  # rax
    seconds: float


class StoppedThread:
    """One thread of `pid`, seized and stopped, with its state saved; `restore_and_detach`
    puts everything back. Every ptrace request must come from the Python thread that seized."""

    def __init__(self, pid: int, tid: int) -> None:
        self.pid, self.tid = pid, tid
        self._attached = False
        _req(PTRACE_SEIZE, tid, 0, 0)
        self._attached = True
        try:
            self.stop()
            self.saved = self.get_regs()
            self._xstate_note, self._xstate = self._get_fpu()
        except BaseException:
            self.detach()
            raise
        self._mem_saved: list[tuple[int, bytes]] = []

    # ---------------------------------------------------------------- stopping and waiting

    def stop(self) -> None:
        """PTRACE_INTERRUPT and wait for the interrupt stop; signals arriving first go through."""
        _req(PTRACE_INTERRUPT, self.tid)
        while True:
            status = self._wait(5.0)
            if status is None:
                raise CallFailed(f"thread {self.tid} did not stop within 5 s")
            if os.WSTOPSIG(status) == signal.SIGTRAP and status >> 16 == PTRACE_EVENT_STOP:
                return
            _req(PTRACE_CONT, self.tid, 0, os.WSTOPSIG(status))  # a signal for the program: deliver

    def resume_briefly(self, seconds: float) -> None:
        """Let the thread run a moment, then stop it again (to catch it at a better place)."""
        _req(PTRACE_CONT, self.tid, 0, 0)
        time.sleep(seconds)
        self.stop()
        self.saved = self.get_regs()
        self._xstate_note, self._xstate = self._get_fpu()

    def _wait(self, timeout: float) -> int | None:
        """The next stop status of the thread, None on timeout; CallFailed when it exited."""
        deadline = time.monotonic() + timeout
        delay = 0.0002
        while True:
            try:
                got, status = os.waitpid(self.tid, os.WNOHANG | WALL)
            except ChildProcessError:
                self._attached = False
                raise CallFailed(f"thread {self.tid} is gone") from None
            if got == self.tid:
                if os.WIFEXITED(status) or os.WIFSIGNALED(status):
                    self._attached = False
                    raise CallFailed(f"thread {self.tid} exited (status {status:#x})")
                return status
            if time.monotonic() > deadline:
                return None
            time.sleep(delay)
            delay = min(delay * 2, 0.01)

    # ---------------------------------------------------------------- registers and memory

    def get_regs(self) -> UserRegs:
        r = UserRegs()
        _req(PTRACE_GETREGS, self.tid, 0, ctypes.addressof(r))
        return r

    def set_regs(self, r: UserRegs) -> None:
        _req(PTRACE_SETREGS, self.tid, 0, ctypes.addressof(r))

    def _get_fpu(self) -> tuple[int, ctypes.Array[ctypes.c_char]]:
        """The full XSAVE area (x87, SSE, AVX, AVX-512, ...), else the FXSAVE area: the call
        clobbers vector registers that the interrupted code may still hold live values in."""
        for note, size in ((NT_X86_XSTATE, XSTATE_MAX), (NT_PRFPREG, 512)):
            buf = ctypes.create_string_buffer(size)
            iov = _IoVec(ctypes.addressof(buf), size)
            try:
                _req(PTRACE_GETREGSET, self.tid, note, ctypes.addressof(iov))
            except PtraceFailed as e:
                if e.errno in (errno.EINVAL, errno.ENODEV):
                    continue
                raise
            return note, ctypes.create_string_buffer(buf.raw[: iov.len], iov.len)
        raise PtraceFailed(errno.EINVAL, "no floating-point register set readable")

    def _set_fpu(self) -> None:
        iov = _IoVec(ctypes.addressof(self._xstate), len(self._xstate))
        _req(PTRACE_SETREGSET, self.tid, self._xstate_note, ctypes.addressof(iov))

    def read_mem(self, addr: int, n: int) -> bytes:
        fd = os.open(f"/proc/{self.pid}/mem", os.O_RDONLY | os.O_CLOEXEC)
        try:
            return os.pread(fd, n, addr)
        finally:
            os.close(fd)

    def read_cstring(self, addr: int, limit: int = 4096) -> str:
        raw = self.read_mem(addr, limit)
        return raw.split(b"\0", 1)[0].decode("utf-8", "replace")

    def _write_mem(self, addr: int, data: bytes) -> None:
        fd = os.open(f"/proc/{self.pid}/mem", os.O_RDWR | os.O_CLOEXEC)
        try:
            if os.pwrite(fd, data, addr) != len(data):
                raise OSError(errno.EIO, f"short write into PID {self.pid} at {addr:#x}")
        finally:
            os.close(fd)

    # ---------------------------------------------------------------- the call

    @property
    def in_syscall(self) -> bool:
        """Stopped inside a system call (orig_rax holds its number), not in user code."""
        return self.saved.orig_rax != 2**64 - 1

    def call(self, func: int, args: list[int | bytes], *, timeout: float) -> CallResult:
        """`func(*args)` on this thread. A bytes argument is copied below the red zone of the
        thread's stack and passed as a pointer to it. Registers and the bytes written are put back
        by `restore_and_detach`, whatever happens here."""
        if len(args) > 6:
            raise ValueError("at most 6 arguments (the register ones)")
        sp = self.saved.rsp - RED_ZONE
        values: list[int] = []
        blobs: list[tuple[int, bytes]] = []
        for a in args:
            if isinstance(a, bytes):
                sp = (sp - len(a)) & ~15
                blobs.append((sp, a))
                values.append(sp)
            else:
                values.append(a)
        sp = (sp & ~15) - 8  # at the callee's entry rsp + 8 is 16-aligned, as after a `call`
        blobs.append((sp, b"\0" * 8))  # return address 0: the return faults, and we catch it
        low = sp
        high = self.saved.rsp - RED_ZONE
        self._mem_saved.append((low, self.read_mem(low, high - low)))
        for addr, data in blobs:
            self._write_mem(addr, data)
        r = UserRegs.from_buffer_copy(bytes(self.saved))
        for reg, v in zip(("rdi", "rsi", "rdx", "rcx", "r8", "r9"), values, strict=False):
            setattr(r, reg, v & (2**64 - 1))
        r.rip, r.rsp, r.rax = func, sp, 0
        r.orig_rax = 2**64 - 1  # not in a system call any more: no syscall restart on resume
        r.eflags &= ~0x400  # the ABI wants the direction flag clear at a call
        self.set_regs(r)
        t0 = time.monotonic()
        _req(PTRACE_CONT, self.tid, 0, 0)
        deadline = t0 + timeout
        while True:
            status = self._wait(max(0.0, deadline - time.monotonic()))
            if status is None:
                # stop it again, so that restore_and_detach can put the saved state back
                with contextlib.suppress(CallFailed, PtraceFailed):
                    self.stop()
                raise CallFailed(
                    f"the call in thread {self.tid} did not return within {timeout:g} s (a lock held "
                    "where the thread was stopped?)"
                )
            sig = os.WSTOPSIG(status)
            if status >> 16 == PTRACE_EVENT_STOP:  # group stop (SIGSTOP to the process): go on
                _req(PTRACE_CONT, self.tid, 0, 0)
                continue
            if sig == signal.SIGSEGV:
                now = self.get_regs()
                if now.rip == 0 and now.rsp == sp + 8:
                    return CallResult(int(now.rax), time.monotonic() - t0)
                raise CallFailed(f"the call faulted in thread {self.tid} at {now.rip:#x}")
            _req(PTRACE_CONT, self.tid, 0, sig)  # the program's own signal: its handler runs on top

    def restore_and_detach(self) -> None:
        """Memory, then registers, then the vector state, exactly as saved; detach suppressing the
        SIGSEGV of the return (the thread resumes what it was doing, system call included)."""
        if not self._attached:
            return
        try:
            for addr, data in reversed(self._mem_saved):
                self._write_mem(addr, data)
            self._mem_saved = []
            self.set_regs(self.saved)
            self._set_fpu()
        finally:
            self.detach()

    def detach(self) -> None:
        if self._attached:
            self._attached = False
            try:
                _req(PTRACE_DETACH, self.tid, 0, 0)
            except PtraceFailed as e:
                if e.errno != errno.ESRCH:
                    raise
