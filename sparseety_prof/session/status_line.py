"""`--status-interval SECONDS`: one line on stderr every so often, for a service's log (journald,
`kubectl logs`): tokens, requests, losses, the recorder's CPU and memory, the ring's fill, with
--follow the runs so far, and with --duty-cycle the share of the time in full detail.

The line is made from the Progress the consumer already keeps (session/options.py), read from a
thread of its own: nothing is added to the consumer's loop. The counters are cumulative (over
every run of a follower); the CPU share is over the last interval. On by default when stderr is
not a terminal (a service's log), off on a terminal (the line would interleave with what the
operator types) unless asked for; 0 turns it off."""

from __future__ import annotations

import os
import resource
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TextIO

from sparseety_prof.session.options import Progress
from sparseety_prof.terminal_text import line

__all__ = ["DEFAULT_INTERVAL_S", "StatusReading", "StatusTicker", "format_status", "status_interval"]

DEFAULT_INTERVAL_S = 30.0


def status_interval(given: float | None, stream: TextIO) -> float:
    """The interval in seconds (0: off): `given`, or the default when `stream` is not a terminal."""
    if given is not None:
        return given
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):
        tty = False
    return 0.0 if tty else DEFAULT_INTERVAL_S


@dataclass(frozen=True)
class StatusReading:
    """What one status line says (cumulative counters)."""

    tokens: int
    requests: int
    kernel_drops: int
    seq_gaps: int
    logits_incomplete: int
    cpu_s: float  # the recorder's, since it started
    rss_bytes: int
    ring_fill_peak: float  # the largest share of the ring a drain found filled (0..1), this run
    runs: int | None = None  # with --follow: engine processes attached so far
    attached_pid: int | None = None  # with --follow: the one recorded now (None: waiting)
    sparse_coverage: float | None = None  # --duty-cycle: share of the time in full detail, this run

    @property
    def losses(self) -> int:
        return self.kernel_drops + self.seq_gaps + self.logits_incomplete


def format_status(now: StatusReading, cpu_share: float | None) -> str:
    """The line: fixed `key value` tokens, easy to grep and parse."""
    parts = ["sparseety-prof: status:"]
    if now.runs is not None:
        state = f"recording PID {now.attached_pid}" if now.attached_pid is not None else "waiting"
        parts.append(f"runs {now.runs} ({state}),")
    parts += [
        f"tokens {now.tokens},",
        f"requests {now.requests},",
        f"losses {now.losses} (kernel_drops {now.kernel_drops}, seq_gaps {now.seq_gaps}, "
        f"logits_incomplete {now.logits_incomplete}),",
        f"cpu {now.cpu_s:.1f} s"
        + (f" ({cpu_share * 100:.1f}% of a core)," if cpu_share is not None else ","),
        f"rss {now.rss_bytes / (1 << 20):.0f} MiB,",
        f"ring peak {now.ring_fill_peak * 100:.0f}%",
    ]
    if now.sparse_coverage is not None:  # the sparse columns hold this share of the time's steps
        parts[-1] += ","
        parts.append(f"sparse coverage {now.sparse_coverage * 100:.1f}%")
    return line(" ".join(parts))


class ProgressTotals:
    """Progress summed over runs: `add_closed` after each run, `reading(current)` any time."""

    def __init__(self) -> None:
        self._done = Progress()
        self.requests_done = 0

    def add_closed(self, p: Progress) -> None:
        d = self._done
        d.tokens += p.tokens
        d.requests += p.requests
        d.kernel_drops += p.kernel_drops
        d.seq_gaps += p.seq_gaps
        d.logits_incomplete += p.logits_incomplete

    def reading(self, current: Progress | None, **follow: int | None) -> StatusReading:
        d, c = self._done, current or Progress()
        return StatusReading(
            tokens=d.tokens + c.tokens,
            requests=d.requests + c.requests,
            kernel_drops=d.kernel_drops + c.kernel_drops,
            seq_gaps=d.seq_gaps + c.seq_gaps,
            logits_incomplete=d.logits_incomplete + c.logits_incomplete,
            cpu_s=process_cpu_s(),
            rss_bytes=c.rss_bytes or resident_now(),
            ring_fill_peak=c.ring_fill_peak,
            sparse_coverage=c.sparse_coverage,
            **follow,
        )


def process_cpu_s() -> float:
    """This process's CPU (user + system) since it started: the recorder's whole cost."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def resident_now() -> int:
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class StatusTicker:
    """Writes `format_status(read())` every `interval_s` from a daemon thread until `stop()`."""

    def __init__(
        self, interval_s: float, read: Callable[[], StatusReading], write: Callable[[str], None]
    ) -> None:
        self.interval_s = interval_s
        self._read = read
        self._write = write
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="status-line", daemon=True)

    def start(self) -> StatusTicker:
        if self.interval_s > 0:
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        t0, cpu0 = time.monotonic(), process_cpu_s()
        while not self._stop.wait(self.interval_s):
            now = self._read()
            t1 = time.monotonic()
            share = (now.cpu_s - cpu0) / (t1 - t0) if t1 > t0 else None
            t0, cpu0 = t1, now.cpu_s
            try:
                self._write(format_status(now, share))
            except (OSError, ValueError):  # stderr gone (a closed pipe): the recording goes on
                return
