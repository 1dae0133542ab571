"""The rows of a killed recording that only its journal holds (the format: store/journal.py).

`Recording.table` (store/recording.py) adds them to what the segments hold when the recording was
not closed; a closed recording's segments hold every row, and a journal found in one is ignored.
The journal comes from a recording made elsewhere as much as its segments do: the folder and every
log file are read through the recording's one reader of untrusted files (store/recording_files.py:
regular files only, never through a link, sizes bounded); each record's header is checked (magic,
a table's name, a payload within the file whose CRC-32 matches); a framed record's Arrow IPC
stream is judged from its metadata before a value is decoded (store/ipc_stream.py: no
compression, no type a table lacks, nesting and buffers bounded), a gathered record's rows read
by store/gathered_codec.py (plain values only, counts and nesting bounded) and framed as the
consumer frames them (store/buffers.py); every frame is then checked against the table's schema
and list bounds. A record that fails (torn by a power cut before its fsync, or anything else) ends the
reading of its log file, which is named in `Recording.damaged`, never raised: the journal is
where an interrupted recording ends, as its torn last segment is.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import polars as pl

from sparseety_prof.errors import CorruptRecording
from sparseety_prof.store import gathered_codec, recording_files, schema
from sparseety_prof.store.buffers import ColumnBuffer
from sparseety_prof.store.gathered_codec import GatheredRowsError
from sparseety_prof.store.ipc_stream import IpcStreamError, check_stream, read_stream
from sparseety_prof.store.journal import HEADER, JOURNAL_DIR, LOG_RE, MAGIC, MAGIC_GATHERED

__all__ = ["MAX_LOGS", "MAX_LOG_BYTES", "journal_rows"]

#: the log files a journal may hold: the writer keeps the one it appends to and those a flush
#: under way has not covered yet; far more is no journal this writer made
MAX_LOGS = 1024
#: the bytes of one log file: a flush interval's rows, uncompressed
MAX_LOG_BYTES = 4 << 30


def journal_rows(
    path: Path,
    table: str,
    segments_read: Mapping[str, int],
    first_segment: int,
    meta: Mapping[str, Any],
    damaged: Callable[[str], None],
) -> list[pl.DataFrame]:
    """The rows of `table` that the journal of the recording at `path` holds and no segment does.

    `segments_read`: the rows of each segment read, by file name (a segment left out counts none:
    the journal may still hold its rows); `first_segment`: the oldest kept (older records' rows
    were rotated out with their segments, --max-disk); `meta`: meta.json, for the list bounds;
    `damaged` is told of each log file whose reading stopped at a record it could not read.
    CorruptRecording when the journal folder is not a folder or holds more than MAX_LOGS logs."""
    folder = path / JOURNAL_DIR
    logs = sorted(name for name in recording_files.table_dir_entries(folder) if LOG_RE.match(name))
    if len(logs) > MAX_LOGS:
        raise CorruptRecording(
            f"{recording_files.shown(folder)} holds {len(logs)} log files, more than the {MAX_LOGS} "
            "a journal does"
        )
    segment_rows = {
        index: rows
        for file, rows in segments_read.items()
        if (index := recording_files.segment_index(file)) is not None
    }
    bounds = recording_files.list_bounds(meta)
    found: list[tuple[int, int, pl.DataFrame]] = []
    for name in logs:
        try:
            data = recording_files.read_file(folder / name, max_bytes=MAX_LOG_BYTES)
        except FileNotFoundError:
            continue  # removed since it was listed: segments hold its rows now
        except CorruptRecording as e:
            damaged(f"{e} (a journal log of the interrupted recording; left out)")
            continue
        try:
            for gathered, segment, row, payload in _records(data, table):
                if segment < first_segment:
                    continue  # its segment was rotated out: so were these rows
                skip = max(0, _rows_from(segment_rows, segment) - row)  # the first rows segments hold
                rows = gathered_codec.payload_rows(payload) if gathered else check_stream(payload)
                if skip >= rows:
                    continue  # segments hold them all: not decoded
                df = _gathered_frame(table, payload) if gathered else read_stream(payload)
                recording_files.check_frame(folder / name, table, df, bounds=bounds)
                if skip < df.height:
                    found.append((segment, row, df.slice(skip)))
        except (IpcStreamError, GatheredRowsError, _TornRecord) as e:
            damaged(
                f"{recording_files.shown(folder / name)}: {e}; the rest of this journal log is left "
                "out (the recording was interrupted)"
            )
        except CorruptRecording as e:
            damaged(f"{e}; the rest of this journal log is left out (the recording was interrupted)")
    return [df for _, _, df in sorted(found, key=lambda c: (c[0], c[1]))]


class _TornRecord(ValueError):
    """A record whose header or payload is not whole (one line saying why)."""


def _gathered_frame(table: str, payload: bytes) -> pl.DataFrame:
    """The frame of a gathered record's rows, made as the consumer makes its frames (in the
    order the rows came), GatheredRowsError when its values do not make one."""
    parts = gathered_codec.decode(table, payload)
    buf = ColumnBuffer(ordered=True)
    try:
        frames = [df for cols in parts for df in buf.add(table, cols, final=False)]
        frames += [df for _, df in buf.take_all()]
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as e:  # a value no column can hold: polars' errors, ValueError, TypeError
        raise GatheredRowsError(f"rows that make no {table} frame ({type(e).__name__})") from None
    if not frames:
        return schema.empty(table)
    return pl.concat(frames) if len(frames) > 1 else frames[0]


def _records(data: bytes, table: str) -> Iterator[tuple[bool, int, int, bytes]]:
    """(gathered, segment S, row R, payload) of each record of `table` in a log file's bytes, in
    order; _TornRecord at the first record that is not whole."""
    want = table.encode()
    pos = 0
    while pos < len(data):
        if len(data) - pos < HEADER.size:
            raise _TornRecord(f"a record's header is cut short at byte {pos}")
        magic, name, segment, row, length, crc = HEADER.unpack_from(data, pos)
        if magic not in (MAGIC, MAGIC_GATHERED):
            raise _TornRecord(f"no record starts at byte {pos}")
        name = name.rstrip(b"\0")
        if name.decode("ascii", "replace") not in schema.TABLES:
            raise _TornRecord(f"the record at byte {pos} names no table")
        start = pos + HEADER.size
        if length > len(data) - start:
            raise _TornRecord(f"the record at byte {pos} is cut short")
        payload = data[start : start + length]
        if zlib.crc32(payload) != crc:
            raise _TornRecord(f"the record at byte {pos} does not match its checksum (torn)")
        pos = start + length
        if name == want:
            yield magic == MAGIC_GATHERED, segment, row, payload


def _rows_from(segment_rows: Mapping[int, int], segment: int) -> int:
    """The rows of segments `segment`, `segment`+1, ... as far as they follow without a gap."""
    n = 0
    while segment in segment_rows:
        n += segment_rows[segment]
        segment += 1
    return n
