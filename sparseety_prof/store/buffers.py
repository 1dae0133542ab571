"""Rows gathered over drains, made into storage frames in batches."""

from __future__ import annotations

from typing import Any

import polars as pl

from sparseety_prof.store import schema


class ColumnBuffer:
    """Rows of each table gathered over drains, as columns, and made into a frame once
    FRAME_ROWS rows are there (or at the end): building a polars frame has a fixed cost per
    column (~70 columns over the tables), which one drain's hundred tokens did not amortise
    (measured: 16 us per token at a frame per drain). The writer keeps frames in memory up to a
    segment anyway, so nothing reaches the disk later than before for a long recording."""

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
