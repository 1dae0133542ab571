"""The main probe program's life: compiles the probes (probes/*.bpf.c) for one engine build and
capture, attaches them to one process, reads their ring buffer on the consumer's thread, and
detaches them. bcc is imported only in capture/ (here and by the layout-discovery probe, through
import_bcc).

BCC reports failures as bare `Exception` strings; they are translated here into the project's
own errors so callers never see them.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import re
import struct
import sys
import sysconfig
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from sparseety_prof.capture import bpf_stats
from sparseety_prof.capture import capabilities as caps
from sparseety_prof.capture import target as tg
from sparseety_prof.capture.elf import cheap_entry_probe_offset, cheap_probe_offset, emulated, read_at_vaddr
from sparseety_prof.capture.events import (
    AGG_MAX_LAYERS,
    LOGITS_HEAD_BYTES,
    LOGITS_REF,
    LOGITS_REF_DTYPE,
    LT_THREADS_DEFAULT,
    PROBES_DIR,
    UBATCH_DTYPE,
    agg_layers_for,
    logits_chunk_for,
    logits_dtype,
    lt_threads_for,
    record_sizes,
)
from sparseety_prof.capture.layouts import EngineBuild
from sparseety_prof.capture.options import Capture
from sparseety_prof.capture.plans import MoePlan
from sparseety_prof.capture.resources import native_library
from sparseety_prof.capture.ring_hold import RingHold
from sparseety_prof.errors import BpfUnavailable, MissingPrivileges, NoSuchProcess

# the ring's size when none is asked for (the recorder asks for --ring-mb, default 64 MiB): a
# small ring loses much of a burst of full capture with a 32k vocabulary, which the consumer
# drains at least every second (docs/overhead.md, the ring's size)
RING_BUFFER_PAGES = (64 << 20) // mmap.PAGESIZE
# The share of the ring pending at which a producer wakes the ring watch (RingReader.arm_watch,
# rb_wake() in token_probes.bpf.c): the consumer's escalation threshold (session/sched.py).
RING_WAKE_FILL = 0.35


@dataclass(frozen=True)
class ProbeSpec:
    symbol: str
    fn_entry: str | None
    fn_return: str | None
    required: bool
    feature: str | None = None  # a Capture flag that must be on (None: always attached)


PROBES = [
    ProbeSpec(tg.SYM_UBATCH, "ubatch_enter", "ubatch_return", True),
    ProbeSpec(tg.SYM_DECODE, "decode_public_enter", None, False),
    ProbeSpec(tg.SYM_DECODE_EXT, "decode_ext_enter", None, False),
    ProbeSpec(tg.SYM_LLAMA_SAMPLER, "llama_sampler_enter", "any_sampler_return", False),
    ProbeSpec(tg.SYM_COMMON_SAMPLER, "common_sampler_enter", "any_sampler_return", False),
    ProbeSpec(tg.SYM_LOGITS_ITH, "logits_enter", "logits_return", True),
    ProbeSpec(tg.SYM_SEQ_RM, "seq_rm_enter", None, False),
    ProbeSpec(tg.SYM_MEM_CLEAR, "mem_clear_enter", None, False),
    ProbeSpec(tg.SYM_GET_ROWS, "moe_get_rows_enter", None, False, "routes_or_probs"),
    ProbeSpec(tg.SYM_MUL, "moe_mul_enter", None, False, "routes"),
    ProbeSpec(tg.SYM_GLU, "glu_enter", "glu_return", False, "activations"),
    ProbeSpec(tg.SYM_SOFT_MAX, "softmax_enter", None, False, "attention"),
    ProbeSpec(tg.SYM_FLASH_ATTN, "fattn_enter", None, False, "attention"),
    ProbeSpec(tg.SYM_KQ_MASK, "kvmask_enter", "kvmask_return", False, "attention"),
    # serving context (llama-server): which request each sequence serves
    ProbeSpec(tg.SYM_TASK_POST_ONE, "task_post_one", None, False),
    ProbeSpec(tg.SYM_TASK_POST_VEC, "task_post_vec", None, False),
    ProbeSpec(tg.SYM_SLOT_LAUNCH, "slot_launch", None, False),
    ProbeSpec(tg.SYM_SLOT_LAUNCH_PARENT, "slot_launch_parent", None, False),
    ProbeSpec(tg.SYM_SLOT_RELEASE, "slot_release", None, False),
    ProbeSpec(tg.SYM_PROCESS_TOKEN, "slot_token", None, False),
]
#: the graph-op probes that map attention layers to masks: detached once the consumer has
#: learned which mask each layer applies (Session.detach_attention_ops)
ATTENTION_OPS = (tg.SYM_SOFT_MAX, tg.SYM_FLASH_ATTN)
#: the socket-read tracepoints (not a uprobe): on when the process is a server, name for `skip`
HTTP_READS = "http_reads"


def _wanted(spec: ProbeSpec, capture: Capture, moe: MoePlan) -> bool:
    if spec.feature is None:
        return True
    if spec.feature == "routes_or_probs":  # get_rows: router probabilities, expert ids
        return capture.router_probs or (capture.routes and not moe.ids_at_mul)
    if spec.feature == "routes":  # the weighted multiply: gate weights (ids, activations)
        return capture.routes or moe.act_at_mul
    if spec.feature == "activations":  # GLU: activations, unless all are read at the multiply
        return capture.activations and not moe.act_at_mul
    return bool(getattr(capture, spec.feature))


def probe_files(capture: Capture, moe: MoePlan) -> list[str]:
    """The probe files of one program, in order: the token probes, the sparse decisions captured
    (their shared part first; activations before MoE, whose multiply probe can count them), the
    serving probes. Each condition is the one the file's programs need, in the terms of the -D
    flags the program is compiled with (`moe` as compiled: MoE read points only where captured)."""
    sparse = (
        ("sparse_common.bpf.c", capture.any),
        ("sparse_activation.bpf.c", capture.activations),
        ("sparse_moe.bpf.c", capture.routes or capture.router_probs or moe.act_at_mul),
        ("sparse_attention.bpf.c", capture.attention),
    )
    return ["token_probes.bpf.c", *(f for f, wanted in sparse if wanted), "server_probes.bpf.c"]


def probe_source(capture: Capture, moe: MoePlan) -> str:
    """The BPF program text: BCC only rewrites and exports what is in its main text, so the probe
    files are concatenated rather than #included."""
    return "\n".join((PROBES_DIR / f).read_text() for f in probe_files(capture, moe))


