"""What the target process is: does it exist, may we trace it, which llama.cpp library files it
really maps, which model file it has open. Pure /proc reading; no BPF here."""

from __future__ import annotations

import errno
import functools
import os
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from .errors import MissingPrivileges, NoSuchProcess, NotAnEngine

# Symbols that make a library a llama.cpp engine library we can probe.
SYM_UBATCH = (
    "_ZN13llama_context14process_ubatchERK12llama_ubatch14llm_graph_type"
    "P22llama_memory_context_iR11ggml_status"
)
SYM_DECODE = "_ZN13llama_context6decodeERK11llama_batch"
SYM_DECODE_EXT = "_ZN13llama_context6decodeERK15llama_batch_ext"
SYM_LLAMA_SAMPLER = "llama_sampler_sample"
SYM_COMMON_SAMPLER = "_Z21common_sampler_sampleP14common_samplerP13llama_contextib"
SYM_LOGITS_ITH = "llama_get_logits_ith"
SYM_SEQ_RM = "llama_memory_seq_rm"
SYM_MEM_CLEAR = "llama_memory_clear"
# where the engine writes a micro-batch's KQ mask (once per kind of mask, before the graph runs)
SYM_KQ_MASK = "_ZNK14llama_kv_cache17set_input_kq_maskEP11ggml_tensorPK12llama_ubatchb"
# ggml CPU graph ops the sparse-decision probes read (libggml-cpu, or linked into the engine)
SYM_GET_ROWS = "ggml_compute_forward_get_rows"
SYM_MUL = "ggml_compute_forward_mul"
SYM_GLU = "ggml_compute_forward_glu"
SYM_SOFT_MAX = "ggml_compute_forward_soft_max"
SYM_FLASH_ATTN = "ggml_compute_forward_flash_attn_ext"
SPARSE_SYMBOLS = (SYM_GET_ROWS, SYM_MUL, SYM_GLU, SYM_SOFT_MAX, SYM_FLASH_ATTN)
# llama-server (built binary, or inside xllamacpp): the request -> task -> slot chain. The server
# context class was renamed server_context -> server_context_impl in 2025; both are probed.
SYM_TASK_POST_ONE = "_ZN12server_queue4postEO11server_taskb"
SYM_TASK_POST_VEC = "_ZN12server_queue4postEOSt6vectorI11server_taskSaIS1_EEb"
SYM_SLOT_RELEASE = "_ZN11server_slot7releaseEv"
SYM_SLOT_LAUNCH = "_ZN19server_context_impl21launch_slot_with_taskER11server_slotO11server_task"
SYM_SLOT_LAUNCH_OLD = "_ZN14server_context21launch_slot_with_taskER11server_slotO11server_task"
SYM_SLOT_LAUNCH_PARENT = (
    "_ZN19server_context_impl29launch_slots_with_parent_task"
    "ER11server_slotRSt6vectorIPS0_SaIS3_EEO11server_task"
)
SYM_PROCESS_TOKEN = "_ZN19server_context_impl13process_tokenER23completion_token_outputR11server_slot"
SYM_PROCESS_TOKEN_OLD = "_ZN14server_context13process_tokenER23completion_token_outputR11server_slot"
SERVER_SYMBOLS = (
    SYM_TASK_POST_ONE,
    SYM_TASK_POST_VEC,
    SYM_SLOT_RELEASE,
    SYM_SLOT_LAUNCH,
    SYM_SLOT_LAUNCH_OLD,
    SYM_SLOT_LAUNCH_PARENT,
    SYM_PROCESS_TOKEN,
    SYM_PROCESS_TOKEN_OLD,
)


@dataclass(frozen=True)
class MappedLib:
    path: Path
    inode: int


@dataclass
class Target:
    pid: int
    exe: str
    cmdline: list[str]
    libs: list[MappedLib] = field(default_factory=list)
    model_paths: list[Path] = field(default_factory=list)


