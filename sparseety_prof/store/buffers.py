"""Rows gathered over drains, made into storage frames in batches."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import polars as pl

from sparseety_prof.store import schema
from sparseety_prof.store.array_rows import ArrayRows, RowParts, part_rows


class ColumnBuffer:
    """Rows of each table gathered over drains, as columns, and made into a frame once
    FRAME_ROWS rows are there (or at the end): building a polars frame has a fixed cost per
    column (schema.TABLES has dozens), which one drain's hundred tokens do not amortise. Rows
    wait here no longer than the flush interval: each flush (FlushSchedule) takes them all to the
    writer.

    A table's rows may also come as RowParts (column lists and numpy arrays). The arrays are kept
    as they are, and a frame is made of the list rows and of the array rows, each in the order
    they came; then put back in the order the rows came (one gather of every column), except
    for the routes table (UNORDERED): eight or more rows per token, for which the gather cost
    more than making the frame, and whose readers do not depend on the order (the recording
    sorts each table when read, store/recording.py; the policies and sinks join on keys). The
    token rows' order matters: the OpenTelemetry sink's token events follow it."""

    FRAME_ROWS = 2048
    UNORDERED = frozenset({"routes"})  # tables whose frames hold the list rows, then the array rows

    def __init__(self, *, journaled: bool = False, ordered: bool = False) -> None:
        """`journaled`: each add is also kept as it came until `take_unjournaled` (a recording's
        journal of gathered rows, store/gathered_codec.py), and, as with `ordered`, every
        table's frames keep the order rows came in, so that the rows the journal holds and the
        rows given to the recording follow one order (a killed recording's reader counts them:
        store/journal.py)."""
        self.unordered = frozenset[str]() if journaled or ordered else self.UNORDERED
        self._journaled = journaled
        self._unjournaled: dict[str, list[Mapping[str, Any]]] = {}
        self._cols: dict[str, dict[str, list[Any]]] = {}
        self._arrays: dict[str, list[ArrayRows]] = {}
        self._rows: dict[str, int] = {}
        # per table, the order rows came in when some came as arrays: per add, whether each row
        # is an array row (frames of UNORDERED tables keep the two kinds apart instead)
        self._kinds: dict[str, list[np.ndarray]] = {}

    def add(self, table: str, cols: Mapping[str, list[Any]], *, final: bool) -> list[pl.DataFrame]:
        """Gather one drain's rows of `table` (every column of the table, as schema.frame wants,
        or RowParts; a drain without rows may pass {} or empty lists); the frames that are due."""
        if self._journaled and part_rows(cols):
            self._unjournaled.setdefault(table, []).append(cols)
        if isinstance(cols, RowParts):
            before = self._rows.get(table, 0)  # list rows alone, for an ordered table without kinds
            n_lists = self._add_lists(table, cols.lists)
            if cols.arrays:
                self._arrays.setdefault(table, []).extend(cols.arrays)
                self._rows[table] = self._rows.get(table, 0) + sum(p.n for p in cols.arrays)
                if table not in self.unordered:
                    kinds = self._kinds.get(table)
                    if kinds is None:
                        kinds = self._kinds[table] = [np.zeros(before, dtype=bool)]
                    kinds.append(cols.is_array)
            elif n_lists and table in self._kinds:
                self._kinds[table].append(np.zeros(n_lists, dtype=bool))
        else:
            n_lists = self._add_lists(table, cols)
            if n_lists and table in self._kinds:
                self._kinds[table].append(np.zeros(n_lists, dtype=bool))
        rows = self._rows.get(table, 0)
        if rows and (final or rows >= self.FRAME_ROWS):
            return [self._frame(table)]
        return []

    def take_all(self) -> list[tuple[str, pl.DataFrame]]:
        """Frames of every row still gathered."""
        return [(table, self._frame(table)) for table in list(self._rows)]

    def detach(self) -> ColumnBuffer:
        """A buffer holding every row gathered so far, this one left empty: a flush done in
        pieces (session/flush_round.py) frames them a table at a time while new rows gather here."""
        held = ColumnBuffer()
        held.unordered = self.unordered
        held._cols, held._arrays, held._rows, held._kinds = self._cols, self._arrays, self._rows, self._kinds
        self._cols, self._arrays, self._rows, self._kinds = {}, {}, {}, {}
        return held

    def take_unjournaled(self) -> dict[str, list[Mapping[str, Any]]]:
        """Per table, each add since the last call as it came (`journaled` buffers only)."""
        taken, self._unjournaled = self._unjournaled, {}
        return taken

    def tables(self) -> list[str]:
        """The tables with rows gathered, in the order they first came."""
        return list(self._rows)

    def take(self, table: str) -> pl.DataFrame | None:
        """A frame of every gathered row of `table` (None when it has none)."""
        return self._frame(table) if table in self._rows else None

    def _add_lists(self, table: str, cols: Mapping[str, list[Any]]) -> int:
        """Gather column lists; the rows gathered."""
        n = len(next(iter(cols.values()), ())) if cols else 0
        if not n:
            return 0
        buf = self._cols.get(table)
        if buf is None:
            schema.check_columns(table, cols)  # a wrong column fails at its drain, not later
            self._cols[table] = {k: list(v) for k, v in cols.items()}
        else:
            for k, v in cols.items():
                buf[k].extend(v)
        self._rows[table] = self._rows.get(table, 0) + n
        return n

    def _frame(self, table: str) -> pl.DataFrame:
        """Every gathered row of `table` as one frame, in the order they came (UNORDERED tables:
        the list rows, then the array rows)."""
        del self._rows[table]
        cols = self._cols.pop(table, None)
        parts = [schema.frame(table, cols)] if cols else []
        parts += [p.frame(table) for p in ArrayRows.concat(self._arrays.pop(table, []))]
        df = pl.concat(parts) if len(parts) > 1 else parts[0]
        kinds = self._kinds.pop(table, None)
        if cols and kinds:  # both kinds: the frame's row of each row as it came
            is_array = np.concatenate(kinds)
            n_lists = int(np.count_nonzero(~is_array))
            at = np.where(is_array, n_lists + np.cumsum(is_array) - 1, np.cumsum(~is_array) - 1)
            df = df[at]
        return df


class FlushSchedule:
    """When the consumer writes what it holds as Parquet segments: often enough that every row
    older than `interval_s` is in a segment (a recorder killed in between still has the newer
    rows in the recording's journal, store/journal.py, written after each drain). A flush drains
    the ring first, so a row waits at most one `period` plus the time to decode and write it
    (MARGIN_S): the write is done in pieces between drains (session/flush_round.py), at nice 10
    on a busy machine up to about half a second of wall time, and the drains in between take
    their share."""

    MARGIN_S = 1.0

    def __init__(self, interval_s: float) -> None:
        if interval_s <= 0:
            raise ValueError(f"the flush interval must be positive, got {interval_s}")
        self.period = max(interval_s - self.MARGIN_S, interval_s / 2)
        self._next = time.monotonic() + self.period

    def wait_s(self, drain_s: float) -> float:
        """How long the loop may wait before its next drain: `drain_s`, or less so that the
        drain before a flush happens on time."""
        return max(0.0, min(drain_s, self._next - time.monotonic()))

    def is_due(self, t: float) -> bool:
        """Whether a drain made at `t` would be flushed (due() without moving the schedule)."""
        return t >= self._next

    def due(self, drained_at: float) -> bool:
        """Whether the drain made at `drained_at` (time.monotonic) is to be flushed now."""
        if drained_at < self._next:
            return False
        self._next = drained_at + self.period
        return True