DEBIAN_BCC = Path("/usr/lib/python3/dist-packages/bcc")  # Debian's python3-bpfcc (pure Python)


def bcc_fix() -> str:
    """The command that makes Debian's bcc importable by this interpreter. BCC is not on PyPI (the
    package named bcc there is another project); a venv sees Debian's copy only when made from
    /usr/bin/python3 with --system-site-packages, so link just that package into site-packages."""
    link = f"ln -sfn {DEBIAN_BCC} {sysconfig.get_paths()['purelib']}/bcc"
    if DEBIAN_BCC.is_dir():
        return f"{link}   (bcc of Debian's python3-bpfcc; scripts/install.sh does this for .venv)"
    return f"apt-get install -y python3-bpfcc libbpfcc && {link}   (scripts/install.sh does both for .venv)"


def import_bcc() -> Any:
    try:
        import bcc
    except ImportError:
        raise BpfUnavailable(
            f"the bcc Python module (BCC, from Debian) is not importable by {sys.executable}; "
            f"to make it importable run: {bcc_fix()}"
        ) from None
    return bcc


@dataclass
class AttachedProbe:
    symbol: str
    library: str
    offset: int
    kind: str  # "entry" | "return"
    address: int = 0  # where the probe sits in the file (symbol + offset)
    via: str = ""  # the name it was attached (and is detached) through: the process's mapping
    # whether the kernel emulates the probed instruction (cheap) instead of single-stepping it
    # (docs/overhead.md): capture/elf.py cheap_probe_offset; None for a tracepoint
    emulated: bool | None = None
    program: str = ""  # the BPF program the point runs (meta.json bpf_programs names its runs)
    detached: bool = False  # detached before the end (Session.detach_attention_ops)


