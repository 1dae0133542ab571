"""Late attach: load the CUPTI injection library into a CUDA process that is already running
(started without CUDA_INJECTION64_PATH), by calling dlopen and then the library's
`SparseetyLateAttach(settings)` on one of its threads through ptrace (gpu/ptrace_call.py).
x86_64 Linux, glibc >= 2.34 targets (dlopen lives in libc.so.6 there) only.

Refusals, each with its own exit code: ptrace not permitted (PtraceNotPermitted, 12); a target that
cannot load the library (InjectionRefused, 13): no libc.so.6 mapped (statically linked), no dlopen
in its libc, another mount namespace (the library path would name another file there: refused, not
guessed), not x86_64. A process without libcuda mapped is not a CUDA process: nothing is injected
and the caller records what it can without the GPU side. A process that already has a ring (started
under `launch`, or attached before) keeps it: nothing is injected again.

The library the target loads is a copy in a root-owned directory (RUN_DIR, 0755; the file 0644,
named by its sha256): the target runs code from a file only root could have written.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from sparseety_prof.capture.elf import load_segments
from sparseety_prof.capture.proc_maps import MapsEntry, read_maps
from sparseety_prof.capture.process_family import ProcessView, read_family
from sparseety_prof.capture.target import check_process, elf_symbols
from sparseety_prof.errors import InjectionRefused, MissingPrivileges, PtraceNotPermitted
from sparseety_prof.gpu import ptrace_call
from sparseety_prof.gpu.launch import find_libcupti
from sparseety_prof.gpu.shm_ring import ring_mappings

RUN_DIR = Path("/run/sparseety-prof")
#: the library's settings (cupti_ext/README.md) a late attach takes from sparseety-prof's own
#: environment, as a launched engine would have inherited them
SETTINGS = tuple(
    f"SPARSEETY_{n}"
    for n in (
        *("WATCH", "WATCH_FILE", "SAMPLE_EVERY", "BUFFER_BYTES_PER_S", "STAGING_BYTES", "RING_BYTES"),
        *("FLUSH_MS", "ACTIVITY_BUFFER_BYTES", "SHM_NAME", "CUPTI_PATH", "CUDA_PATH"),
    )
)
YAMA_SCOPE = Path("/proc/sys/kernel/yama/ptrace_scope")
CAP_SYS_PTRACE = 19
RTLD_NOW = 2
ENTRY = "SparseetyLateAttach"
#: settings text passed to the library (its copy is 16 KiB)
MAX_SETTINGS = 16383
#: tries at stopping a thread outside libc's and the loader's own code (locks they may hold)
STOP_TRIES = 100
CALL_TIMEOUT_S = 20.0

#: what a late attach cannot see, said at attach time and kept in meta.json (gpu.late_attach)
NOT_SEEN = (
    "kernels launched before the attach (also those still running on the GPU at that moment), memory "
    "copies before it, and launches of CUDA graphs instantiated before it are not recorded as launches "
    "until replayed after the attach; the kernel activity of graph replays after the attach is recorded "
    "as CUPTI delivers it (graph and node ids), but the graphs' kernel arguments are not read"
)

_LIBC = re.compile(r"/libc(\.so\.6|-2\.\d+\.so)$")
_LIBCUDA = re.compile(r"/libcuda\.so(\.\d+)*$")
_LIBCUPTI = re.compile(r"/libcupti\.so(\.[\d.]+)*$")
_LOADER = re.compile(r"/ld-linux-x86-64\.so\.2$|/ld-2\.\d+\.so$")


@dataclass
class LateAttach:
    """What happened: `injected` (the library was loaded now into at least one process),
    `message` for the user."""

    injected: bool
    message: str


def _effective_caps() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return int(line.split()[1], 16)
    return 0


def _privilege_hint() -> str:
    return (
        "late attach needs CAP_SYS_PTRACE (root; in a container --cap-add SYS_PTRACE) and a Yama "
        "ptrace_scope below 3"
    )


def check_ptrace_allowed() -> None:
    """Refuse before touching the target when this machine will not let us trace a process (a
    target already traced is refused by _refuse_traced)."""
    try:
        scope: int | None = int(YAMA_SCOPE.read_text().strip())
    except FileNotFoundError:
        scope = None  # no Yama: the classic ptrace rules (same user, or CAP_SYS_PTRACE)
    if scope is not None and scope >= 3:
        raise PtraceNotPermitted(
            f"Yama forbids ptrace on this machine ({YAMA_SCOPE} = {scope}; it cannot be lowered "
            "until a reboot): late attach is impossible, start the engine under `sparseety-prof launch`"
        )
    if not _effective_caps() >> CAP_SYS_PTRACE & 1:
        where = f"Yama ptrace_scope {scope}" if scope is not None else "no Yama module"
        raise PtraceNotPermitted(f"this process lacks CAP_SYS_PTRACE ({where}): {_privilege_hint()}")


def _refuse_traced(process: ProcessView) -> None:
    if process.tracer_pid:
        raise PtraceNotPermitted(
            f"PID {process.pid} is already traced by PID {process.tracer_pid} (a debugger?): detach it first"
        )


def _check_x86_64(pid: int) -> None:
    if not ptrace_call.supported():
        raise InjectionRefused("late attach is implemented for x86_64 only")
    try:
        with open(f"/proc/{pid}/exe", "rb") as f:
            head = f.read(20)
    except OSError as e:
        raise InjectionRefused(f"cannot read the executable of PID {pid}: {e.strerror}") from None
    if head[:4] != b"\x7fELF" or head[4] != 2 or int.from_bytes(head[18:20], "little") != 62:
        raise InjectionRefused(f"PID {pid} is not an x86_64 ELF program: late attach is x86_64 only")


def _mapped_file(maps: list[MapsEntry], pattern: re.Pattern[str]) -> MapsEntry | None:
    """The offset-0 mapping of the first file matching `pattern` (its load address)."""
    for m in maps:
        if m.offset == 0 and pattern.search(m.path):
            return m
    return None


def _symbol_address(pid: int, lib: MapsEntry, names: tuple[str, ...]) -> int | None:
    """Run-time address of the first of `names` defined in the mapped library `lib`."""
    path = Path(lib.path)
    st = path.stat()
    if st.st_ino != lib.inode:
        raise InjectionRefused(
            f"{lib.path} on disk is not the file PID {pid} mapped (replaced since, e.g. by an upgrade)"
        )
    offset = _symbol_offset(path, names)
    return None if offset is None else lib.start + offset


def _symbol_offset(path: Path, names: tuple[str, ...]) -> int | None:
    """Offset of the first of `names` from the library's load address (its offset-0 mapping)."""
    syms = elf_symbols(path)
    # nm -D names versioned symbols `name@@VERSION` (the default one) and `name@VERSION`
    by_name = {k.split("@", 1)[0]: v for k, v in sorted(syms.items(), key=lambda kv: "@@" in kv[0])}
    addr = next((by_name[n][0] for n in names if n in by_name), None)
    if addr is None:
        return None
    first_load = min(vaddr for vaddr, _off, _size in load_segments(path)) & ~0xFFF
    return addr - first_load


