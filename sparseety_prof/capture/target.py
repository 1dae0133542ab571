"""What the target process is: does it exist, may we trace it, which llama.cpp library files it
really maps, which model file it has open. Pure /proc reading; no BPF here."""

from __future__ import annotations

import errno
import functools
import os
import re
import stat
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from sparseety_prof.capture.proc_maps import MapsEntry, read_maps
from sparseety_prof.capture.untrusted_files import open_untrusted, read_prefix, target_path, trusted_tool
from sparseety_prof.errors import MissingPrivileges, NoSuchProcess, NotAnEngine

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
# context class was renamed server_context -> server_context_impl in 2025: SYMBOL_ROLES finds
# either by demangled signature.
SYM_TASK_POST_ONE = "_ZN12server_queue4postEO11server_taskb"
SYM_TASK_POST_VEC = "_ZN12server_queue4postEOSt6vectorI11server_taskSaIS1_EEb"
SYM_SLOT_RELEASE = "_ZN11server_slot7releaseEv"
SYM_SLOT_LAUNCH = "_ZN19server_context_impl21launch_slot_with_taskER11server_slotO11server_task"
SYM_SLOT_LAUNCH_PARENT = (
    "_ZN19server_context_impl29launch_slots_with_parent_task"
    "ER11server_slotRSt6vectorIPS0_SaIS3_EEO11server_task"
)
SYM_PROCESS_TOKEN = "_ZN19server_context_impl13process_tokenER23completion_token_outputR11server_slot"
#: nm on a 100 MB library takes seconds; a file that keeps it busy longer is not read
TOOL_TIMEOUT_S = 120

SERVER_SYMBOLS = (
    SYM_TASK_POST_ONE,
    SYM_TASK_POST_VEC,
    SYM_SLOT_RELEASE,
    SYM_SLOT_LAUNCH,
    SYM_SLOT_LAUNCH_PARENT,
    SYM_PROCESS_TOKEN,
)


@dataclass(frozen=True)
class MappedLib:
    path: Path
    inode: int


@dataclass(frozen=True)
class ModelFile:
    """A GGUF file the process has mapped or open: `path` as it is named (resolved through
    /proc/PID/root for a process in a container), `source` a link of /proc to the very file the
    process holds (/proc/PID/map_files/START-END or /proc/PID/fd/N), which no rename or swap of
    `path` can redirect: the model is read through it (untrusted_files.PinnedFile)."""

    path: Path
    source: str


@dataclass
class Target:
    pid: int
    exe: str
    cmdline: list[str]
    libs: list[MappedLib] = field(default_factory=list)
    models: list[ModelFile] = field(default_factory=list)

    @property
    def model_paths(self) -> list[Path]:
        return [m.path for m in self.models]


def check_process(pid: int) -> None:
    """Fail with a clear message when the PID is wrong or we may not look at it."""
    if pid <= 0:
        raise NoSuchProcess(f"invalid PID {pid}: give the process id of a running engine")
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        raise NoSuchProcess(f"no process with PID {pid} (did the engine exit?)") from None
    except PermissionError:
        # Signalling another user's process needs CAP_KILL, which tracing it does not: the
        # process exists; whether it may be traced is what reading its executable link asks the
        # kernel (the ptrace access check, CAP_SYS_PTRACE).
        check_may_trace(pid)


def check_may_trace(pid: int) -> None:
    """MissingPrivileges when the kernel's ptrace access check refuses us PID's executable link
    (its maps may be readable where the link is not: CAP_SYS_ADMIN alone opens them)."""
    try:
        os.readlink(f"/proc/{pid}/exe")
    except FileNotFoundError:
        raise NoSuchProcess(f"no process with PID {pid} (did the engine exit?)") from None
    except PermissionError:
        raise MissingPrivileges(
            f"PID {pid} belongs to another user and you may not trace it: give the recorder "
            f"CAP_SYS_PTRACE (docs/privileges.md) or run it as root, e.g.\n"
            f'  sudo "$(command -v sparseety-prof)" record --pid {pid} ...'
        ) from None


def check_privileges() -> None:
    """BPF uprobes need CAP_BPF + CAP_PERFMON (or CAP_SYS_ADMIN); test the effective set."""
    caps = _effective_caps()
    cap_sys_admin, cap_perfmon, cap_bpf = 21, 38, 39
    has = lambda bit: bool(caps >> bit & 1)  # noqa: E731
    if has(cap_sys_admin) or (has(cap_bpf) and has(cap_perfmon)):
        return
    hint = (
        "already root but capabilities are missing: in a container add --cap-add SYS_ADMIN "
        "--cap-add SYS_PTRACE --cap-add DAC_READ_SEARCH (uprobes need CAP_SYS_ADMIN on current "
        "kernels; docs/privileges.md), or --cap-add BPF --cap-add PERFMON on older ones"
        if os.geteuid() == 0
        else 'run it as root: sudo "$(command -v sparseety-prof)" ...'
    )
    raise MissingPrivileges(
        f"attaching eBPF uprobes needs CAP_BPF and CAP_PERFMON (or CAP_SYS_ADMIN); {hint}"
    )