@dataclass
class Session:
    """A loaded and attached BPF program. `close()` detaches everything (idempotent)."""

    bpf: Any
    pid: int
    attached: list[AttachedProbe] = field(default_factory=list)
    detached: list[AttachedProbe] = field(default_factory=list)  # detached while running
    compile_s: float = 0.0
    logits_chunk: int = 1024
    agg_layers: int = AGG_MAX_LAYERS  # layers an aggregate record holds (events.agg_layers_for)
    lt_threads: int = LT_THREADS_DEFAULT  # engine threads it times (events.lt_threads_for)
    moe: MoePlan = field(default_factory=MoePlan)  # where the MoE probes read (as compiled)
    ring_pages: int = RING_BUFFER_PAGES  # size of the ring buffer the probes write to
    stats_fd: int | None = None  # the kernel's BPF run statistics are on while it is open (bpf_stats.py)
    _closed: bool = False

    def counters(self) -> dict[str, int]:
        c = self.bpf["counters"]
        vals = [int(c[ctypes.c_int(i)].value) for i in range(7)]
        return {
            "records_produced": vals[0],
            "kernel_drops": vals[1],
            "ubatch_rows_not_copied": vals[2],
            "sparse_rows_not_captured": vals[3],
            "attention_rows_not_counted": vals[4],
            # head sampling in the probes (token_probes.bpf.c head_keeps): not losses
            "head_logits_not_copied": vals[5],
            "head_logits_copied_mixed": vals[6],
        }

    def program_misses(self) -> int:
        """Probe hits whose program the kernel did not run: another BPF program was running on
        that CPU (a preempted one, or one in interrupt context), which the kernel's recursion
        guard counts per program (`recursion_misses` in the program's fdinfo). The probes keep
        per-CPU scratch state; this is the count of hits that could have met it in use."""
        total = 0
        for fn in list(getattr(self.bpf, "funcs", {}).values()):
            with contextlib.suppress(OSError, ValueError, AttributeError):
                total += fdinfo_recursion_misses(Path(f"/proc/self/fdinfo/{fn.fd}").read_text())
        return total

    @property
    def kv_mask_probe(self) -> bool:
        """Attention masks are counted where the engine writes them (set_input_kq_mask)."""
        return any(p.symbol == tg.SYM_KQ_MASK for p in self.attached)

    def detach_attention_ops(self) -> int:
        """Detach the soft_max / flash-attention probes (their layer-to-mask map is known and the
        masks are counted at set_input_kq_mask). Returns how many probes were detached."""
        n = 0
        for p in [p for p in self.attached if p.symbol in ATTENTION_OPS]:
            fn = self.bpf.detach_uretprobe if p.kind == "return" else self.bpf.detach_uprobe
            try:
                fn(name=p.via or p.library, addr=p.address, pid=self.pid)
            except Exception:  # still attached: its records keep coming, and agree with the map
                continue
            self.attached.remove(p)
            p.detached = True
            self.detached.append(p)
            n += 1
        return n

    def probes_meta(self) -> list[dict[str, object]]:
        """meta.json `probes`: every point attached, those detached while running marked so."""
        return [p.__dict__ for p in [*self.attached, *self.detached]]

    def enable_run_stats(self) -> str:
        """Have the kernel count each program's runs and run time until close(); "" when on,
        else why not."""
        if self.stats_fd is None:
            self.stats_fd, why = bpf_stats.enable_run_stats()
            return why
        return ""

    def program_costs(self) -> dict[str, dict[str, int]]:
        """Each program's runs and nanoseconds run so far (bpf_stats.py): counted only while
        the run statistics are on; programs that never ran are left out."""
        out: dict[str, dict[str, int]] = {}
        for name, fn in list(getattr(self.bpf, "funcs", {}).items()):
            with contextlib.suppress(OSError, ValueError, AttributeError):
                runs, ns = bpf_stats.program_runs(Path(f"/proc/self/fdinfo/{fn.fd}").read_text())
                if runs:
                    key = name.decode() if isinstance(name, bytes) else str(name)
                    out[key] = {"runs": runs, "run_ns": ns}
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # detaching the probes of a process that already exited may fail harmlessly
        with contextlib.suppress(Exception):
            self.bpf.cleanup()
        if self.stats_fd is not None:
            os.close(self.stats_fd)
            self.stats_fd = None


