"""Run the layout-discovery probe on a live engine until its `llama_ubatch` layout is known.

Attaches probes/discover_ubatch.bpf.c to the micro-batch entry, the public decode entry and the
sampler returns, feeds what they copy to layout_discovery.discover after every poll, and detaches
as soon as one layout is proven (or the time is up). The forward passes it watches are not
recorded: the recording probes are compiled with the layout it finds.
"""

from __future__ import annotations

import contextlib
import ctypes
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from sparseety_prof.capture import target as tg
from sparseety_prof.capture.bpf_loader import cheap_entry_probe_offset, import_bcc
from sparseety_prof.capture.elf import read_at_vaddr
from sparseety_prof.capture.events import PROBES_DIR
from sparseety_prof.capture.layout_discovery import Verdict, discover, parse
from sparseety_prof.capture.layouts import UbatchLayout
from sparseety_prof.capture.params_check import ParamsVerdict, check_params
from sparseety_prof.errors import BpfUnavailable, MissingPrivileges, UnsupportedEngineBuild

MAX_RECORDS = 4096  # a discovery that has not converged after this many records never will
POLL_BUDGET = 32  # micro-batch records per poll: well inside the 1 MiB ring


@dataclass(frozen=True)
class Discovery:
    layout: UbatchLayout
    ubatches: int  # forward passes watched (not recorded)
    seconds: float  # from attaching the discovery probe to the verdict
    compile_s: float
    evidence: tuple[str, ...]
    drops: int  # discovery records the ring had no room for (counted in BPF)
    params: ParamsVerdict  # the ggml_compute_params offsets, checked on the same forward passes

    def to_meta(self) -> dict[str, object]:
        return {
            "ubatch_layout": self.layout.__dict__,
            "ubatches_watched": self.ubatches,
            "seconds": round(self.seconds, 3),
            "compile_s": round(self.compile_s, 3),
            "anchors": list(self.evidence),
            "drops": self.drops,
            "compute_params": {
                "offsets": list(self.params.offsets) if self.params.offsets else None,
                "calls": self.params.calls,
                "source": self.params.source,
            },
        }


def run_discovery(
    pid: int,
    where: dict[str, Path],
    n_vocab: int,
    *,
    timeout_s: float,
    log: Callable[[str], None],
    stop: Callable[[], bool] = lambda: False,
    params_table: tuple[int, int] = (0, 4),
) -> Discovery:
    """Watch forward passes until exactly one layout fits them. UnsupportedEngineBuild (exit 6)
    when no layout fits, naming the invariant, or when none was proven within `timeout_s`. The
    ggml_compute_params offsets are checked on the same passes (`params_table` kept if it holds)."""
    bcc = import_bcc()
    t0 = time.monotonic()
    try:
        b = bcc.BPF(src_file=str(PROBES_DIR / "discover_ubatch.bpf.c"), cflags=["-Wno-macro-redefined"])
    except Exception as e:
        if "Operation not permitted" in str(e):
            raise MissingPrivileges(f"the kernel refused the discovery probe ({e}): run as root") from None
        raise BpfUnavailable(f"could not compile the layout-discovery probe: {e}") from None
    compile_s = time.monotonic() - t0
    records: list[bytes] = []
    params: list[bytes] = []

    def on_record(_ctx: object, data: int, size: int) -> None:
        if len(records) < MAX_RECORDS:
            records.append(ctypes.string_at(data, size))

    def on_params(_ctx: object, data: int, size: int) -> None:
        params.append(ctypes.string_at(data, size))

    try:
        b["dsc_events"].open_ring_buffer(on_record)
        b["dsc_params_events"].open_ring_buffer(on_params)
        if tg.SYM_GET_ROWS in where:  # a CPU op every text model's graph runs (the token embedding)
            _attach(b, pid, where, tg.SYM_GET_ROWS, "dsc_params", ret=False)
        _attach(b, pid, where, tg.SYM_UBATCH, "dsc_ubatch", ret=False)
        if tg.SYM_DECODE in where:
            _attach(b, pid, where, tg.SYM_DECODE, "dsc_batch", ret=False)
        for sym in (tg.SYM_LLAMA_SAMPLER, tg.SYM_COMMON_SAMPLER):
            if sym in where:
                _attach(b, pid, where, sym, "dsc_sample", ret=True)
        t_attached = time.monotonic()
        log(
            f"sparseety-prof: learning this build's llama_ubatch layout from live forward passes "
            f"(up to {timeout_s:.0f} s; the engine must be working: send it a request)"
        )
        verdict = Verdict(None, 0, 0, "no forward pass was seen")
        judged = 0  # records the verdict was made on: judge again only when more came
        budget = b["dsc_budget"]
        while True:
            budget[ctypes.c_int(0)] = ctypes.c_uint64(POLL_BUDGET)
            b.ring_buffer_poll(100)
            if len(records) > judged:
                judged = len(records)
                verdict = discover(parse(records), n_vocab)
                if verdict.layout is not None:
                    break
                if verdict.candidates == 0 and verdict.ubatches:
                    raise UnsupportedEngineBuild(
                        f"unsupported engine build: no consistent llama_ubatch layout in PID {pid}'s "
                        f"{where[tg.SYM_UBATCH]} ({verdict.reason}; {verdict.ubatches} micro-batches "
                        f"examined). Recording it would produce garbage, so nothing was attached."
                    )
            if len(records) >= MAX_RECORDS or time.monotonic() - t_attached > timeout_s or stop():
                raise UnsupportedEngineBuild(
                    f"unsupported engine build: the llama_ubatch layout of PID {pid} was not proven within "
                    f"{timeout_s:.0f} s ({verdict.reason}). Run the engine on a prompt while attaching, or "
                    f"raise --discover-timeout"
                )
            tg.check_process(pid)  # NoSuchProcess when the engine exited meanwhile
        pv = check_params(params, params_table)
        if pv.offsets is None and pv.calls:
            raise UnsupportedEngineBuild(
                f"unsupported engine build: no consistent ggml_compute_params layout in PID {pid} "
                f"({pv.source}; {pv.calls} compute calls examined). Nothing was attached."
            )
        return Discovery(
            layout=verdict.layout,
            ubatches=verdict.ubatches,
            seconds=time.monotonic() - t_attached,
            compile_s=compile_s,
            evidence=verdict.evidence,
            drops=int(b["dsc_drops"][ctypes.c_int(0)].value),
            params=pv,
        )
    finally:
        with contextlib.suppress(Exception):
            b.cleanup()


def _attach(b: object, pid: int, where: dict[str, Path], role: str, fn: str, *, ret: bool) -> None:
    lib = where[role]
    vaddr = tg.elf_symbols(lib)[tg.symbol_in(lib, role)][0]
    # a return probe needs the return address at [rsp]: it sits on the first instruction
    off = 0 if ret else cheap_entry_probe_offset(read_at_vaddr(lib, vaddr, 32))
    attach = b.attach_uretprobe if ret else b.attach_uprobe  # type: ignore[attr-defined]
    name = tg.pinned_path(pid, lib)  # the file the process maps, whatever its name leads to now
    try:
        attach(name=name, addr=vaddr + off, fn_name=fn, pid=pid)
    except Exception as e:
        tg.check_process(pid)
        raise BpfUnavailable(f"could not attach the discovery probe to {lib} ({role}): {e}") from None
