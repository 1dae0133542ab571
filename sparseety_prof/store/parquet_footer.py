"""What a Parquet file says about itself, read without decoding a single value: its footer
(FileMetaData) and the header of every page, parsed from the file's bytes in bounded steps.

A recording made elsewhere is untrusted (store/recording_files.py): what matters before its
segments are handed to the Parquet decoder is how much memory decoding them will take. That is
set by the page headers (the decoder decompresses each page into a buffer of the size its header
declares, and decodes the number of values it declares), so every page header is read, not only
the footer's per-column totals, which the decoder never checks against the pages.

Thrift compact protocol (the encoding of Parquet's metadata), the subset Parquet uses; every
length is checked against the bytes that remain before anything is allocated, nesting is bounded,
and a malformed structure raises `ParquetMetadataError` with what was wrong.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

__all__ = [
    "ColumnChunk",
    "ParquetFacts",
    "ParquetMetadataError",
    "footer_data_bytes",
    "footer_length",
    "parquet_facts",
]

MAGIC = b"PAR1"
#: a footer this long would describe far more columns and row groups than a segment has
MAX_FOOTER_BYTES = 4 << 20
#: Values one footer may hold (each becomes a Python object) and pages one file may have (each
#: header is parsed): a segment's footer holds a few thousand, its pages are about a megabyte
#: each; a crafted footer of empty structures, or a file of empty pages, would otherwise cost
#: memory and time out of proportion to its size
MAX_FOOTER_VALUES = 500_000
MAX_PAGES = 200_000
_PAGE_HEADER_VALUES = 10_000  # a page header holds its sizes, counts and statistics: a few dozen
_MAX_NESTING = 32  # Parquet's own structures nest five deep; a deeper one is hostile

# Thrift compact types
_BOOL_TRUE, _BOOL_FALSE, _BYTE, _I16, _I32, _I64, _DOUBLE, _BINARY, _LIST, _SET, _MAP, _STRUCT = range(1, 13)

# PageType
_DATA_PAGE, _INDEX_PAGE, _DICTIONARY_PAGE, _DATA_PAGE_V2 = 0, 1, 2, 3


class ParquetMetadataError(ValueError):
    """The file's footer or a page header is not well-formed Parquet metadata."""


@dataclass
class ColumnChunk:
    """One column of one row group, as its page headers describe it."""

    path: tuple[str, ...]  # the leaf's path in the schema ("expert_ids", "list", "element", ...)
    physical_type: int = -1  # Parquet's Type: BOOLEAN 0, INT32 1, INT64 2, ..., BYTE_ARRAY 6
    values: int = 0  # values the data pages declare (leaf slots: nulls and empty lists count)
    decompressed_bytes: int = 0  # the pages' declared uncompressed sizes, dictionary pages included
    dictionary_values: int = 0


@dataclass
class ParquetFacts:
    rows: int
    row_groups: int
    columns: list[ColumnChunk] = field(default_factory=list)
    pages: int = 0

    @property
    def decompressed_bytes(self) -> int:
        return sum(c.decompressed_bytes for c in self.columns)

    @property
    def values(self) -> int:
        return sum(c.values for c in self.columns)

    def leaf_values(self) -> dict[str, int]:
        """Declared values per top-level column (all row groups)."""
        out: dict[str, int] = {}
        for c in self.columns:
            out[c.path[0]] = out.get(c.path[0], 0) + c.values
        return out