def compile_and_attach(
    pid: int,
    where: dict[str, Path],
    build: EngineBuild,
    n_vocab: int,
    *,
    capture: Capture | None = None,
    skip: frozenset[str] = frozenset(),
    moe: MoePlan | None = None,
    ring_pages: int = RING_BUFFER_PAGES,
    n_layer: int | None = None,
    head_keep_below: int | None = None,
) -> Session:
    """`head_keep_below`: head sampling in the probes (session/policy.py probe_keep_below), or
    None to copy every logits row."""
    if build.ubatch is None:
        raise ValueError("compile_and_attach needs a llama_ubatch layout (from the table or discovery)")
    bcc = import_bcc()
    capture = capture or Capture()
    # what the capture needs of the model's plan: router probabilities come with the ids from
    # get_rows; activations are read at the multiply only when they are captured at all
    plan = moe or MoePlan()
    moe = MoePlan(
        ids_at_mul=plan.ids_at_mul and capture.routes and not capture.router_probs,
        act_at_mul=plan.act_at_mul and capture.activations,
    )
    http_reads = is_server(where) and HTTP_READS not in skip
    kv_mask = capture.attention and tg.SYM_KQ_MASK in where and tg.SYM_KQ_MASK not in skip
    agg_layers = agg_layers_for(n_layer)  # the aggregate record sized to the model (events.h)
    lt_threads = lt_threads_for(os.cpu_count())  # and its layer times to the host's CPUs
    cflags = [
        f"-I{PROBES_DIR}",
        *build.ubatch.cflags(),
        *build.tensor.cflags(),
        *build.server.cflags(),
        *(["-DHTTP_READS", f"-DTARGET_TGID={pid}"] if http_reads else []),
        *capture.cflags(),
        *(["-DCAPTURE_KVMASK"] if kv_mask else []),
        *moe.cflags(),
        f"-DN_VOCAB={n_vocab}",
        f"-DLOGITS_CHUNK={logits_chunk_for(n_vocab)}",
        f"-DRB_PAGES={ring_pages}",
        f"-DAGG_LAYERS={agg_layers}",
        f"-DAGG_LAYER_MASK={agg_layers - 1}",
        f"-DLT_THREADS={lt_threads}",
        f"-DLT_THREAD_MASK={lt_threads - 1}",
        *(["-DHAVE_TASK_STORAGE"] if task_storage_usable() else []),
        *([f"-DHEAD_KEEP_BELOW={head_keep_below}ULL"] if head_keep_below is not None else []),
        "-Wno-macro-redefined",
    ]
    t0 = time.monotonic()
    try:
        b = bcc.BPF(text=probe_source(capture, moe), cflags=cflags)
    except Exception as e:
        msg = str(e)
        if "Operation not permitted" in msg or "EPERM" in msg:
            raise MissingPrivileges(
                f"the kernel refused to load the BPF program ({msg}): run as root"
            ) from None
        raise BpfUnavailable(
            f"could not compile/load the BPF program: {msg}. Run `sparseety-prof doctor` to check "
            f"kernel headers and BCC"
        ) from None
    sess = Session(
        bpf=b,
        pid=pid,
        compile_s=time.monotonic() - t0,
        logits_chunk=logits_chunk_for(n_vocab),
        agg_layers=agg_layers,
        lt_threads=lt_threads,
        moe=moe,
        ring_pages=ring_pages,
    )
    if http_reads:  # TRACEPOINT_PROBEs attach when the program loads
        tp = "syscalls:sys_{enter,exit}_{recvfrom,read}"
        sess.attached.append(AttachedProbe(tp, "kernel", 0, "tracepoint"))
    try:
        if capture.activations:
            # the activation counter continues a thread's rows through tail calls to glu_continue
            try:
                cont = b.load_func("glu_continue", bcc.BPF.KPROBE)
                b["act_tail"][ctypes.c_int(0)] = ctypes.c_int(cont.fd)
            except Exception as e:
                raise BpfUnavailable(f"could not load the activation counter's continuation: {e}") from None
        if kv_mask:  # an F16 mask is counted by a program of its own (one counting loop each)
            try:
                f16 = b.load_func("kvmask_f16", bcc.BPF.KPROBE)
                b["kvm_tail"][ctypes.c_int(0)] = ctypes.c_int(f16.fd)
            except Exception as e:
                raise BpfUnavailable(f"could not load the F16 mask counter: {e}") from None
        for spec in PROBES:
            lib = where.get(spec.symbol)
            if lib is None or spec.symbol in skip or not _wanted(spec, capture, moe):
                continue
            if spec.symbol == tg.SYM_KQ_MASK and not kv_mask:
                continue
            syms = tg.elf_symbols(lib)
            vaddr = syms[tg.symbol_in(lib, spec.symbol)][0]
            code = read_at_vaddr(lib, vaddr, 32)
            # a return probe needs the return address at [rsp]: only entry-only probes may skip
            # a stack-realigning prologue
            off = cheap_probe_offset(code) if spec.fn_return else cheap_entry_probe_offset(code)
            # The return probe goes in first: a call whose entry the probes see must have its
            # return seen too, or per-thread state opened at entry (the sampler-call depth) would
            # stay open for good when the engine runs such a call while we attach.
            at, cheap = vaddr + off, emulated(code[off:])
            if spec.fn_return:
                via = _attach(b.attach_uretprobe, lib, at, spec.fn_return, pid)
            if spec.fn_entry:
                via = _attach(b.attach_uprobe, lib, at, spec.fn_entry, pid)
                sess.attached.append(
                    AttachedProbe(spec.symbol, str(lib), off, "entry", at, via, cheap, spec.fn_entry)
                )
            if spec.fn_return:
                sess.attached.append(
                    AttachedProbe(spec.symbol, str(lib), off, "return", at, via, cheap, spec.fn_return)
                )
    except BaseException:
        sess.close()
        raise
    return sess


def is_server(where: dict[str, Path]) -> bool:
    """The process runs llama-server's task/slot machinery (a built binary or xllamacpp)."""
    return tg.SYM_SLOT_LAUNCH in where and (tg.SYM_TASK_POST_ONE in where or tg.SYM_TASK_POST_VEC in where)


def fdinfo_recursion_misses(fdinfo: str) -> int:
    """The `recursion_misses` of a BPF program's fdinfo (0 where the kernel does not report it)."""
    m = re.search(r"^recursion_misses:\s*(\d+)", fdinfo, flags=re.MULTILINE)
    return int(m.group(1)) if m else 0


