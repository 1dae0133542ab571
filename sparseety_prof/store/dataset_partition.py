"""Where a recording goes in a dataset: its partition values (host, date, engine, model) from its
meta.json, made safe to be folder names.

Recordings come from other machines and are hostile input: a hostname or model name is whatever the
recording's author wrote. A partition value becomes a path component (``host=<value>``) that root
creates and every query engine parses, so it keeps only ``[A-Za-z0-9._+-]`` (anything else, `/`,
`=`, `%`, spaces and control characters included, becomes `_`, and so does a run of dots), never
starts with a dot (no `.`, `..` or hidden folders), and is at most MAX_VALUE_CHARS long. A value
that had to be changed gets a short hash of the original appended, so two different hostile names
never share a partition.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

from sparseety_prof.store import schema

__all__ = ["MAX_VALUE_CHARS", "UNKNOWN", "Placement", "placement", "sanitise"]

MAX_VALUE_CHARS = 64
#: The value of a partition the recording does not say (or says as something other than text).
UNKNOWN = "unknown"
_UNSAFE = re.compile(r"[^A-Za-z0-9._+-]|\.{2,}")  # a run of dots too: no ".." anywhere
_HASH_CHARS = 8
# the widest span of days listed for one recording: a hostile end time cannot make a huge list
_MAX_DAYS = 366
# times outside [1970, 2286) are not a recording's: treated as unknown
_MAX_UNIX_MS = 10**13


def sanitise(value: object) -> str:
    """`value` as a safe partition value (see the module docstring); UNKNOWN for no text."""
    if not isinstance(value, str) or not value.strip():
        return UNKNOWN
    clean = _UNSAFE.sub("_", value).lstrip(".") or "_"
    if clean == value and len(clean) <= MAX_VALUE_CHARS:
        return clean
    digest = hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[:_HASH_CHARS]
    return f"{clean[: MAX_VALUE_CHARS - _HASH_CHARS - 1]}-{digest}"


@dataclass(frozen=True)
class Placement:
    """A recording's partition values (sanitised) and the UTC days it spans."""

    host: str
    date: str
    engine: str
    model: str
    dates: list[str]

    def values(self) -> dict[str, str]:
        return {k: getattr(self, k) for k in schema.DATASET_PARTITIONS}

    def folder(self) -> PurePosixPath:
        """The partition's folder under a table's folder: host=../date=../engine=../model=.."""
        return PurePosixPath(*(f"{k}={v}" for k, v in self.values().items()))


def placement(meta: Mapping[str, Any]) -> Placement:
    """The partition of a recording, from its meta.json (already parsed as a JSON object)."""
    host = _field(meta.get("host"), "hostname")
    engine = _field(meta.get("engine"), "name")
    model_meta = meta.get("model")
    model = _field(model_meta, "name")
    if not (isinstance(model, str) and model.strip()) and isinstance(model_meta, Mapping):
        path = model_meta.get("path")  # an unnamed GGUF: its file name, as the live view shows it
        model = PurePosixPath(path).stem if isinstance(path, str) else None
    start = _unix_ms(meta.get("start_unix_ms")) or _unix_ms(meta.get("created_unix_ms"))
    end = _unix_ms(meta.get("end_unix_ms")) or start
    dates = _days(start, end)
    return Placement(
        host=sanitise(host),
        date=dates[0] if dates else UNKNOWN,
        engine=sanitise(engine),
        model=sanitise(model),
        dates=dates,
    )


def _field(section: object, key: str) -> object:
    """meta[section][key], or meta[section] itself when the recording stored it as plain text."""
    if isinstance(section, Mapping):
        return section.get(key)
    return section


def _unix_ms(v: object) -> int | None:
    if isinstance(v, int) and not isinstance(v, bool) and 0 < v < _MAX_UNIX_MS:
        return v
    return None


def _days(start: int | None, end: int | None) -> list[str]:
    if start is None or end is None:
        return []
    first = dt.datetime.fromtimestamp(start / 1000, dt.UTC).date()
    last = dt.datetime.fromtimestamp(max(start, end) / 1000, dt.UTC).date()
    n = min((last - first).days, _MAX_DAYS)
    return [(first + dt.timedelta(days=i)).isoformat() for i in range(n + 1)]
