"""Recordings laid out as one Hive-partitioned Parquet dataset (`sparseety-prof collect`).

Layout::

    DEST/manifest.json                      what was collected (MANIFEST_FORMAT, below)
    DEST/<table>/host=H/date=D/engine=E/model=M/part-<recording id>.parquet

One file per recording and table, every table written (an empty table as an empty file with its
columns), so `DEST/<table>/**/*.parquet` always reads as one table whose columns are exactly
schema.dataset_table(table) plus the partition columns, whatever the recordings held: a column an
older recording lacks is written as nulls, every column is cast to the schema's dtype.

A recording's id is the sha256 of its meta.json (32 hex digits): a closed recording's meta.json
never changes, so the same recording collected twice, from anywhere, has the same id and is
skipped the second time. Its files are staged under hidden names and put in place together before
the manifest names them, so a failed or refused recording leaves nothing a reader would see.
Only closed recordings are collected: an unclosed one may still be growing (its id would change).
"""

from __future__ import annotations

import functools
import hashlib
import json
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import polars as pl

from sparseety_prof.errors import CorruptRecording, ProfError, UsageError
from sparseety_prof.store import recording, schema
from sparseety_prof.store.dataset_dir import DatasetDir, StagedFile
from sparseety_prof.store.dataset_partition import placement
from sparseety_prof.store.recording_files import MAX_META_BYTES, parse_json, read_file, shown

__all__ = ["MANIFEST", "MANIFEST_FORMAT", "CollectReport", "collect", "recording_id"]

MANIFEST = "manifest.json"
MANIFEST_FORMAT = "sparseety-prof-dataset"
_ID_CHARS = 32

#: progress(recording index, recordings, table or "", source path): called before each table
Progress = Callable[[int, int, str, Path], None]


@dataclass
class CollectReport:
    """What `collect` did with each source."""

    collected: list[dict[str, Any]] = field(default_factory=list)  # manifest entries added
    already: list[tuple[Path, str]] = field(default_factory=list)  # (source, id) already there
    refused: list[tuple[Path, str]] = field(default_factory=list)  # (source, why)


def recording_id(meta_bytes: bytes) -> str:
    return hashlib.sha256(meta_bytes).hexdigest()[:_ID_CHARS]


def collect(
    sources: Iterable[Path],
    dest: Path,
    *,
    owner: tuple[int, int] | None = None,
    progress: Progress | None = None,
) -> CollectReport:
    """Add each recording of `sources` to the dataset `dest` (created when missing). A recording
    that cannot be read, is not closed or is damaged is refused (in the report, with why) and the
    others are collected. UsageError when `dest` is not a dataset this version can extend."""
    srcs = list(sources)
    report = CollectReport()
    with DatasetDir(dest, MANIFEST, owner) as out:
        manifest = _load_manifest(out)
        known = {e["id"] for e in manifest["recordings"]}
        for i, src in enumerate(srcs):
            if progress is not None:
                progress(i, len(srcs), "", src)
            try:
                rec, rid = _open_source(src)
            except ProfError as e:
                report.refused.append((src, str(e)))
                continue
            if rid in known:
                report.already.append((src, rid))
                continue
            try:
                entry = _collect_one(out, rec, rid, functools.partial(_tick, progress, i, len(srcs), src=src))
            except UsageError:
                raise  # the dataset cannot be written (disk full, ...): stop, the next would fail too
            except ProfError as e:
                report.refused.append((src, str(e)))
                continue
            manifest["recordings"].append(entry)
            known.add(rid)
            report.collected.append(entry)
            out.write_atomic(MANIFEST, lambda f: f.write(_manifest_bytes(manifest)))
        if out.read(MANIFEST) is None:  # a dataset of no recordings yet still says what it is
            out.write_atomic(MANIFEST, lambda f: f.write(_manifest_bytes(manifest)))
    return report


def _tick(progress: Progress | None, i: int, n: int, table: str, src: Path) -> None:
    if progress is not None:
        progress(i, n, table, src)


# ---------------------------------------------------------------------- one recording


def _open_source(src: Path) -> tuple[recording.Recording, str]:
    """The recording at `src` and its id; CorruptRecording/UsageError saying why it is refused."""
    rec = recording.open(src)  # every file read through store/recording_files.py
    meta_path = rec.path / recording.META_FILE
    # the id is of the meta.json that was parsed (open keeps its bytes); read again after, a
    # meta.json that changed meanwhile belongs to a recording still being written
    meta_bytes = rec.meta_bytes or b""
    try:
        again = read_file(meta_path, max_bytes=MAX_META_BYTES)
    except FileNotFoundError:
        again = b""
    if again != meta_bytes:
        raise CorruptRecording(f"{shown(meta_path)} changed while it was being read: is it still recording?")
    if not rec.complete:
        raise CorruptRecording(
            f"{shown(src)} was not closed (it is still recording, or the recorder was killed or could "
            "not write): only closed recordings are collected, as an unclosed one may still change"
        )
    return rec, recording_id(meta_bytes)