def task_storage_usable(release: str | None = None) -> bool:
    """Task-local storage from kprobe/uprobe programs (and bpf_get_current_task_btf): Linux 5.11
    and later. Older kernels get a hash map keyed by thread id, which costs more per call;
    SPARSEETY_PROF_TASK_STORAGE=0 forces that fallback (a kernel whose task storage misbehaves)."""
    if os.environ.get("SPARSEETY_PROF_TASK_STORAGE") == "0":
        return False
    m = re.match(r"(\d+)\.(\d+)", release or os.uname().release)
    return m is not None and (int(m.group(1)), int(m.group(2))) >= (5, 11)


def _attach(fn: Any, lib: Path, vaddr: int, fn_name: str, pid: int) -> str:
    """Attach through the process's own mapping of `lib`; returns the name attached through."""
    name = tg.pinned_path(pid, lib)  # the file the process maps, whatever its name leads to now
    try:
        fn(name=name, addr=vaddr, fn_name=fn_name, pid=pid)
        return name
    except Exception as e:
        msg = str(e)
        try:
            tg.check_process(pid)
        except NoSuchProcess:
            raise
        raise BpfUnavailable(
            f"could not attach a uprobe to {lib} at {vaddr:#x} ({fn_name}): {msg}{_uprobe_hint()}"
        ) from None


def _uprobe_hint() -> str:
    """Why a uprobe may be refused where the BPF programs loaded: kernels with the 2025 fix
    "perf: Require CAP_SYS_ADMIN for uprobes" refuse the uprobe PMU to CAP_PERFMON alone."""
    if caps.has_capability(caps.effective_capabilities(), caps.CAP_SYS_ADMIN):
        return ""
    return "; placing a uprobe needs CAP_SYS_ADMIN on current kernels (docs/privileges.md)"


class _Arena:
    """Records of one size, back to back in a numpy buffer that is reused drain after drain:
    fresh buffers every drain cost a page fault per 4 KiB of records, reuse costs none. A buffer
    grows by doubling and is touched page by page when it is made (`prefault`), so that the
    faults are taken once, at attach time for the sizes known in advance, instead of inside the
    first drains under load."""

    def __init__(self, size: int, capacity: int = 0) -> None:
        self.size = size
        self.buf = _prefaulted(max(size * 64, capacity, 1 << 16))
        self.addr = self.buf.ctypes.data
        self.used = 0

    def append(self, data: Any, n: int = 0) -> None:
        """One entry: `self.size` bytes from address `data` (the first `n` only, when given)."""
        end = self.used + self.size
        if end > len(self.buf):
            self.grow(end)
        ctypes.memmove(self.addr + self.used, data, n or self.size)
        self.used = end

    def grow(self, min_bytes: int) -> None:
        """At least `min_bytes` of room (doubling), the records so far kept."""
        bigger = _prefaulted(max(2 * len(self.buf), min_bytes))
        bigger[: self.used] = self.buf[: self.used]
        self.buf, self.addr = bigger, bigger.ctypes.data


def _prefaulted(n: int) -> np.ndarray:
    buf = np.empty(n, dtype=np.uint8)
    buf[:: mmap.PAGESIZE] = 0  # one write per page: the kernel maps them all now
    return buf


# sparseety_prof/native/ringwalk.c, built by sparseety_prof/native/build.sh (scripts/install.sh runs
# it); without it RingReader walks the ring in Python, an order of magnitude slower per record.
_WALK_LIB = native_library("libringwalk.so")
_WALK_ABI = 3
_RW_BUSY, _RW_ARENA_FULL, _RW_UNKNOWN_SIZE, _RW_LIMIT = range(1, 5)  # 0: caught up


def _load_walk(path: Path) -> Any:
    """The C ring walk, or None (missing, unloadable, or of another ABI version: a stale build)."""
    try:
        lib = ctypes.CDLL(str(path))
        if lib.sparseety_ring_walk_abi() != _WALK_ABI:
            return None
        fn = lib.sparseety_ring_walk
    except (OSError, AttributeError):
        return None
    p, u64 = ctypes.c_void_p, ctypes.c_uint64
    fn.argtypes = [p, u64, p, u64, p, ctypes.c_int, p, p, p, p, p, u64, p]
    fn.restype = ctypes.c_int
    return fn


_ring_walk = _load_walk(_WALK_LIB)


