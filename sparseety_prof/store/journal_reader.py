"""The rows of a killed recording that only its journal holds (the format: store/journal.py).

`Recording.table` (store/recording.py) adds them to what the segments hold when the recording was
not closed; a closed recording's segments hold every row, and a journal found in one is ignored.
The journal comes from a recording made elsewhere as much as its segments do: the folder and every
chunk are read through the recording's one reader of untrusted files (store/recording_files.py:
regular files only, sizes bounded), each chunk's Arrow IPC stream judged from its metadata before
a value is decoded (store/ipc_stream.py: no compression, no type a table lacks, nesting and
buffers bounded), and the frame checked against the table's schema and list bounds. A chunk that
fails (torn by a power cut before its fsync, or anything else) is left out and named in
`Recording.damaged`, never raised: the journal is where an interrupted recording ends, as its
torn last segment is.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import polars as pl

from sparseety_prof.errors import CorruptRecording
from sparseety_prof.store import recording_files
from sparseety_prof.store.ipc_stream import IpcStreamError, read_stream
from sparseety_prof.store.journal import CHUNK_RE, JOURNAL_DIR

__all__ = ["MAX_CHUNKS", "MAX_CHUNK_BYTES", "journal_rows"]

#: the chunks a journal may name: the writer leaves a flush interval's drains per table at most
#: (and those of a flush that failed); far more is no journal this writer made
MAX_CHUNKS = 100_000
#: the bytes of one chunk: a drain's rows of one table
MAX_CHUNK_BYTES = 256 << 20


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
    the journal may still hold its rows); `first_segment`: the oldest kept (older chunks' rows were
    rotated out with their segments, --max-disk); `meta`: meta.json, for the list bounds;
    `damaged` is told of each chunk left out. CorruptRecording when the journal folder is not a
    folder or names more than MAX_CHUNKS chunks."""
    folder = path / JOURNAL_DIR
    names = recording_files.table_dir_entries(folder)
    if len(names) > MAX_CHUNKS:
        raise CorruptRecording(
            f"{recording_files.shown(folder)} names {len(names)} files, more than the {MAX_CHUNKS} "
            "chunks a journal holds"
        )
    segment_rows = {
        index: rows
        for file, rows in segments_read.items()
        if (index := recording_files.segment_index(file)) is not None
    }
    bounds = recording_files.list_bounds(meta)
    found: list[tuple[int, int, pl.DataFrame]] = []
    for name in names:
        m = CHUNK_RE.match(name)
        if m is None or m.group("table") != table:
            continue  # (a chunk's hidden name while it was written, another table's)
        segment, row = int(m.group("segment")), int(m.group("row"))
        if segment < first_segment:
            continue  # its segment was rotated out: so were these rows
        try:
            df = _read_chunk(folder / name, table, bounds)
        except FileNotFoundError:
            continue  # removed since it was listed: a segment holds its rows now
        except CorruptRecording as e:
            damaged(f"{e} (a chunk of the journal, where the interrupted recording ends; left out)")
            continue
        skip = max(0, _rows_from(segment_rows, segment) - row)  # the first rows segments hold
        if skip < df.height:
            found.append((segment, row, df.slice(skip)))
    return [df for _, _, df in sorted(found, key=lambda c: (c[0], c[1]))]


def _read_chunk(path: Path, table: str, bounds: recording_files.ListBounds) -> pl.DataFrame:
    """One chunk as a frame of `table`; CorruptRecording naming it when it is not one."""
    data = recording_files.read_file(path, max_bytes=MAX_CHUNK_BYTES)
    try:
        df = read_stream(data)
    except IpcStreamError as e:
        raise CorruptRecording(
            f"{recording_files.shown(path)} is not a readable journal chunk: {e}"
        ) from None
    recording_files.check_frame(path, table, df, bounds=bounds)
    return df


def _rows_from(segment_rows: Mapping[int, int], segment: int) -> int:
    """The rows of segments `segment`, `segment`+1, ... as far as they follow without a gap."""
    n = 0
    while segment in segment_rows:
        n += segment_rows[segment]
        segment += 1
    return n
