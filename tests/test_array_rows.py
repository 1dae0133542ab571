"""Rows held as numpy arrays (store/array_rows.py): their frame is the frame the same rows make
as column lists (schema.frame), their mapping view gives the lists, and ColumnBuffer gathers
them beside list rows."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from sparseety_prof.store import schema
from sparseety_prof.store.array_rows import ArrayRows, RowParts, split_rows
from sparseety_prof.store.buffers import ColumnBuffer

KEYS = ("step_id", "ctx_id", "seq_id", "pos", "row", "layer")


def _routes(n: int, k: int, *, seed: int, counted: np.ndarray | None = None) -> ArrayRows:
    rng = np.random.default_rng(seed)
    arrays: dict[str, np.ndarray | None] = {name: rng.integers(0, 1000, n) for name in KEYS}
    arrays["expert_ids"] = rng.integers(0, 64, (n, k)).astype(np.int32)
    arrays["expert_weights"] = rng.random((n, k), dtype=np.float32)
    arrays["router_probs"] = None
    arrays["act_zero_ratio"] = rng.random(n)  # float64: the frame makes it float32, as schema.frame
    arrays["act_below_ratio"] = rng.random(n)
    arrays["act_values"] = rng.integers(1, 5000, n)
    nulls = {}
    if counted is not None:
        nulls = {name: ~counted for name in ("act_zero_ratio", "act_below_ratio", "act_values")}
    return ArrayRows(n, arrays, nulls)


def _with(rows: ArrayRows, **cols: np.ndarray | list[object] | None) -> ArrayRows:
    """The rows with some columns replaced."""
    return ArrayRows(rows.n, {**rows.arrays, **cols}, rows.nulls, rows.null_items)


def _as_lists(rows: ArrayRows) -> dict[str, list[object]]:
    return {name: rows.column(name) for name in schema.TABLES["routes"]}


@pytest.mark.parametrize("with_nulls", [False, True])
def test_array_rows_make_the_frame_their_column_lists_make(with_nulls: bool) -> None:
    counted = np.array([True, False, True, True, False, True]) if with_nulls else None
    rows = _routes(6, 2, seed=1, counted=counted)
    lists = _as_lists(rows)
    if with_nulls:
        assert lists["act_values"][1] is None and lists["act_zero_ratio"][4] is None
        assert lists["act_values"][0] is not None
    assert lists["router_probs"] == [None] * 6
    assert isinstance(lists["expert_ids"][0], list) and len(lists["expert_ids"][0]) == 2
    got, want = rows.frame("routes"), schema.frame("routes", lists)
    assert got.schema == want.schema
    assert got.equals(want)


def test_parts_of_one_shape_are_joined_and_others_kept_apart() -> None:
    a, b, c = _routes(3, 2, seed=1), _routes(4, 2, seed=2), _routes(2, 3, seed=3)
    d = _routes(2, 3, seed=4, counted=np.array([True, False]))
    e = _routes(2, 3, seed=5)
    e = _with(e, expert_weights=np.asarray(e.arrays["expert_weights"], dtype=np.float64))
    joined = ArrayRows.concat([a, b, c, d, e])
    # a and b alike; c and d differ only in d's null marks; e's weights have another dtype
    assert [p.n for p in joined] == [7, 4, 2]
    assert joined[0].frame("routes").equals(pl.concat([a.frame("routes"), b.frame("routes")]))
    assert joined[1].frame("routes").equals(pl.concat([c.frame("routes"), d.frame("routes")]))
    assert ArrayRows.concat([]) == []


def test_parts_with_null_columns_join_parts_with_values() -> None:
    """A part whose column is None (all null), or Python values, or without null marks joins
    parts with arrays, marks and null items: the joined frame is the parts' frames one after
    the other (with head sampling in the probes, a dropped request's routes rows have no
    activation values and alternate with kept ones)."""
    parts = [
        _routes(3, 2, seed=s, counted=np.array([True, False, True]) if s % 2 else None) for s in range(6)
    ]
    parts[0] = _with(parts[0], act_zero_ratio=None)
    parts[1] = _with(parts[1], act_values=None)
    parts[2] = _with(parts[2], expert_weights=None)
    parts[3].null_items["expert_weights"] = np.array([False, True, False])
    parts[4] = _with(parts[4], router_probs=[[0.5, 0.5], None, [0.25, 0.75]])
    joined = ArrayRows.concat(parts)
    assert [p.n for p in joined] == [18]
    want = pl.concat([p.frame("routes") for p in parts])
    got = joined[0].frame("routes")
    assert got.schema == want.schema
    assert got.equals(want)
    assert got["act_values"].null_count() == 3 + 1 + 1  # part 1 all null; parts 3 and 5 marked
    assert got["router_probs"].null_count() == 15 + 1  # Python values in one part only


def test_row_parts_read_as_columns_in_the_order_the_rows_came() -> None:
    arrays = _routes(3, 2, seed=5)
    lists = schema.fill_absent(
        "routes",
        {"step_id": [10, 11], "layer": [0, 1]},
        [c for c in schema.TABLES["routes"] if c not in ("step_id", "layer")],
    )
    # a list row, the three array rows, the other list row
    parts = RowParts(lists, [arrays], np.array([False, True, True, True, False]))
    a_steps = arrays.column("step_id")
    assert parts["step_id"] == [10, *a_steps, 11]
    assert list(parts) == list(lists) and len(parts) == len(lists)
    want = {name: parts[name] for name in lists}
    assert parts == want and want == parts  # compares as the column lists it stands for


def test_column_buffer_gathers_array_rows_beside_list_rows() -> None:
    def lists(steps: list[int]) -> dict[str, list[object]]:
        given: dict[str, list[object]] = {"step_id": list(steps), "layer": [0] * len(steps)}
        return schema.fill_absent("routes", given, [c for c in schema.TABLES["routes"] if c not in given])

    buf = ColumnBuffer()
    buf.FRAME_ROWS = 8
    a = _routes(3, 2, seed=6)
    assert buf.add("routes", lists([1, 2]), final=False) == []
    assert (
        buf.add("routes", RowParts(lists([3]), [a], np.array([True, True, True, False])), final=False) == []
    )
    b = _routes(2, 2, seed=7)
    (df,) = buf.add("routes", RowParts(lists([]), [b], np.ones(2, bool)), final=False)
    # the list rows first, then the array rows, each in their order
    assert df.height == 8
    assert df["step_id"].to_list() == [1, 2, 3, *a.column("step_id"), *b.column("step_id")]
    assert df.slice(3).equals(pl.concat([a.frame("routes"), b.frame("routes")]))
    # array rows alone, taken at the end
    buf.add("routes", RowParts(lists([]), [a], np.ones(3, bool)), final=False)
    [(table, last)] = buf.take_all()
    assert table == "routes" and last.equals(a.frame("routes"))
    assert buf.take_all() == []


def test_a_column_of_nulls_has_its_dtype() -> None:
    for dtype in (pl.List(pl.Float32()), pl.List(pl.List(pl.Int32())), pl.Int32(), pl.String()):
        s = schema.null_series("x", dtype, 5)
        assert s.dtype == dtype and s.len() == 5 and s.null_count() == 5
    assert schema.null_series("x", pl.Int64(), 0).len() == 0


def test_column_buffer_keeps_the_order_rows_came_in_for_ordered_tables() -> None:
    """Every table but routes (ColumnBuffer.UNORDERED) gets its rows back in the order they came,
    list rows before the first array rows and after the last included; the frame's values are
    those the same rows make as lists."""

    def lists(steps: list[int]) -> dict[str, list[object]]:
        given: dict[str, list[object]] = {"step_id": list(steps), "layer": [0] * len(steps)}
        return schema.fill_absent("routes", given, [c for c in schema.TABLES["routes"] if c not in given])

    buf = ColumnBuffer(ordered=True)  # the routes schema, kept in order as the tokens table is
    a, b = _routes(3, 2, seed=8), _routes(2, 2, seed=9)
    buf.add("routes", lists([1, 2]), final=False)
    buf.add("routes", RowParts(lists([3]), [a], np.array([True, False, True, True])), final=False)
    buf.add("routes", RowParts(lists([]), [b], np.ones(2, bool)), final=False)
    buf.add("routes", lists([4]), final=False)
    [(_, df)] = buf.take_all()
    a_steps, b_steps = a.column("step_id"), b.column("step_id")
    assert df["step_id"].to_list() == [1, 2, a_steps[0], 3, *a_steps[1:], *b_steps, 4]
    rows = {
        name: [*lists([1, 2])[name], a.column(name)[0], lists([3])[name][0]]
        for name in schema.TABLES["routes"]
    }
    assert df.head(4).equals(schema.frame("routes", rows))


@pytest.mark.parametrize("as_parts", [False, True])
def test_rows_split_apart_frame_as_the_rows_they_were(as_parts: bool) -> None:
    """split_rows: the rows left are the others in their order, every column; the rows set apart
    hold the named columns' values (list rows and array rows, nulls kept) and nulls elsewhere."""
    a, b = _routes(4, 2, seed=8, counted=np.array([True, False, True, True])), _routes(3, 2, seed=9)
    given: dict[str, list[object]] = {
        "step_id": [100, 101, 102],
        "layer": [0, 1, 2],
        "act_values": [7, None, 9],
    }
    lists = schema.fill_absent("routes", given, [c for c in schema.TABLES["routes"] if c not in given])
    # list, a's four, list, b's three, list
    is_array = np.array([False, True, True, True, True, False, True, True, True, False])
    cols = RowParts(lists, [a, b], is_array) if as_parts else lists
    n = len(is_array) if as_parts else 3
    apart = np.zeros(n, dtype=bool)
    apart[[0, 2, 3, 6, 7, 8] if as_parts else [1, 2]] = True
    names = {"step_id", "act_values", "expert_ids"}
    whole = schema.frame("routes", {name: list(cols[name]) for name in schema.TABLES["routes"]})
    rest, parts = split_rows(cols, apart, names)
    got_rest = schema.frame("routes", {name: list(rest[name]) for name in schema.TABLES["routes"]})
    assert got_rest.equals(whole.filter(pl.Series(~apart)))
    got = pl.concat([p.frame("routes") for p in parts])
    want = whole.filter(pl.Series(apart))
    order = ["step_id", "layer"]
    for name in schema.TABLES["routes"]:
        if name in names:
            assert sorted(got[name].to_list(), key=repr) == sorted(want[name].to_list(), key=repr), name
        else:
            assert got[name].null_count() == got.height, name
    assert got.height == int(apart.sum()) and got.sort(order)["step_id"].equals(want.sort(order)["step_id"])
    nothing, none = split_rows(cols, np.zeros(n, dtype=bool), names)
    assert nothing is cols and none == []
