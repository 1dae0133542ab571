"""What a recording keeps of the rows the consumer makes (`--policy`).

`full` keeps every row. `aggregate` keeps the always-on aggregates (store/aggregates.py) and the
requests table, one row per request, and drops the per-token and per-step rows: the mode to stay
attached for days. What a policy drops is counted per table in meta.json "policy", apart from
"losses" (rows the profiler failed to capture). Metrics endpoints and exporters (session/sinks.py)
are fed every row whatever the policy: the policy decides what is stored."""

from __future__ import annotations

from typing import Any

POLICIES: tuple[str, ...] = ("full", "aggregate")
_DROPPED_TABLES: dict[str, frozenset[str]] = {
    "full": frozenset(),
    "aggregate": frozenset({"tokens", "steps", "routes", "masks", "kernels"}),
}


class RowPolicy:
    """Decides per frame of rows whether the recording stores it, and counts what it drops."""

    def __init__(self, name: str) -> None:
        if name not in POLICIES:
            raise ValueError(f"unknown policy {name!r}; policies are {', '.join(POLICIES)}")
        self.name = name
        self._drops = _DROPPED_TABLES[name]
        self.rows_dropped: dict[str, int] = {}

    def keeps(self, table: str, rows: int) -> bool:
        if table not in self._drops:
            return True
        self.rows_dropped[table] = self.rows_dropped.get(table, 0) + rows
        return False

    def to_meta(self) -> dict[str, Any]:
        return {"name": self.name, "rows_dropped": dict(sorted(self.rows_dropped.items()))}
