"""A table's rows as the consumer gathered them (column lists and ArrayRows, before any frame), as
bytes and back: the journal's record (store/journal.py).

Making a Polars frame costs a fixed amount per column whatever the rows, and the tables have
dozens of columns: framed after every drain for the journal, the rows paid that several times a
second instead of once per flush. Here the rows go as they are: the column lists through
`marshal.dumps` (lists and numbers written in C, no conversion), the ArrayRows' arrays as their
bytes. Decoding gives back the same values and arrays, which store/buffers.py frames as it frames
live rows: a killed recording's journal rows are the frames its flush would have written.

A payload may come from a recording made elsewhere: it is read with store/plain_marshal.py (plain
values only, counts and nesting bounded, never `marshal.loads`), every part's shape is checked
(columns of the table, lengths that agree, arrays whose bytes fit their shape) and anything else
is GatheredRowsError (one line). The values themselves are checked when framed: a value no
column can hold fails there (store/journal_reader.py).

Layout: "SPG1" | rows: u32 (every part's, for a reader that skips the payload) | marshal (version
4) of a list of parts, each

    (0, {column: values})                                  column lists
    (1, {column: values}, [array rows], order: bytes)      RowParts; order: one byte per row, 1 for
                                                           an array row (RowParts.is_array)
    array rows := (n, {column: None | values | (dtype code, shape, bytes)},
                   {column: null marks}, {column: null-item marks})   marks: one byte per row
"""

from __future__ import annotations

import marshal
import struct
from collections.abc import Mapping, Sequence
from itertools import chain
from typing import Any

import numpy as np
import polars as pl

from sparseety_prof.store import schema
from sparseety_prof.store.array_rows import ArrayColumn, ArrayRows, RowParts, part_rows
from sparseety_prof.store.plain_marshal import MarshalError, loads

__all__ = ["MAX_ROWS", "GatheredRowsError", "decode", "encode", "payload_rows"]

MAGIC = b"SPG1"
MAX_ROWS = 1 << 22  # rows of one payload (a drain's rows are far fewer)
MAX_NDIM = 3  # a tokens row's per-layer lists of experts: rows x layers x k
#: marshal nesting: the part list, a part, its arrays list, an array part, its columns, a column
#: of lists of lists of values
_MAX_DEPTH = 9
_DTYPES: tuple[np.dtype[Any], ...] = tuple(
    np.dtype(c) for c in ("<i8", "<i4", "<i2", "i1", "<u8", "<u4", "<u2", "u1", "<f8", "<f4", "?")
)
_CODE = {d: i for i, d in enumerate(_DTYPES)}
_ROWS = struct.Struct("<I")


class GatheredRowsError(ValueError):
    """The bytes are not rows this encoder wrote (one line saying why)."""


# ---------------------------------------------------------------------------------------- encode
def encode(parts: Sequence[Mapping[str, Any]]) -> bytes:
    """Gathered rows of one table, each part as ColumnBuffer.add took it (column lists or
    RowParts), in order."""
    body: list[Any] = []
    for cols in parts:
        if isinstance(cols, RowParts):
            order = np.ascontiguousarray(cols.is_array, dtype=np.uint8).tobytes()
            body.append((1, _plain_columns(cols.lists), [_array_rows(p) for p in cols.arrays], order))
        else:
            body.append((0, _plain_columns(cols)))
    rows = sum(part_rows(cols) for cols in parts)
    return b"".join((MAGIC, _ROWS.pack(rows), marshal.dumps(body, 4)))


def _array_rows(p: ArrayRows) -> tuple[Any, ...]:
    cols: dict[str, Any] = {}
    for name, a in p.arrays.items():
        code = _code(a) if isinstance(a, np.ndarray) else None
        if isinstance(a, np.ndarray) and (code is None or not 1 <= a.ndim <= MAX_NDIM):
            cols[name] = p.column(name)  # an array of another kind: as values
        elif isinstance(a, np.ndarray):
            assert code is not None
            # marshal writes a buffer as bytes (read back as bytes): the array's own memory, no copy
            cols[name] = (code, a.shape, np.ascontiguousarray(a, dtype=_DTYPES[code]).data)
        elif isinstance(a, list):
            cols[name] = a if _looks_plain(a) else _plain(a)
        else:
            cols[name] = a
    marks = [
        {k: np.ascontiguousarray(v, dtype=np.uint8).tobytes() for k, v in m.items() if k in cols}
        for m in (p.nulls, p.null_items)
    ]
    return (p.n, cols, *marks)


