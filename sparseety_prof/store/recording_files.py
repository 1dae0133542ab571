"""The one reader of a recording's files. A recording may come from elsewhere (another host, a
user, an attacker), so every file of it is read as untrusted, by construction:

- regular files only: opened with O_NOFOLLOW | O_NONBLOCK (a symlink is refused, a FIFO opens
  at once instead of waiting for a writer), and the type checked with fstat on the opened
  descriptor (no FIFO, device, socket or directory, whose reads block or never end);
- sizes bounded before anything is read (meta.json: `MAX_META_BYTES`; a segment:
  `MAX_SEGMENT_BYTES`), and a read stops at the size fstat gave;
- JSON nesting bounded before the parser recurses (`MAX_JSON_DEPTH`);
- a Parquet segment is judged from its footer and page headers (store/parquet_footer.py) before
  a value is decoded: its rows against what the caller allows (meta.json's count), the values
  of each list column against the lengths the schema and meta.json bound, and the memory that
  decoding will take against the segment's size on disk (`decoded_budget`); the frame decoded
  is then checked against the table's schema and list bounds (`check_frame`);
- the bytes decoded are the bytes checked: a segment is read once, into memory, and decoded from
  there (a file rewritten between the check and the decoding changes nothing).

Every failure raises CorruptRecording (exit 7) with one line naming the file, its name spelled
out as token text is (`shown`: a newline or ESC in a folder name cannot forge an output line).
A missing file raises FileNotFoundError, for the caller to say what its absence means.
"""

from __future__ import annotations

import io
import json
import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from sparseety_prof.capture.untrusted_files import RefusedFile, file_kind, open_untrusted
from sparseety_prof.errors import CorruptRecording
from sparseety_prof.store import schema
from sparseety_prof.store.parquet_footer import (
    ParquetFacts,
    ParquetMetadataError,
    footer_data_bytes,
    footer_length,
    parquet_facts,
)
from sparseety_prof.terminal_text import visible

__all__ = [
    "DECODED_FLOOR",
    "DECODED_RATIO",
    "MAX_JSON_DEPTH",
    "MAX_META_BYTES",
    "MAX_SEGMENT_BYTES",
    "MAX_SEGMENT_ROWS",
    "ListBounds",
    "check_frame",
    "decoded_budget",
    "list_bounds",
    "parse_json",
    "read_file",
    "read_json",
    "read_segment",
    "schema_diff",
    "segment_facts",
    "segment_index",
    "segment_rows",
    "shown",
    "table_dir_entries",
]

#: meta.json of a real recording is a few KiB to a few hundred KiB (the engine's settings, the
#: expert load of a redacted one); this leaves a wide margin and bounds what a hostile one costs
MAX_META_BYTES = 4 << 20
#: JSON nesting: meta.json nests about six deep; Python's parser recurses once per level
MAX_JSON_DEPTH = 64
#: a segment holds at most the writer's segment_rows rows; this bounds the bytes read for one
MAX_SEGMENT_BYTES = 4 << 30
#: rows in one segment (the writer's default is 50,000 per segment)
MAX_SEGMENT_ROWS = 1 << 24
#: Decoding a segment may take DECODED_RATIO times its size on disk, and DECODED_FLOOR whatever
#: its size: a recording's columns compress well (nulls, repeated ids) but not by orders of
#: magnitude, while a decompression bomb does (a few KiB of zstd that expand to gigabytes)
DECODED_RATIO = 64
DECODED_FLOOR = 256 << 20
#: What decoding one value costs at most, beyond its page's decompressed bytes (dictionary and
#: RLE encodings produce values that take no decompressed bytes of their own), by Parquet
#: physical type: its width (a string or binary as a 16-byte view), plus one 8-byte offset of a
#: list for a value of a list column, plus its validity bit rounded up to a byte
_VALUE_BYTES = {0: 1, 1: 4, 2: 8, 3: 12, 4: 4, 5: 8, 6: 16, 7: 16}
_UNKNOWN_VALUE_BYTES = 16
_LIST_OFFSET_BYTES = 8