def _effective_caps() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return int(line.split()[1], 16)
    return 0


def inspect(pid: int) -> Target:
    check_process(pid)
    maps = [m for m in read_maps(pid) if m.file_backed]
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
    except OSError as e:
        if e.errno == errno.ENOENT:
            raise NoSuchProcess(f"no process with PID {pid} (did the engine exit?)") from None
        raise MissingPrivileges(
            f"cannot inspect PID {pid}: {e.strerror}; run as root (sudo), or give the recorder "
            f"CAP_SYS_PTRACE for an engine of another user (docs/privileges.md)"
        ) from None
    # Paths as the process sees them, resolved through /proc/PID/root in a container: its files,
    # not ours of the same name.
    libs: list[MappedLib] = []
    seen: set[str] = set()
    for m in maps:
        if m.path in seen or m.deleted:
            continue
        seen.add(m.path)
        if re.search(r"\.so(\.\d+)*$", m.path) or m.path == exe:
            libs.append(MappedLib(target_path(pid, m.path), m.inode))
    models = [ModelFile(target_path(pid, p), src) for p, src in _open_models(pid, maps)]
    return Target(
        pid=pid, exe=exe, cmdline=[c.decode(errors="replace") for c in cmdline], libs=libs, models=models
    )


def pinned_path(pid: int, lib: Path) -> str:
    """Where to place a uprobe on `lib` (a path from `inspect`): the /proc/PID/map_files link of
    the process's own mapping of it, which the kernel follows to the very file mapped, so that a
    name renamed or swapped since `inspect` (say, for a link to another library) cannot move the
    probe elsewhere. Raises NotAnEngine when the process no longer maps a file by that name; the
    name itself where the links may not be opened (no CAP_SYS_ADMIN or CAP_CHECKPOINT_RESTORE:
    the probe is filtered to the process, so it can only reach that process's own mappings)."""
    for m in read_maps(pid):
        if m.file_backed and not m.deleted and target_path(pid, m.path) == lib:
            link = f"/proc/{pid}/map_files/{m.map_files_name}"
            try:
                os.stat(link)
            except PermissionError:
                return str(lib)
            except OSError:  # unmapped since maps was read
                continue
            return link
    raise NotAnEngine(
        f"PID {pid} no longer maps {lib} (renamed, replaced or unloaded since it was inspected); "
        f"nothing was attached to it"
    )


def _open_models(pid: int, maps: list[MapsEntry]) -> list[tuple[str, str]]:
    """(path, /proc link to the file) of each GGUF file the process has mapped (llama.cpp mmaps
    models by default) or open as an fd; once per path."""
    found = [(m.path, f"/proc/{pid}/map_files/{m.map_files_name}") for m in maps if m.path.endswith(".gguf")]
    fd_dir = Path(f"/proc/{pid}/fd")
    try:
        for fd in fd_dir.iterdir():
            try:
                t = os.readlink(fd)
                # stat of the fd link is the open file itself (never blocks): a FIFO or device
                # named *.gguf is no model
                if t.endswith(".gguf") and stat.S_ISREG(os.stat(fd).st_mode):
                    found.append((t, str(fd)))
            except OSError:
                continue
    except OSError:
        pass
    out: dict[str, str] = {}
    for p, src in found:
        out.setdefault(p, src)
    return list(out.items())


def elf_symbols(path: Path) -> dict[str, tuple[int, int]]:
    """Defined function symbols of an ELF file -> (address, size), from .dynsym and .symtab.
    Uses binutils' nm, present wherever BCC's toolchain is. Read once per file version: finding
    the engine and attaching each probe both ask, and nm on a 100 MB library takes a while.
    The file belongs to the target: nm (from /usr/bin, never through PATH) reads it through a
    descriptor opened without blocking, and only when it is a regular file."""
    st = path.stat()
    return dict(_elf_symbols(path, st.st_ino, st.st_mtime_ns))


def symbol_table(path: Path) -> dict[str, tuple[int, int, str]]:
    """Every defined symbol with a size (functions and data) -> (address, size, nm type letter)."""
    st = path.stat()
    return _symbol_table(path, st.st_ino, st.st_mtime_ns)


