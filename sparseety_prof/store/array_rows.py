"""Rows of a table held as numpy arrays, and one drain's rows of a table as ordered parts: column
lists (what schema.frame takes) and such arrays.

The routes rows of one-row decode steps (eight or more per token) come from the aggregate
records' arrays. Made Python lists per row, and the lists made arrays again by the frame, they
were the consumer's largest per-row cost; held as arrays they go to the frame as they are."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np
import polars as pl

from sparseety_prof.store import schema


@dataclass(frozen=True)
class ArrayRows:
    """`n` rows of a table: per column, an array of n values (2-D, n x width, for a list column),
    or None for a column of nulls; `nulls` marks, per column that has any, the rows that are null
    in it (their array values are ignored)."""

    n: int
    arrays: dict[str, np.ndarray | None]
    nulls: dict[str, np.ndarray] = field(default_factory=dict)

    def frame(self, table: str) -> pl.DataFrame:
        """The rows as a frame of the table's schema (dtypes cast as schema.frame casts them)."""
        series = []
        for name, dtype in schema.TABLES[table].items():
            a = self.arrays[name]
            if a is None:
                series.append(schema.null_series(name, dtype, self.n))
                continue
            if a.ndim == 2:
                s = pl.Series(name, a.reshape(-1)).reshape(a.shape).cast(dtype)
            else:
                s = pl.Series(name, a).cast(dtype)
            null = self.nulls.get(name)
            if null is not None and null.any():
                s = pl.select(pl.when(pl.Series(null)).then(None).otherwise(s).alias(name)).to_series()
            series.append(s)
        return pl.DataFrame(series)

    def column(self, name: str) -> list[object]:
        """One column as Python values, None for a null (what column lists hold)."""
        a = self.arrays[name]
        if a is None:
            return [None] * self.n
        values: list[object] = a.tolist()
        null = self.nulls.get(name)
        if null is not None:
            values = [None if z else v for v, z in zip(values, null.tolist(), strict=True)]
        return values

    @staticmethod
    def concat(parts: list[ArrayRows]) -> list[ArrayRows]:
        """Consecutive parts whose columns have the same shapes joined into one."""
        out: list[ArrayRows] = []
        run: list[ArrayRows] = []
        for p in [*parts, None]:
            if run and (p is None or _shapes(p) != _shapes(run[0])):
                out.append(_joined(run))
                run = []
            if p is not None:
                run.append(p)
        return out


def _shapes(p: ArrayRows) -> tuple[object, ...]:
    return tuple(
        (name, None if a is None else (a.shape[1:], a.dtype), name in p.nulls) for name, a in p.arrays.items()
    )


def _joined(run: list[ArrayRows]) -> ArrayRows:
    if len(run) == 1:
        return run[0]
    first = run[0]
    arrays = {
        name: None if a is None else np.concatenate([p.arrays[name] for p in run])
        for name, a in first.arrays.items()
    }
    nulls = {name: np.concatenate([p.nulls[name] for p in run]) for name in first.nulls}
    return ArrayRows(sum(p.n for p in run), arrays, nulls)


class RowParts(Mapping[str, list[object]]):
    """One drain's rows of a table: `lists` (column lists) and `arrays` (ArrayRows), and the order
    the rows came in: `is_array`, one flag per row (the lists' rows and the arrays' rows each keep
    their own order). Read as a mapping, it gives each column's values as Python lists in that
    order, as column lists would (tests, readers that want values); store.buffers.ColumnBuffer
    takes its parts as they are, the list rows first."""

    def __init__(self, lists: schema.Columns, arrays: list[ArrayRows], is_array: np.ndarray) -> None:
        self.lists = lists
        self.arrays = arrays
        self.is_array = is_array
        self._merged: dict[str, list[object]] = {}

    def __getitem__(self, name: str) -> list[object]:
        got = self._merged.get(name)
        if got is None:
            from_arrays = iter([v for p in self.arrays for v in p.column(name)])
            from_lists = iter(self.lists[name])
            got = self._merged[name] = [
                next(from_arrays) if a else next(from_lists) for a in self.is_array.tolist()
            ]
        return got

    def __iter__(self) -> Iterator[str]:
        return iter(self.lists)

    def __len__(self) -> int:
        return len(self.lists)
