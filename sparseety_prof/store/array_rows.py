"""Rows of a table held as numpy arrays, and one drain's rows of a table as ordered parts: column
lists (what schema.frame takes) and such arrays.

The routes rows of one-row decode steps (eight or more per token), and the per-layer lists of
their token rows, come from the aggregate records' arrays. Made Python lists per row, and the
lists made arrays again by the frame, they were the consumer's largest per-row cost; held as
arrays they go to the frame as they are."""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping, Sized
from dataclasses import dataclass, field
from typing import TypeAlias

import numpy as np
import polars as pl

from sparseety_prof.store import schema

#: a column of ArrayRows: an array (2-D, n x width, for a list column), Python values, or None
# (TypeAlias: a checker that cannot see numpy, as when mypyc builds a wheel, still reads it as one)
ArrayColumn: TypeAlias = np.ndarray | list[object] | None


@dataclass(frozen=True)
class ArrayRows:
    """`n` rows of a table: per column, an array of n values (2-D, n x width, for a list column),
    the n values as a Python list (what schema.frame takes: the columns that are not worth an
    array), or None for a column of nulls. `nulls` marks, per array column that has any, the
    rows that are null in it; `null_items`, per 2-D array column that has any, the rows whose
    list holds only nulls (a list as long as the others, not a null list). Array values under
    either mark are ignored."""

    n: int
    arrays: Mapping[str, ArrayColumn]
    nulls: dict[str, np.ndarray] = field(default_factory=dict)
    null_items: dict[str, np.ndarray] = field(default_factory=dict)

    def frame(self, table: str) -> pl.DataFrame:
        """The rows as a frame of the table's schema (dtypes cast as schema.frame casts them)."""
        out = []
        for name, dtype in schema.TABLES[table].items():
            a = self.arrays[name]
            if a is None:
                out.append(schema.null_series(name, dtype, self.n))
                continue
            if isinstance(a, list):
                out.append(schema.series(name, a, dtype))
                continue
            if a.ndim == 2:
                s = pl.Series(name, a.reshape(-1)).reshape(a.shape).cast(dtype)
            else:
                s = pl.Series(name, a).cast(dtype)
            items = self.null_items.get(name)
            if items is not None and items.any():
                nulls_row = pl.Series(name, [[None] * a.shape[1]], dtype=dtype).new_from_index(0, self.n)
                s = pl.select(pl.when(pl.Series(items)).then(nulls_row).otherwise(s).alias(name)).to_series()
            null = self.nulls.get(name)
            if null is not None and null.any():
                s = pl.select(pl.when(pl.Series(null)).then(None).otherwise(s).alias(name)).to_series()
            out.append(s)
        return pl.DataFrame(out)

    def column(self, name: str) -> list[object]:
        """One column as Python values, None for a null (what column lists hold)."""
        a = self.arrays[name]
        if a is None:
            return [None] * self.n
        if isinstance(a, list):
            return list(a)
        values: list[object] = a.tolist()
        items = self.null_items.get(name)
        if items is not None and items.any():
            nulls_row = [None] * a.shape[1]
            values = [list(nulls_row) if z else v for v, z in zip(values, items.tolist(), strict=True)]
        null = self.nulls.get(name)
        if null is not None:
            values = [None if z else v for v, z in zip(values, null.tolist(), strict=True)]
        return values

    @staticmethod
    def of_lists(lists: schema.Columns, at: list[int], names: Collection[str]) -> ArrayRows:
        """Rows `at` of column lists as ArrayRows of Python values, only the `names` columns
        holding values (the others None: all null)."""
        arrays: dict[str, ArrayColumn] = {
            name: [values[i] for i in at] if name in names else None for name, values in lists.items()
        }
        return ArrayRows(len(at), arrays)

    def select(self, at: np.ndarray, names: Collection[str] | None = None) -> ArrayRows:
        """The rows at indices `at`, in that order; with `names`, only those columns hold values
        (the others None: all null)."""
        rows = at.tolist()
        arrays: dict[str, ArrayColumn] = {}
        for name, a in self.arrays.items():
            if a is None or (names is not None and name not in names):
                arrays[name] = None
            elif isinstance(a, list):
                arrays[name] = [a[i] for i in rows]
            else:
                arrays[name] = a[at]
        nulls = {k: v[at] for k, v in self.nulls.items() if arrays.get(k) is not None}
        items = {k: v[at] for k, v in self.null_items.items() if arrays.get(k) is not None}
        return ArrayRows(len(rows), arrays, nulls, items)

    @staticmethod
    def concat(parts: list[ArrayRows]) -> list[ArrayRows]:
        """Consecutive parts whose columns agree joined into one: each column an array of one
        width and dtype, Python values, or None (all null) in any of them. A part's None column
        joins arrays as rows marked null, and a part without a null mark joins marked ones as
        rows not null: with head sampling in the probes, the routes rows of a dropped request's
        steps (activations not counted) alternate with kept ones, and every run apart is a
        frame apart, whose cost is per column."""
        out: list[ArrayRows] = []
        run: list[ArrayRows] = []
        kinds: dict[str, object] = {}  # the run's kind of each column (_kind), None while all null
        for p in [*parts, None]:
            if run and (p is None or not _agrees(kinds, p)):
                out.append(_joined(run, kinds))
                run, kinds = [], {}
            if p is not None:
                run.append(p)
                for name, a in p.arrays.items():
                    if kinds.get(name) is None:
                        kinds[name] = _kind(a)
        return out


