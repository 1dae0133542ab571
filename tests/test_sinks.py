"""The fan-out that feeds sinks (metrics, exporters) the recording's rows: redacted as the
recording stores them, and a failing sink switched off without ending the recording."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import polars as pl
import pytest

from sparseety_prof.session.metrics_sink import PrometheusSink
from sparseety_prof.session.metrics_tally import MetricsTally
from sparseety_prof.session.options import Progress
from sparseety_prof.session.otlp_sink import OtlpSink
from sparseety_prof.session.otlp_spans import SpanContext, TokenSummaries, step_span
from sparseety_prof.session.sinks import SinkFanout
from sparseety_prof.store import schema
from sparseety_prof.store.array_rows import ArrayRows


class Collecting:
    def __init__(
        self, name: str = "collect", fail_on: str = "", tables: frozenset[str] | None = None
    ) -> None:
        self.name = name
        self.tables = frozenset(schema.TABLES) if tables is None else tables
        self.fail_on = fail_on
        self.opened: Mapping[str, Any] | None = None
        self.frames: list[tuple[str, pl.DataFrame]] = []
        self.drains = 0

    def open(self, meta: Mapping[str, Any]) -> None:
        self.opened = meta

    def take(self, table: str, df: pl.DataFrame) -> None:
        if self.fail_on == "take":
            raise ConnectionError("collector went away")
        self.frames.append((table, df))

    def drained(self, progress: Progress) -> None:
        self.drains += 1

    def close(self, meta: Mapping[str, Any]) -> dict[str, Any]:
        return {"frames": len(self.frames)}


def _tokens() -> pl.DataFrame:
    cols: schema.Columns = {c: [None, None] for c in schema.TOKENS}
    cols.update(
        token_id=[5, 6],
        token_text=["secret", "words"],
        expert_ids=[[[1, 2], [3, 4]], [[0, 1], [2, 3]]],
        act_zero_ratio=[[0.123, 0.456], [0.5, 0.25]],
    )
    return schema.frame("tokens", cols)


def test_sinks_get_the_rows_as_the_recording_stores_them() -> None:
    sink = Collecting()
    meta = {"layers": {"moe": [0, 1], "ffn": [0, 1]}}
    fan = SinkFanout(
        [sink], meta, redact_text=True, redact=frozenset({"routing"}), redact_layers=None, log=print
    )
    fan.take("tokens", _tokens())
    fan.drained(Progress())
    assert sink.opened == meta and sink.drains == 1
    ((table, df),) = sink.frames
    assert table == "tokens" and df.schema == schema.empty("tokens").schema
    assert df["token_text"].to_list() == [None, None]
    assert df["expert_ids"].to_list() == [None, None]
    assert df["token_id"].to_list() == [5, 6]  # ids stay: only "ids" removes them
    assert fan.close({}) == {"collect": {"frames": 1}}


def test_a_failing_sink_is_switched_off_and_the_others_go_on() -> None:
    bad, good = Collecting("bad", fail_on="take"), Collecting("good")
    logged: list[str] = []
    fan = SinkFanout(
        [bad, good], {}, redact_text=False, redact=frozenset(), redact_layers=None, log=logged.append
    )
    fan.take("tokens", _tokens())
    fan.take("tokens", _tokens())
    assert len(good.frames) == 2 and bad.frames == []
    assert logged == ["sparseety-prof: bad switched off: ConnectionError: collector went away"]
    assert fan.close({}) == {"bad": {"error": "ConnectionError: collector went away"}, "good": {"frames": 2}}


def test_no_sink_means_no_work() -> None:
    fan = SinkFanout([], {}, redact_text=False, redact=frozenset(), redact_layers=None, log=print)
    assert not fan
    fan.take("tokens", _tokens())
    assert fan.close({}) == {}


def test_a_table_is_wanted_while_a_live_sink_reads_it() -> None:
    routes_reader = Collecting("metrics", tables=frozenset({"tokens", "routes"}))
    spans = Collecting("spans", fail_on="take", tables=frozenset({"tokens", "requests"}))
    fan = SinkFanout(
        [routes_reader, spans],
        {},
        redact_text=False,
        redact=frozenset(),
        redact_layers=None,
        log=lambda _s: None,
    )
    assert fan.wants("routes") and fan.wants("requests") and not fan.wants("masks")
    fan.take("tokens", _tokens())  # the spans sink fails: switched off, its tables no longer wanted
    assert fan.wants("routes") and not fan.wants("requests")
    assert not SinkFanout([], {}, redact_text=False, redact=frozenset(), redact_layers=None, log=print).wants(
        "tokens"
    )


class Declaring(Collecting):
    """A sink that says which columns of the token rows it reads (sinks.py: rows set apart)."""

    def __init__(self, columns: Mapping[str, frozenset[str]]) -> None:
        super().__init__("declaring", tables=frozenset(columns) | {"requests"})
        self.columns = columns


def test_rows_set_apart_reach_a_sink_as_the_columns_it_reads() -> None:
    """Rows of requests head sampling dropped come to the sinks as frames of the columns the sinks
    read (the others null); a sink that reads a table and does not say which columns keeps that
    table's rows whole (SinkFanout.columns None: nothing is set apart)."""
    reads = Declaring({"tokens": frozenset({"token_id", "expert_ids"})})
    fan = SinkFanout([reads], {}, redact_text=False, redact=frozenset(), redact_layers=None, log=print)
    assert fan.columns("tokens") == {"token_id", "expert_ids"}
    assert fan.columns("steps") == frozenset()  # read by no sink: nothing to keep for them
    lists = {c: v.to_list() for c, v in _tokens().to_dict().items()}
    part = ArrayRows.of_lists(lists, [1], {"token_id", "expert_ids", "request_id"})
    fan.take_apart("tokens", [part])
    assert reads.frames == []  # held until the flush
    fan.give_apart()
    ((table, df),) = reads.frames
    assert table == "tokens" and df.columns == list(schema.TOKENS)
    assert df.select("token_id", "expert_ids").rows() == [(6, [[0, 1], [2, 3]])]
    assert df["token_text"].to_list() == [None]  # not set apart: a column the sink did not ask for
    fan.take_apart("routes", [])  # a table no sink reads: nothing
    assert len(reads.frames) == 1
    # a drain's list rows come set apart before its array rows: put back in step order, one frame
    lists["step_id"] = [11, 10]
    names = {"token_id", "step_id"}
    fan.take_apart("tokens", [ArrayRows.of_lists(lists, [0], names)])
    fan.take_apart("tokens", [ArrayRows.of_lists(lists, [1], names)])  # (a later drain)
    fan.give_apart()
    assert len(reads.frames) == 2
    assert reads.frames[1][1].select("step_id", "token_id").rows() == [(10, 6), (11, 5)]
    # a requests frame comes after the set-apart tokens held before it: its spans pair them
    fan.take_apart("tokens", [ArrayRows.of_lists(lists, [0], names)])
    requests = _filled("requests", 1)
    fan.take("requests", requests)
    assert [t for t, _ in reads.frames[2:]] == ["tokens", "requests"]
    whole = SinkFanout(
        [reads, Collecting("whole", tables=frozenset({"tokens"}))],
        {},
        redact_text=False,
        redact=frozenset(),
        redact_layers=None,
        log=print,
    )
    assert whole.columns("tokens") is None


