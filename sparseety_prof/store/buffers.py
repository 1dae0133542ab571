"""Rows gathered over drains, made into storage frames in batches."""

from __future__ import annotations

import time
from typing import Any

import polars as pl

from sparseety_prof.store import schema


class ColumnBuffer:
    """Rows of each table gathered over drains, as columns, and made into a frame once
    FRAME_ROWS rows are there (or at the end): building a polars frame has a fixed cost per
    column (~70 columns over the tables), which one drain's hundred tokens do not amortise. Rows
    wait here no longer than the flush interval: each flush (FlushSchedule) takes them all to the
    writer."""

    FRAME_ROWS = 2048

    def __init__(self) -> None:
        self._cols: dict[str, dict[str, list[Any]]] = {}

    def add(self, table: str, cols: dict[str, list[Any]], *, final: bool) -> list[pl.DataFrame]:
        """Gather one drain's rows of `table` (every column of the table, as schema.frame wants;
        a drain without rows may pass {} or empty lists); the frames that are due."""
        buf = self._cols.get(table)
        if cols and len(next(iter(cols.values()))):
            if buf is None:
                schema.check_columns(table, cols)  # a wrong column fails at its drain, not later
                buf = self._cols[table] = {k: list(v) for k, v in cols.items()}
            else:
                for k, v in cols.items():
                    buf[k].extend(v)
        if buf is not None and (final or len(next(iter(buf.values()), ())) >= self.FRAME_ROWS):
            del self._cols[table]
            return [schema.frame(table, buf)]
        return []

    def take_all(self) -> list[tuple[str, pl.DataFrame]]:
        """Frames of every row still gathered."""
        out = [(table, schema.frame(table, cols)) for table, cols in self._cols.items()]
        self._cols.clear()
        return out


class FlushSchedule:
    """When the consumer writes what it holds to disk: often enough that a recorder killed at
    any moment has every row older than `interval_s` on disk. A flush drains the ring first, so a
    row waits at most one `period` plus the time to decode and write it (MARGIN_S)."""

    MARGIN_S = 0.5

    def __init__(self, interval_s: float) -> None:
        if interval_s <= 0:
            raise ValueError(f"the flush interval must be positive, got {interval_s}")
        self.period = max(interval_s - self.MARGIN_S, interval_s / 2)
        self._next = time.monotonic() + self.period

    def wait_s(self, drain_s: float) -> float:
        """How long the loop may wait before its next drain: `drain_s`, or less so that the
        drain before a flush happens on time."""
        return max(0.0, min(drain_s, self._next - time.monotonic()))

    def due(self, drained_at: float) -> bool:
        """Whether the drain made at `drained_at` (time.monotonic) is to be flushed now."""
        if drained_at < self._next:
            return False
        self._next = drained_at + self.period
        return True