@functools.lru_cache(maxsize=32)
def _symbol_table(path: Path, _inode: int, _mtime_ns: int) -> dict[str, tuple[int, int, str]]:
    syms: dict[str, tuple[int, int, str]] = {}
    nm = trusted_tool("nm")
    fd, _ = open_untrusted(path)
    try:
        outputs = [
            subprocess.run(
                [nm, *extra, "--defined-only", "-S", f"/dev/fd/{fd}"],
                capture_output=True,
                text=True,
                pass_fds=(fd,),
                timeout=TOOL_TIMEOUT_S,
            ).stdout
            for extra in (["-D"], [])
        ]
    except subprocess.TimeoutExpired:
        raise OSError(f"{path}: nm did not finish within {TOOL_TIMEOUT_S} s") from None
    finally:
        os.close(fd)
    for out in outputs:
        for line in out.splitlines():
            parts = line.split()
            if len(parts) == 4:
                syms.setdefault(parts[3], (int(parts[0], 16), int(parts[1], 16), parts[2]))
    return syms


@functools.lru_cache(maxsize=32)
def _elf_symbols(path: Path, _inode: int, _mtime_ns: int) -> dict[str, tuple[int, int]]:
    table = _symbol_table(path, _inode, _mtime_ns)
    return {name: (a, n) for name, (a, n, kind) in table.items() if kind in ("T", "t", "W", "i")}


@dataclass(frozen=True)
class SymbolRole:
    """A probe point found by what the function is, not by one mangled name: functions get
    renamed across llama.cpp versions (server_context -> server_context_impl, the KV-cache class
    llama_kv_cache_unified -> llama_kv_cache). `names` are the accepted qualified names, `params`
    the leading parameter types the probe reads (demangled, as c++filt prints them)."""

    key: str  # the canonical mangled name: the role's key in `where`
    names: tuple[str, ...]
    params: tuple[str, ...]


def _role(key: str, names: tuple[str, ...], *params: str) -> SymbolRole:
    return SymbolRole(key, names, params)


_SERVER_CTX = ("server_context_impl", "server_context")
SYMBOL_ROLES: tuple[SymbolRole, ...] = (
    _role(SYM_UBATCH, ("llama_context::process_ubatch",), "llama_ubatch const&"),
    _role(SYM_DECODE, ("llama_context::decode",), "llama_batch const&"),
    _role(SYM_DECODE_EXT, ("llama_context::decode",), "llama_batch_ext const&"),
    _role(SYM_COMMON_SAMPLER, ("common_sampler_sample",), "common_sampler*", "llama_context*", "int"),
    _role(
        SYM_KQ_MASK,
        ("llama_kv_cache::set_input_kq_mask", "llama_kv_cache_unified::set_input_kq_mask"),
        "ggml_tensor*",
        "llama_ubatch const*",
    ),
    _role(SYM_TASK_POST_ONE, ("server_queue::post",), "server_task&&"),
    _role(
        SYM_TASK_POST_VEC, ("server_queue::post",), "std::vector<server_task, std::allocator<server_task> >&&"
    ),
    _role(SYM_SLOT_RELEASE, ("server_slot::release",)),
    _role(
        SYM_SLOT_LAUNCH,
        tuple(f"{c}::launch_slot_with_task" for c in _SERVER_CTX),
        "server_slot&",
        "server_task&&",
    ),
    _role(
        SYM_SLOT_LAUNCH_PARENT,
        tuple(f"{c}::launch_slots_with_parent_task" for c in _SERVER_CTX),
        "server_slot&",
        "std::vector<server_slot*, std::allocator<server_slot*> >&",
        "server_task&&",
    ),
    _role(
        SYM_PROCESS_TOKEN,
        tuple(f"{c}::process_token" for c in _SERVER_CTX),
        "completion_token_output&",
        "server_slot&",
    ),
)


def split_params(demangled: str) -> tuple[str, tuple[str, ...]] | None:
    """'ns::f(a, b<c, d>) const' -> ('ns::f', ('a', 'b<c, d>')); None if it is not a function."""
    depth, start = 0, -1
    for i, ch in enumerate(demangled):
        if ch in "<(":
            if ch == "(" and depth == 0:
                start = i
                break
            depth += 1
        elif ch in ">)":
            depth -= 1
    if start < 0:
        return None
    name, params, depth, cur = demangled[:start], [], 0, ""
    for ch in demangled[start + 1 :]:
        if ch in "<(":
            depth += 1
        elif ch in ">)":
            if depth == 0:
                break
            depth -= 1
        if ch == "," and depth == 0:
            params.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        params.append(cur.strip())
    return name, tuple(p for p in params if p != "void")


def _demangle(names: list[str]) -> list[str]:
    if not names:
        return []
    r = subprocess.run(
        [trusted_tool("c++filt")],
        input="\n".join(names),
        capture_output=True,
        text=True,
        timeout=TOOL_TIMEOUT_S,
    )
    out = r.stdout.splitlines()
    return out if len(out) == len(names) else names


def _base(qualified: str) -> str:
    return qualified.rsplit("::", 1)[-1]


