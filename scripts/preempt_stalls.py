#!/usr/bin/env python3
"""How long the engine's threads wait when something preempts them, and who took their CPU.

Made to see how the consumer's CPU reaches the engine's inter-token tail (docs/overhead.md, "Why
the inter-token tail follows the consumer's CPU"): llama.cpp's threads meet at a barrier after
each graph node, so a thread that waits for its CPU holds the whole step back by about as long
as it waits. What matters for the tail is not only how much CPU the recorder takes but in what
pieces: one 4 ms stall in one step in a hundred moves the p99, 100 µs in every step does not.

A BCC program on the sched_switch tracepoint notes when an engine thread is switched out while
still runnable (preempted) and which process's thread took the CPU; when the engine thread runs
again the wait is added to a log2 histogram by who took it: the recorder (a process whose
command line holds `--recorder-match`), another process (the kernel's threads among them), or
this tracer (its scan of /proc for engines, once a second). Run it beside a benchmark:

    sudo .venv/bin/python scripts/preempt_stalls.py --seconds 100 &
    sudo .venv/bin/python scripts/bench_sustained.py --pairs 1 --seconds 45

Engines are the processes whose command line holds `--engine-match` (default: the engines of
tests/engines), found again every second. The figures are per wait: count, total, the share of
the total in waits of 1 ms and more, the median's and the p99's bucket, and the histogram; then
the other processes that took the most. `scripts/bench_sustained.py --stalls` counts the same
per side of each pair (StallTracer).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # bench_figures lives there
from bench_figures import Stalls  # noqa: E402

from sparseety_prof.terminal_text import visible  # noqa: E402

BPF_TEXT = r"""
struct stall_key_t {
    u32 culprit_tgid;  // the process whose thread took the CPU (0: not known)
    u32 slot;          // log2 of the wait in µs
};
BPF_HASH(engine_tgid, u32, u8, 64);
BPF_HASH(tgid_of, u32, u32, 65536);       // tid -> tgid, learnt as threads are switched out
BPF_HASH(out_at, u32, u64, 4096);         // engine tid preempted -> when
BPF_HASH(out_by, u32, u32, 4096);         // engine tid preempted -> the tgid that took its CPU
BPF_HASH(stalls, struct stall_key_t, u64, 4096);
BPF_HASH(stall_ns, u32, u64, 4096);       // culprit tgid -> total wait
BPF_HASH(long_ns, u32, u64, 4096);        // culprit tgid -> total of the waits of 1 ms and more
BPF_HASH(long_n, u32, u64, 4096);         // culprit tgid -> how many waits of 1 ms and more

TRACEPOINT_PROBE(sched, sched_switch) {
    u64 id = bpf_get_current_pid_tgid();  // the task switched out
    u32 prev = args->prev_pid, next = args->next_pid, tgid = id >> 32;
    u64 now = bpf_ktime_get_ns();
    if (prev != 0)
        tgid_of.update(&prev, &tgid);
    // switched out while runnable: preempted (the state has no sleep bits)
    if (engine_tgid.lookup(&tgid) && (args->prev_state & 0xff) == 0) {
        u32 by = 0, *t = tgid_of.lookup(&next);
        if (t)
            by = *t;
        out_at.update(&prev, &now);
        out_by.update(&prev, &by);
    }
    u64 *at = out_at.lookup(&next);
    if (at) {
        u64 wait = now - *at;
        u32 *by = out_by.lookup(&next);
        struct stall_key_t k = {};
        k.culprit_tgid = by ? *by : 0;
        k.slot = bpf_log2l(wait / 1000 + 1);
        stalls.increment(k);
        stall_ns.increment(k.culprit_tgid, wait);
        if (wait >= 1000000) {
            long_ns.increment(k.culprit_tgid, wait);
            long_n.increment(k.culprit_tgid);
        }
        out_at.delete(&next);
        out_by.delete(&next);
    }
    return 0;
}
"""


#: who took an engine thread's CPU, as the tables name it
CLASSES = ("recorder", "engine", "other", "tracer", "unknown")
#: how many of the other processes the report names
TOP_OTHERS = 5
#: the maps summed per culprit: total wait, the part in waits of 1 ms and more, and how many such
#: waits (the one threshold for "long" is the BPF program's)
_PER_CULPRIT = ("stall_ns", "long_ns", "long_n")


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:  # (bounded: any process sets its own)
            return f.read(4096).replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _comm(pid: int) -> str:
    """A process's name as it set it (shown through terminal_text), or "?" once it is gone."""
    try:
        with open(f"/proc/{pid}/comm", "rb") as f:
            return f.read(64).decode(errors="replace").strip()
    except OSError:
        return "?"


def _matching(pattern: str) -> set[int]:
    pids = (int(p) for p in os.listdir("/proc") if p.isdigit())
    return {p for p in pids if p != os.getpid() and pattern in _cmdline(p)}


