"""schema.frame's fast path for list columns must build exactly what polars' general path builds."""

from __future__ import annotations

import math

import polars as pl
import pytest
from polars.testing import assert_series_equal

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
]


@pytest.mark.parametrize(("values", "dtype"), CASES)
def test_fast_path_equals_general_path(values: list[object], dtype: pl.DataType) -> None:
    fast = schema._regular_list_series("c", values, dtype)
    want = _general(values, dtype)
    got = fast if fast is not None else want
    assert_series_equal(got, want)
    assert got.null_count() == want.null_count()


def test_frame_uses_schema_order_and_dtypes() -> None:
    df = schema.frame("routes", {"layer": [1, 2], "expert_ids": [[3, 4], None], "step_id": [7, 7]})
    assert list(df.columns) == list(schema.ROUTES)
    assert dict(df.schema) == schema.ROUTES
    assert df["expert_ids"].to_list() == [[3, 4], None]
    assert df["router_probs"].null_count() == 2
    with pytest.raises(KeyError, match="not in the routes schema"):
        schema.frame("routes", {"nope": [1]})


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
    got = schema.frame("steps", cols)
    want = pl.DataFrame(
        [pl.Series(k, cols.get(k, [None] * n), dtype=t, strict=False) for k, t in schema.STEPS.items()]
    )
    assert got.schema == want.schema
    assert got.equals(want)