def install_library(library: Path, run_dir: Path = RUN_DIR) -> Path:
    """A copy of `library` that only root can have written: `run_dir` (root-owned, 0755, created
    if missing) / libsparseety_cupti-<sha256 prefix>.so, mode 0644."""
    if os.geteuid() != 0:
        raise MissingPrivileges("late attach runs as root (sudo): the library copy must be root's")
    data = library.read_bytes()
    digest = hashlib.sha256(data).hexdigest()[:16]
    run_dir.mkdir(mode=0o755, exist_ok=True)
    for d in (run_dir, *run_dir.parents):
        st = os.lstat(d)
        loose = not stat.S_ISDIR(st.st_mode) or st.st_uid != 0 or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
        if loose and (d == run_dir or not st.st_mode & stat.S_ISVTX):  # a sticky parent (/tmp) is fine
            raise InjectionRefused(f"{d} is not a root-owned directory only root writes: not used")
    os.chmod(run_dir, 0o755)
    dest = run_dir / f"libsparseety_cupti-{digest}.so"
    if (
        dest.is_file()
        and not dest.is_symlink()
        and hashlib.sha256(dest.read_bytes()).hexdigest()[:16] == digest
    ):
        return dest
    fd, tmp = tempfile.mkstemp(dir=run_dir, prefix=".lib-")
    try:
        os.write(fd, data)
        os.fchmod(fd, 0o644)
        os.close(fd)
        os.replace(tmp, dest)
    except BaseException:
        os.unlink(tmp)
        raise
    return dest


