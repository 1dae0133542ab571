"""Per-operator tracing (issue 62, `record --trace-ops`): the entry of every graph node the CPU
backend computes, on every engine thread, and the end of every graph (probes/op_trace.bpf.c says
where); session/op_times.py pairs them into each node's time on each thread.

Compiled and attached on its own, apart from the probes, as a `Session` of its own: the duty cycle
(capture/probe_switch.py, session/duty_driver.py) takes its probes out between windows and puts
them back, as it does the sparse probes. The node's operator is an `enum ggml_op` number,
named by the engine's own table: ggml_op_name(op) returns GGML_OP_NAME[op], and its code (one
load from a table) says where that table is; the names are read from the engine's memory, once
per operator seen. A build whose ggml_op_name is compiled otherwise leaves the numbers ("op 26").
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from sparseety_prof.capture import target as tg
from sparseety_prof.capture.bpf_loader import AttachedProbe, Session, _attach, import_bcc
from sparseety_prof.capture.elf import cheap_entry_probe_offset, emulated, load_segments, read_at_vaddr
from sparseety_prof.capture.layouts import TensorLayout
from sparseety_prof.capture.proc_maps import read_maps
from sparseety_prof.capture.resources import PROBES_DIR
from sparseety_prof.capture.tensor_probe import ProcessMemory
from sparseety_prof.errors import BpfUnavailable, MissingPrivileges

#: ggml-cpu's call at the start of every node it computes (ggml_compute_forward is static)
SYM_NODE = "ggml_cpu_extra_compute_forward"
#: the RMS_NORM + MUL kernel ggml-cpu calls instead of ggml_compute_forward (builds that fuse them)
SYM_FUSED = "ggml_compute_forward_rms_norm_mul_fused"
#: returns once every graph thread has passed the graph's last barrier
SYM_GRAPH = "ggml_graph_compute"
OP_SYMBOLS = (SYM_NODE, SYM_FUSED, SYM_GRAPH)
#: probes/op_trace.bpf.c enum op_kind
OP_NODE, OP_FUSED, OP_GRAPH_END = 0, 1, 2
SYM_OP_NAME = "ggml_op_name"
SOURCE = "op_trace.bpf.c"
OP_PAGES = 4096  # the event ring: 16 MiB, about 190,000 node entries between drains
NAME_LEN = 48  # probes/op_trace.bpf.c OP_NAME_LEN
EVENT_BYTES = 88  # sizeof(struct op_rec) (80) and the ring's 8-byte header of each record
#: ggml_op_name's code in the builds seen: mov %edi,%edi; lea TABLE(%rip),%rax; mov (%rax,%rdi,8),%rax
_OP_NAME_HEAD = b"\x89\xff\x48\x8d\x05"
_OP_NAME_LOAD = b"\x48\x8b\x04\xf8"


class _OpRec(ctypes.Structure):
    _fields_ = [
        ("ts", ctypes.c_uint64),
        ("node", ctypes.c_uint64),
        ("tid", ctypes.c_uint32),
        ("ith", ctypes.c_int32),
        ("op", ctypes.c_int32),
        ("kind", ctypes.c_uint32),
        ("name", ctypes.c_char * NAME_LEN),
    ]


@dataclass(frozen=True)
class OpEvent:
    """A node's entry on an engine thread (kind OP_NODE, or OP_FUSED: an RMS_NORM computed with
    the MUL after it), or the end of a graph (OP_GRAPH_END, on the thread that ran it); `ts`
    CLOCK_MONOTONIC ns."""

    ts: int
    kind: int
    tid: int
    ith: int = -1
    node: int = 0  # the ggml_tensor's address
    op: int = -1  # enum ggml_op
    name: bytes = b""


def find_op_libs(libs: Iterable[Path]) -> dict[str, Path]:
    """Which of the engine's mapped files defines each of OP_SYMBOLS and ggml_op_name."""
    out: dict[str, Path] = {}
    for lib in libs:
        try:
            syms = tg.elf_symbols(lib)
        except (OSError, ValueError):
            continue
        for s in (*OP_SYMBOLS, SYM_OP_NAME):
            if s in syms and s not in out:
                out[s] = lib
    return out


def _runtime_address(pid: int, lib: Path, vaddr: int) -> int | None:
    """Where the file address `vaddr` of `lib` is in the process (None where it is not mapped)."""
    file_off = None
    for seg_vaddr, seg_off, seg_size in load_segments(lib):
        if seg_vaddr <= vaddr < seg_vaddr + seg_size:
            file_off = seg_off + vaddr - seg_vaddr
    if file_off is None:
        return None
    ino = lib.stat().st_ino
    for m in read_maps(pid):
        if m.inode == ino and m.offset <= file_off < m.offset + (m.end - m.start):
            return m.start + file_off - m.offset
    return None