#: bounds of a list where meta.json does not say it: generous, far above any model
MAX_LAYERS = 4096
MAX_EXPERTS = 1 << 16
MAX_TOP = 1 << 16
MAX_BATCH_ROWS = 1 << 20

_SEGMENT_RE = re.compile(r"^part-(\d{6})\.parquet$")


def shown(path: object) -> str:
    """A name from a recording as it may appear in a message: every hidden character (newline,
    ESC, bidi override) spelled out, as token text is (terminal_text.visible)."""
    return visible(path)


def _refuse(path: object, why: str) -> CorruptRecording:
    return CorruptRecording(visible(f"{path} {why}"))


# ---------------------------------------------------------------------- plain files


def _kind_of(path: str | os.PathLike[str]) -> str:
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return "not readable"
    return "a regular file" if stat.S_ISREG(mode) else file_kind(mode)


def read_file(path: str | os.PathLike[str], *, max_bytes: int) -> bytes:
    """The bytes of the regular file `path` of a recording, at most `max_bytes` of them.

    Opened with O_NOFOLLOW | O_NONBLOCK (never through a symlink, never waiting on a FIFO), the
    type checked with fstat on the opened descriptor (a FIFO, device, socket or directory is
    refused), the size checked against `max_bytes` before anything is read, and the read stopped
    at the size fstat gave (a file that grows meanwhile is read to that size). Raises
    FileNotFoundError when `path` does not exist, CorruptRecording (one line naming the file)
    for anything else."""
    fd, st = _open_regular(path, max_bytes)
    try:
        return _pread(path, fd, st.st_size, 0)
    finally:
        os.close(fd)


def _open_regular(path: str | os.PathLike[str], max_bytes: int) -> tuple[int, os.stat_result]:
    try:
        return open_untrusted(path, follow=False, max_size=max_bytes)
    except FileNotFoundError:
        raise
    except OSError as e:  # RefusedFile (fstat: not regular, too big), ELOOP, ENXIO (a socket), ...
        kind = _kind_of(path)
        if kind != "a regular file":
            raise _refuse(path, f"is not a plain file ({kind}): a recording holds only plain files") from None
        if isinstance(e, RefusedFile):  # too big, or replaced by another kind since the lstat
            raise _refuse(path, e.strerror or "is refused") from None
        raise _refuse(path, f"cannot be read ({e.strerror})") from None


def _pread(path: str | os.PathLike[str], fd: int, n: int, offset: int) -> bytes:
    """`n` bytes at `offset` (fewer where the file shrank meanwhile: its content then says)."""
    chunks: list[bytes] = []
    got = 0
    try:
        while got < n:  # one read for anything under a GiB: no copy of its bytes
            chunk = os.pread(fd, min(n - got, 1 << 30), offset + got)
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
    except OSError as e:
        raise _refuse(path, f"cannot be read ({e.strerror})") from None
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _read_parquet_file(path: str | os.PathLike[str]) -> bytes:
    """A segment's bytes, read whole only after its two ends were checked: Parquet magic, a footer
    that fits, and a file no larger than the column chunks its footer describes (so a sparse
    file of gigabytes, or one padded with what no column holds, is refused unread)."""
    fd, st = _open_regular(path, MAX_SEGMENT_BYTES)
    try:
        size = st.st_size
        try:
            footer_len = footer_length(_pread(path, fd, 4, 0), _pread(path, fd, 8, max(size - 8, 0)), size)
            described = footer_data_bytes(_pread(path, fd, footer_len, size - 8 - footer_len))
        except ParquetMetadataError as e:
            raise _refuse(
                path, f"is not a readable Parquet segment: it is truncated or damaged ({e})"
            ) from None
        # page indexes and bloom filters may lie between the chunks and the footer: as much again
        most = 4 + 2 * described + footer_len + 8 + (1 << 20)
        if size > most:
            raise _refuse(
                path,
                f"is {size} bytes, but its footer describes {described} bytes of columns: "
                "not a Parquet segment as written (padded, or damaged)",
            )
        return _pread(path, fd, size, 0)
    finally:
        os.close(fd)


