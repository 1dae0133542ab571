"""schema.frame's fast path for list columns must build exactly what polars' general path builds."""

from __future__ import annotations

import math
from typing import Any

import polars as pl
import pytest
from polars.testing import assert_frame_equal, assert_series_equal

from sparseety_prof.store import schema


def _general(values: list[object], dtype: pl.DataType) -> pl.Series:
    return pl.Series("c", values, dtype=dtype, strict=False)


CASES: list[tuple[list[object], pl.DataType]] = [
    ([[1, 2], [3, 4], [5, 6]], pl.List(pl.Int32())),
    ([[1, 2], None, [5, 6]], pl.List(pl.Int32())),  # null rows stay null
    ([[[1, 2], [3, 4]], [[5, 6], [7, 8]]], pl.List(pl.List(pl.Int32()))),
    ([[[1, 2], None], [[5, 6], [7, 8]]], pl.List(pl.List(pl.Int32()))),  # None inside: general path
    ([[0.5, None], [0.25, 0.75]], pl.List(pl.Float32())),  # None inside a float row must not become NaN
    ([[0.5, math.nan], [0.25, 0.75]], pl.List(pl.Float32())),  # a real NaN stays NaN
    ([[1, 2, 3], [4]], pl.List(pl.Int32())),  # ragged
    ([[], []], pl.List(pl.List(pl.Int32()))),  # dense model: empty per-layer lists
    ([None, None], pl.List(pl.Float32())),
    ([[1.5, 2.5]] * 3, pl.List(pl.Float64())),
    # rows of nulls among regular rows (--act-every's uncounted steps), with null rows too
    ([[0.5, 0.25], [None, None], None, [0.75, 1.0]], pl.List(pl.Float32())),
    ([[None, None], [0.5, 0.25]], pl.List(pl.Float32())),
    ([[[1, 2], [3, 4]], [None, None], [[5, 6], [7, 8]]], pl.List(pl.List(pl.Int32()))),
    # no regular row (steps whose sparse probes were out: --duty-cycle): the rows repeated
    ([[None, None], [None, None]], pl.List(pl.Float32())),
    ([[None, None], None, [None, None]], pl.List(pl.Float32())),
    ([[None, None, None]] * 40, pl.List(pl.List(pl.Int32()))),
    ([None, [None, None, None], None], pl.List(pl.List(pl.Int32()))),
    ([[None, None], [None]], pl.List(pl.Float32())),  # of two lengths: general path
    ([[0.5, 0.25], [None, None, None]], pl.List(pl.Float32())),  # nulls of another length
    ([[0.5, 0.25], [None, 0.5]], pl.List(pl.Float32())),  # some nulls: general path
]


RAGGED = [
    ([[1, 2, 3], [4], [], None, [5, 6]], pl.List(pl.Int32())),
    ([[7]] * 20 + [[1, 2, 3, 4]], pl.List(pl.Int64())),
    ([[0.5], [0.25, 0.75], None], pl.List(pl.Float32())),
    ([[], []], pl.List(pl.Int32())),
    ([None, None], pl.List(pl.Int32())),  # all null: the general path, cheap then
    ([[1, None], [2]], pl.List(pl.Int32())),  # None inside a row: general path
    ([[0.5, None], [0.25]], pl.List(pl.Float32())),  # ... of floats too: numpy would make it NaN
    ([[0.5, math.nan], [0.25]], pl.List(pl.Float32())),  # a real NaN: general path, stays NaN
    ([[[1], [2, 3]], [[4]]], pl.List(pl.List(pl.Int32()))),  # lists of lists: general path
    ([["a"], ["b", "c"]], pl.List(pl.String())),  # not numbers: general path
]


@pytest.mark.parametrize(("values", "dtype"), RAGGED)
def test_ragged_path_equals_general_path(values: list[object], dtype: pl.DataType) -> None:
    parts = schema._ragged_parts(values, dtype)
    fast = None if parts is None else schema._ragged_series({"c": parts}, {"c": dtype})["c"]
    rows: list[Any] = [v for v in values if v is not None]
    plain = dtype in (pl.List(pl.Int32()), pl.List(pl.Int64()), pl.List(pl.Float32()))
    numbers = all(x is not None and x == x for v in rows for x in v)  # (x != x: NaN)
    assert (fast is not None) == (plain and bool(rows) and numbers)
    want = _general(values, dtype)
    got = fast if fast is not None else want
    assert_series_equal(got, want)
    assert got.null_count() == want.null_count()


def test_ragged_columns_of_one_frame_are_sliced_together_as_each_alone() -> None:
    """Several ragged columns, null rows in some, made in one query: each equals its own."""
    cols = {
        "a": ([[1, 2, 3], [4], [], None, [5, 6]], pl.List(pl.Int32())),
        "b": ([[0.5], None, [0.25, 0.75], [1.0], []], pl.List(pl.Float32())),
        "c": ([[9] * 7, [8], [7], [6], [5]], pl.List(pl.Int64())),
    }
    parts = {name: schema._ragged_parts(v, dt) for name, (v, dt) in cols.items()}  # type: ignore[arg-type]
    assert all(p is not None for p in parts.values())
    together = schema._ragged_series(parts, {name: dt for name, (_, dt) in cols.items()})  # type: ignore[arg-type]
    for name, (values, dtype) in cols.items():
        assert_series_equal(together[name], _general(values, dtype).alias(name))  # type: ignore[arg-type]