@dataclass
class OpNames:
    """enum ggml_op -> its name, read from the engine's GGML_OP_NAME table once per operator."""

    pid: int
    table: int | None  # the table's address in the process; None: not found (numbers shown)
    _names: dict[int, str] = field(default_factory=dict)

    @classmethod
    def find(cls, pid: int, lib: Path | None) -> OpNames:
        if lib is None:
            return cls(pid, None)
        vaddr = tg.elf_symbols(lib)[SYM_OP_NAME][0]
        code = read_at_vaddr(lib, vaddr, 16)
        if not (code.startswith(_OP_NAME_HEAD) and code[9:13] == _OP_NAME_LOAD):
            return cls(pid, None)
        (rel,) = struct.unpack_from("<i", code, 5)
        return cls(pid, _runtime_address(pid, lib, vaddr + 9 + rel))

    def name(self, op: int) -> str:
        got = self._names.get(op)
        if got is None:
            got = self._names[op] = self._read(op) or f"op {op}"
        return got

    def _read(self, op: int) -> str | None:
        if self.table is None or not 0 <= op < 1024:
            return None
        mem = ProcessMemory(self.pid)
        ptr = mem.read(self.table + 8 * op, 8)
        if ptr is None:
            return None
        raw = mem.read(struct.unpack("<Q", ptr)[0], 32)
        if raw is None or b"\0" not in raw:
            return None
        text = raw.split(b"\0", 1)[0]
        return text.decode() if text.isascii() and text.replace(b"_", b"").isalnum() else None


@dataclass
class OpTracer:
    """The node probes of one engine, attached (armed); `session` is what the duty cycle's
    ProbeSwitch takes out and puts back. `take()` returns the events sent since the last
    call; `close()` detaches (idempotent)."""

    session: Session
    names: OpNames
    _pending: list[OpEvent] = field(default_factory=list)
    _closed: bool = False

    @classmethod
    def attach(cls, pid: int, libs: Iterable[Path], tensor: TensorLayout) -> OpTracer:
        where = find_op_libs(libs)
        missing = [s for s in (SYM_NODE, SYM_GRAPH) if s not in where]
        if missing:
            raise BpfUnavailable(
                f"--trace-ops: the engine's ggml-cpu exports no {', '.join(missing)} (a build these "
                f"probes do not know): nothing was attached for it"
            )
        bcc = import_bcc()
        cflags = [
            f"-DTARGET_TGID={pid}",
            f"-DT_OP={tensor.nb + 32}",  # ggml_tensor: nb[4] (size_t) then enum ggml_op op
            f"-DT_NAME={tensor.name}",
            f"-DP_ITH={tensor.params_ith}",
            f"-DOP_PAGES={OP_PAGES}",
        ]
        try:
            b = bcc.BPF(text=(PROBES_DIR / SOURCE).read_text(), cflags=cflags)
        except Exception as e:
            if "Operation not permitted" in str(e):
                raise MissingPrivileges(
                    f"the kernel refused the operator probes' BPF program ({e}): run as root"
                ) from None
            raise BpfUnavailable(f"could not compile/load the operator probes' BPF program: {e}") from None
        tracer = cls(Session(bpf=b, pid=pid, ring_pages=OP_PAGES), OpNames.find(pid, where.get(SYM_OP_NAME)))
        b["ops"].open_ring_buffer(tracer._on_record)
        try:
            # the graph's return first (as compile_and_attach does): a graph whose nodes are seen
            # has its end seen
            points = (
                (SYM_GRAPH, "op_graph_return", "return"),
                (SYM_NODE, "op_node_enter", "entry"),
                (SYM_FUSED, "op_fused_enter", "entry"),
            )
            for symbol, program, kind in points:
                lib = where.get(symbol)
                if lib is None:  # (a build that does not fuse)
                    continue
                vaddr = tg.elf_symbols(lib)[symbol][0]
                code = read_at_vaddr(lib, vaddr, 32)
                # a return probe needs the return address at [rsp]: at the function's first byte
                off = cheap_entry_probe_offset(code) if kind == "entry" else 0
                at = vaddr + off
                attach = b.attach_uprobe if kind == "entry" else b.attach_uretprobe
                via = _attach(attach, lib, at, program, pid)
                tracer.session.attached.append(
                    AttachedProbe(symbol, str(lib), off, kind, at, via, emulated(code[off:]), program)
                )
        except BaseException:
            tracer.session.close()
            raise
        return tracer

    def _on_record(self, _ctx: object, data: int, _size: int) -> None:
        r = ctypes.cast(data, ctypes.POINTER(_OpRec)).contents
        self._pending.append(OpEvent(r.ts, r.kind, r.tid, r.ith, r.node, r.op, bytes(r.name)))

    def take(self) -> list[OpEvent]:
        """The events sent since the last call, in the ring's order."""
        if not self._closed:
            self.session.bpf.ring_buffer_consume()
        got, self._pending = self._pending, []
        return got

    def lost(self) -> int:
        """Events the ring could not take."""
        return int(self.session.bpf["lost"][ctypes.c_int(0)].value)

    def close(self) -> None:
        """Detach; the nodes still in the ring are taken first (take() returns them)."""
        if not self._closed:
            self.take_pending()
            self._closed = True
        self.session.close()

    def take_pending(self) -> None:
        self.session.bpf.ring_buffer_consume()
