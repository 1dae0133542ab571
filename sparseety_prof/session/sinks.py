"""Where the consumer's rows go besides the recording: a metrics endpoint, a trace exporter.

A sink is fed the same frames the recording is written from, as that recording would store them
(redaction applied), and the consumer's progress after every drain. The consumer is the one
thread that keeps the ring from overflowing, so a sink must return at once: whatever it does
with a frame that takes time (a network send, a scrape) happens on its own thread behind a
bounded queue, and what that queue cannot hold is dropped and counted by the sink, never waited
for. A sink that raises is switched off (and says so in meta), the recording goes on.

Under head sampling in the probes, the token and step rows of the requests the probes dropped are
set apart by the correlator (Correlator head_rows_apart) instead of being framed, held by the
policy and dropped: a sink that declares which columns it reads (`columns`) gets those rows as a
frame of just those columns, the others null (`take_apart`), so that the sinks still see every
request, and the rows nobody stores cost what the sinks read of them, no more. A sink without
that declaration keeps every row whole (nothing is set apart)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import polars as pl

from sparseety_prof.session.options import Progress
from sparseety_prof.store import redaction_levels
from sparseety_prof.store.array_rows import ArrayRows
from sparseety_prof.store.recording import list_layers, without_text

#: rows set apart held for the sinks before they are framed and given, flushes aside: what they
#: hold between flushes stays bounded at any token rate
APART_ROWS = 8192


class FrameSink(Protocol):
    """What the recorder feeds; see the module docstring for the rules a sink keeps."""

    name: str
    # the tables whose frames take() reads: a table no sink reads may not be made at all
    tables: frozenset[str]
    # optional: per table of `tables` whose rows may come set apart (tokens, steps), the columns
    # take() reads of them (the others may come null); see the module docstring
    # columns: Mapping[str, frozenset[str]]

    def open(self, meta: Mapping[str, Any]) -> None:
        """Once attached, before the first frame: the recording's meta (engine, model, layers)."""

    def take(self, table: str, df: pl.DataFrame) -> None:
        """Rows of `table` (schema.TABLES[table] columns); returns at once."""

    def drained(self, progress: Progress) -> None:
        """After every drain: counters of the session so far; returns at once."""

    def close(self, meta: Mapping[str, Any]) -> dict[str, Any]:
        """At detach, with the final meta (losses, counts): send what is left within a bounded
        time, stop threads, and say what was sent and dropped (stored under meta "sinks")."""


class SinkFanout:
    """Feeds every sink, redacting rows first as the recording does (--redact-text, --redact
    levels and layers), and switches off a sink that fails."""

    def __init__(
        self,
        sinks: Sequence[FrameSink],
        meta: Mapping[str, Any],
        *,
        redact_text: bool,
        redact: frozenset[str],
        redact_layers: frozenset[int] | None,
        log: Callable[[str], None],
    ) -> None:
        self._redaction = redaction_levels.Redaction(redact, redact_layers, list_layers(meta))
        self._redact_text = redact_text
        self._log = log
        self._live: list[FrameSink] = []
        self._failed: dict[str, str] = {}
        self._apart: dict[str, list[ArrayRows]] = {}  # rows set apart, until give_apart
        self._apart_rows = 0
        for s in sinks:
            self._call(s, s.open, meta)
            if s.name not in self._failed:
                self._live.append(s)

    def __bool__(self) -> bool:
        return bool(self._live)

    def wants(self, table: str) -> bool:
        """Whether a live sink reads `table`."""
        return any(table in s.tables for s in self._live)

    def columns(self, table: str) -> frozenset[str] | None:
        """The columns of `table` the live sinks that read it read (see the module docstring);
        None when one of them does not say (its rows must come whole)."""
        out: frozenset[str] = frozenset()
        for s in self._live:
            if table not in s.tables:
                continue
            declared = getattr(s, "columns", None)
            if declared is None or table not in declared:
                return None
            out |= declared[table]
        return out

    def take_apart(self, table: str, parts: Sequence[ArrayRows]) -> None:
        """One drain's rows set apart (their `columns` hold values, the others are null), held
        until give_apart (each flush, and APART_ROWS rows at most): a sink's work on a frame has
        a fixed cost (the span sink's group-bys), which the drains, about one a second, would
        pay ten times as often as the flushes do (docs/overhead.md, "The fleet sinks under head
        sampling")."""
        if not self.wants(table):
            return
        held = self._apart.setdefault(table, [])
        for p in parts:
            if p.n:
                held.append(p)
                self._apart_rows += p.n
        if self._apart_rows >= APART_ROWS:
            self.give_apart()

    def give_apart(self) -> None:
        """The rows set apart held so far, a frame per table in the order they were made: each
        sink that reads the table reads it as any frame. The correlator sets a drain's list rows
        apart before its array rows (split_rows), so a request's first token, made alone, would
        come after the run of tokens that followed it: the frame is put back in step order
        (stable: the rows of one step keep theirs), as a sink that numbers a request's tokens
        (the span sink's sampled events) needs."""
        held, self._apart, self._apart_rows = self._apart, {}, 0
        for table, parts in held.items():
            frames = [rows.frame(table) for rows in ArrayRows.concat(parts) if rows.n]
            if not frames:
                continue
            df = pl.concat(frames) if len(frames) > 1 else frames[0]
            if "step_id" in df.columns and df["step_id"].null_count() == 0:
                df = df.sort("step_id", maintain_order=True)
            self.take(table, df)

    def take(self, table: str, df: pl.DataFrame) -> None:
        if not self._live or df.height == 0:
            return
        if table == "requests" and self._apart:  # a request's set-apart tokens before its row
            self.give_apart()
        if self._redact_text:
            df = without_text(table, df)
        df = self._redaction.frame(table, df)
        for s in list(self._live):
            self._call(s, s.take, table, df)

    def drained(self, progress: Progress) -> None:
        for s in list(self._live):
            self._call(s, s.drained, progress)

    def close(self, meta: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
        """Each sink's own account, and the error of any sink switched off."""
        self.give_apart()  # (those of requests whose rows never came: a requests frame gives the rest)
        out: dict[str, dict[str, Any]] = {name: {"error": err} for name, err in self._failed.items()}
        for s in self._live:
            try:
                out[s.name] = s.close(meta)
            except Exception as e:
                out[s.name] = {"error": f"{type(e).__name__}: {e}"}
        self._live.clear()
        return out

    def _call(self, sink: FrameSink, fn: Callable[..., object], *args: Any) -> None:
        try:
            fn(*args)
        except Exception as e:  # a sink's bug or dead endpoint must not end the recording
            self._failed[sink.name] = f"{type(e).__name__}: {e}"
            if sink in self._live:
                self._live.remove(sink)
            self._log(f"sparseety-prof: {sink.name} switched off: {self._failed[sink.name]}")
