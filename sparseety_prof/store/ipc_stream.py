"""Arrow IPC streams of a recording's journal (store/journal.py), judged before they are decoded.

A journal record's rows are an Arrow IPC stream: the cheapest format Polars writes (no encoding
pass, the columns' buffers copied out as they are). A record may come from a recording made
elsewhere, so the
stream's metadata is read here, without decoding a value, and refused (`IpcStreamError`) unless it
is what the journal writes: one schema message, then record batches; the schema at most
`MAX_DEPTH` types deep with `MAX_FIELDS` fields, of the types the tables use (integers, floats,
booleans, strings, binary and lists of them: no dictionaries, no views, no extension types); no
body compression (an uncompressed stream decodes into about its own size: no decompression bomb);
every buffer within its message's body, every node's length within what the body can hold. The
metadata is FlatBuffers (https://arrow.apache.org/docs/format/Columnar.html, Message.fbs and
Schema.fbs); only the fields checked are read, each offset checked against the bytes it points
into.
"""

from __future__ import annotations

import io
import struct

import polars as pl

__all__ = ["MAX_DEPTH", "MAX_FIELDS", "IpcStreamError", "check_stream", "read_stream", "write_stream"]

MAX_DEPTH = 4  # a table's deepest column is a list of lists of numbers
MAX_FIELDS = 1024  # fields over every level (the widest table has a few dozen)
MAX_MESSAGES = 4096  # the journal writes a schema and a batch or a few
MAX_ROWS = 1 << 24

_CONTINUATION = 0xFFFFFFFF
# Message.header's union: Schema 1, DictionaryBatch 2, RecordBatch 3 (Tensor, SparseTensor: never)
_SCHEMA, _RECORD_BATCH = 1, 3
# Type's union: Int 2, FloatingPoint 3, Binary 4, Utf8 5, Bool 6, List 12, LargeBinary 19,
# LargeUtf8 20, LargeList 21: what Polars writes for the schema's dtypes at CompatLevel.oldest()
_TYPES = frozenset({2, 3, 4, 5, 6, 12, 19, 20, 21})
_LISTS = frozenset({12, 21})


class IpcStreamError(ValueError):
    """The bytes are not an Arrow IPC stream the journal writes (one line saying why)."""


def write_stream(df: pl.DataFrame) -> bytes:
    """`df` as the journal writes it: an IPC stream, uncompressed, with the oldest Arrow types
    (large strings and lists, no views)."""
    buf = io.BytesIO()
    df.write_ipc_stream(buf, compression="uncompressed", compat_level=pl.CompatLevel.oldest())
    return buf.getvalue()


def read_stream(data: bytes) -> pl.DataFrame:
    """The frame of a stream `check_stream` accepted (IpcStreamError otherwise, or when Polars
    cannot decode it)."""
    check_stream(data)
    try:
        return pl.read_ipc_stream(io.BytesIO(data))
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # polars raises its own errors, OSError, and pyo3 PanicException
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise IpcStreamError(f"cannot be decoded ({reason})") from None


def check_stream(data: bytes) -> int:
    """Judge the stream `data` from its metadata alone; the rows its batches declare."""
    pos, rows, messages, schema_seen = 0, 0, 0, False
    while True:
        if pos + 4 > len(data):
            raise IpcStreamError("ends before its end-of-stream marker (torn)")
        (size,) = struct.unpack_from("<I", data, pos)
        pos += 4
        if size == _CONTINUATION:
            if pos + 4 > len(data):
                raise IpcStreamError("ends inside a message's length (torn)")
            (size,) = struct.unpack_from("<I", data, pos)
            pos += 4
        if size == 0:
            break  # end of stream
        if size > len(data) - pos:
            raise IpcStreamError("ends inside a message's metadata (torn)")
        messages += 1
        if messages > MAX_MESSAGES:
            raise IpcStreamError(f"holds more than {MAX_MESSAGES} messages")
        meta = _Buf(data[pos : pos + size])
        pos += size
        kind, body = _message(meta)
        if body > len(data) - pos:
            raise IpcStreamError("ends inside a message's body (torn)")
        if kind == _SCHEMA:
            if schema_seen:
                raise IpcStreamError("holds two schemas")
            schema_seen = True
            _check_schema(meta)
        elif kind == _RECORD_BATCH:
            if not schema_seen:
                raise IpcStreamError("holds a record batch before its schema")
            rows += _check_batch(meta, body)
            if rows > MAX_ROWS:
                raise IpcStreamError(f"holds more than {MAX_ROWS} rows")
        else:
            raise IpcStreamError(f"holds a message of kind {kind} (the journal writes schemas and batches)")
        pos += body
    if not schema_seen:
        raise IpcStreamError("holds no schema")
    return rows


