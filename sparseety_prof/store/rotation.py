"""A recording's disk budget (`record --max-disk`): once its segments hold more bytes than the
budget, the oldest segments, whatever their table, make room for the newest. The tables are
flushed together, so removing by write order keeps them roughly in step: what remains is the
latest stretch of the run. Rows removed this way are counted apart (`rotation` in meta.json),
never as losses: the operator chose to keep only the most recent."""

from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """'500M', '2G', '1.5GiB', '4096' -> bytes (binary units). Raises ValueError."""
    m = _SIZE_RE.match(text)
    if m is None:
        raise ValueError(f"not a size: {text!r} (examples: 500M, 2G, 1048576)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


@dataclass(frozen=True)
class Segment:
    table: str
    index: int
    nbytes: int
    rows: int


class DiskBudget:
    """The segments on disk in write order, and which to remove to stay within `max_bytes`."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError(f"a disk budget must be positive, got {max_bytes}")
        self.max_bytes = max_bytes
        self._on_disk: deque[Segment] = deque()
        self.bytes = 0
        self.removed_segments = 0
        self.removed_rows: dict[str, int] = {}

    def added(self, seg: Segment, *, overhead: int) -> list[Segment]:
        """Record a segment just written; return the oldest segments to remove so that the
        segments and `overhead` (metadata, its reserve) fit the budget. The newest segment is
        never among them: a single segment larger than the budget stays (the budget is then
        exceeded by at most that one segment)."""
        self._on_disk.append(seg)
        self.bytes += seg.nbytes
        return self.make_room(overhead=overhead)

    def make_room(self, *, overhead: int) -> list[Segment]:
        """The oldest segments to remove so that the segments and `overhead` (metadata, its
        reserve, the journal: store/journal.py) fit the budget; never the newest."""
        victims: list[Segment] = []
        while len(self._on_disk) > 1 and self.bytes + overhead > self.max_bytes:
            old = self._on_disk.popleft()
            self.bytes -= old.nbytes
            self.removed_segments += 1
            self.removed_rows[old.table] = self.removed_rows.get(old.table, 0) + old.rows
            victims.append(old)
        return victims

    def to_meta(self) -> dict[str, object]:
        return {
            "max_disk_bytes": self.max_bytes,
            "segments_removed": self.removed_segments,
            "rows_removed": dict(self.removed_rows),
        }