@functools.lru_cache(maxsize=32)
def _role_symbols(path: Path, _inode: int, _mtime_ns: int) -> dict[str, str]:
    """role key -> the mangled name that plays it in this file (the canonical name if present,
    else the first candidate whose demangled name and leading parameters match)."""
    syms = _elf_symbols(path, _inode, _mtime_ns)
    found: dict[str, str] = {}
    pending = []
    for role in SYMBOL_ROLES:
        if role.key in syms:
            found[role.key] = role.key
        else:
            pending.append(role)
    if not pending:
        return found
    frags = {f"{len(_base(n))}{_base(n)}" for role in pending for n in role.names}
    cands = sorted(s for s in syms if s.startswith("_Z") and any(f in s for f in frags))
    parsed = [split_params(d) for d in _demangle(cands)]
    for role in pending:
        for mangled, sig in zip(cands, parsed, strict=True):
            if sig is None or sig[0] not in role.names:
                continue
            if sig[1][: len(role.params)] == role.params and (role.params or not sig[1]):
                found[role.key] = mangled
                break
    return found


def symbol_in(lib: Path, role: str) -> str:
    """The mangled name that plays `role` (a SYM_* key) in `lib`; the key itself by default."""
    st = lib.stat()
    return _role_symbols(lib, st.st_ino, st.st_mtime_ns).get(role, role)


def build_id(path: Path) -> str | None:
    """GNU build id (hex) from the ELF note, or None."""
    try:
        data = read_prefix(path, 1 << 16)
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
        st = lib.path.stat()
        for role in _role_symbols(lib.path, st.st_ino, st.st_mtime_ns):
            where.setdefault(role, lib.path)
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


@dataclass(frozen=True)
class CaptureLayer:
    name: str
    available: bool
    detail: str  # which symbols serve it, or what is missing and what that costs


def capture_layers(where: dict[str, Path]) -> list[CaptureLayer]:
    """What this engine build lets the recorder see, from the probe points found in it. Only the
    token layer is required; a missing optional layer degrades that layer alone."""

    def have(*syms: str) -> bool:
        return all(s in where for s in syms)

    sampler = have(SYM_LLAMA_SAMPLER) or have(SYM_COMMON_SAMPLER)
    server = have(SYM_SLOT_LAUNCH) and (have(SYM_TASK_POST_ONE) or have(SYM_TASK_POST_VEC))
    layers = [
        CaptureLayer(
            "tokens",
            have(SYM_UBATCH, SYM_LOGITS_ITH) and sampler,
            "micro-batches, sampled tokens, logits rows"
            if have(SYM_UBATCH, SYM_LOGITS_ITH) and sampler
            else "needs llama_context::process_ubatch, llama_get_logits_ith and a sampler entry point",
        ),
        CaptureLayer(
            "batch cross-check",
            have(SYM_DECODE) or have(SYM_DECODE_EXT),
            "public llama_batch at decode"
            if have(SYM_DECODE)
            else "no llama_context::decode: layout checks use invariants only",
        ),
        CaptureLayer(
            "request boundaries",
            have(SYM_SEQ_RM) or have(SYM_MEM_CLEAR),
            "llama_memory_seq_rm / llama_memory_clear"
            if have(SYM_SEQ_RM) or have(SYM_MEM_CLEAR)
            else "no memory API symbols: requests are cut by position resets only",
        ),
        CaptureLayer(
            "server requests",
            server,
            "task -> slot -> token chain: client request ids"
            if server
            else "not a llama-server: generated request ids",
        ),
        CaptureLayer(
            "server forks",
            server and have(SYM_SLOT_LAUNCH_PARENT),
            "launch_slots_with_parent_task"
            if have(SYM_SLOT_LAUNCH_PARENT)
            else "launch_slots_with_parent_task inlined or absent: n_cmpl > 1 children have no parent_seq_id",
        ),
        CaptureLayer(
            "experts and activations",
            have(SYM_GET_ROWS) or have(SYM_MUL) or have(SYM_GLU),
            "ggml CPU ops get_rows / mul / glu"
            if have(SYM_GET_ROWS) or have(SYM_MUL) or have(SYM_GLU)
            else "no ggml CPU op symbols (another backend?): no routing or sparsity",
        ),
        CaptureLayer(
            "attention coverage",
            have(SYM_SOFT_MAX) or have(SYM_FLASH_ATTN) or have(SYM_KQ_MASK),
            ("KQ mask write" if have(SYM_KQ_MASK) else "graph ops only (no set_input_kq_mask)")
            if have(SYM_SOFT_MAX) or have(SYM_FLASH_ATTN) or have(SYM_KQ_MASK)
            else "no soft_max / flash_attn_ext / set_input_kq_mask: no attention coverage",
        ),
    ]
    return layers