def check_process(pid: int) -> None:
    """Fail with a clear message when the PID is wrong or we may not look at it."""
    if pid <= 0:
        raise NoSuchProcess(f"invalid PID {pid}: give the process id of a running engine")
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        raise NoSuchProcess(f"no process with PID {pid} (did the engine exit?)") from None
    except PermissionError:
        raise MissingPrivileges(
            f"PID {pid} belongs to another user and you may not trace it: run as root, e.g.\n"
            f'  sudo env "PATH=$PATH" sparseety-prof record --pid {pid} ...'
        ) from None


def check_privileges() -> None:
    """BPF uprobes need CAP_BPF + CAP_PERFMON (or CAP_SYS_ADMIN); test the effective set."""
    caps = _effective_caps()
    cap_sys_admin, cap_perfmon, cap_bpf = 21, 38, 39
    has = lambda bit: bool(caps >> bit & 1)  # noqa: E731
    if has(cap_sys_admin) or (has(cap_bpf) and has(cap_perfmon)):
        return
    hint = (
        "already root but capabilities are missing: in a container add --cap-add BPF --cap-add PERFMON "
        "(or --privileged)"
        if os.geteuid() == 0
        else 'run it as root: sudo env "PATH=$PATH" sparseety-prof ...'
    )
    raise MissingPrivileges(
        f"attaching eBPF uprobes needs CAP_BPF and CAP_PERFMON (or CAP_SYS_ADMIN); {hint}"
    )


def _effective_caps() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return int(line.split()[1], 16)
    return 0


def _read_maps(pid: int) -> list[tuple[str, int]]:
    try:
        text = Path(f"/proc/{pid}/maps").read_text()
    except FileNotFoundError:
        raise NoSuchProcess(f"no process with PID {pid} (did the engine exit?)") from None
    except PermissionError:
        raise MissingPrivileges(f"cannot read /proc/{pid}/maps: run as root (sudo)") from None
    out = []
    for line in text.splitlines():
        parts = line.split(None, 5)
        if len(parts) == 6 and parts[5].startswith("/"):
            out.append((parts[5], int(parts[4])))
    return out


def inspect(pid: int) -> Target:
    check_process(pid)
    maps = _read_maps(pid)
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
    except OSError as e:
        if e.errno == errno.ENOENT:
            raise NoSuchProcess(f"no process with PID {pid} (did the engine exit?)") from None
        raise MissingPrivileges(f"cannot inspect PID {pid}: {e.strerror}; run as root (sudo)") from None
    libs: list[MappedLib] = []
    seen: set[str] = set()
    for path, inode in maps:
        if path in seen or path.endswith(" (deleted)"):
            continue
        seen.add(path)
        if re.search(r"\.so(\.\d+)*$", path) or path == exe:
            libs.append(MappedLib(Path(path), inode))
    models = _open_models(pid, [p for p, _ in maps])
    return Target(
        pid=pid, exe=exe, cmdline=[c.decode(errors="replace") for c in cmdline], libs=libs, model_paths=models
    )


def _open_models(pid: int, mapped: list[str]) -> list[Path]:
    """GGUF files the process has mapped (llama.cpp mmaps models by default) or open as fds."""
    found: list[str] = [p for p in mapped if p.endswith(".gguf")]
    fd_dir = Path(f"/proc/{pid}/fd")
    try:
        for fd in fd_dir.iterdir():
            try:
                t = os.readlink(fd)
            except OSError:
                continue
            if t.endswith(".gguf"):
                found.append(t)
    except OSError:
        pass
    out: list[Path] = []
    for p in found:
        if Path(p) not in out:
            out.append(Path(p))
    return out


def elf_symbols(path: Path) -> dict[str, tuple[int, int]]:
    """Defined function symbols of an ELF file -> (address, size), from .dynsym and .symtab.
    Uses binutils' nm, present wherever BCC's toolchain is. Read once per file version: finding
    the engine and attaching each probe both ask, and nm on a 100 MB library takes a while."""
    st = path.stat()
    return dict(_elf_symbols(path, st.st_ino, st.st_mtime_ns))