def _code(a: np.ndarray) -> int | None:
    """The array's dtype code (_DTYPES), None for one not journaled as an array."""
    return _CODE.get(a.dtype.newbyteorder("<") if a.dtype.byteorder == ">" else a.dtype)


#: the types marshal writes as themselves; any other that it takes (numpy's scalars, anything with
#: a buffer) it writes as bytes, which would come back as bytes
_PLAIN_TYPES = frozenset({int, float, str, bool, bytes, type(None)})


def _plain_columns(cols: Mapping[str, list[Any]]) -> dict[str, list[Any]]:
    """The columns, each as it is when its first value looks plain, or made plain (`_plain`).
    The correlator makes its columns of Python values (tests/test_journal_gathered.py holds it
    to that on real drains); a column of numpy values shows in its first one. A numpy value
    further down a column would come back as bytes, which the reader refuses in any column but
    a binary one (`decode`): that drain's rows are then named damaged, never read wrong."""
    return {k: v if not v or _looks_plain(v) else _plain(v) for k, v in cols.items()}


def _looks_plain(values: list[Any]) -> bool:
    """Whether the first value that is not None, down to its first item that is not a list, is of
    a _PLAIN_TYPES type."""
    v: Any = next((x for x in values if x is not None), None)
    for _ in range(MAX_NDIM + 1):
        if type(v) not in (list, tuple):
            return type(v) in _PLAIN_TYPES
        v = next((x for x in v if x is not None), None)
    return False


def _plain(v: Any) -> Any:
    """`v` with numpy values made Python's (lists, tuples and dicts walked; bytes left alone)."""
    if isinstance(v, np.generic | np.ndarray):
        return v.tolist()
    if isinstance(v, list):
        return [_plain(x) for x in v]
    if isinstance(v, tuple):
        return tuple(_plain(x) for x in v)
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    return v


# ---------------------------------------------------------------------------------------- decode
def payload_rows(payload: bytes) -> int:
    """The rows a payload says it holds (GatheredRowsError if it is not one)."""
    if len(payload) < 8 or payload[:4] != MAGIC:
        raise GatheredRowsError("not gathered rows (no SPG1 mark)")
    rows = int(_ROWS.unpack_from(payload, 4)[0])
    if rows > MAX_ROWS:
        raise GatheredRowsError(f"{rows} rows, more than the {MAX_ROWS} a drain holds")
    return rows


def decode(table: str, payload: bytes) -> list[Mapping[str, Any]]:
    """The parts `encode` was given (column lists and RowParts), for store/buffers.py to frame."""
    if table not in schema.TABLES:
        raise GatheredRowsError(f"{table!r} is no table")
    rows = payload_rows(payload)
    try:
        body = loads(payload[8:], max_items=MAX_ROWS * 64, max_depth=_MAX_DEPTH)
    except MarshalError as e:
        raise GatheredRowsError(str(e)) from None
    if not isinstance(body, list):
        raise GatheredRowsError("the parts are not a list")
    parts: list[Mapping[str, Any]] = []
    got = 0
    for part in body:
        if isinstance(part, tuple) and len(part) == 2 and part[0] == 0:
            cols = _lists(table, part[1], None)
            parts.append(cols)
            got += _height(cols)
        elif isinstance(part, tuple) and len(part) == 4 and part[0] == 1:
            parts.append(_row_parts(table, part))
            got += len(parts[-1].is_array)  # type: ignore[attr-defined]
        else:
            raise GatheredRowsError("a part that is neither column lists nor array rows")
    if got != rows:
        raise GatheredRowsError(f"{got} rows where the payload says {rows}")
    return parts


def _lists(table: str, cols: Any, rows: int | None) -> dict[str, list[Any]]:
    """Column lists of `table`, all of one length (`rows` when given)."""
    if not isinstance(cols, dict) or not all(isinstance(k, str) for k in cols):
        raise GatheredRowsError("columns that are not named")
    lengths = {len(v) if isinstance(v, list) else -1 for v in cols.values()}
    if -1 in lengths or len(lengths) > 1 or (rows is not None and lengths and lengths != {rows}):
        raise GatheredRowsError(f"columns of lengths {sorted(lengths)} in one part")
    if cols and cols.keys() != schema.TABLES[table].keys():  # (its names are not echoed: untrusted)
        raise GatheredRowsError(f"column lists that are not the {table} table's columns")
    for name, values in cols.items():
        _no_stray_bytes(table, name, values)
    return cols