def table_dir_entries(path: Path) -> list[str]:
    """The names in a table's folder of a recording ([] when it does not exist). The folder itself
    must be a directory, not a symlink to one elsewhere; the entries are judged when read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return []
    except OSError as e:
        kind = _kind_of(path)
        if kind in ("not readable", "a directory"):
            raise _refuse(path, f"cannot be read ({e.strerror})") from None
        raise _refuse(path, f"is not a plain folder ({kind}): a recording holds only plain folders") from None
    try:
        return os.listdir(fd)
    except OSError as e:
        raise _refuse(path, f"cannot be listed ({e.strerror})") from None
    finally:
        os.close(fd)


# ---------------------------------------------------------------------- JSON


def json_depth(data: bytes) -> int:
    """The deepest nesting of arrays and objects in JSON text, strings left out; computed without
    recursion (numpy over the bracket characters)."""
    outside = re.sub(rb'"(?:[^"\\]|\\.)*"', b"", data)
    arr = np.frombuffer(outside, dtype=np.uint8)
    step = np.zeros(arr.shape, dtype=np.int32)
    step[(arr == ord("[")) | (arr == ord("{"))] = 1
    step[(arr == ord("]")) | (arr == ord("}"))] = -1
    return int(np.cumsum(step).max()) if step.size else 0


def parse_json(data: bytes, path: str | os.PathLike[str], *, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """JSON text of the recording file `path`, parsed with its nesting bounded (checked before
    the parser recurses) and every parser failure (bad UTF-8, bad JSON, a number of a million
    digits) as CorruptRecording naming the file."""
    depth = json_depth(data)
    if depth > max_depth:
        raise _refuse(path, f"nests {depth} levels deep, more than the {max_depth} accepted")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _refuse(path, f"is not UTF-8 text (byte {e.start})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise _refuse(path, f"is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except (ValueError, RecursionError) as e:  # int() of too many digits; a depth the scan missed
        raise _refuse(
            path, f"is not valid JSON ({str(e).splitlines()[0] if str(e) else type(e).__name__})"
        ) from None


def read_json(
    path: str | os.PathLike[str], *, max_bytes: int = MAX_META_BYTES, max_depth: int = MAX_JSON_DEPTH
) -> tuple[Any, bytes]:
    """(parsed value, raw bytes) of a recording's JSON file: `read_file` then `parse_json`."""
    data = read_file(path, max_bytes=max_bytes)
    return parse_json(data, path, max_depth=max_depth), data


# ---------------------------------------------------------------------- list bounds


@dataclass(frozen=True)
class ListBounds:
    """The longest list each list column may hold per row, by table and column, one bound per
    nesting level (outer first). From the schema's meaning of each column and meta.json's
    layers; a column not named is unbounded here (its memory is still bounded by the budget)."""

    bounds: Mapping[str, Mapping[str, tuple[int, ...]]]

    def of(self, table: str) -> Mapping[str, tuple[int, ...]]:
        return self.bounds.get(table, {})


def list_bounds(meta: Mapping[str, Any] | None) -> ListBounds:
    """The per-row list bounds a recording with meta.json `meta` allows: the tokens table's
    per-layer lists hold one element per layer meta.json "layers" lists (MAX_LAYERS without
    it), an expert list at most MAX_EXPERTS, a step's per-row lists at most MAX_BATCH_ROWS,
    a kernel's grid and block three."""
    layers: Mapping[str, Any] = {}
    if meta is not None and isinstance(meta.get("layers"), dict):
        layers = meta["layers"]

    def n(kind: str) -> int:
        v = layers.get(kind)
        return len(v) if isinstance(v, list) else MAX_LAYERS

    per_row = (MAX_BATCH_ROWS,)
    return ListBounds(
        {
            "tokens": {
                "top_ids": (MAX_TOP,),
                "top_log_probs": (MAX_TOP,),
                "expert_ids": (n("moe"), MAX_EXPERTS),
                "expert_weights": (n("moe"), MAX_EXPERTS),
                "router_probs": (n("moe"), MAX_EXPERTS),
                "act_zero_ratio": (n("ffn"),),
                "act_below_ratio": (n("ffn"),),
                "attn_attended": (n("attn"),),
            },
            "steps": {
                c: per_row for c in ("seq_ids", "token_ids", "positions", "row_seq_ids", "output_rows")
            },
            "routes": {c: (MAX_EXPERTS,) for c in ("expert_ids", "expert_weights", "router_probs")},
            "kernels": {"grid": (3,), "block": (3,)},
        }
    )


