"""The only module that imports bcc: compiles probes/token_probes.bpf.c for one engine build,
attaches it to one process, and drains its ring buffer on a reader thread.

BCC reports failures as bare `Exception` strings; they are translated here into the project's
own errors so callers never see them.
"""

from __future__ import annotations

import contextlib
import ctypes
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from . import target as tg
from .capture import Capture
from .elf import cheap_entry_probe_offset, cheap_probe_offset, read_at_vaddr
from .errors import BpfUnavailable, MissingPrivileges, NoSuchProcess
from .events import PROBES_DIR, logits_chunk_for
from .layouts import EngineBuild

RING_BUFFER_PAGES = 16384  # 64 MiB: a 1 MiB ring lost 35-70% of a burst here, 16 MiB lost none;
# the consumer drains every 0.5 s, and full capture with a 32k vocabulary writes ~40 MB/s


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
    # serving context (llama-server): which request each sequence serves
    ProbeSpec(tg.SYM_TASK_POST_ONE, "task_post_one", None, False),
    ProbeSpec(tg.SYM_TASK_POST_VEC, "task_post_vec", None, False),
    ProbeSpec(tg.SYM_SLOT_LAUNCH, "slot_launch", None, False),
    ProbeSpec(tg.SYM_SLOT_LAUNCH_OLD, "slot_launch", None, False),
    ProbeSpec(tg.SYM_SLOT_LAUNCH_PARENT, "slot_launch_parent", None, False),
    ProbeSpec(tg.SYM_SLOT_RELEASE, "slot_release", None, False),
    ProbeSpec(tg.SYM_PROCESS_TOKEN, "slot_token", None, False),
    ProbeSpec(tg.SYM_PROCESS_TOKEN_OLD, "slot_token", None, False),
]
#: the socket-read tracepoints (not a uprobe): on when the process is a server, name for `skip`
HTTP_READS = "http_reads"


def _wanted(spec: ProbeSpec, capture: Capture) -> bool:
    if spec.feature is None:
        return True
    if spec.feature == "routes_or_probs":
        return capture.routes or capture.router_probs
    return bool(getattr(capture, spec.feature))


PROBE_SOURCES = ("token_probes.bpf.c", "sparse_probes.bpf.c", "server_probes.bpf.c")


def probe_source() -> str:
    """The BPF program text: BCC only rewrites and exports what is in its main text, so the probe
    files are concatenated rather than #included."""
    return "\n".join((PROBES_DIR / f).read_text() for f in PROBE_SOURCES)


def import_bcc() -> Any:
    try:
        import bcc
    except ImportError:
        raise BpfUnavailable(
            "the bcc Python module is not importable: install Debian's python3-bpfcc and libbpfcc and link "
            "/usr/lib/python3/dist-packages/bcc into this interpreter's site-packages "
            "(scripts/setup.sh does both)"
        ) from None
    return bcc


@dataclass
class AttachedProbe:
    symbol: str
    library: str
    offset: int
    kind: str  # "entry" | "return"


@dataclass
class Session:
    """A loaded and attached BPF program. `close()` detaches everything (idempotent)."""

    bpf: Any
    pid: int
    attached: list[AttachedProbe] = field(default_factory=list)
    compile_s: float = 0.0
    logits_chunk: int = 1024
    _closed: bool = False

    def counters(self) -> dict[str, int]:
        c = self.bpf["counters"]
        vals = [int(c[ctypes.c_int(i)].value) for i in range(5)]
        return {
            "records_produced": vals[0],
            "kernel_drops": vals[1],
            "ubatch_rows_not_copied": vals[2],
            "sparse_rows_not_captured": vals[3],
            "attention_rows_not_counted": vals[4],
        }

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # detaching the probes of a process that already exited may fail harmlessly
        with contextlib.suppress(Exception):
            self.bpf.cleanup()