def _no_stray_bytes(table: str, name: str, values: list[Any]) -> None:
    """Bytes in a column that holds no bytes: a value marshal wrote as bytes (a numpy value
    among Python ones, `_plain_columns`), refused rather than read as something else."""
    dtype: Any = schema.TABLES[table][name]
    while isinstance(dtype, pl.List):
        dtype = dtype.inner
    if isinstance(dtype, pl.Binary):
        return
    level: list[Any] = values
    for _ in range(MAX_NDIM + 1):
        types = set(map(type, level))
        if bytes in types:
            raise GatheredRowsError(f"bytes in column {name}, which holds none")
        if not types & {list, tuple}:
            return
        level = list(chain.from_iterable(x for x in level if type(x) in (list, tuple)))


def _height(cols: Mapping[str, list[Any]]) -> int:
    return len(next(iter(cols.values()), ()))


def _row_parts(table: str, part: tuple[Any, ...]) -> RowParts:
    _, lists, arrays, order = part
    if not isinstance(arrays, list) or not isinstance(order, bytes):
        raise GatheredRowsError("array rows without their list or order")
    cols = _lists(table, lists, None)
    got = [_array_part(table, a) for a in arrays]
    is_array = np.frombuffer(order, dtype=np.uint8).astype(bool)
    n_arrays = int(is_array.sum())
    if n_arrays != sum(p.n for p in got) or len(is_array) - n_arrays != _height(cols):
        raise GatheredRowsError("the rows' order marks do not match the parts")
    return RowParts(cols, got, is_array)


def _array_part(table: str, a: Any) -> ArrayRows:
    if not (isinstance(a, tuple) and len(a) == 4 and isinstance(a[0], int) and 0 <= a[0] <= MAX_ROWS):
        raise GatheredRowsError("array rows that are not (rows, columns, marks, marks)")
    n, cols, nulls, items = a
    if not isinstance(cols, dict) or set(cols) != set(schema.TABLES[table]):
        raise GatheredRowsError(f"array rows without every column of the {table} table")
    arrays: dict[str, ArrayColumn] = {}
    for name, col in cols.items():
        if col is None:
            arrays[name] = None
        elif isinstance(col, list) and len(col) == n:
            _no_stray_bytes(table, name, col)
            arrays[name] = col
        elif isinstance(col, tuple):
            arrays[name] = _array(col, n)
        else:
            raise GatheredRowsError(f"column {name} is not {n} rows")
    return ArrayRows(n, arrays, _marks(nulls, arrays, n), _marks(items, arrays, n))


def _array(col: tuple[Any, ...], n: int) -> np.ndarray:
    if len(col) != 3:
        raise GatheredRowsError("an array that is not (type, shape, bytes)")
    code, shape, data = col
    if not (isinstance(code, int) and 0 <= code < len(_DTYPES)):
        raise GatheredRowsError(f"an array of type code {code!r}")
    if not (isinstance(shape, tuple) and 1 <= len(shape) <= MAX_NDIM and shape[0] == n):
        raise GatheredRowsError(f"an array of shape {shape!r} among {n} rows")
    if not all(isinstance(d, int) and 0 <= d <= MAX_ROWS for d in shape) or not isinstance(data, bytes):
        raise GatheredRowsError(f"an array of shape {shape!r}")
    dtype = _DTYPES[code]
    if len(data) != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
        raise GatheredRowsError(f"an array of shape {shape} in {len(data)} bytes")
    return np.frombuffer(data, dtype=dtype).reshape(shape)


def _marks(marks: Any, arrays: Mapping[str, ArrayColumn], n: int) -> dict[str, np.ndarray]:
    if not isinstance(marks, dict):
        raise GatheredRowsError("null marks that are not by column")
    out: dict[str, np.ndarray] = {}
    for name, raw in marks.items():
        if not isinstance(arrays.get(name), np.ndarray) or not isinstance(raw, bytes) or len(raw) != n:
            raise GatheredRowsError(f"null marks of column {name!r} that do not fit it")
        out[name] = np.frombuffer(raw, dtype=np.uint8).astype(bool)
    return out