@functools.lru_cache(maxsize=32)
def _elf_symbols(path: Path, _inode: int, _mtime_ns: int) -> dict[str, tuple[int, int]]:
    syms: dict[str, tuple[int, int]] = {}
    for extra in (["-D"], []):
        r = subprocess.run(["nm", *extra, "--defined-only", "-S", str(path)], capture_output=True, text=True)
        for line in r.stdout.splitlines():
            parts = line.split()
            if len(parts) == 4 and parts[2] in ("T", "t", "W", "i"):
                syms.setdefault(parts[3], (int(parts[0], 16), int(parts[1], 16)))
    return syms


def build_id(path: Path) -> str | None:
    """GNU build id (hex) from the ELF note, or None."""
    try:
        data = path.read_bytes()[: 1 << 16]
    except OSError:
        return None
    i = data.find(b"GNU\0")
    if i < 12:
        return None
    desc_size = int.from_bytes(data[i - 8 : i - 4], "little")
    note_type = int.from_bytes(data[i - 4 : i], "little")
    if note_type != 3 or not 8 <= desc_size <= 64:
        return None
    return data[i + 4 : i + 4 + desc_size].hex()


def find_engine_libs(t: Target) -> dict[str, Path]:
    """Which mapped file holds each probe point. Raises NotAnEngine when none is llama.cpp."""
    where: dict[str, Path] = {}
    wanted = {
        SYM_UBATCH,
        SYM_DECODE,
        SYM_DECODE_EXT,
        SYM_LLAMA_SAMPLER,
        SYM_COMMON_SAMPLER,
        SYM_LOGITS_ITH,
        SYM_SEQ_RM,
        SYM_MEM_CLEAR,
        SYM_KQ_MASK,
        *SPARSE_SYMBOLS,
        *SERVER_SYMBOLS,
    }
    for lib in t.libs:
        name = lib.path.name
        if not ("llama" in name or "ggml" in name or name == Path(t.exe).name or "common" in name):
            continue
        syms = elf_symbols(lib.path)
        for s in wanted & syms.keys():
            where.setdefault(s, lib.path)
    if SYM_UBATCH not in where:
        raise NotAnEngine(
            f"PID {t.pid} ({t.exe}) maps no llama.cpp library with the micro-batch entry point "
            f"(llama_context::process_ubatch); supported engines: llama-cpp-python, xllamacpp (llama-server)"
        )
    return where


def listening_urls(pid: int) -> list[str]:
    """http://host:port of the TCP sockets the process listens on (from /proc, no tools)."""
    inodes: set[str] = set()
    fd_dir = Path(f"/proc/{pid}/fd")
    try:
        for fd in fd_dir.iterdir():
            try:
                link = fd.readlink().as_posix()
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    except OSError as e:
        raise MissingPrivileges(f"cannot list the sockets of PID {pid}: {e.strerror}; run as root") from None
    urls = []
    for table, v6 in (("tcp", False), ("tcp6", True)):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) < 10 or f[3] != "0A" or f[9] not in inodes:  # 0A = LISTEN
                continue
            addr, port = f[1].split(":")
            host = _host(addr, v6)
            urls.append(f"http://{host}:{int(port, 16)}")
    return urls


def _host(hex_addr: str, v6: bool) -> str:
    if not v6:
        b = bytes.fromhex(hex_addr)[::-1]
        ip = ".".join(str(x) for x in b)
        return "127.0.0.1" if ip == "0.0.0.0" else ip
    words = [bytes.fromhex(hex_addr[i : i + 8])[::-1] for i in range(0, 32, 8)]
    raw = b"".join(words)
    if raw == bytes(16):
        return "[::1]"
    if raw[:12] == bytes(10) + b"\xff\xff":
        return ".".join(str(x) for x in raw[12:])
    return "[" + ":".join(raw[i : i + 2].hex() for i in range(0, 16, 2)) + "]"