def _kind(a: ArrayColumn) -> object:
    """What a column must share with another's to be joined: None (all null) joins any."""
    return None if a is None else "list" if isinstance(a, list) else (a.shape[1:], a.dtype)


def _agrees(kinds: dict[str, object], p: ArrayRows) -> bool:
    if kinds.keys() != p.arrays.keys():
        return False
    for name, a in p.arrays.items():
        want, got = kinds[name], _kind(a)
        if want is not None and got is not None and want != got:
            return False
    return True


def _joined(run: list[ArrayRows], kinds: dict[str, object]) -> ArrayRows:
    if len(run) == 1:
        return run[0]
    arrays: dict[str, ArrayColumn] = {}
    nulls: dict[str, np.ndarray] = {}
    items: dict[str, np.ndarray] = {}
    for name, kind in kinds.items():
        if kind is None:
            arrays[name] = None
        elif kind == "list":
            values: list[object] = []
            for p in run:
                a = p.arrays[name]
                values += a if isinstance(a, list) else [None] * p.n
            arrays[name] = values
        else:
            assert isinstance(kind, tuple)
            width, dtype = kind
            got = [p.arrays[name] for p in run]
            arrays[name] = np.concatenate(
                [
                    a if isinstance(a, np.ndarray) else np.zeros((p.n, *width), dtype)
                    for a, p in zip(got, run, strict=True)
                ]
            )
            null = [
                p.nulls.get(name, np.zeros(p.n, bool)) if isinstance(a, np.ndarray) else np.ones(p.n, bool)
                for a, p in zip(got, run, strict=True)
            ]
            if any(name in p.nulls or not isinstance(a, np.ndarray) for a, p in zip(got, run, strict=True)):
                nulls[name] = np.concatenate(null)
            if any(name in p.null_items for p in run):
                items[name] = np.concatenate([p.null_items.get(name, np.zeros(p.n, bool)) for p in run])
    return ArrayRows(sum(p.n for p in run), arrays, nulls, items)


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


def part_rows(cols: Mapping[str, object]) -> int:
    """The rows of one drain's rows of a table: column lists (their length) or RowParts."""
    if isinstance(cols, RowParts):
        return len(cols.is_array)
    first = next(iter(cols.values()), ())
    return len(first) if isinstance(first, Sized) else 0


def split_rows(
    cols: schema.Columns | RowParts, apart: np.ndarray, names: Collection[str]
) -> tuple[schema.Columns | RowParts, list[ArrayRows]]:
    """One drain's rows of a table (every column, as column lists or RowParts) less the rows
    flagged in `apart` (bool, one per row), in their order; and those rows as ArrayRows whose
    columns but `names` are left null. The rows set apart keep the order of their list rows,
    then of their array rows: they are counted, never stored."""
    if not apart.any():
        return cols, []
    lists = cols.lists if isinstance(cols, RowParts) else cols
    is_array = cols.is_array if isinstance(cols, RowParts) else np.zeros(len(apart), dtype=bool)
    list_apart = apart[~is_array]
    rest_lists = _list_rows(lists, np.flatnonzero(~list_apart))
    parts: list[ArrayRows] = []
    if list_apart.any():
        parts.append(ArrayRows.of_lists(lists, np.flatnonzero(list_apart).tolist(), names))
    if not isinstance(cols, RowParts):
        return rest_lists, parts
    rest_arrays: list[ArrayRows] = []
    array_apart = apart[is_array]
    start = 0
    for p in cols.arrays:
        flags = array_apart[start : start + p.n]
        start += p.n
        if not flags.any():
            rest_arrays.append(p)
            continue
        parts.append(p.select(np.flatnonzero(flags), names))
        if not flags.all():
            rest_arrays.append(p.select(np.flatnonzero(~flags)))
    return RowParts(rest_lists, rest_arrays, is_array[~apart]), parts


def _list_rows(lists: schema.Columns, at: np.ndarray) -> schema.Columns:
    rows = at.tolist()
    return {name: [values[i] for i in rows] for name, values in lists.items()}