class _Reader:
    """Thrift compact protocol over bytes[start:end]; values as Python objects, structs as
    {field id: value}."""

    def __init__(
        self, data: bytes | memoryview, start: int, end: int, budget: int = MAX_FOOTER_VALUES
    ) -> None:
        self.data = data
        self.pos = start
        self.end = end
        self.budget = budget  # values this reader may still produce

    def _byte(self) -> int:
        if self.pos >= self.end:
            raise ParquetMetadataError("metadata ends in the middle of a value")
        b = self.data[self.pos]
        self.pos += 1
        return b

    def varint(self) -> int:
        shift = result = 0
        while True:
            b = self._byte()
            result |= (b & 0x7F) << shift
            if not b & 0x80:
                return result
            shift += 7
            if shift > 63:
                raise ParquetMetadataError("a varint longer than 64 bits")

    def zigzag(self) -> int:
        n = self.varint()
        return (n >> 1) ^ -(n & 1)

    def _take(self, n: int) -> bytes:
        if n < 0 or n > self.end - self.pos:
            raise ParquetMetadataError(f"a length of {n} bytes runs past the metadata")
        b = bytes(self.data[self.pos : self.pos + n])
        self.pos += n
        return b

    def value(self, kind: int, depth: int) -> object:
        if depth > _MAX_NESTING:
            raise ParquetMetadataError("metadata nested deeper than Parquet's structures")
        self.budget -= 1
        if self.budget < 0:
            raise ParquetMetadataError("metadata of more values than a segment's footer holds")
        if kind in (_BOOL_TRUE, _BOOL_FALSE):
            return kind == _BOOL_TRUE
        if kind == _BYTE:
            return self._byte()
        if kind in (_I16, _I32, _I64):
            return self.zigzag()
        if kind == _DOUBLE:
            return struct.unpack("<d", self._take(8))[0]
        if kind == _BINARY:
            return self._take(self.varint())
        if kind in (_LIST, _SET):
            head = self._byte()
            size, elem = head >> 4, head & 0x0F
            if size == 15:
                size = self.varint()
            if size > self.end - self.pos:  # every element takes at least one byte
                raise ParquetMetadataError(f"a list of {size} elements runs past the metadata")
            if elem in (_BOOL_TRUE, _BOOL_FALSE):
                self.budget -= size
                if self.budget < 0:
                    raise ParquetMetadataError("metadata of more values than a segment's footer holds")
                return [self._byte() == 1 for _ in range(size)]
            return [self.value(elem, depth + 1) for _ in range(size)]
        if kind == _MAP:
            size = self.varint()
            if size == 0:
                return {}
            if size > self.end - self.pos:
                raise ParquetMetadataError(f"a map of {size} entries runs past the metadata")
            head = self._byte()
            return {
                _hashable(self.value(head >> 4, depth + 1)): self.value(head & 0x0F, depth + 1)
                for _ in range(size)
            }
        if kind == _STRUCT:
            return self.struct(depth + 1)
        raise ParquetMetadataError(f"unknown Thrift type {kind}")

    def struct(self, depth: int = 0) -> dict[int, object]:
        out: dict[int, object] = {}
        last = 0
        while True:
            head = self._byte()
            if head == 0:
                return out
            delta, kind = head >> 4, head & 0x0F
            fid = last + delta if delta else self.zigzag()
            out[fid] = self.value(kind, depth)
            last = fid


def _hashable(v: object) -> object:
    return v if isinstance(v, int | str | bytes | bool | float) else repr(v)


def _int(d: dict[int, object], fid: int, what: str, *, default: int | None = None) -> int:
    v = d.get(fid, default)
    if not isinstance(v, int) or isinstance(v, bool):
        raise ParquetMetadataError(f"{what} is missing or not an integer")
    return v


def _struct(d: dict[int, object], fid: int, what: str) -> dict[int, object]:
    v = d.get(fid)
    if not isinstance(v, dict):
        raise ParquetMetadataError(f"{what} is missing")
    return v


def _list(d: dict[int, object], fid: int, what: str) -> list[object]:
    v = d.get(fid)
    if not isinstance(v, list):
        raise ParquetMetadataError(f"{what} is missing")
    return v


def footer_length(head: bytes, tail: bytes, size: int) -> int:
    """The footer's length from a file's first 4 and last 8 bytes (`size` bytes in all), checked:
    Parquet magic at both ends, a footer that fits the file and MAX_FOOTER_BYTES."""
    if size < 12 or head[:4] != MAGIC or tail[-4:] != MAGIC or len(tail) < 8:
        raise ParquetMetadataError("no Parquet magic at both ends (truncated, or not Parquet)")
    footer_len: int = struct.unpack("<I", tail[-8:-4])[0]
    if footer_len > MAX_FOOTER_BYTES or footer_len > size - 12:
        raise ParquetMetadataError(f"a footer of {footer_len} bytes does not fit the file")
    return footer_len


def footer_data_bytes(footer: bytes) -> int:
    """The bytes of column chunks the footer (FileMetaData, without the length and magic)
    describes: what a file holding it has besides its footer, page indexes aside."""
    meta = _Reader(footer, 0, len(footer)).struct()
    total = 0
    for g in _list(meta, 4, "the row groups"):
        if not isinstance(g, dict):
            raise ParquetMetadataError("a row group is not a structure")
        for c in _list(g, 1, "a row group's columns"):
            if not isinstance(c, dict):
                raise ParquetMetadataError("a column chunk is not a structure")
            total += max(_int(_struct(c, 3, "a column chunk's metadata"), 7, "a column chunk's size"), 0)
    return total


