"""`export --pprof FILE`: the CPU sampler's stacks (cpu_stacks) as a pprof profile, what
`go tool pprof`, Parca, Pyroscope and speedscope read: a gzipped protocol buffer of the message
`perftools.profiles.Profile` (github.com/google/pprof, proto/profile.proto), encoded here by hand
(the fields below, nothing else; no protobuf dependency).

One pprof sample per (folded stack, step kind, phase, thread), its values the sample count and
the CPU time it stands for (count times the sampling period), its labels the step kind, the phase
and the thread id: `pprof -tagfocus=phase=decode` keeps the decode steps' CPU. A frame is a
function (pprof Location with one Line), by name: the recording keeps names, not addresses.

Field numbers used (profile.proto):
  Profile   1 sample_type (ValueType), 2 sample (Sample), 4 location (Location),
            5 function (Function), 6 string_table (string), 9 time_nanos, 10 duration_nanos,
            11 period_type (ValueType), 12 period, 13 comment (string index),
            14 default_sample_type (string index)
  ValueType 1 type, 2 unit (string indices)
  Sample    1 location_id (packed uint64, leaf first), 2 value (packed int64), 3 label (Label)
  Label     1 key, 2 str (string indices), 3 num, 4 num_unit (string index)
  Location  1 id, 4 line (Line)
  Line      1 function_id
  Function  1 id, 2 name, 3 system_name (string indices)
"""

from __future__ import annotations

import gzip
from typing import Any, BinaryIO

import polars as pl

from sparseety_prof.store.recording import Recording

LABELS = ("step_kind", "phase", "tid")


def _varint(v: int) -> bytes:
    if v < 0:  # int64: two's complement, ten bytes
        v += 1 << 64
    out = bytearray()
    while v >= 0x80:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


def _key(field: int, wire: int) -> bytes:
    return _varint(field << 3 | wire)


def _int(field: int, v: int) -> bytes:
    """A varint field; a zero is left out (proto3's default)."""
    return _key(field, 0) + _varint(v) if v else b""


def _bytes(field: int, data: bytes) -> bytes:
    return _key(field, 2) + _varint(len(data)) + data


def _packed(field: int, values: list[int]) -> bytes:
    return _bytes(field, b"".join(_varint(v) for v in values)) if values else b""


class _Strings:
    """The profile's string table: index 0 is the empty string, as pprof requires."""

    def __init__(self) -> None:
        self.index: dict[str, int] = {"": 0}

    def __call__(self, s: str) -> int:
        got = self.index.get(s)
        if got is None:
            got = self.index[s] = len(self.index)
        return got


def profile_bytes(
    stacks: pl.DataFrame, *, period_ns: int, time_nanos: int = 0, duration_nanos: int = 0, comment: str = ""
) -> bytes:
    """The Profile message (not gzipped) of cpu_stacks rows."""
    strings = _Strings()
    functions: dict[str, int] = {}  # name -> function id (= its location id)
    samples: list[bytes] = []
    grouped = stacks.group_by("stack", *LABELS).agg(pl.col("samples").sum()).sort("samples", descending=True)
    for stack, kind, phase, tid, n in grouped.select("stack", *LABELS, "samples").iter_rows():
        frames = str(stack).split(";")
        ids = [functions.setdefault(f, len(functions) + 1) for f in reversed(frames)]  # leaf first
        labels = [
            _bytes(3, _int(1, strings("step_kind")) + _int(2, strings(str(kind)))),
            *([_bytes(3, _int(1, strings("phase")) + _int(2, strings(str(phase))))] if phase else []),
            _bytes(3, _int(1, strings("thread id")) + _int(3, int(tid))),
        ]
        samples.append(
            _bytes(2, _packed(1, ids) + _packed(2, [int(n), int(n) * period_ns]) + b"".join(labels))
        )
    value_types = [
        _bytes(1, _int(1, strings("samples")) + _int(2, strings("count"))),
        _bytes(1, _int(1, strings("cpu")) + _int(2, strings("nanoseconds"))),
    ]
    locations = [_bytes(4, _int(1, fid) + _bytes(4, _int(1, fid))) for fid in functions.values()]
    funcs = [
        _bytes(5, _int(1, fid) + _int(2, strings(name)) + _int(3, strings(name)))
        for name, fid in functions.items()
    ]
    tail = (
        _int(9, time_nanos)
        + _int(10, duration_nanos)
        + _bytes(11, _int(1, strings("cpu")) + _int(2, strings("nanoseconds")))
        + _int(12, period_ns)
        + (_int(13, strings(comment)) if comment else b"")
        + _int(14, strings("cpu"))
    )
    table = b"".join(_bytes(6, s.encode()) for s in strings.index)  # (insertion order = index)
    return b"".join(value_types) + b"".join(samples) + b"".join(locations) + b"".join(funcs) + table + tail


def write_pprof(rec: Recording, out: BinaryIO) -> dict[str, Any]:
    """The recording's CPU profile, gzipped, to `out`; what it holds (for the command's line)."""
    meta = rec.meta
    sampler = meta.get("cpu_sampler") or {}
    period_ns = int(sampler.get("period_ns") or 0)
    stacks = rec.cpu_stacks()
    start_ms, end_ms = meta.get("start_unix_ms"), meta.get("end_unix_ms")
    duration = (int(end_ms) - int(start_ms)) * 1_000_000 if start_ms and end_ms else 0
    comment = f"sparseety-prof CPU sampler at {sampler.get('rate_hz')} Hz" if sampler else ""
    data = profile_bytes(
        stacks,
        period_ns=period_ns,
        time_nanos=int(start_ms or 0) * 1_000_000,
        duration_nanos=duration,
        comment=comment,
    )
    # mtime=0: the same recording gives the same bytes
    out.write(gzip.compress(data, mtime=0))
    return {"samples": int(stacks["samples"].sum()) if stacks.height else 0, "stacks": stacks.height}
