"""A flush done in pieces between drains.

A flush (every `--flush-interval`) frames the rows gathered since the last one, hands them to the
aggregates, the policy, the sinks and the writer, and writes a Parquet segment per table and
meta.json: tens of milliseconds of the consumer's CPU on a 4-client server. At nice 10 on a busy
machine that took many times as long in wall time, all of it between two drains, and the ring
filled for that long: the consumer escalated to the engine's priority several times a run
(scripts/bench_sustained.py; docs/overhead.md). Done in pieces (one table's frame, one table's
segment, meta.json, the collector's pass), the loop drains between them whenever a drain is due, so
a flush delays a drain by its longest piece rather than by all of it.

What a flush writes is fixed when it starts (the gathered rows are detached from the buffer): rows
gathered after it wait for the next one. A drain that frames rows of a table whose older rows the
flush has not framed yet hands the older ones over first (`before_frames`), so each table's rows
still reach their readers in the order they came (the OpenTelemetry sink's token events follow it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import polars as pl

from sparseety_prof.store.buffers import ColumnBuffer


class FlushRound:
    """One flush at a time, advanced a piece per `step`; `finish` does what is left at once."""

    def __init__(self) -> None:
        self._emit: Callable[[str, pl.DataFrame], None] = _nowhere  # a frame of a table's rows to its readers
        self._gathered: ColumnBuffer | None = None  # the rows this flush has not framed yet
        self._steps: Iterator[str] | None = None
        self.rounds = 0  # flushes started
        self.pieces = 0  # steps taken over all of them

    @property
    def active(self) -> bool:
        return self._steps is not None

    def start(
        self, gathered: ColumnBuffer, emit: Callable[[str, pl.DataFrame], None], rest: Iterator[str]
    ) -> None:
        """A flush of the rows `gathered`, framed a table at a time and given to `emit`, then
        `rest` (its writes: a yield after each piece, naming it). One still under way is
        finished first: flushes never overlap."""
        self.finish()
        self._gathered, self._emit = gathered, emit
        self._steps = self._run(rest)
        self.rounds += 1

    def step(self) -> str | None:
        """Do the next piece; what it was (None: nothing was left, the flush is over)."""
        if self._steps is None:
            return None
        try:
            done = next(self._steps)
        except StopIteration:
            self._steps = None
            return None
        except BaseException:
            self._steps = self._gathered = None  # a failed flush is not resumed
            raise
        self.pieces += 1
        return done

    def finish(self) -> None:
        """Every piece left, now (before a flush forced by memory pressure, and at the end)."""
        while self.step() is not None:
            pass

    def before_frames(self, table: str) -> None:
        """A drain is about to hand over frames of `table`: the older rows of it that this flush
        holds go first."""
        if self._gathered is not None:
            df = self._gathered.take(table)
            if df is not None:
                self._emit(table, df)

    def _run(self, rest: Iterator[str]) -> Iterator[str]:
        gathered = self._gathered
        assert gathered is not None
        for table in gathered.tables():
            df = gathered.take(table)  # (None when a drain's frames took it first)
            if df is not None:
                self._emit(table, df)
                yield f"rows {table}"
        self._gathered = None
        yield from rest


def _nowhere(table: str, df: pl.DataFrame) -> None:
    raise AssertionError(f"a frame of {table} with no flush started")
