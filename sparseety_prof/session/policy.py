"""What a recording keeps of the rows the consumer makes (`--policy`, repeatable).

`full` keeps every row. `aggregate` keeps the always-on aggregates (store/aggregates.py) and the
requests table, one row per request, and drops the per-token and per-step rows: the mode to stay
attached for days. The per-request policies, `head:RATE`, `tail:Q` and `anomaly[:KINDS]`
(session/request_verdicts.py), keep the rows of the requests any of them keeps, and the aggregates
and the requests table whatever they decide (`aggregate` among them changes nothing). What a policy
drops is counted per table in meta.json "policy", apart from "losses" (rows the profiler failed to
capture). Metrics endpoints and exporters (session/sinks.py) are fed every row whatever the
policy: the policy decides what is stored."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import polars as pl

from sparseety_prof.session import request_verdicts
from sparseety_prof.session.request_hold import DEFAULT_WINDOW_BYTES, LEARNED_COLUMNS, RequestHold
from sparseety_prof.store.array_rows import ArrayRows

POLICIES: tuple[str, ...] = ("full", "aggregate", "head:RATE", "tail:Q", "anomaly[:KINDS]")
_DROPPED_TABLES: dict[str, frozenset[str]] = {
    "full": frozenset(),
    "aggregate": frozenset({"tokens", "steps", "routes", "masks", "kernels"}),
}


def probe_head_rate(specs: Sequence[str]) -> float | None:
    """The rate of head sampling done in the probes, or None. When `head:RATE` is the only
    per-request policy (`aggregate` may come with it), a request is decided at its start and
    nothing else may keep it: the probes draw it there and copy no logits row of a request they
    drop (token_probes.bpf.c head_keeps). With tail or anomaly, which decide at a request's end,
    every request is captured and head is decided in the consumer, from the request id."""
    per_request = [s for s in check(specs) if s not in _DROPPED_TABLES]
    if len(per_request) != 1 or not per_request[0].startswith("head:"):
        return None
    head = request_verdicts.parse(per_request)[0]
    assert isinstance(head, request_verdicts.Head)
    return head.rate


def probe_keep_below(rate: float) -> int:
    """The probes' threshold for a rate: a draw of bpf_get_prandom_u32() below it keeps."""
    return min(1 << 32, max(0, round(rate * (1 << 32))))


def check(specs: Sequence[str]) -> tuple[str, ...]:
    """The `--policy` values, checked (ValueError with what is wrong)."""
    specs = tuple(specs) or ("full",)
    if "full" in specs and len(specs) > 1:
        raise ValueError("full keeps every row: it cannot be combined with another policy")
    request_verdicts.parse([s for s in specs if s not in _DROPPED_TABLES])
    return specs


class RowPolicy:
    """Decides per frame of rows whether the recording stores it, and counts what it drops."""

    def __init__(self, name: str) -> None:
        if name not in _DROPPED_TABLES:
            raise ValueError(f"unknown policy {name!r}; policies are {', '.join(POLICIES)}")
        self.name = name
        self.drops = _DROPPED_TABLES[name]
        self.rows_dropped: dict[str, int] = {}

    def keeps(self, table: str, rows: int) -> bool:
        if table not in self.drops:
            return True
        self.rows_dropped[table] = self.rows_dropped.get(table, 0) + rows
        return False

    def to_meta(self) -> dict[str, Any]:
        return {"name": self.name, "rows_dropped": dict(sorted(self.rows_dropped.items()))}


class RecordingPolicy:
    """Every `--policy` value together: frames in, the frames to store out."""

    def __init__(
        self,
        specs: Sequence[str],
        meta: Mapping[str, Any] | None = None,
        *,
        window_bytes: int = DEFAULT_WINDOW_BYTES,
        probe_verdicts: dict[str, bool] | None = None,
    ) -> None:
        """`probe_verdicts`: with head sampling in the probes (probe_head_rate), the verdicts
        the correlator takes from the probes' draws (request_verdicts.Head)."""
        self.specs = check(specs)
        per_request = [s for s in self.specs if s not in _DROPPED_TABLES]
        self._rows = RowPolicy(self.specs[0] if not per_request else "full")
        self.probe_head = probe_verdicts is not None
        self.hold = (
            RequestHold(request_verdicts.parse(per_request, meta, probe_verdicts), max_bytes=window_bytes)
            if per_request
            else None
        )

    @property
    def per_request(self) -> bool:
        return self.hold is not None

    def stores(self, table: str) -> bool:
        """Whether any row of `table` may be stored (a per-request policy may keep any)."""
        return self.hold is not None or table not in self._rows.drops

    def count_dropped(self, table: str, rows: int) -> None:
        """Rows of a table this policy never stores (stores() is False) that were counted
        instead of made: dropped, as if their frame had been taken."""
        if self.stores(table):
            raise ValueError(f"the policy stores {table} rows: they must be made")
        self._rows.keeps(table, rows)

    def count_head_dropped(self, table: str, rows: int) -> None:
        """Rows of requests head sampling in the probes dropped that were counted instead of
        made (Correlator `head_drops_routes`): dropped, as the held rows of such a request are."""
        if self.hold is None or not self.probe_head:
            raise ValueError("only head sampling in the probes drops rows before they are made")
        self.hold.rows_dropped[table] = self.hold.rows_dropped.get(table, 0) + rows

    def learns(self, table: str) -> frozenset[str]:
        """The columns of `table` set_apart reads."""
        return LEARNED_COLUMNS.get(table, frozenset())

    def set_apart(self, table: str, parts: list[ArrayRows]) -> None:
        """Rows of requests head sampling in the probes dropped, set apart by the correlator
        (Correlator head_rows_apart) with the columns `learns` names: dropped, as the held rows of
        such a request are, and their requests learned as held token rows teach them."""
        if self.hold is None or not self.probe_head:
            raise ValueError("only head sampling in the probes sets rows apart")
        self.hold.set_apart(table, parts)

    def take(self, table: str, df: pl.DataFrame) -> list[tuple[str, pl.DataFrame]]:
        """A frame the consumer made: what of it to store now."""
        if self.hold is not None:
            out = self.hold.add(table, df)
            return [] if out is None else [(table, out)]
        return [(table, df)] if self._rows.keeps(table, df.height) else []

    def settle(self, *, final: bool = False) -> list[tuple[str, pl.DataFrame]]:
        """The held rows decided since the last call (every frame of the requests that ended must
        have been taken)."""
        return self.hold.settle(final=final) if self.hold is not None else []

    def to_meta(self) -> dict[str, Any]:
        name = "+".join(self.specs)
        if self.hold is None:
            return {**self._rows.to_meta(), "name": name}
        out = {
            "name": name,
            "rows_dropped": dict(sorted(self.hold.rows_dropped.items())),
            **self.hold.meta(),
        }
        if self.probe_head:
            heads = [v for v in self.hold.verdicts if isinstance(v, request_verdicts.Head)]
            out["head_in_probes"] = {"unjudged_requests": sum(h.unjudged for h in heads)}
        return out
