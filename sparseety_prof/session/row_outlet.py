"""Where the consumer's rows go, and when.

Every drain's rows (tokens, steps, requests, routes, masks, kernels) are gathered in a
ColumnBuffer; a flush frames them and hands each frame to its readers: the always-on aggregates
(every row), the recording (what the policy keeps) and the sinks (OpenTelemetry, Prometheus: every
row). A flush comes on schedule (`--flush-interval`), done in pieces between drains
(flush_round.py), or at once under memory pressure (`--max-memory`) and at the end. A recording
with a journal (store/journal.py) has the rows gathered framed after a drain, at most every
JOURNAL_GAP_S, and handed to its readers, the recording's journal among them: a SIGKILL then
loses the last drain or so, not a flush interval (the rows the per-request policies hold reach
the recording, and so the journal, when decided, at flushes). When the recording stores every
row as it comes (no per-request policy, no redaction), the journal takes the rows as gathered
instead, unframed (store/gathered_codec.py), and the frames are made at flushes as without a
journal: a frame's fixed cost per column, paid after every drain, was most of the journal's
cost. Every reader (the aggregates, the recording and its policy, the sinks) takes the rows
through one interface (row_readers.py), the rows a policy set apart in the correlator (a
head-dropped request's, as arrays) included.

The recorder drives it (recorder.py); this module decides nothing about the engine or the ring.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import polars as pl

from sparseety_prof.session.collector import FlushTimedCollector
from sparseety_prof.session.flush_round import FlushRound
from sparseety_prof.session.memory_budget import PRESSURE_GAP_S, MemoryBudget, anon_bytes, trim_heap
from sparseety_prof.session.policy import RecordingPolicy
from sparseety_prof.session.row_readers import AggregateReader, RecordingReader, RowReader
from sparseety_prof.session.sched import ConsumerSched
from sparseety_prof.session.sinks import SinkFanout
from sparseety_prof.session.stage_cpu import StageCpu
from sparseety_prof.store.aggregates import Aggregator
from sparseety_prof.store.array_rows import ArrayRows, part_rows
from sparseety_prof.store.buffers import ColumnBuffer, FlushSchedule
from sparseety_prof.store.recording_writer import RecordingWriter

#: the shortest time between two framings for the journal: drains that come faster (a ring that
#: fills fast) share one, so that its fixed cost (a frame and a record per table) is paid at most
#: about twice a second; a drain's rows still reach the journal within about a second
JOURNAL_GAP_S = 0.5


class RowOutlet:
    """The rows' readers (`writer` may be None: nothing recorded; `aggregates` None: none kept)
    and the flushes that feed them. `collector` is told after each flush (collector.py);
    `stages` is charged for the flushes' pieces ("flush") and the journal's appends ("journal")."""

    def __init__(
        self,
        writer: RecordingWriter | None,
        policy: RecordingPolicy,
        aggregates: Aggregator | None,
        sinks: SinkFanout,
        *,
        stages: StageCpu,
        collector: FlushTimedCollector,
        log: Callable[[str], None],
    ) -> None:
        self.writer = writer
        self.policy = policy
        self.aggregates = aggregates
        self.sinks = sinks
        self.round = FlushRound()  # the flush under way, done in pieces between drains
        self._journaled = writer is not None and writer.journaling
        # the journal takes rows as gathered, not framed (the module's docstring says when)
        self._as_gathered = (
            self._journaled and writer is not None and writer.stores_as_given and policy.hold is None
        )
        self._rows = ColumnBuffer(journaled=self._as_gathered)
        # in this order: the aggregates, the recording, the sinks
        self.readers: list[RowReader] = [
            *([AggregateReader(aggregates)] if aggregates is not None else []),
            RecordingReader(writer, policy, journaled=self._as_gathered),
            sinks,
        ]
        self._gathered: dict[str, int] = {}  # per table, the rows gathered so far (as_gathered)
        self._stages = stages
        self._collector = collector
        self._log = log
        self._next_journal = 0.0  # (time.monotonic) the first drain after it writes the journal

    @property
    def wanted(self) -> bool:
        """Whether anything reads the rows: a recording or a sink (a live view alone does not)."""
        return self.writer is not None or bool(self.sinks)

    @property
    def write_failed(self) -> bool:
        """The recording could not be written (a full disk): the writer counts what is lost."""
        return self.writer is not None and self.writer.write_error is not None

    # ------------------------------------------------------------------ rows in
    def add(self, table: str, cols: Mapping[str, Any], *, final: bool = False) -> None:
        """One drain's rows of `table` (columns); a frame goes out whenever the buffer makes one."""
        for df in self._rows.add(table, cols, final=final):
            self.round.before_frames(table)  # a flush under way holds older rows of it
            self.emit(table, df)

    def emit(self, table: str, df: pl.DataFrame) -> None:
        """One frame of rows to every reader."""
        for reader in self.readers:
            reader.take(table, df)

    def add_apart(self, apart: Mapping[str, list[ArrayRows]]) -> None:
        """One drain's rows set apart (Correlator.take_apart: dropped requests' rows, only the
        columns that are read, as arrays: never framed) to every reader; before the drain's
        frames, whose requests rows may be those of these tokens."""
        for table, parts in apart.items():
            for reader in self.readers:
                reader.take_apart(table, parts)

    # ------------------------------------------------------------------ flushes
    def keep_durable(self, flush: FlushSchedule, drained_at: float, *, in_pieces: bool = False) -> None:
        """After each drain: the rows the recording was given since the last, to its journal (a
        SIGKILL then loses this drain's rows at most); and a flush on schedule (sinks get rows no
        older than the flush interval), at once or, `in_pieces`, started here and done by
        `flush_pieces` between drains."""
        if self._journaled and drained_at >= self._next_journal:
            self._next_journal = drained_at + JOURNAL_GAP_S
            self._stages.lap("flush")
            if self._as_gathered:
                self._journal_gathered()
            else:
                self._frame_gathered()
            assert self.writer is not None
            self.writer.write_journal()
            self._stages.lap("journal")
        if self.wanted and flush.due(drained_at):
            if in_pieces:
                self._start_flush()
            else:
                self.flush_now()

    def flush_now(self) -> None:
        """A flush of the rows gathered since the last one (after the one under way), all at once."""
        self._start_flush()
        self.round.finish()

    def flush_pieces(self, sched: ConsumerSched, *, until: float, stopped: Callable[[], bool]) -> None:
        """The pieces of a flush under way until `until` (time.monotonic), when the next drain is
        due, or until `stopped()`; one at least, so that a consumer pressed to drain all the time
        still flushes."""
        if not self.round.active:
            return
        self._stages.lap("loop")
        first = True
        while self.round.active and (first or time.monotonic() < until) and not stopped():
            t, cpu = time.monotonic(), time.thread_time()
            piece = self.round.step()
            sched.after_flush((time.monotonic() - t) * 1e3, (time.thread_time() - cpu) * 1e3, piece or "")
            first = False
        self._stages.lap("flush")

    def relieve_memory(self, budget: MemoryBudget, anon: int, now: float, sched: ConsumerSched) -> None:
        """Above --max-memory (`anon`: the recorder's anonymous bytes, read by this drain): the
        gathered rows go out now (a whole flush, timed as a piece of one), and the freed heap
        back to the kernel (memory_budget.py)."""
        if not budget.pressed(anon, now):
            return
        t, cpu = time.monotonic(), time.thread_time()
        self.flush_now()
        sched.after_flush((time.monotonic() - t) * 1e3, (time.thread_time() - cpu) * 1e3, "memory pressure")
        trim_heap()
        left = anon_bytes()
        if not budget.relieved(left) and budget.over_after_flush == 1:
            assert budget.limit is not None
            self._log(
                f"sparseety-prof: --max-memory {budget.limit >> 20} MiB is below what the recorder holds "
                f"with its rows written out ({left >> 20} MiB anonymous): it writes them out every "
                f"{PRESSURE_GAP_S:g} s while it stays above (counted in meta.json profiler_memory.budget)"
            )

    def _journal_gathered(self) -> None:
        """The rows gathered since the last time, as they came, to the recording's journal (they
        reach the recording itself framed, at flushes, in the same order)."""
        assert self.writer is not None
        for table, parts in self._rows.take_unjournaled().items():
            start = self._gathered.get(table, 0)
            self._gathered[table] = start + sum(part_rows(p) for p in parts)
            if self.policy.stores_whole(table):
                self.writer.journal_gathered(table, parts, start=start)

    def _frame_gathered(self) -> None:
        """Every row gathered so far framed and handed to its readers now (each table after the
        older rows of it that a flush under way holds)."""
        for table, df in self._rows.take_all():
            self.round.before_frames(table)
            self.emit(table, df)

    def close_rows(self) -> None:
        """At the end: a flush under way finished, then every row still gathered (those of drains
        before an error too), the policies' last decisions and every aggregate bucket, open or
        not, into the recording."""
        self.round.finish()  # its rows before those gathered since
        for table, df in self._rows.take_all():
            self.emit(table, df)
        self._settle(final=True)
        for _ in self._store_aggregates(final=True):
            pass

    def settle_policy(self) -> None:
        """The policies' decisions still pending, to the recording (an engine without host
        probes: no aggregates, nothing gathered here)."""
        self._settle(final=True)

    def _start_flush(self) -> None:
        """A flush of the rows gathered since the last one to the aggregates, the sinks and the
        recording, in pieces (flush_round.py): the rows are fixed now, their writes follow. The
        rows set apart since the last flush go to the sinks first (a request's tokens before its
        requests row, which this flush may hold)."""
        self.sinks.give_apart()
        self.round.start(self._rows.detach(), self.emit, self._flush_writes())

    def _flush_writes(self) -> Iterator[str]:
        """A flush's pieces after its rows were handed over, each named: the requests the
        policies decided, the closed aggregate buckets, a Parquet segment per table and
        meta.json, and the collector's pass (collector.py)."""
        self._settle(final=False)
        yield "policy"
        yield from self._store_aggregates(final=False)
        if self.writer is not None:
            yield from self.writer.flush_steps()
        self._collector.after_flush()
        yield "collector"

    def _settle(self, *, final: bool) -> None:
        """The rows the per-request policies decided since the last flush, to the recording. Called
        after a flush's frames (the requests rows among them) have all been emitted."""
        if self.writer is not None:
            for table, df in self.policy.settle(final=final):
                self.writer.append(table, df)

    def _store_aggregates(self, *, final: bool) -> Iterator[str]:
        """The aggregates of buckets now closed (all of them at the end) into the recording: a
        yield after each metric's counts (a flush's pieces, flush_round.py) and at the end."""
        if self.aggregates is None or self.writer is None:
            return
        closed: list[pl.DataFrame] = []
        yield from self.aggregates.take_steps(None if final else time.time_ns() // 1_000_000, closed)
        for rows in closed:
            if rows.height:
                self.writer.append("aggregates", rows)
        yield "aggregates"