def _filled(table: str, n: int) -> pl.DataFrame:
    """n rows of `table`, every column holding a value (two requests, one list shape)."""

    def value(name: str, dtype: pl.DataType, i: int) -> Any:
        if name == "request_id":
            return f"req-{i % 2}"
        if name in ("ctx_id", "seq_id"):
            return i % 2
        if isinstance(dtype, pl.List):
            inner = dtype.inner
            if isinstance(inner, pl.List):
                return [[(i + j + k) % 4 for k in range(2)] for j in range(3)]
            return [float(i % 3) / 4 + j / 8 if inner.is_float() else (i + j) % 4 for j in range(3)]
        if dtype == pl.String():
            return "decode" if name == "phase" else f"{name}-{i}"
        if dtype == pl.Boolean():
            return i % 2 == 0
        if dtype.is_float():
            return -0.25 * (i + 1)
        return 1_000 * (i + 1) + (7 if name == "t_end_ns" else 0)

    return pl.DataFrame(
        [pl.Series(c, [value(c, d, i) for i in range(n)], dtype=d) for c, d in schema.TABLES[table].items()]
    )


def _only(df: pl.DataFrame, columns: frozenset[str]) -> pl.DataFrame:
    """`df` with every column but `columns` null (what a sink gets of rows set apart)."""
    return df.with_columns(pl.lit(None, dtype=df.schema[c]).alias(c) for c in df.columns if c not in columns)


@pytest.mark.parametrize("event_rate", [0.0, 1.0])
def test_the_span_sinks_declared_columns_are_all_it_reads(event_rate: float) -> None:
    """OtlpSink.columns: its token summaries, token events and step spans made of those columns
    alone (the others null) equal those made of whole rows."""
    sink = OtlpSink("http://127.0.0.1:9", token_event_rate=event_rate, steps=True)
    tokens, steps = _filled("tokens", 6), _filled("steps", 3)
    got, want = TokenSummaries(event_rate), TokenSummaries(event_rate)
    got.add(_only(tokens, sink.columns["tokens"]), 0)
    want.add(tokens, 0)
    assert got._open == want._open and len(want._open) == 2
    assert all(s.events for s in want._open.values()) == (event_rate > 0)
    ctx = SpanContext.from_meta({}, 0)
    parts = _only(steps, sink.columns["steps"]).iter_rows(named=True)
    for full, part in zip(steps.iter_rows(named=True), parts, strict=True):
        assert step_span(part, ctx) == step_span(full, ctx) is not None


def test_the_metrics_sinks_declared_columns_are_all_it_reads() -> None:
    """PrometheusSink.columns (TALLY_COLUMNS): the tally of token and step rows made of those
    columns alone (the others null) equals that of whole rows."""
    got, want = (MetricsTally([0, 1, 2], 4, [0, 1, 2]) for _ in range(2))
    for table in ("tokens", "steps"):
        df = _filled(table, 5)
        got.add(table, _only(df, PrometheusSink.columns[table]))
        want.add(table, df)
    a, b = got.snapshot(), want.snapshot()
    assert a.tokens == b.tokens == 5
    for field in ("nll", "step_seconds"):
        ha, hb = getattr(a, field), getattr(b, field)
        assert (ha.counts == hb.counts).all() and (ha.sums == hb.sums).all() and hb.counts.sum() > 0