def settings_text(settings: dict[str, str]) -> bytes:
    for k, v in settings.items():
        if not re.fullmatch(r"SPARSEETY_[A-Z0-9_]+", k) or "\n" in v or "\0" in v:
            raise InjectionRefused(f"setting {k!r} cannot be passed to the library")
    text = "".join(f"{k}={v}\n" for k, v in settings.items()).encode()
    if len(text) > MAX_SETTINGS:
        raise InjectionRefused(
            f"the settings for the library are too long ({len(text)} > {MAX_SETTINGS} bytes)"
        )
    return text + b"\0"


def _stopped_thread(pid: int, maps: list[MapsEntry]) -> ptrace_call.StoppedThread:
    """Seize a thread stopped at a safe place: inside a system call, or in code that is neither
    libc's nor the loader's (which may hold the malloc or loader locks dlopen needs), with CALL_STACK
    bytes of its stack mapping below the stack pointer. The main thread first."""
    unsafe = [(m.start, m.end) for m in maps if _LIBC.search(m.path) or _LOADER.search(m.path)]
    tids = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))
    tids.sort(key=lambda t: t != pid)
    for tid in tids:
        try:
            th = ptrace_call.StoppedThread(pid, tid)
        except ptrace_call.PtraceFailed as e:
            if e.errno == 1:  # EPERM
                raise PtraceNotPermitted(f"ptrace(PTRACE_SEIZE) of PID {pid}: {_privilege_hint()}") from None
            continue  # the thread exited meanwhile
        except ptrace_call.CallFailed:
            continue
        ok = False
        try:
            for _ in range(STOP_TRIES):
                rip, rsp = th.saved.rip, th.saved.rsp
                in_lib = any(a <= rip < b for a, b in unsafe)
                stack = next((m for m in maps if m.start <= rsp < m.end), None)
                # the main thread's [stack] grows on demand; a thread's stack is a fixed mapping
                if (
                    stack is not None
                    and stack.path != "[stack]"
                    and rsp - stack.start < ptrace_call.CALL_STACK
                ):
                    break  # too little stack below: another thread
                if th.in_syscall or not in_lib:
                    ok = stack is not None
                    break
                th.resume_briefly(0.002)
        finally:
            if not ok:
                th.detach()
        if ok:
            return th
    raise InjectionRefused(f"no thread of PID {pid} could be stopped at a safe place for the call")


def late_attach(
    pid: int,
    library: Path,
    settings: dict[str, str],
    *,
    log: Callable[[str], None],
    run_dir: Path = RUN_DIR,
) -> LateAttach:
    """Make sure `pid` and those of its descendants that are CUDA processes (vLLM/SGLang run the
    GPU in worker processes) publish to CUPTI rings: a process with a ring keeps it, one that maps
    libcuda without one receives the library; nothing happens when none of them is a CUDA
    process. A refusal stops at the process refused (those before it keep their library). The
    processes are read once, before anything is done to them (capture/process_family.py)."""
    check_process(pid)
    check_ptrace_allowed()
    family = read_family(pid)
    target = family[0]
    _refuse_traced(target)
    with_ring = {p.pid for p in family if ring_mappings(p.maps)}
    if _mapped_file(target.maps, _LIBC) is None and not with_ring:
        raise InjectionRefused(
            f"PID {pid} maps no libc.so.6 (statically linked, or not glibc): it has no dlopen to load the "
            "library with; run without --late-attach to record what the eBPF probes see"
        )
    cuda_procs = [p for p in family if p.pid not in with_ring and _mapped_file(p.maps, _LIBCUDA) is not None]
    if not cuda_procs:
        if with_ring:
            pids = ", ".join(map(str, sorted(with_ring)))
            return LateAttach(False, f"PID(s) {pids} already publish to a CUPTI ring: using it")
        return LateAttach(
            False,
            f"PID {pid} has no libcuda loaded (not a CUDA process, nor its children): no GPU side to record",
        )
    lib = install_library(library, run_dir)
    states = [_inject(p, lib, settings, log) for p in cuda_procs]
    return LateAttach(True, "; ".join(states))