def _leaf_slots(rows: int, bounds: tuple[int, ...]) -> int:
    """The most leaf value slots `rows` rows of a list column bounded by `bounds` can declare: a
    null or empty list takes one slot, a full one the product of its bounds."""
    most = rows
    for b in bounds:
        most *= max(b, 1)
    return most


# ---------------------------------------------------------------------- Parquet segments


def decoded_budget(size_on_disk: int) -> int:
    """Bytes decoding a segment of `size_on_disk` bytes may take (see DECODED_RATIO)."""
    return max(DECODED_FLOOR, DECODED_RATIO * size_on_disk)


def _values_bytes(facts: ParquetFacts) -> int:
    """The most the decoded values of `facts`' columns take beside their pages (see _VALUE_BYTES),
    with a row's offset and validity for every column."""
    total = 0
    for c in facts.columns:
        width = _VALUE_BYTES.get(c.physical_type, _UNKNOWN_VALUE_BYTES) + 1
        total += c.values * (width + (_LIST_OFFSET_BYTES if len(c.path) > 1 else 0))
        total += (c.values + facts.rows) // 8 + _LIST_OFFSET_BYTES * facts.rows
    return total


def segment_facts(
    path: str | os.PathLike[str],
    data: bytes,
    table: str,
    *,
    max_rows: int | None = None,
    bounds: ListBounds | None = None,
) -> ParquetFacts:
    """What the segment `data` (read from `path`) of `table` declares, checked before any value
    is decoded: well-formed footer and page headers; at most `max_rows` rows (and
    MAX_SEGMENT_ROWS); no columns the table does not have; each list column's values within
    what its per-row bounds allow for those rows; the decoding within `decoded_budget`."""
    try:
        facts = parquet_facts(data)
    except ParquetMetadataError as e:
        raise _refuse(path, f"is not a readable Parquet segment: it is truncated or damaged ({e})") from None
    limit = MAX_SEGMENT_ROWS if max_rows is None else min(max_rows, MAX_SEGMENT_ROWS)
    if facts.rows > limit:
        why = (
            f"holds {facts.rows} rows, more than the recording accounts for ({limit})"
            if max_rows is not None and max_rows < MAX_SEGMENT_ROWS
            else f"holds {facts.rows} rows, more than the {MAX_SEGMENT_ROWS} a segment may"
        )
        raise _refuse(path, why)
    want = schema.TABLES[table]
    declared = facts.leaf_values()
    unknown = [c for c in declared if c not in want]
    if unknown:
        raise _refuse(path, f"does not match the {table} table schema: unexpected columns {unknown}")
    for column, bound in (bounds or list_bounds(None)).of(table).items():
        most = _leaf_slots(facts.rows, bound)
        if declared.get(column, 0) > most:
            raise _refuse(
                path,
                f"declares {declared[column]} values in column {column} for {facts.rows} rows, more "
                f"than its lists may hold ({most})",
            )
    cost = facts.decompressed_bytes + _values_bytes(facts)
    budget = decoded_budget(len(data))
    if cost > budget:
        raise _refuse(
            path,
            f"would take {cost} bytes to decode from {len(data)} on disk, more than the {budget} "
            "accepted (a decompression bomb, or a damaged segment)",
        )
    return facts


