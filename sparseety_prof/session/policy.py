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
from dataclasses import dataclass
from typing import Any

import polars as pl

from sparseety_prof.session import request_verdicts
from sparseety_prof.session.request_hold import DEFAULT_WINDOW_BYTES, LEARNED_COLUMNS, RequestHold
from sparseety_prof.store.array_rows import ArrayRows

POLICIES: tuple[str, ...] = ("full", "aggregate", "head:RATE", "tail:Q", "anomaly[:KINDS]")
_DROPPED_TABLES: dict[str, frozenset[str]] = {
    "full": frozenset(),
    "aggregate": frozenset({"tokens", "steps", "routes", "masks", "kernels", "layer_times"}),
}


@dataclass(frozen=True)
class PolicyChoice:
    """The `--policy` values, parsed once (`parse`): what Options carries, and what each
    recording's RecordingPolicy is made from."""

    specs: tuple[str, ...]  # the values as given, checked (meta.json policy.name joins them)
    rows: str  # the table-level policy: "full", or "aggregate" when no per-request one keeps rows
    per_request: tuple[request_verdicts.VerdictSpec, ...]
    #: the rate of head sampling done in the probes, or None. When `head:RATE` is the only
    #: per-request policy (`aggregate` may come with it), a request is decided at its start and
    #: nothing else may keep it: the probes draw it there and copy no logits row of a request they
    #: drop (token_probes.bpf.c head_keeps). With tail or anomaly, which decide at a request's end,
    #: every request is captured and head is decided in the consumer, from the request id.
    head_in_probes: float | None

    @classmethod
    def parse(cls, specs: Sequence[str]) -> PolicyChoice:
        """The `--policy` values, checked (ValueError with what is wrong)."""
        specs = tuple(specs) or ("full",)
        if "full" in specs and len(specs) > 1:
            raise ValueError("full keeps every row: it cannot be combined with another policy")
        per_request = request_verdicts.parse_specs([s for s in specs if s not in _DROPPED_TABLES])
        head = per_request[0] if len(per_request) == 1 and per_request[0].name == "head" else None
        return cls(
            specs=specs,
            rows=specs[0] if not per_request else "full",
            per_request=per_request,
            head_in_probes=head.number if head is not None else None,
        )


def probe_keep_below(rate: float) -> int:
    """The probes' threshold for a rate: a draw of bpf_get_prandom_u32() below it keeps."""
    return min(1 << 32, max(0, round(rate * (1 << 32))))


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
        choice: PolicyChoice | Sequence[str],
        *,
        window_bytes: int = DEFAULT_WINDOW_BYTES,
        probe_verdicts: dict[str, bool] | None = None,
    ) -> None:
        """`choice`: the parsed `--policy` values (Options.policy_choice), or the values as text.
        `probe_verdicts`: with head sampling in the probes (PolicyChoice.head_in_probes), the
        verdicts the correlator takes from the probes' draws (request_verdicts.Head)."""
        if not isinstance(choice, PolicyChoice):
            choice = PolicyChoice.parse(choice)
        self.specs = choice.specs
        self._rows = RowPolicy(choice.rows)
        self.probe_verdicts = probe_verdicts
        self.probe_head = probe_verdicts is not None
        self.hold = (
            RequestHold([v.make(probe_verdicts) for v in choice.per_request], max_bytes=window_bytes)
            if choice.per_request
            else None
        )

    @classmethod
    def for_session(cls, choice: PolicyChoice, window_bytes: int) -> RecordingPolicy:
        """The policy of one recording: with head sampling in the probes, a verdicts dict for the
        correlator to fill (probe_verdicts)."""
        verdicts: dict[str, bool] | None = {} if choice.head_in_probes is not None else None
        return cls(choice, window_bytes=window_bytes, probe_verdicts=verdicts)

    def read_layout(self, meta: Mapping[str, Any]) -> None:
        """The recording's metadata, once attached: the anomaly detectors read its layer map."""
        for v in self.hold.verdicts if self.hold is not None else ():
            if isinstance(v, request_verdicts.Anomaly):
                v.meta = meta

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

    def stores_whole(self, table: str) -> bool:
        """Whether every row of `table` is stored as it comes, in order (no per-request decision
        holds or drops some, the table is not dropped): a recording's journal may then hold
        them as gathered (session/row_outlet.py)."""
        return self.hold is None and table not in self._rows.drops

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