def _inject(process: ProcessView, lib: Path, settings: dict[str, str], log: Callable[[str], None]) -> str:
    """Load `lib` into the CUDA process `process` and call its entry point; the outcome in words."""
    pid, maps = process.pid, process.maps
    _refuse_traced(process)
    _check_x86_64(pid)
    libc, cuda = _mapped_file(maps, _LIBC), _mapped_file(maps, _LIBCUDA)
    if libc is None or cuda is None:
        raise InjectionRefused(
            f"PID {pid} maps libcuda but no libc.so.6: it has no dlopen to load the library with"
        )
    if process.foreign_mount_ns:
        raise InjectionRefused(
            f"PID {pid} runs in another mount namespace (a container): the library path would name another "
            "file there, so nothing is loaded; run sparseety-prof inside that namespace, or start the "
            "engine under `sparseety-prof launch`"
        )
    dlopen = _symbol_address(pid, libc, ("dlopen",))
    dlerror = _symbol_address(pid, libc, ("dlerror",))
    if dlopen is None or dlerror is None:
        raise InjectionRefused(f"{libc.path} of PID {pid} has no dlopen (glibc older than 2.34)")
    given = dict(settings)
    given.setdefault("SPARSEETY_CUDA_PATH", cuda.path)  # the very driver it runs with
    cupti = _mapped_file(maps, _LIBCUPTI)
    if cupti is not None:  # e.g. torch loads libcupti for Kineto: the same copy, not a second one
        given.setdefault("SPARSEETY_CUPTI_PATH", cupti.path)
    elif (wheel := find_libcupti()) is not None:  # as `launch` does
        given.setdefault("SPARSEETY_CUPTI_PATH", str(wheel))
    text = settings_text(given)
    entry_offset = _symbol_offset(lib, (ENTRY,))  # read now: nm is slow, the thread waits for nothing
    if entry_offset is None:
        raise InjectionRefused(f"{lib} has no {ENTRY}: rebuild it (`sparseety-prof build-cupti`)")

    t0 = time.monotonic()
    th = _stopped_thread(pid, maps)
    try:
        handle = th.call(dlopen, [str(lib).encode() + b"\0", RTLD_NOW], timeout=CALL_TIMEOUT_S).value
        if handle == 0:
            err = th.call(dlerror, [], timeout=CALL_TIMEOUT_S).value
            why = th.read_cstring(err) if err else "unknown error"
            raise InjectionRefused(f"dlopen of {lib} in PID {pid} failed: {why}")
        loaded = _mapped_file(read_maps(pid), re.compile(re.escape(str(lib)) + "$"))
        if loaded is None:
            raise InjectionRefused(f"dlopen of {lib} in PID {pid} returned, but the library is not mapped")
        rc = th.call(loaded.start + entry_offset, [text], timeout=CALL_TIMEOUT_S).value
    except ptrace_call.CallFailed as e:
        raise InjectionRefused(f"the call into PID {pid} failed: {e}") from None
    except ptrace_call.PtraceFailed as e:
        raise InjectionRefused(f"ptrace on PID {pid} failed: {e.strerror}") from None
    finally:
        th.restore_and_detach()
    held_ms = (time.monotonic() - t0) * 1e3
    rc32 = rc & 0xFFFFFFFF  # an int return: only eax is defined
    rc32 = rc32 - 2**32 if rc32 >= 2**31 else rc32
    # its own ring, by the name it maps (a process in another mount namespace was refused above)
    rings = [m.path for m in ring_mappings(read_maps(pid))]
    if rc32 == -1 or not rings:
        raise InjectionRefused(
            f"the library loaded into PID {pid} could not create its ring (its stderr says why)"
        )
    state = {
        1: "CUPTI subscribed",
        0: "CUPTI not subscribed (the ring's errors say why)",
        2: "it was already initialised",
    }.get(rc32, f"returned {rc32}")
    log(
        f"sparseety-prof: late attach to PID {pid} (thread {th.tid} held {held_ms:.1f} ms): "
        f"{lib.name} loaded, {state}, ring {rings[0]}. Not seen: {NOT_SEEN}."
    )
    return f"PID {pid}: {state}"
