"""The readers of the consumer's rows, behind one interface.

Every row the correlator makes reaches its readers in one of two forms, and every reader takes
both: a frame of a table (`take`), or the rows a head-sampling policy set apart in the correlator
(a request the probes drew to drop), as arrays of only the columns the readers read
(`take_apart`; Correlator head_rows_apart). The outlet (row_outlet.py) hands each drain's rows to
every reader, the set-apart ones first, and decides nothing about what a reader does with them:

- the always-on aggregates count every row, set apart or not (AggregateReader);
- the recording stores what the policy keeps; set-apart rows teach the policy their requests and
  are counted dropped (RecordingReader);
- the sinks (metrics, OTLP: sinks.py's SinkFanout) read every row, set-apart ones as frames of the
  columns they declared.

A reader returns at once: the consumer is the one thread that keeps the ring from overflowing."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import polars as pl

from sparseety_prof.session.policy import RecordingPolicy
from sparseety_prof.store.aggregates import Aggregator
from sparseety_prof.store.array_rows import ArrayRows
from sparseety_prof.store.recording_writer import RecordingWriter


class RowReader(Protocol):
    """What the outlet hands rows to."""

    def take(self, table: str, df: pl.DataFrame) -> None:
        """A frame of `table`'s rows (schema.TABLES[table] columns)."""

    def take_apart(self, table: str, parts: Sequence[ArrayRows]) -> None:
        """One drain's rows of `table` set apart: only the columns the readers read hold values."""


class AggregateReader:
    """The always-on aggregates (store/aggregates.py): every row counted, set-apart rows from their
    arrays without a frame."""

    def __init__(self, aggregates: Aggregator) -> None:
        self.aggregates = aggregates

    def take(self, table: str, df: pl.DataFrame) -> None:
        self.aggregates.add(table, df)

    def take_apart(self, table: str, parts: Sequence[ArrayRows]) -> None:
        self.aggregates.add_rows(table, list(parts))


class RecordingReader:
    """The recording (`writer`; None: nothing is recorded, and the policy still counts): what the
    policy keeps of a frame, appended (`journaled`: its journal already holds the rows as gathered,
    row_outlet.py); set-apart rows are the policy's only (counted dropped, their requests
    learned), never stored."""

    def __init__(self, writer: RecordingWriter | None, policy: RecordingPolicy, *, journaled: bool) -> None:
        self.writer = writer
        self.policy = policy
        self.journaled = journaled

    def take(self, table: str, df: pl.DataFrame) -> None:
        if self.writer is None:
            return
        for kept_table, kept in self.policy.take(table, df):
            self.writer.append(kept_table, kept, journaled=self.journaled)

    def take_apart(self, table: str, parts: Sequence[ArrayRows]) -> None:
        self.policy.set_apart(table, list(parts))