class _WalkTables:
    """The arenas as the C walk takes them: parallel arrays of record size, buffer address,
    entry size, header bytes taken by reference (0: the record is copied), capacity and entries
    used (both in entries). `refs` maps a record size taken by reference to (its arena, the
    header bytes copied)."""

    def __init__(
        self, fill: dict[int, _Arena], sizes: list[int], refs: dict[int, tuple[_Arena, int]]
    ) -> None:
        arenas = [refs[s][0] if s in refs else fill[s] for s in sizes]
        self.arenas = arenas
        self.sizes = np.array(sizes, dtype=np.uint32)
        self.dst = np.array([a.addr for a in arenas], dtype=np.uint64)
        self.item = np.array([a.size for a in arenas], dtype=np.uint32)
        self.ref = np.array([refs[s][1] if s in refs else 0 for s in sizes], dtype=np.uint32)
        self.cap = np.array([len(a.buf) // a.size for a in arenas], dtype=np.uint64)
        self.used = np.array([a.used // a.size for a in arenas], dtype=np.uint64)

    def store_used(self) -> None:
        for a, n in zip(self.arenas, self.used.tolist(), strict=True):
            a.used = n * a.size


class RingReader:
    """Drains the BPF ring buffer when asked (`take()`), on the consumer's own thread, by reading
    the ring's memory directly: the map is mmap'ed (consumer position read-write, producer
    position and data read-only, the data mapped twice so that no record wraps), records are
    walked from the consumer to the producer position seen at the start, copied into per-size
    arenas, and the consumer position is advanced. No callback per record: BCC's
    ring_buffer_consume called a Python function through ctypes for every record, and kept
    consuming as long as the producer kept producing; a thread of its own would contend for the
    GIL with the consumer.

    What the ring cannot hold is counted by the probes as dropped (reserve failures) and by the
    consumer as sequence gaps."""

    BUSY = 1 << 31  # BPF_RINGBUF_BUSY_BIT: reserved, not yet submitted
    DISCARD = 1 << 30  # BPF_RINGBUF_DISCARD_BIT
    HDR = 8  # BPF_RINGBUF_HDR_SZ
    MAX_PASSES = 8
    CHECK_EVERY = 256
    python_walk = False  # True: the Python walk even with the C one built (tests compare them)
    # Logits records are taken by reference (their floats read in the ring, the space handed
    # back by release() once the drain has been handled) when the ring can take what the
    # producers add meanwhile (ring_hold.py: the pending share, the producers' rate, the last
    # drains' handling times; before any drain was handled, when less than REF_MAX_SHARE of the
    # ring is pending, the share paced drains aim for: ConsumerSched.PACE_FILL) and the logits
    # records were at least REF_MIN_LOGITS of the bytes the last drain took. Else they are
    # copied and the space handed back at once: holding every record of a drain while it is
    # handled is worth it where the copy is most of the walk (a 32k vocabulary: ~130 KiB of
    # logits against 4-8 KiB of other records per token), not for a small vocabulary at
    # thousands of tokens/s, where the drain's handling is long and the copy small (the stress
    # run of scripts/stress_aggregate.py lost records with every drain by reference, none with
    # the copy: docs/overhead.md). `meta.json` consumer.drains_logits_by_ref counts the drains
    # that held the ring.
    REF_MAX_SHARE = 0.25
    REF_MIN_LOGITS = 0.5

    #: bytes of the logits rows' arena made at attach time: half a second's worth at 250 tokens a second
    #: of a 32k vocabulary (most drains read the rows in the ring and need none); bigger ones grow it
    PRESIZE_BYTES = 32 << 20
    #: records every other arena holds from attach time: one drain's worth of per-token records
    #: (a drain every half second at up to 500 tokens a second). Sized by record count alone,
    #: the larger micro-batch and aggregate records grew their arenas twice in the first drains
    #: of every generation (page faults and copies on the engine's cores).
    PRESIZE_RECORDS = 256
    #: the large micro-batch record's: only micro-batches of more than UB_SMALL_TOK rows (prompts)
    #: take it, a few per drain
    PRESIZE_LARGE_UBATCHES = 16

    def __init__(self, sess: Session) -> None:
        self._sess = sess
        # every layout's arena is made now, outside the drains (see _Arena)
        logits_size = logits_dtype(sess.logits_chunk).itemsize
        records = {UBATCH_DTYPE.itemsize: self.PRESIZE_LARGE_UBATCHES}
        self._fill: dict[int, _Arena] = {
            size: _Arena(
                size,
                self.PRESIZE_BYTES if size == logits_size else size * records.get(size, self.PRESIZE_RECORDS),
            )
            for size in record_sizes(sess.logits_chunk, sess.agg_layers, sess.lt_threads)
        }
        self._logits_size = logits_size
        self._refs = _Arena(LOGITS_REF_DTYPE.itemsize, LOGITS_REF_DTYPE.itemsize * self.PRESIZE_RECORDS)
        self._walked: int | None = None  # how far the last take() read, when not handed back yet
        self._hold = RingHold(self.REF_MAX_SHARE)  # whether a drain may hold the ring (by reference)
        self._logits_share = 0.0  # of the bytes the last take() drained (REF_MIN_LOGITS)
        self._ring_bytes = 0  # drained so far, headers included, and in how many records (arm_watch)
        self._ring_records = 0
        self.last_take_bytes = 0  # of the ring the last take() drained, headers included
        self.takes = 0  # take() calls that drained anything, and how many took logits by reference
        self.takes_by_ref = 0
        self._seq_at_take = self._next_seq()  # the producers' next sequence number at the last take
        page = mmap.PAGESIZE
        fd = sess.bpf["events"].map_fd
        self._size = sess.ring_pages * page
        try:
            self._cons_mm = mmap.mmap(fd, page, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=0)
            self._prod_mm = mmap.mmap(fd, page + 2 * self._size, mmap.MAP_SHARED, mmap.PROT_READ, offset=page)
        except OSError as e:
            raise BpfUnavailable(f"cannot map the BPF ring buffer: {e}") from None
        self._cons = ctypes.c_uint64.from_buffer(self._cons_mm)
        self._data = np.frombuffer(self._prod_mm, dtype=np.uint8, offset=page)  # read-only view
        self._data_addr = self._data.ctypes.data
        self._page = page

    @property
    def data(self) -> np.ndarray:
        """The ring's data (both mappings): what the offsets of logits records taken by reference
        point into (events.decode_groups' `ring_data`)."""
        return self._data

    @property
    def wake_fd(self) -> int:
        """The ring's map fd: readable (edge-triggered epoll) when a producer wakes the ring watch
        (rb_wake() in token_probes.bpf.c)."""
        return int(self._sess.bpf["events"].map_fd)

    def arm_watch(self) -> None:
        """Let a producer wake the ring watch once the ring is about RING_WAKE_FILL full: at the
        record sequence number the producers were at when the last take() emptied the ring, plus
        as many records as that share of the ring holds at the mean size drained so far, or before
        any drain at the largest record's size (one wakeup per arming: the producer that wakes it
        disarms it). An estimate, erring early before the first drain: a mark beyond what the ring
        holds would never be reached, a wakeup below the threshold only disarms the watch until
        the next drain, and the drains' own checks see the real backlog."""
        mean = self._ring_bytes / self._ring_records if self._ring_records else float(max(self._fill))
        ahead = max(1, int(self._size * RING_WAKE_FILL / max(mean, 8.0)))
        self._sess.bpf["ring_watch"][ctypes.c_int(0)] = ctypes.c_uint64(self._seq_at_take + ahead)

    def _next_seq(self) -> int:
        """The sequence number the producers give their next record (counters[0])."""
        return int(self._sess.bpf["counters"][ctypes.c_int(0)].value)

    def positions(self) -> tuple[int, int, int]:
        """The addresses of the ring's producer and consumer positions and its data bytes, for a
        watch in C (session/ring_watch.py NativeRingWatch), which must stop before stop()."""
        return self._data_addr - self._page, ctypes.addressof(self._cons), self._size

    def pending_share(self) -> float:
        """The share of the ring produced but not yet drained: two reads of the ring's memory, safe
        from another thread than the one that drains (ring_watch.py)."""
        prod = struct.unpack_from("<Q", self._prod_mm, 0)[0]
        return float(max(0, prod - self._cons.value) / self._size)

    def take(
        self, on_backlog: Callable[[float], object] | None = None, *, by_ref: bool = True
    ) -> dict[int, np.ndarray]:
        """Drain the ring up to where the producer was when called: {record size: the records
        back to back}, and under LOGITS_REF the logits records taken by reference (`by_ref`, when
        the ring is not filling: REF_MAX_SHARE), whose floats stay in the ring until release().
        The arrays are valid until the next take(), which releases what the last one held.
        `on_backlog` is told the share of the ring still pending at the start of each pass and
        every CHECK_EVERY records (the consumer raises its priority from there when the ring
        fills under load)."""
        self.release()
        walk = self._walk_python if _ring_walk is None or self.python_walk else self._walk_c
        prod_mm = self._prod_mm
        cons = cons0 = self._cons.value
        start_share = (struct.unpack_from("<Q", prod_mm, 0)[0] - cons) / self._size
        refs = (
            {self._logits_size: (self._refs, LOGITS_HEAD_BYTES)}
            if by_ref
            and self._logits_share >= self.REF_MIN_LOGITS
            and self._hold.allows(start_share, time.monotonic())
            else {}
        )

        def backlog(at: int) -> None:
            if on_backlog is not None:
                on_backlog((struct.unpack_from("<Q", prod_mm, 0)[0] - at) / self._size)

        # passes until caught up (what was produced while the previous pass ran, too), at most
        # MAX_PASSES so that a producer faster than us cannot keep us here forever
        for _ in range(self.MAX_PASSES):
            prod = struct.unpack_from("<Q", prod_mm, 0)[0]
            if cons >= prod:
                break
            backlog(cons)  # before copying, so that a full ring escalates first
            cons, busy = walk(cons, prod, backlog, refs)
            if self._refs.used:
                self._walked = cons  # handed back by release(), once the floats have been read
            else:
                self._cons.value = cons  # hands the space back to the producers
            if busy:
                break  # reserved but not submitted yet: the next take() gets it
        fill = self._fill
        out = {size: a.buf[: a.used] for size, a in fill.items() if a.used}
        # the bytes the records took in the ring, the logits records' whether copied or not
        copied = fill.get(self._logits_size)
        logits_bytes = (copied.used if copied else 0) + self._refs.used // self._refs.size * self._logits_size
        total = sum(a.used for size, a in fill.items() if size != self._logits_size) + logits_bytes
        if self._refs.used:
            out[LOGITS_REF] = self._refs.buf[: self._refs.used]
        if total:
            self._logits_share = logits_bytes / total
        # what the ring held, whatever was copied: a by-reference logits record's array holds its
        # header and offset only (the consumer's pace reads the fill from this)
        self.last_take_bytes = cons - cons0
        self._ring_bytes += self.last_take_bytes
        if cons > cons0:
            self.takes += 1
            self.takes_by_ref += bool(self._refs.used)
            self._hold.taken(time.monotonic())
        self._seq_at_take = self._next_seq()
        self._ring_records += sum(a.used // a.size for a in (*fill.values(), self._refs))
        for a in (*fill.values(), self._refs):
            a.used = 0  # reused by the next take(): the views above are valid until then
        return out

    def release(self) -> None:
        """Hand back to the producers the space of the records the last take() read by reference
        (their views are not to be read after this)."""
        if self._walked is not None:
            self._cons.value = self._walked
            self._walked = None
        self._hold.released(time.monotonic())

    def _walk_c(
        self, cons: int, prod: int, backlog: Callable[[int], None], refs: dict[int, tuple[_Arena, int]]
    ) -> tuple[int, bool]:
        """One pass of the walk in C (sparseety_prof/native/ringwalk.c), CHECK_EVERY records per
        call: (new consumer position, stopped at a busy record)."""
        fill = self._fill
        pos, stop = ctypes.c_uint64(cons), ctypes.c_uint32(0)
        sizes = list(fill)
        tables = _WalkTables(fill, sizes, refs)
        while True:
            rc = _ring_walk(
                self._data_addr,
                self._size - 1,
                ctypes.addressof(pos),
                prod,
                tables.sizes.ctypes.data,
                len(sizes),
                tables.dst.ctypes.data,
                tables.item.ctypes.data,
                tables.ref.ctypes.data,
                tables.cap.ctypes.data,
                tables.used.ctypes.data,
                self.CHECK_EVERY,
                ctypes.addressof(stop),
            )
            if rc == _RW_LIMIT:
                backlog(pos.value)
                continue
            if rc not in (_RW_ARENA_FULL, _RW_UNKNOWN_SIZE):
                break
            tables.store_used()
            size = int(stop.value)
            if rc == _RW_UNKNOWN_SIZE:
                fill[size] = _Arena(size)
                sizes.append(size)
            else:
                full = refs[size][0] if size in refs else fill[size]
                full.grow(full.used + full.size)
            tables = _WalkTables(fill, sizes, refs)
        tables.store_used()
        return pos.value, rc == _RW_BUSY

    def _walk_python(
        self, cons: int, prod: int, backlog: Callable[[int], None], refs: dict[int, tuple[_Arena, int]]
    ) -> tuple[int, bool]:
        """One pass of the walk in Python (the fallback, and the reference the tests compare the C
        walk with)."""
        unpack, prod_mm, page = struct.unpack_from, self._prod_mm, self._page
        mask = self._size - 1
        fill, base = self._fill, self._data_addr
        busy, discard, hdr = self.BUSY, self.DISCARD, self.HDR
        n = 0
        while cons < prod:
            off = cons & mask
            length = unpack("<I", prod_mm, page + off)[0]
            if length & busy:
                return cons, True
            size = length & ~(busy | discard)
            if not length & discard and size in refs:  # the header, then where the rest lies (ringwalk.c)
                ref_arena, head = refs[size]
                ref_arena.append(base + off + hdr, head)
                ref_arena.buf[ref_arena.used - 8 : ref_arena.used].view("<u8")[0] = off + hdr + head
            elif not length & discard:
                arena = fill.get(size)
                if arena is None:
                    arena = fill[size] = _Arena(size)
                arena.append(base + off + hdr)
            cons += (size + hdr + 7) & ~7
            n += 1
            if n % self.CHECK_EVERY == 0:
                backlog(cons)
        return cons, False

    def stop(self) -> dict[int, np.ndarray]:
        """The last records, copied (the probes are detached by the session afterwards)."""
        rest = self.take(by_ref=False)  # (take releases what the last one held)
        # copies: the arenas stay valid, the mappings go
        del self._cons, self._data
        self._cons_mm.close()
        # A view of the ring's memory may still be alive (the last drain's logits rows, held by
        # the traceback of an error raised while it was handled): mmap refuses to unmap under it,
        # and unmaps when the last view goes; nothing reads it after this.
        with contextlib.suppress(BufferError):
            self._prod_mm.close()
        return rest
