"""The only module that imports bcc: compiles probes/token_probes.bpf.c for one engine build,
attaches it to one process, and drains its ring buffer on a reader thread.

BCC reports failures as bare `Exception` strings; they are translated here into the project's
own errors so callers never see them.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import target as tg
from .capture import Capture
from .elf import cheap_entry_probe_offset, cheap_probe_offset, read_at_vaddr
from .errors import BpfUnavailable, MissingPrivileges, NoSuchProcess
from .events import PROBES_DIR, logits_chunk_for
from .layouts import EngineBuild

RING_BUFFER_PAGES = 8192  # 32 MiB: a 1 MiB ring lost 35-70% of a burst here, 16 MiB lost none
DRAIN_PERIOD_S = 0.1  # the reader empties the ring this often (records never wake it)


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
]


def _wanted(spec: ProbeSpec, capture: Capture) -> bool:
    if spec.feature is None:
        return True
    if spec.feature == "routes_or_probs":
        return capture.routes or capture.router_probs
    return bool(getattr(capture, spec.feature))


PROBE_SOURCES = ("token_probes.bpf.c", "sparse_probes.bpf.c")


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
    cflags = [
        f"-I{PROBES_DIR}",
        *build.ubatch.cflags(),
        *build.tensor.cflags(),
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


class RingReader:
    """Drains the ring buffer on its own thread. The callback only copies the record's bytes;
    decoding happens in batches on the consumer side (`take()`)."""

    def __init__(self, sess: Session) -> None:
        self._sess = sess
        self._records: list[bytes] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._halt_poll = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sparseety-ring-reader", daemon=True)
        string_at = ctypes.string_at
        records = self._records
        halt = self._halt_poll

        def on_record(_ctx: Any, data: Any, size: int) -> int:
            records.append(string_at(data, size))
            # A negative return ends this poll early, so a hot producer cannot keep the
            # poll (and us) from seeing the stop request.
            return -1 if halt.is_set() else 0

        self._cb = on_record
        sess.bpf["events"].open_ring_buffer(on_record)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        # Records are submitted without a wakeup, so epoll would never fire: consume on a clock.
        b = self._sess.bpf
        while not self._stop.wait(DRAIN_PERIOD_S):
            b.ring_buffer_consume()

    def take(self) -> list[bytes]:
        """Everything drained so far. list.append/swap are atomic under the GIL."""
        with self._lock:
            out = self._records[:]
            del self._records[: len(out)]
        return out

    def stop(self) -> list[bytes]:
        """Stop the thread after a final drain and return what is left."""
        self._stop.set()
        self._halt_poll.set()
        self._thread.join(timeout=5)
        self._halt_poll.clear()
        self._sess.bpf.ring_buffer_consume()
        return self.take()
