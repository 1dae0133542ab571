"""A flush done in pieces between drains (session/flush_round.py): one table's rows framed per
piece, then the writes; the rows are those gathered when it started; a drain's newer frames of a
table never overtake the older rows the flush still holds; flushes never overlap."""

from __future__ import annotations

from collections.abc import Iterator

import polars as pl
import pytest

from sparseety_prof.session.flush_round import FlushRound
from sparseety_prof.store import schema
from sparseety_prof.store.buffers import ColumnBuffer


def _steps(ids: list[int]) -> dict[str, list[object]]:
    given: dict[str, list[object]] = {"step_id": list(ids), "ctx_id": [0] * len(ids)}
    return schema.fill_absent("steps", given, [c for c in schema.TABLES["steps"] if c not in given])


def _requests(ids: list[str]) -> dict[str, list[object]]:
    given: dict[str, list[object]] = {"request_id": list(ids)}
    return schema.fill_absent("requests", given, [c for c in schema.TABLES["requests"] if c not in given])


class Readers:
    """Where the frames go, and the writes' pieces as they run."""

    def __init__(self) -> None:
        self.got: list[tuple[str, list[object]]] = []
        self.log: list[str] = []

    def emit(self, table: str, df: pl.DataFrame) -> None:
        key = "step_id" if table == "steps" else "request_id"
        self.got.append((table, df[key].to_list()))

    def writes(self, name: str) -> Iterator[str]:
        self.log.append(f"{name}: settle")
        yield "settle"
        self.log.append(f"{name}: segments")
        yield "segments"
        self.log.append(f"{name}: meta")
        yield "meta"


def test_a_flush_frames_one_table_per_piece_then_writes_and_leaves_later_rows_for_the_next() -> None:
    rows, readers, flush = ColumnBuffer(), Readers(), FlushRound()
    rows.add("steps", _steps([1, 2]), final=False)
    rows.add("requests", _requests(["a"]), final=False)
    flush.start(rows.detach(), readers.emit, readers.writes("first"))
    assert flush.active and readers.got == []
    rows.add("steps", _steps([3]), final=False)  # a drain between two pieces
    assert flush.step() == "rows steps"
    assert readers.got == [("steps", [1, 2])]
    assert flush.step() == "rows requests"
    assert readers.got == [("steps", [1, 2]), ("requests", ["a"])] and readers.log == []
    assert flush.step() == "settle" and readers.log == ["first: settle"]
    assert flush.step() == "segments" and readers.log == ["first: settle", "first: segments"]
    assert flush.step() == "meta" and readers.log[-1] == "first: meta"
    assert flush.step() is None and not flush.active
    assert rows.tables() == ["steps"]  # the drain's row: the next flush's
    assert (flush.rounds, flush.pieces) == (1, 5)


def test_a_drains_frames_of_a_table_the_flush_holds_come_after_its_older_rows() -> None:
    rows, readers, flush = ColumnBuffer(), Readers(), FlushRound()
    rows.FRAME_ROWS = 3
    rows.add("requests", _requests(["a"]), final=False)
    rows.add("steps", _steps([1]), final=False)
    flush.start(rows.detach(), readers.emit, readers.writes("first"))
    assert flush.step() == "rows requests"  # steps [1] still held
    # a drain gathers enough steps rows for a frame: the held row goes first
    for df in rows.add("steps", _steps([2, 3, 4]), final=False):
        flush.before_frames("steps")
        readers.emit("steps", df)
    assert readers.got == [("requests", ["a"]), ("steps", [1]), ("steps", [2, 3, 4])]
    flush.finish()  # its steps piece finds the table taken and goes on to the writes
    assert readers.got[-1] == ("steps", [2, 3, 4]) and len(readers.got) == 3
    assert readers.log == ["first: settle", "first: segments", "first: meta"]


def test_a_flush_started_while_one_is_under_way_finishes_that_one_first() -> None:
    rows, readers, flush = ColumnBuffer(), Readers(), FlushRound()
    rows.add("steps", _steps([1]), final=False)
    flush.start(rows.detach(), readers.emit, readers.writes("first"))
    flush.step()
    rows.add("steps", _steps([2]), final=False)
    flush.start(rows.detach(), readers.emit, readers.writes("second"))
    assert readers.log == ["first: settle", "first: segments", "first: meta"]
    flush.finish()
    assert readers.got == [("steps", [1]), ("steps", [2])]
    assert readers.log[3:] == ["second: settle", "second: segments", "second: meta"]


def test_a_piece_that_fails_ends_its_flush() -> None:
    rows, readers, flush = ColumnBuffer(), Readers(), FlushRound()

    def failing() -> Iterator[str]:
        yield "settle"
        raise OSError("No space left on device")

    rows.add("steps", _steps([1]), final=False)
    flush.start(rows.detach(), readers.emit, failing())
    flush.step()
    flush.step()
    with pytest.raises(OSError, match="No space"):
        flush.step()
    assert not flush.active and flush.step() is None
    flush.before_frames("steps")  # nothing held any more
    assert readers.got == [("steps", [1])]
