"""The fan-out that feeds sinks (metrics, exporters) the recording's rows: redacted as the
recording stores them, and a failing sink switched off without ending the recording."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import polars as pl

from sparseety_prof.session.options import Progress
from sparseety_prof.session.sinks import SinkFanout
from sparseety_prof.store import schema


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