def parquet_facts(data: bytes | memoryview) -> ParquetFacts:
    """The row count, row groups and per-column page totals of the Parquet file `data`, from its
    footer and page headers only. ParquetMetadataError when they are malformed or disagree (a
    page outside its column chunk, page values that do not add up to the chunk's)."""
    n = len(data)
    footer_len = footer_length(bytes(data[:4]), bytes(data[max(n - 8, 0) :]), n)
    meta = _Reader(data, n - 8 - footer_len, n - 8).struct()
    rows = _int(meta, 3, "the file's row count")
    groups = _list(meta, 4, "the row groups")
    facts = ParquetFacts(rows=rows, row_groups=len(groups))
    group_rows = 0
    data_end = n - 8 - footer_len
    for g in groups:
        if not isinstance(g, dict):
            raise ParquetMetadataError("a row group is not a structure")
        g_rows = _int(g, 3, "a row group's row count")
        if g_rows < 0:
            raise ParquetMetadataError(f"a row group of {g_rows} rows")
        group_rows += g_rows
        for c in _list(g, 1, "a row group's columns"):
            if not isinstance(c, dict):
                raise ParquetMetadataError("a column chunk is not a structure")
            if c.get(1) is not None:
                raise ParquetMetadataError("a column chunk in another file (file_path)")
            facts.columns.append(
                _column_chunk(data, _struct(c, 3, "a column chunk's metadata"), data_end, facts)
            )
    if rows < 0 or group_rows != rows:
        raise ParquetMetadataError(f"the row groups hold {group_rows} rows, the footer says {rows}")
    return facts


def _column_chunk(
    data: bytes | memoryview, md: dict[int, object], data_end: int, facts: ParquetFacts
) -> ColumnChunk:
    path = tuple(
        p.decode("utf-8", "replace") if isinstance(p, bytes) else str(p)
        for p in _list(md, 3, "a column chunk's path")
    )
    if not path:
        raise ParquetMetadataError("a column chunk with an empty path")
    kind = md.get(1)
    chunk = ColumnChunk(
        path, physical_type=kind if isinstance(kind, int) and not isinstance(kind, bool) else -1
    )
    declared_values = _int(md, 5, f"column {'.'.join(path)}: its value count")
    size = _int(md, 7, f"column {'.'.join(path)}: its compressed size")
    start = _int(md, 9, f"column {'.'.join(path)}: its data page offset")
    dict_offset = md.get(11)
    if isinstance(dict_offset, int) and not isinstance(dict_offset, bool) and 0 < dict_offset < start:
        start = dict_offset
    end = start + size
    if start < 4 or size < 0 or end > data_end:
        raise ParquetMetadataError(f"column {'.'.join(path)}: its pages lie outside the file's data")
    pos = start
    while pos < end:
        facts.pages += 1
        if facts.pages > MAX_PAGES:
            raise ParquetMetadataError(f"more than {MAX_PAGES} pages")
        r = _Reader(data, pos, end, budget=_PAGE_HEADER_VALUES)
        header = r.struct()
        page_type = _int(header, 1, "a page's type")
        uncompressed = _int(header, 2, "a page's uncompressed size")
        compressed = _int(header, 3, "a page's compressed size")
        if uncompressed < 0 or compressed < 0 or r.pos + compressed > end:
            raise ParquetMetadataError(f"column {'.'.join(path)}: a page runs past its column chunk")
        chunk.decompressed_bytes += uncompressed
        if page_type == _DICTIONARY_PAGE:
            chunk.dictionary_values += _page_values(header, 7)
        elif page_type == _DATA_PAGE:
            chunk.values += _page_values(header, 5)
        elif page_type == _DATA_PAGE_V2:
            chunk.values += _page_values(header, 8)
        elif page_type != _INDEX_PAGE:
            raise ParquetMetadataError(f"column {'.'.join(path)}: a page of unknown type {page_type}")
        pos = r.pos + compressed
    if chunk.values != declared_values:
        raise ParquetMetadataError(
            f"column {'.'.join(path)}: its pages hold {chunk.values} values, its metadata says "
            f"{declared_values}"
        )
    return chunk


def _page_values(header: dict[int, object], fid: int) -> int:
    n = _int(_struct(header, fid, "a page's own header"), 1, "a page's value count")
    if n < 0:
        raise ParquetMetadataError(f"a page of {n} values")
    return n