class StallTracer:
    """The BPF program loaded, counting the waits of the engines added (add_engine) until take()
    reads and clears them; close() unloads it."""

    def __init__(self) -> None:
        from bcc import BPF  # (root only; imported late so --help works anywhere)

        self._bpf = BPF(text=BPF_TEXT)
        self.engines: set[int] = set()

    def add_engine(self, pid: int) -> None:
        t = self._bpf["engine_tgid"]
        t[t.Key(pid)] = t.Leaf(1)
        self.engines.add(pid)

    def take(self, recorders: set[int]) -> Stalls:
        """The waits counted since the last take (or the start), the processes in `recorders` as
        the recorder's; the counts start again from zero."""
        me = os.getpid()

        def cls(tgid: int) -> str:
            if tgid in recorders:
                return "recorder"
            if tgid in self.engines:
                return "engine"
            if tgid == me:
                return "tracer"
            return "other" if tgid else "unknown"

        hist: dict[str, dict[int, int]] = {}
        for k, v in self._bpf["stalls"].items():
            slots = hist.setdefault(cls(k.culprit_tgid), {})
            slots[k.slot] = slots.get(k.slot, 0) + v.value
        by_class: dict[str, dict[str, int]] = {}  # map -> class -> its sum
        for name in _PER_CULPRIT:
            sums = by_class[name] = {}
            for k, v in self._bpf[name].items():
                sums[cls(k.value)] = sums.get(cls(k.value), 0) + v.value
        by_tgid = [(v.value, k.value) for k, v in self._bpf["stall_ns"].items()]
        others = sorted(((ns, tgid) for ns, tgid in by_tgid if cls(tgid) == "other"), reverse=True)
        top = [(visible(_comm(tgid)), tgid, ns) for ns, tgid in others[:TOP_OTHERS]]
        for name in ("stalls", *_PER_CULPRIT):
            self._bpf[name].clear()
        total, long_ns, long_n = (by_class[name] for name in _PER_CULPRIT)
        return Stalls(hist, total, long_ns, long_n, set(self.engines), set(recorders), top)

    def close(self) -> None:
        self._bpf.cleanup()


def trace(seconds: float, engine_match: str, recorder_match: str) -> Stalls:
    """Trace for `seconds` (or until KeyboardInterrupt), finding engines and recorders by command
    line every second."""
    tracer = StallTracer()
    try:
        recorders: set[int] = set()
        end = time.monotonic() + seconds
        try:
            while True:
                for pid in _matching(engine_match) - tracer.engines:
                    tracer.add_engine(pid)
                recorders |= _matching(recorder_match)
                left = end - time.monotonic()
                if left <= 0:
                    break
                time.sleep(min(1.0, left))
        except KeyboardInterrupt:  # (SIGINT ends the trace early: what was counted is reported)
            pass
        return tracer.take(recorders)
    finally:
        tracer.close()


def bucket(slot: int) -> str:
    """A log2 slot's upper bound in µs (slot s: waits below 2**s µs)."""
    return f"<{2**slot}" if slot else "<1"


def table(st: Stalls) -> list[str]:
    """Markdown rows: per class, waits, total, median and p99 bucket, and the histogram."""
    out = [
        "| CPU taken by | waits | total ms | of it in waits ≥ 1 ms | median | p99 | histogram (µs: waits) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name in CLASSES:
        h = st.hist.get(name)
        if not h:
            continue
        n = sum(h.values())
        acc, med, p99 = 0, 0, 0
        for slot in sorted(h):
            acc += h[slot]
            med = med or (slot if acc >= n / 2 else 0)
            p99 = p99 or (slot if acc >= n * 0.99 else 0)
        total_ms = st.total_ns.get(name, 0) / 1e6
        share = f"{st.long_ns.get(name, 0) / 1e6 / total_ms:.0%}" if total_ms else "-"
        cells = ", ".join(f"{bucket(s)}: {h[s]}" for s in sorted(h))
        out.append(f"| {name} | {n} | {total_ms:.1f} | {share} | {bucket(med)} | {bucket(p99)} | {cells} |")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--engine-match", default="tests/engines/", help="an engine's command line holds this")
    ap.add_argument("--recorder-match", default="sparseety_prof.cli record")
    a = ap.parse_args()
    if os.geteuid() != 0:
        print("preempt_stalls: needs root (BPF)", file=sys.stderr)
        return 2
    # SIGINT or SIGTERM end the trace early, as its report says (a shell's background job starts
    # with SIGINT ignored: the handler is set here, not inherited)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    st = trace(a.seconds, a.engine_match, a.recorder_match)
    print(f"engines {sorted(st.engines)}, recorders {sorted(st.recorders)}, {a.seconds:.0f} s")
    print("\n".join(table(st)))
    if st.top_others:
        named = ", ".join(f"{name} ({pid}) {ns / 1e6:.1f} ms" for name, pid, ns in st.top_others)
        print(f"the other processes that took the most: {named}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
