"""The figures the benchmark scripts make of what they sample: the requests' token times of a
side, the answer lengths both sides ask for, the engine's preemptions and the machine's idle CPU,
the stall and loss cells. scripts/bench_sustained.py, scripts/preempt_stalls.py and
scripts/yield_pieces.py use them (tests/ is on their path); tests/test_bench_itl.py checks them."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np


class Stalls(NamedTuple):
    """The waits of engine threads preempted, by who took the CPU: log2 µs bucket -> count, and
    the total wait in ns."""

    hist: dict[str, dict[int, int]]
    total_ns: dict[str, int]
    long_ns: dict[str, int]  # of total_ns, in waits of 1 ms and more
    long_waits: dict[str, int]  # how many waits of 1 ms and more
    engines: set[int]
    recorders: set[int]
    top_others: list[tuple[str, int, int]]  # the "other" processes that took the most: name, pid, ns


@dataclass(frozen=True)
class AnswerLengths:
    """Each request's answer length: `tokens` within ±`spread` of it (a fraction), drawn from a
    hash of (client, request number) so that both sides of a pair, and every pair, ask for the
    same lengths in the same order."""

    tokens: int
    spread: float = 0.0

    def __call__(self, client: int, i: int) -> int:
        if self.spread <= 0:
            return self.tokens
        digest = hashlib.blake2b(f"{client}:{i}".encode(), digest_size=8).digest()
        u = int.from_bytes(digest, "little") / 2**64  # uniform in [0, 1)
        lo = self.tokens * (1 - self.spread)
        return max(1, round(lo + u * 2 * self.spread * self.tokens))


def answer_lengths(tokens: int | AnswerLengths) -> AnswerLengths:
    """A load's lengths: other scripts pass one length for every request."""
    return tokens if isinstance(tokens, AnswerLengths) else AnswerLengths(tokens)


@dataclass
class Side:
    """One side of a pair: every request's send time and token arrival times (ns, CLOCK_MONOTONIC),
    and the engine process's user and system CPU time over the side (timed_load)."""

    requests: list[tuple[int, list[int]]] = field(default_factory=list)
    engine_user_s: float = 0.0
    engine_sys_s: float = 0.0
    engine_preempted: int = 0  # its threads' involuntary context switches over the side
    machine_idle_s: float = 0.0  # CPU time the machine's cores spent idle over the side (idle_cpu_s)
    stalls: Stalls | None = None  # with --stalls: the engine threads' waits when preempted, by culprit

    def add(self, t_request: int, times: list[int]) -> None:
        if times:
            self.requests.append((t_request, times))

    @property
    def tokens(self) -> int:
        return sum(len(t) for _, t in self.requests)

    def tps(self) -> float:
        start = min(r for r, _ in self.requests)
        end = max(t[-1] for _, t in self.requests)
        return self.tokens / ((end - start) / 1e9)

    def ttft_ms(self) -> np.ndarray:
        return np.array([(t[0] - r) / 1e6 for r, t in self.requests])

    def itl_ms(self) -> np.ndarray:
        return np.concatenate([np.diff(np.array(t, dtype=np.int64)) / 1e6 for _, t in self.requests])

    def prefill_gaps(self) -> np.ndarray:
        """Per inter-token gap (itl_ms's order), whether another request's prompt ran in its step.
        On a server whose slots share forward passes, a step that takes in a new prompt is as
        long as that prompt's prefill for every other slot streaming: those gaps are their own
        population (up to 2% of the gaps at 4 clients and 64-token answers), and a p99 over all gaps
        sits at its edge. A request's first token comes with the step that ran its prompt, and
        reaches its client about when the other slots' tokens of that step reach theirs: the gap
        of another request holding that time, shifted back by half the median gap (the clients
        read their streams a little apart), is the one that waited for the prompt. One request
        at a time (llama-cpp-python): none."""
        times = [np.array(t, dtype=np.int64) for _, t in self.requests]  # (add keeps none empty)
        flags = [np.zeros(len(t) - 1, dtype=bool) for t in times]
        if len(times) < 2:
            return np.concatenate(flags) if flags else np.zeros(0, dtype=bool)
        half = int(np.median(self.itl_ms()) * 1e6) // 2
        firsts = np.array([t[0] for t in times], dtype=np.int64)
        for k, t in enumerate(times):
            others = np.delete(firsts, k) - half
            at = np.searchsorted(t, others, side="left")  # gap i is (t[i], t[i + 1]]: at = i + 1
            inside = (at > 0) & (at < len(t))
            flags[k][at[inside] - 1] = True
        return np.concatenate(flags)

    def itl_decode_ms(self) -> np.ndarray:
        """The inter-token gaps of steps that ran no other request's prompt (prefill_gaps)."""
        return self.itl_ms()[~self.prefill_gaps()]