def compile_and_attach(
    pid: int,
    where: dict[str, Path],
    build: EngineBuild,
    n_vocab: int,
    *,
    capture: Capture | None = None,
    skip: frozenset[str] = frozenset(),
) -> Session:
    bcc = import_bcc()
    capture = capture or Capture()
    http_reads = is_server(where) and HTTP_READS not in skip
    cflags = [
        f"-I{PROBES_DIR}",
        *build.ubatch.cflags(),
        *build.tensor.cflags(),
        *build.server.cflags(),
        *(["-DHTTP_READS", f"-DTARGET_TGID={pid}"] if http_reads else []),
        *capture.cflags(),
        f"-DN_VOCAB={n_vocab}",
        f"-DLOGITS_CHUNK={logits_chunk_for(n_vocab)}",
        f"-DRB_PAGES={RING_BUFFER_PAGES}",
        "-Wno-macro-redefined",
    ]
    t0 = time.monotonic()
    try:
        b = bcc.BPF(text=probe_source(), cflags=cflags)
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
    sess = Session(bpf=b, pid=pid, compile_s=time.monotonic() - t0, logits_chunk=logits_chunk_for(n_vocab))
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
        for spec in PROBES:
            lib = where.get(spec.symbol)
            if lib is None or spec.symbol in skip or not _wanted(spec, capture):
                continue
            syms = tg.elf_symbols(lib)
            vaddr = syms[spec.symbol][0]
            code = read_at_vaddr(lib, vaddr, 32)
            # a return probe needs the return address at [rsp]: only entry-only probes may skip
            # a stack-realigning prologue
            off = cheap_probe_offset(code) if spec.fn_return else cheap_entry_probe_offset(code)
            if spec.fn_entry:
                _attach(b.attach_uprobe, lib, vaddr + off, spec.fn_entry, pid)
                sess.attached.append(AttachedProbe(spec.symbol, str(lib), off, "entry"))
            if spec.fn_return:
                _attach(b.attach_uretprobe, lib, vaddr + off, spec.fn_return, pid)
                sess.attached.append(AttachedProbe(spec.symbol, str(lib), off, "return"))
    except BaseException:
        sess.close()
        raise
    return sess


def is_server(where: dict[str, Path]) -> bool:
    """The process runs llama-server's task/slot machinery (a built binary or xllamacpp)."""
    return (tg.SYM_SLOT_LAUNCH in where or tg.SYM_SLOT_LAUNCH_OLD in where) and (
        tg.SYM_TASK_POST_ONE in where or tg.SYM_TASK_POST_VEC in where
    )


def _attach(fn: Any, lib: Path, vaddr: int, fn_name: str, pid: int) -> None:
    try:
        fn(name=str(lib), addr=vaddr, fn_name=fn_name, pid=pid)
    except Exception as e:
        msg = str(e)
        try:
            tg.check_process(pid)
        except NoSuchProcess:
            raise
        raise BpfUnavailable(f"could not attach a uprobe to {lib} at {vaddr:#x} ({fn_name}): {msg}") from None


class _Arena:
    """Records of one size, back to back in a numpy buffer that is reused drain after drain:
    fresh buffers every drain cost a page fault per 4 KiB (about 1 ms per token of 128 KiB of
    logits here), reuse costs none."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.buf = np.empty(max(size * 64, 1 << 16), dtype=np.uint8)
        self.addr = self.buf.ctypes.data
        self.used = 0

    def append(self, data: Any) -> None:
        end = self.used + self.size
        if end > len(self.buf):
            bigger = np.empty(max(2 * len(self.buf), end), dtype=np.uint8)
            bigger[: self.used] = self.buf[: self.used]
            self.buf, self.addr = bigger, bigger.ctypes.data
        ctypes.memmove(self.addr + self.used, data, self.size)
        self.used = end


class RingReader:
    """Drains the ring buffer into per-size arenas when asked (`take()`), on the consumer's own
    thread. A separate reader thread cost more than it saved: every record's callback had to win
    the GIL from the busy consumer, and the hand-offs cost 5-10x the copying itself (measured:
    215 us of CPU per token instead of 17-42 us). The ring holds several seconds of records, so
    draining every half second loses nothing; what it cannot hold is counted as dropped."""

    #: records per take() at most, so that a producer faster than us cannot keep us in the
    #: callback forever; the rest waits in the ring for the next take()
    MAX_RECORDS_PER_TAKE = 1 << 20

    def __init__(self, sess: Session) -> None:
        self._sess = sess
        self._fill: dict[int, _Arena] = {}
        self._spare: dict[int, _Arena] = {}
        self._taken = 0
        limit = self.MAX_RECORDS_PER_TAKE

        def on_record(_ctx: Any, data: Any, size: int) -> int:
            arena = self._fill.get(size)
            if arena is None:
                arena = self._fill[size] = _Arena(size)
            arena.append(data)
            self._taken += 1
            # a negative return ends this consume early
            return -1 if self._taken >= limit else 0

        self._cb = on_record
        sess.bpf["events"].open_ring_buffer(on_record)

    def take(self) -> dict[int, np.ndarray]:
        """Drain the ring and return what it held: {record size: the records back to back}.
        The arrays are valid until the next take()."""
        self._taken = 0
        self._sess.bpf.ring_buffer_consume()
        full, self._fill = self._fill, self._spare
        for a in self._fill.values():
            a.used = 0
        self._spare = full
        return {size: a.buf[: a.used] for size, a in full.items() if a.used}

    def stop(self) -> dict[int, np.ndarray]:
        """The last records (the probes are detached by the session afterwards)."""
        return self.take()
