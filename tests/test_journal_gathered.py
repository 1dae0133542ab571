"""The journal's gathered records (store/gathered_codec.py, store/plain_marshal.py): the rows as the
consumer gathered them come back as the frames it makes; a recording killed at any point of its
drains and flushes holds every row journaled, once; a payload from elsewhere is refused with one
error and never decoded by marshal.loads."""

from __future__ import annotations

import marshal
import random
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pytest
from polars.testing import assert_frame_equal

import sparseety_prof
from sparseety_prof.session.collector import FlushTimedCollector
from sparseety_prof.session.policy import RecordingPolicy
from sparseety_prof.session.row_outlet import RowOutlet
from sparseety_prof.session.sinks import SinkFanout
from sparseety_prof.session.stage_cpu import StageCpu
from sparseety_prof.store import gathered_codec, plain_marshal, schema
from sparseety_prof.store.array_rows import ArrayRows, RowParts
from sparseety_prof.store.buffers import ColumnBuffer, FlushSchedule
from sparseety_prof.store.journal import HEADER, JOURNAL_DIR, MAGIC, MAGIC_GATHERED
from sparseety_prof.store.journal_reader import _gathered_frame
from sparseety_prof.store.recording_writer import RecordingWriter

META = {"target": {"pid": 1}, "layers": {"moe": [0, 1, 2], "ffn": [0, 1, 2], "attention": [0, 1, 2]}}
TABLES = ("tokens", "steps", "routes", "requests")


# ------------------------------------------------------------------ random rows of any table
def _leaf(rng: random.Random, dtype: Any) -> Any:
    if isinstance(dtype, pl.String):
        return rng.choice(["a", "", " the", "é\x1b[2J", "\u202e", "x" * 40])
    if isinstance(dtype, pl.Boolean):
        return rng.random() < 0.5
    if isinstance(dtype, pl.Float32 | pl.Float64):
        return rng.choice([rng.uniform(-5, 5), 0.0, -0.0, float("inf")])
    return rng.randrange(-(2**31), 2**31) if isinstance(dtype, pl.Int32) else rng.randrange(-(2**62), 2**62)


def _value(rng: random.Random, dtype: Any, width: int) -> Any:
    """One value of `dtype`: lists of `width` items (ragged now and then), None now and then."""
    if rng.random() < 0.1:
        return None
    if isinstance(dtype, pl.List):
        n = width if rng.random() < 0.8 else rng.randrange(0, 2 * width + 1)
        return [
            _value(rng, dtype.inner, width) if isinstance(dtype.inner, pl.List) else _leaf(rng, dtype.inner)
            for _ in range(n)
        ]
    return _leaf(rng, dtype)


def _lists(rng: random.Random, table: str, n: int) -> dict[str, list[Any]]:
    width = rng.randrange(1, 4)
    return {c: [_value(rng, d, width) for _ in range(n)] for c, d in schema.TABLES[table].items()}


def _numpy_of(dtype: Any) -> Any:
    while isinstance(dtype, pl.List):
        dtype = dtype.inner
    numpy_of: dict[Any, Any] = {pl.Int32(): np.int32, pl.Int64(): np.int64, pl.Float32(): np.float32}
    return numpy_of.get(dtype, np.float64 if isinstance(dtype, pl.Float64) else None)


def _array_rows(rng: random.Random, table: str, n: int) -> ArrayRows:
    """Rows as the correlator hands them: numbers as arrays (lists as 2-D or 3-D ones), some null
    marks and rows of null items, text as Python values, a column of nulls now and then."""
    arrays: dict[str, Any] = {}
    nulls: dict[str, np.ndarray] = {}
    items: dict[str, np.ndarray] = {}
    for c, d in schema.TABLES[table].items():
        np_type = _numpy_of(d)
        depth = 0
        inner: Any = d
        while isinstance(inner, pl.List):
            inner, depth = inner.inner, depth + 1
        if rng.random() < 0.1:
            arrays[c] = None
        elif np_type is None or depth > 2:
            arrays[c] = [_value(rng, d, 2) for _ in range(n)]
        else:
            shape = (n, *([rng.randrange(1, 4)] * depth))
            arrays[c] = (
                (np.array([rng.uniform(-9, 9) for _ in range(int(np.prod(shape)))]) * 7)
                .astype(np_type)
                .reshape(shape)
            )
            if rng.random() < 0.3:
                nulls[c] = np.array([rng.random() < 0.3 for _ in range(n)])
            if depth == 1 and rng.random() < 0.3:
                items[c] = np.array([rng.random() < 0.3 for _ in range(n)])
    return ArrayRows(n, arrays, nulls, items)


def _part(rng: random.Random, table: str) -> Mapping[str, Any]:
    """One drain's rows of `table`: column lists, or RowParts of list rows and array rows."""
    n = rng.randrange(0, 12)
    if rng.random() < 0.4:
        return _lists(rng, table, n)
    arrays = [_array_rows(rng, table, rng.randrange(1, 6)) for _ in range(rng.randrange(1, 3))]
    n_arrays = sum(p.n for p in arrays)
    order = np.array([True] * n_arrays + [False] * n)
    rng.shuffle(order)  # type: ignore[arg-type]
    return RowParts(_lists(rng, table, n), arrays, order)