def test_a_frame_with_ragged_rows_equals_the_general_path() -> None:
    """The steps table: one-row decode steps and a prompt step among them."""
    n = 40
    cols: dict[str, list[Any]] = {c: [None] * n for c in schema.STEPS}
    cols["seq_ids"] = [[0] for _ in range(n)]
    cols["token_ids"] = [[5]] * 17 + [[1, 2, 3, 4, 5, 6]] + [[9]] * 22
    cols["positions"] = [[k] for k in range(17)] + [list(range(6))] + [[k] for k in range(22)]
    cols["output_rows"] = [[0]] * 17 + [[5]] + [[]] + [[0]] * 21
    got = schema.frame("steps", cols)
    want = pl.DataFrame([pl.Series(c, cols[c], dtype=t, strict=False) for c, t in schema.STEPS.items()])
    assert_frame_equal(got, want)


@pytest.mark.parametrize(("values", "dtype"), CASES)
def test_fast_path_equals_general_path(values: list[object], dtype: pl.DataType) -> None:
    fast = schema._regular_list_series("c", values, dtype)
    rows = [v for v in values if isinstance(v, list)]
    if any(v and v.count(None) == len(v) for v in rows):
        # rows of nulls of one length, with regular rows of that length or none, take the fast path
        assert (
            fast is not None
            or len({len(v) for v in rows}) > 1
            or any(None in v for v in rows if v.count(None) != len(v))
        )
    want = _general(values, dtype)
    got = fast if fast is not None else want
    assert_series_equal(got, want)
    assert got.null_count() == want.null_count()


def test_frame_uses_schema_order_and_dtypes() -> None:
    given: dict[str, list[object]] = {"layer": [1, 2], "expert_ids": [[3, 4], None], "step_id": [7, 7]}
    df = schema.frame("routes", given, absent=[c for c in schema.ROUTES if c not in given])
    assert list(df.columns) == list(schema.ROUTES)
    assert dict(df.schema) == schema.ROUTES
    assert df["expert_ids"].to_list() == [[3, 4], None]
    assert df["router_probs"].null_count() == 2


def _routes(**drop_or_add: list[object] | None) -> dict[str, list[object]]:
    cols: dict[str, list[object]] = {c: [None] for c in schema.ROUTES}
    for name, values in drop_or_add.items():
        if values is None:
            del cols[name]
        else:
            cols[name] = values
    return cols


def test_a_missing_column_is_an_error_naming_it() -> None:
    with pytest.raises(ValueError, match=r"routes table: missing columns \['seq_id'\]"):
        schema.frame("routes", _routes(seq_id=None))
    # unless the producer says it does not have it: then it is null
    df = schema.frame("routes", _routes(seq_id=None), absent=["seq_id"])
    assert df["seq_id"].to_list() == [None]


def test_an_unknown_column_is_an_error_naming_it() -> None:
    # a misspelling: both names are said
    with pytest.raises(
        ValueError, match=r"routes table: missing columns \['seq_id'\]; unknown columns \['seq_idd'\]"
    ):
        schema.frame("routes", _routes(seq_id=None, seq_idd=[1]))
    with pytest.raises(ValueError, match=r"unknown columns \['nope'\]"):
        schema.frame("routes", _routes(nope=[1]), absent=["seq_id"])
    with pytest.raises(ValueError, match=r"declared absent but not in the table \['seq_idd'\]"):
        schema.frame("routes", _routes(seq_id=None), absent=["seq_id", "seq_idd"])


def test_fill_absent_and_columns_check_names() -> None:
    cols = schema.fill_absent(
        "masks", {c: [1] for c in schema.MASKS if c != "nonzero_bits"}, ["nonzero_bits"]
    )
    assert cols["nonzero_bits"] == [None] and cols.keys() == schema.MASKS.keys()
    assert schema.columns("masks", "row", "layer") == ("row", "layer")
    with pytest.raises(ValueError, match=r"not columns of the masks table: \['rows'\]"):
        schema.columns("masks", "row", "rows")
    with pytest.raises(ValueError, match="different lengths"):
        schema.frame("masks", {c: [1] if c != "row" else [1, 2] for c in schema.MASKS})


def test_frame_with_ragged_lists_keeps_rows_in_order() -> None:
    """A prompt step (many rows) among one-row decode steps: grouped by shape for the fast path,
    then back in the original order, equal to polars' own construction."""
    n = 40
    cols: dict[str, list[object]] = {
        "step_id": list(range(n)),
        "token_ids": [[1, 2, 3] if i % 13 == 0 else [i] for i in range(n)],
        "positions": [[0, 1, 2] if i % 13 == 0 else [i + 3] for i in range(n)],
        "seq_ids": [None if i == 5 else [0] for i in range(n)],
    }
    got = schema.frame("steps", cols, absent=[c for c in schema.STEPS if c not in cols])
    want = pl.DataFrame(
        [pl.Series(k, cols.get(k, [None] * n), dtype=t, strict=False) for k, t in schema.STEPS.items()]
    )
    assert got.schema == want.schema
    assert got.equals(want)