def _collect_one(
    out: DatasetDir, rec: recording.Recording, rid: str, tick: Callable[[str], None]
) -> dict[str, Any]:
    place = placement(rec.meta)
    staged: list[StagedFile] = []
    rows: dict[str, int] = {}
    try:
        for table in schema.TABLES:
            tick(table)
            frame = _conformed(rec, table, rid)
            rel = PurePosixPath(table) / place.folder() / f"part-{rid}.parquet"
            out.remove_leftovers(rel.parent)
            try:
                height = frame.select(pl.len()).collect().item()
                staged.append(out.stage(rel, lambda f, frame=frame: frame.sink_parquet(f)))  # type: ignore[misc]
            except (KeyboardInterrupt, SystemExit):
                raise
            except OSError as e:
                raise UsageError(f"cannot write {out.path / rel}: {e.strerror}") from None
            except BaseException as e:  # polars errors and panics on a hostile segment
                raise CorruptRecording(
                    f"{shown(rec.path / table)} does not fit the {table} table's schema: {shown(_reason(e))}"
                ) from None
            rows[table] = int(height)
        for f in staged:
            f.publish()
    except BaseException:
        for f in staged:
            f.discard()
        raise
    return {
        "id": rid,
        "source": str(rec.path.absolute()),
        **place.values(),
        "dates": place.dates,
        "recording_schema_version": rec.meta.get("schema_version"),
        "collected_unix_ms": time.time_ns() // 1_000_000,
        "rows": rows,
        "files": {f.rel.parts[0]: {"path": str(f.rel), "sha256": f.sha256, "bytes": f.size} for f in staged},
    }


def _conformed(rec: recording.Recording, table: str, rid: str) -> pl.LazyFrame:
    """The table's segments as one lazy frame in the dataset's columns (schema.dataset_table): a
    missing column as nulls, every column cast (strictly) to its dtype, an unknown one refused."""
    want = schema.TABLES[table]
    parts = []
    # each segment read and checked as `open` reads it (regular file, rows against meta.json,
    # decoded size bounded); a gap, a removed segment, an unknown column: CorruptRecording
    for df in rec.segment_frames(table, exact_schema=False):
        got = df.schema
        parts.append(
            df.lazy().select(
                pl.lit(rid, schema.DATASET_COLUMNS[schema.RECORDING_ID]).alias(schema.RECORDING_ID),
                *(
                    pl.col(c).cast(dtype, strict=True) if c in got else pl.lit(None, dtype).alias(c)
                    for c, dtype in want.items()
                ),
            )
        )
    if not parts:
        return pl.LazyFrame(schema=schema.dataset_table(table))
    return pl.concat(parts, how="vertical")


def _reason(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


# ---------------------------------------------------------------------- the manifest


def _load_manifest(out: DatasetDir) -> dict[str, Any]:
    raw = out.read(MANIFEST)
    if raw is None:
        return {
            "format": MANIFEST_FORMAT,
            "schema_version": schema.SCHEMA_VERSION,
            "partitions": list(schema.DATASET_PARTITIONS),
            "tables": list(schema.TABLES),
            "recordings": [],
        }
    where = out.path / MANIFEST
    try:
        m = parse_json(raw, where)  # nesting bounded: a dataset may come from elsewhere
    except CorruptRecording as e:
        raise UsageError(f"{e}: not a dataset this command can extend") from None
    if not isinstance(m, dict) or m.get("format") != MANIFEST_FORMAT:
        raise UsageError(f"{where} is not a sparseety-prof dataset manifest")
    if m.get("schema_version") != schema.SCHEMA_VERSION:
        raise UsageError(
            f"{where}: the dataset has schema version {m.get('schema_version')!r}, this sparseety-prof "
            f"writes {schema.SCHEMA_VERSION}: collect into a new folder (a dataset keeps one schema)"
        )
    recs = m.get("recordings")
    if not isinstance(recs, list) or not all(
        isinstance(e, Mapping) and isinstance(e.get("id"), str) for e in recs
    ):
        raise UsageError(f"{where}: 'recordings' must be a list of entries with an id")
    return m


def _manifest_bytes(m: Mapping[str, Any]) -> bytes:
    return (json.dumps(m, indent=1, ensure_ascii=True) + "\n").encode()