def idle_cpu_s() -> float:
    """CPU time all of the machine's cores have spent idle since boot (/proc/stat's cpu line: idle
    and iowait, in USER_HZ ticks). Per token over a side, it is the room the engine and the load
    leave: what a consumer at SCHED_IDLE could run in without taking a core from the engine
    (docs/overhead.md). A tick is 10 ms, so over a 40-s side it is exact to a few parts in a thousand."""
    with open("/proc/stat") as f:
        fields = f.readline().split()
    if fields[0] != "cpu":
        raise RuntimeError(f"/proc/stat begins with {fields[0]!r}, not the cpu line")
    return (int(fields[4]) + int(fields[5])) / os.sysconf("SC_CLK_TCK")


def preemptions(pid: int) -> int:
    """The involuntary context switches of a process's threads so far (/proc/PID/task/*/status
    nonvoluntary_ctxt_switches): how often another thread took their core while they could run.
    Threads that exited in between are not counted (the engines' threads live as long as they)."""
    total = 0
    for status in Path(f"/proc/{pid}/task").glob("*/status"):
        try:
            text = status.read_text()
        except OSError:  # the thread exited
            continue
        for line in text.splitlines():
            if line.startswith("nonvoluntary_ctxt_switches:"):
                total += int(line.split()[1])
    return total


#: --stalls: per side, µs of engine-thread waits per generated token, for the recorder's threads
#: (B) and for anything else (A and B: other processes, the benchmark's own clients, and the
#: engine's other threads, such as a server's HTTP threads); of the recorder's, the share in waits
#: of 1 ms and more, and how many such waits per 100 tokens
STALL_ROWS = ("wait_rec_b", "wait_rec_long_share_b", "long_waits_rec_b", "wait_other_a", "wait_other_b")


def stall_figures(rows: dict[str, list[float]], pa: Side, pb: Side) -> None:
    """One pair's --stalls figures (STALL_ROWS)."""
    assert pa.stalls is not None and pb.stalls is not None
    rec_ns = pb.stalls.total_ns.get("recorder", 0)
    rows["wait_rec_b"].append(rec_ns / max(pb.tokens, 1) / 1e3)
    rows["wait_rec_long_share_b"].append(pb.stalls.long_ns.get("recorder", 0) / rec_ns if rec_ns else 0.0)
    rows["long_waits_rec_b"].append(pb.stalls.long_waits.get("recorder", 0) / max(pb.tokens, 1) * 100)
    for side, p in (("a", pa), ("b", pb)):
        assert p.stalls is not None
        other = sum(ns for name, ns in p.stalls.total_ns.items() if name != "recorder")
        rows[f"wait_other_{side}"].append(other / max(p.tokens, 1) / 1e3)


def losses_text(r: dict[str, Any]) -> str:
    """The losses cell: the ring's lost records of those produced, then any other loss by kind
    (activation rows past the in-kernel counting budget are rows, not records)."""
    text = f"{r['losses']} of {r['records']} records"
    kinds = r.get("not_captured") or {}
    return text + "".join(f"; {k} {v}" for k, v in kinds.items())