def _frames(table: str, parts: list[Mapping[str, Any]]) -> pl.DataFrame:
    buf = ColumnBuffer(ordered=True)
    frames = [df for p in parts for df in buf.add(table, p, final=False)] + [df for _, df in buf.take_all()]
    return pl.concat(frames) if frames else schema.empty(table)


# ------------------------------------------------------------------ the codec
@pytest.mark.parametrize("table", TABLES)
def test_gathered_rows_come_back_as_the_frames_the_consumer_makes(table: str) -> None:
    rng = random.Random(f"gathered-{table}")
    for _ in range(60):
        parts = [_part(rng, table) for _ in range(rng.randrange(1, 4))]
        payload = gathered_codec.encode(parts)
        back = gathered_codec.decode(table, payload)
        want = _frames(table, parts)
        assert gathered_codec.payload_rows(payload) == want.height
        assert_frame_equal(_frames(table, back), want)
        assert_frame_equal(_gathered_frame(table, payload), want)


def test_numpy_values_among_a_column_s_values_come_back_as_the_same_numbers() -> None:
    cols = _lists(random.Random(3), "steps", 4)
    cols["n_tokens"] = [np.int32(5), 6, np.int64(7), None]
    back = gathered_codec.decode("steps", gathered_codec.encode([cols]))
    assert back[0]["n_tokens"] == [5, 6, 7, None]


def test_a_numpy_value_past_a_column_s_first_is_refused_when_read_never_read_wrong() -> None:
    """marshal writes a numpy scalar (a buffer) as bytes: the reader refuses bytes in a column
    that holds none, so that drain's rows are named damaged rather than read as other values."""
    cols = _lists(random.Random(4), "steps", 3)
    cols["n_tokens"] = [5, np.int64(6), 7]
    with pytest.raises(gathered_codec.GatheredRowsError, match="bytes in column n_tokens"):
        gathered_codec.decode("steps", gathered_codec.encode([cols]))
    cols["n_tokens"] = [5, 6, 7]
    cols["positions"] = [[1], [2, np.int32(3)], None]
    with pytest.raises(gathered_codec.GatheredRowsError, match="bytes in column positions"):
        gathered_codec.decode("steps", gathered_codec.encode([cols]))


def test_marshal_s_reader_for_plain_values_reads_what_marshal_writes() -> None:
    rng = random.Random(9)

    def gen(depth: int = 0) -> Any:
        k = rng.randrange(9 if depth < 4 else 6)
        if k == 0:
            return None
        if k == 1:
            return rng.randrange(-(2**70), 2**70)
        if k == 2:
            return rng.random()
        if k == 3:
            return rng.choice(["a", "bb", "é", "\ud800", "tok" * 100])
        if k == 4:
            return rng.randbytes(rng.randrange(5))
        if k == 5:
            return rng.random() < 0.5
        if k == 6:
            return [gen(depth + 1) for _ in range(rng.randrange(4))]
        if k == 7:
            return tuple(gen(depth + 1) for _ in range(rng.randrange(4)))
        return {rng.choice("abc"): gen(depth + 1) for _ in range(rng.randrange(3))}

    for _ in range(2000):
        v = gen()
        assert repr(plain_marshal.loads(marshal.dumps(v, 4))) == repr(v)


# ------------------------------------------------------------------ from elsewhere
def test_what_plain_values_do_not_have_is_refused_never_built() -> None:
    code = marshal.dumps((lambda: 1).__code__, 4)
    with pytest.raises(plain_marshal.MarshalError, match="plain values do not have"):
        plain_marshal.loads(code)
    deep: list[Any] = []
    for _ in range(40):
        deep = [deep]
    with pytest.raises(plain_marshal.MarshalError, match="nested deeper"):
        plain_marshal.loads(marshal.dumps(deep, 4))
    # a list that says it holds two billion items, in a few bytes: refused before any is read
    with pytest.raises(plain_marshal.MarshalError, match="container of"):
        plain_marshal.loads(b"[" + (2**31 - 1).to_bytes(4, "little") + b"N")
    with pytest.raises(plain_marshal.MarshalError, match="more than"):
        plain_marshal.loads(marshal.dumps([None] * 1000, 4), max_items=100)
    payload = gathered_codec.MAGIC + (1).to_bytes(4, "little") + code
    with pytest.raises(gathered_codec.GatheredRowsError):
        gathered_codec.decode("steps", payload)


def test_mutated_gathered_records_are_refused_with_one_error_and_never_crash_the_reader() -> None:
    rng = random.Random(61)
    refused = 0
    for _ in range(300):
        table = rng.choice(TABLES)
        data = bytearray(gathered_codec.encode([_part(rng, table) for _ in range(2)]))
        for _ in range(rng.randint(1, 4)):
            op = rng.randrange(3)
            if op == 0:
                data[rng.randrange(len(data))] = rng.randrange(256)
            elif op == 1:
                del data[rng.randrange(len(data)) :]
            else:
                data.insert(rng.randrange(len(data) + 1), rng.randrange(256))
        try:
            df = _gathered_frame(table, bytes(data))
        except gathered_codec.GatheredRowsError:
            refused += 1
            continue
        assert df.columns == list(schema.TABLES[table])
    assert refused > 100  # (any other exception, or a crash, fails the test too)