def read_segment(
    path: str | os.PathLike[str],
    table: str,
    *,
    max_rows: int | None = None,
    bounds: ListBounds | None = None,
    exact_schema: bool = True,
) -> pl.DataFrame:
    """A segment of `table` as a frame: its bytes read whole (at most MAX_SEGMENT_BYTES, and only
    after its ends and footer were checked), `segment_facts` on them, then decoded from those
    same bytes and checked by `check_frame` (with `exact_schema=False`, missing columns and
    other dtypes are left for the caller to cast)."""
    data = _read_parquet_file(path)
    segment_facts(path, data, table, max_rows=max_rows, bounds=bounds)
    try:
        df = pl.read_parquet(io.BytesIO(data))
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # polars raises its own errors, OSError, and pyo3 PanicException
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise _refuse(
            path, f"is not a readable Parquet segment: it is truncated or damaged ({reason})"
        ) from None
    # strings decode as views of a shared dictionary: a 1 KiB value repeated a million times costs
    # little here, but a gigabyte to whatever copies the column out (export, a view, a join)
    logical = df.estimated_size()
    budget = decoded_budget(len(data))
    if logical > budget:
        raise _refuse(
            path,
            f"holds {logical} bytes of values in {len(data)} on disk, more than the {budget} accepted "
            "(a decompression bomb, or a damaged segment)",
        )
    check_frame(path, table, df, bounds=bounds, exact_schema=exact_schema)
    return df


def segment_rows(path: str | os.PathLike[str]) -> int:
    """The rows a segment's footer declares, reading the footer and page headers only (for a
    table's row count against meta.json before any segment is decoded)."""
    data = _read_parquet_file(path)
    try:
        return parquet_facts(data).rows
    except ParquetMetadataError as e:
        raise _refuse(path, f"is not a readable Parquet segment: it is truncated or damaged ({e})") from None


def check_frame(
    where: str | os.PathLike[str],
    table: str,
    df: pl.DataFrame,
    *,
    bounds: ListBounds | None = None,
    exact_schema: bool = True,
) -> None:
    """`df` (rows of `table` read from `where`) has exactly the table's columns and dtypes, and no
    list longer than `bounds` allow (list_bounds(None) when not given); CorruptRecording naming
    `where` otherwise. For frames read from any recording file (segments, journals).
    `exact_schema=False`: only columns the table does not have are refused."""
    want = schema.TABLES[table]
    if exact_schema:
        diff = schema_diff(table, df.schema)
        if diff:
            raise _refuse(where, f"does not match the {table} table schema: {diff}")
    else:
        unknown = [c for c in df.columns if c not in want]
        if unknown:
            raise _refuse(where, f"does not match the {table} table schema: unexpected columns {unknown}")
    for column, bound in (bounds or list_bounds(None)).of(table).items():
        if column not in df.columns or df.height == 0 or df.schema[column] != want[column]:
            continue  # a column of another dtype (exact_schema=False) is the caller's to cast
        longest = [df.select(pl.col(column).list.len().max()).item()]
        if len(bound) > 1:
            longest.append(_inner_longest(df, column))
        for level, (most, got) in enumerate(zip(bound, longest, strict=True)):
            if got is not None and got > most:
                inner = " (an inner list)" if level else ""
                raise _refuse(
                    where, f"column {column} holds a list{inner} of {got} elements, more than {most}"
                )


def _inner_longest(df: pl.DataFrame, column: str) -> int | None:
    value = df.select(pl.col(column).list.eval(pl.element().list.len()).list.max().max()).item()
    return None if value is None else int(value)


def schema_diff(table: str, got: Mapping[str, pl.DataType]) -> str:
    """Human-readable difference between a frame's schema and the table's; '' when identical."""
    want = schema.TABLES[table]
    problems = []
    missing = [c for c in want if c not in got]
    extra = [c for c in got if c not in want]
    if missing:
        problems.append(f"missing columns {missing}")
    if extra:
        problems.append(f"unexpected columns {extra}")
    wrong = [f"{c}: {got[c]} (expected {want[c]})" for c in want if c in got and got[c] != want[c]]
    if wrong:
        problems.append("wrong dtypes " + ", ".join(wrong))
    if not problems and list(got) != list(want):
        problems.append(f"columns out of order {list(got)} (expected {list(want)})")
    return "; ".join(problems)


def segment_index(name: str) -> int | None:
    """The index of a segment file name (part-000003.parquet -> 3), None for any other name."""
    m = _SEGMENT_RE.match(name)
    return int(m.group(1)) if m else None