class _Buf:
    """A FlatBuffers buffer, every read bounds-checked (IpcStreamError)."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def _unpack(self, fmt: str, at: int) -> int:
        if at < 0 or at + struct.calcsize(fmt) > len(self.data):
            raise IpcStreamError("has metadata pointing outside itself")
        value: int = struct.unpack_from(fmt, self.data, at)[0]
        return value

    def root(self) -> int:
        return self._unpack("<I", 0)

    def field(self, table: int, index: int) -> int:
        """Where field `index` of the table at `table` lies (0: absent)."""
        vtable = table - self._unpack("<i", table)
        vt_size = self._unpack("<H", vtable)
        slot = 4 + 2 * index
        if slot + 2 > vt_size:
            return 0
        off = self._unpack("<H", vtable + slot)
        return table + off if off else 0

    def scalar(self, table: int, index: int, fmt: str, default: int = 0) -> int:
        at = self.field(table, index)
        return self._unpack(fmt, at) if at else default

    def ref(self, table: int, index: int) -> int:
        """The table or vector field `index` points to (0: absent)."""
        at = self.field(table, index)
        return at + self._unpack("<I", at) if at else 0

    def vector(self, at: int, item: int) -> tuple[int, int]:
        """(count, first item's position) of the vector at `at`, its items `item` bytes each."""
        n = self._unpack("<I", at)
        if at + 4 + n * item > len(self.data):
            raise IpcStreamError("has a vector running past its metadata")
        return n, at + 4

    def table_at(self, at: int) -> int:
        return at + self._unpack("<I", at)


def _message(b: _Buf) -> tuple[int, int]:
    """(header kind, body length) of a Message."""
    msg = b.root()
    kind = b.scalar(msg, 1, "<B")
    body = b.scalar(msg, 3, "<q")
    if body < 0:
        raise IpcStreamError("declares a negative body length")
    return kind, body


def _check_schema(b: _Buf) -> None:
    msg = b.root()
    schema = b.ref(msg, 2)
    if not schema:
        raise IpcStreamError("has a schema message without its schema")
    fields = b.ref(schema, 1)
    todo = [(fields, 1)] if fields else []
    seen = 0
    while todo:
        vec, depth = todo.pop()
        if depth > MAX_DEPTH:
            raise IpcStreamError(f"nests types more than {MAX_DEPTH} deep")
        n, first = b.vector(vec, 4)
        seen += n
        if seen > MAX_FIELDS:
            raise IpcStreamError(f"declares more than {MAX_FIELDS} fields")
        for i in range(n):
            field = b.table_at(first + 4 * i)
            kind = b.scalar(field, 2, "<B")
            if kind not in _TYPES:
                raise IpcStreamError(f"has a column of Arrow type {kind}, which no table has")
            if b.field(field, 4):
                raise IpcStreamError("has a dictionary-encoded column")
            children = b.ref(field, 5)
            n_children = b.vector(children, 4)[0] if children else 0
            if n_children != (1 if kind in _LISTS else 0):
                raise IpcStreamError(f"has a column of Arrow type {kind} with {n_children} children")
            if children:
                todo.append((children, depth + 1))


def _check_batch(b: _Buf, body: int) -> int:
    """The rows of a RecordBatch message; IpcStreamError unless its buffers lie in its body,
    uncompressed, and its nodes' lengths fit what the body can hold."""
    msg = b.root()
    batch = b.ref(msg, 2)
    if not batch:
        raise IpcStreamError("has a record batch message without its batch")
    rows = b.scalar(batch, 0, "<q")
    if b.field(batch, 3):
        raise IpcStreamError("has a compressed body (the journal writes none)")
    if b.field(batch, 4):
        raise IpcStreamError("has variadic buffers (views; the journal writes none)")
    most = 8 * body + 64  # elements a body can hold: a bit each, at the least (booleans)
    if not 0 <= rows <= most:
        raise IpcStreamError(f"declares {rows} rows in a body of {body} bytes")
    nodes = b.ref(batch, 1)
    n, first = b.vector(nodes, 16) if nodes else (0, 0)
    for i in range(n):
        length, nulls = struct.unpack_from("<qq", b.data, first + 16 * i)
        if not (0 <= length <= most and 0 <= nulls <= length):
            raise IpcStreamError(f"declares a column of {length} values in a body of {body} bytes")
    buffers = b.ref(batch, 2)
    n, first = b.vector(buffers, 16) if buffers else (0, 0)
    for i in range(n):
        offset, length = struct.unpack_from("<qq", b.data, first + 16 * i)
        if offset < 0 or length < 0 or offset + length > body:
            raise IpcStreamError("has a buffer outside its message's body")
    return rows