# ------------------------------------------------------------------ killed at any point
def _outlet(writer: RecordingWriter, policy: tuple[str, ...] = ("full",)) -> RowOutlet:
    sinks = SinkFanout([], META, redact_text=False, redact=frozenset(), redact_layers=None, log=print)
    return RowOutlet(
        writer,
        RecordingPolicy(policy),
        None,
        sinks,
        stages=StageCpu(),
        collector=FlushTimedCollector(),
        log=print,
    )


def _sorted(df: pl.DataFrame) -> pl.DataFrame:
    return df.sort(pl.all(), nulls_last=True, maintain_order=True)


def test_a_recording_killed_anywhere_holds_every_journaled_row_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Drains of routes (list rows and array rows mixed) and steps, journal records, flushes done
    in pieces, frames made early (FRAME_ROWS) and segments written mid-flush (segment_rows): the
    recording's files are copied after every step, as a SIGKILL would leave them; each copy
    holds every row that had reached the journal or a segment, each once, and no other."""
    monkeypatch.setattr(ColumnBuffer, "FRAME_ROWS", 40)
    rng = random.Random(62)
    rec = tmp_path / "rec"
    w = RecordingWriter(rec, META, fsync_interval=1000.0, segment_rows=25)
    out = _outlet(w)
    flush = FlushSchedule(10.0)
    fed: dict[str, list[pl.DataFrame]] = {t: [] for t in ("routes", "steps")}
    durable = {t: 0 for t in fed}  # rows of each table the files must hold
    t0 = time.monotonic()
    copies = 0

    def check() -> None:
        nonlocal copies
        copy = tmp_path / f"kill-{copies}"
        copies += 1
        shutil.copytree(rec, copy)
        r = sparseety_prof.open(copy)
        assert not r.damaged, r.damaged
        for table in fed:
            want = pl.concat(fed[table]).head(durable[table]) if durable[table] else schema.empty(table)
            assert_frame_equal(_sorted(r.table(table).select(want.columns)), _sorted(want))
        shutil.rmtree(copy)

    for drain in range(40):
        for table in fed:
            part = _part(rng, table)
            fed[table].append(_frames(table, [part]))
            out.add(table, part)
        now = t0 + drain  # a drain a second: each one's rows journaled after it
        flush._next = now + (0 if drain % 7 == 6 else 100)  # a flush every seventh drain
        out.keep_durable(flush, now, in_pieces=True)
        durable = {t: sum(df.height for df in fed[t]) for t in fed}
        check()
        while out.round.active:  # the flush's pieces, a kill after each
            out.round.step()
            check()
    out.close_rows()
    w.close()
    r = sparseety_prof.open(rec)
    assert r.complete and not (rec / JOURNAL_DIR).exists()
    for table in fed:
        assert_frame_equal(
            _sorted(r.table(table).select(list(schema.TABLES[table]))), _sorted(pl.concat(fed[table]))
        )


def _magics(rec: Path) -> set[bytes]:
    out = set()
    for log in (rec / JOURNAL_DIR).iterdir():
        data, pos = log.read_bytes(), 0
        while pos < len(data):
            magic, _, _, _, length, _ = HEADER.unpack_from(data, pos)
            out.add(magic)
            pos += HEADER.size + length
    return out


@pytest.mark.parametrize(
    ("policy", "redact_text", "want"),
    [
        (("full",), False, MAGIC_GATHERED),  # stored as gathered: the journal holds them so
        (("full",), True, MAGIC),  # a redaction changes them: journaled as stored, framed
        (("tail:0.5",), False, MAGIC),  # a policy holds rows: framed when decided
    ],
)
def test_rows_the_recording_changes_or_holds_go_framed_the_others_as_gathered(
    tmp_path: Path, policy: tuple[str, ...], redact_text: bool, want: bytes
) -> None:
    rec = tmp_path / "rec"
    w = RecordingWriter(rec, META, fsync_interval=1000.0, redact_text=redact_text)
    out = _outlet(w, policy)
    rng = random.Random(63)
    lists = _lists(rng, "tokens", 5)
    lists["token_text"] = ["secret"] * 5
    out.add("tokens", lists)
    out.keep_durable(FlushSchedule(10.0), time.monotonic(), in_pieces=True)
    if policy != ("full",):
        assert not (rec / JOURNAL_DIR).exists() or _magics(rec) <= {MAGIC}  # held: nothing yet
    else:
        assert _magics(rec) == {want}
    if redact_text:
        assert b"secret" not in b"".join(p.read_bytes() for p in (rec / JOURNAL_DIR).iterdir())
    out.close_rows()
    w.close()
