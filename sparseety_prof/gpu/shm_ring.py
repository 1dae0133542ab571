"""Reader of the shared-memory ring that `cupti_ext/libsparseety_cupti.so` fills in an engine process.

Standard library only (plus `records`): `scripts/gpu_check.py` loads this file by path on a GPU
machine without polars. The layout is defined in `cupti_ext/src/ring_format.h` and described in
`cupti_ext/README.md`; in short (little-endian, offsets in bytes):

File `/dev/shm/sparseety-prof-cupti.<pid>`, mode 0600: a 4096-byte header, then `capacity` data bytes
(a power of two) used as a ring.

Header::

    0   u64 magic "SPKCUPTI"        8  u32 version (1)      12 u32 header_size (4096)
    16  u64 capacity                24 u32 pid              28 u32 clock_domain (0 CUPTI default, 1 monotonic)
    32  u64 start_mono_ns           40 u64 calib_realtime_ns  48 u64 calib_mono_ns
    56  u32 finished                60 u32 flags (bit 0: late attach)
    64  u64 write_head (producers)  128 u64 read_tail (this reader)
    192 u64 counters[10]: activity_dropped, ring_dropped, buffers_skipped_sampling,
        buffers_skipped_budget, buffers_failed, callback_ns, launches_seen, graph_launches,
        records_written, buffers_copied

Records start at `read_tail % capacity`, 8-byte aligned, never wrap (a PAD record fills the end of
the data area), each with an 8-byte header ``u32 length, u16 type, u16 reserved``. `length` is the
commit word: producers store it last with release semantics, so 0 means "not written yet" and the
reader stops there. The reader zeroes every byte it consumed before it advances `read_tail`
(a single aligned 8-byte store), which keeps reserved-but-unwritten space reading as 0. The
reader uses pread/pwrite, not a mapping (the producer may truncate the file), and reads the
committed records a second time after it saw their lengths (x86-64 keeps separate reads in order).

The file's name proves nothing: `find_rings` takes a ring only where the process maps it, and
`open_ring` opens that very inode, owned by the process's user (capture/untrusted_files.py;
the maps are read by capture/proc_maps.py).

Record payloads (after the 8-byte header):

- KERNEL (1): ``u64 start, end, graph_node_id; u32 correlation_id, device, context, stream;
  i32 grid[3], block[3]; u32 shared_mem, graph_id, name_len, reserved`` (80 bytes), then the name.
- LAUNCH_API (2): ``u64 enter_ns, exit_ns, graph_exec_id; u32 correlation_id, tid, pid;
  u16 cbid; u8 domain, reserved; u32 name_len, reserved`` (48 bytes), then the API name.
- MEMCPY (3): ``u64 start, end, bytes; u32 correlation_id, device, context, stream, graph_id;
  u8 copy_kind, src_kind, dst_kind, flags`` (48 bytes).
- WATCHED_BUFFER (4): ``u64 launch_ns; u32 correlation_id, tid, arg_index, dtype, ndim, name_len;
  u64 data_len; u64 shape[4]`` (72 bytes), the kernel name padded to 8, then the data.
- WATCHED_GRAPH_BUFFER (6): a watched buffer of a CUDA graph replay: the 72 bytes of WATCHED_BUFFER
  (correlation_id: the graph launch's), then ``u64 graph_node_id; u32 graph_id, reserved``, then
  the name and data as there. Readers that predate it skip it.
- ERROR (5): ``i32 code; u32 text_len`` then the UTF-8 text.
- PAD (0x50): no payload; skipped.

Kernel and memcpy times are CLOCK_MONOTONIC when `clock_domain` is 1; otherwise CUPTI's own clock
(CLOCK_REALTIME on Linux) and :meth:`ShmRing.drain` converts them with the calibration pair. Launch
API and watched-buffer times are always CLOCK_MONOTONIC (taken by the library itself).
"""

from __future__ import annotations

import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

try:
    # relative on purpose: loaded by file path, an absolute import would pull in the package
    from ..capture.proc_maps import MapsEntry, mapped_files
    from ..capture.process_match import descendants
    from ..capture.untrusted_files import open_untrusted, process_uids, target_path
    from ..errors import ProfError
    from .records import KernelActivity, LaunchApi, MemcpyActivity, RingCounters, WatchedBuffer
except ImportError:  # loaded by file path (scripts/gpu_check.py): these were loaded by their names
    from errors import ProfError  # type: ignore[no-redef]
    from proc_maps import MapsEntry, mapped_files  # type: ignore[no-redef]
    from process_match import descendants  # type: ignore[no-redef]
    from records import (  # type: ignore[no-redef]
        KernelActivity,
        LaunchApi,
        MemcpyActivity,
        RingCounters,
        WatchedBuffer,
    )
    from untrusted_files import (  # type: ignore[no-redef]
        open_untrusted,
        process_uids,
        target_path,
    )

__all__ = [
    "CLOCK_CUPTI_DEFAULT",
    "CLOCK_MONOTONIC",
    "SHM_DIR",
    "SHM_PREFIX",
    "Record",
    "RingError",
    "RingFile",
    "RingHeader",
    "ShmRing",
    "find_rings",
    "open_ring",
    "remove_stale_rings",
    "ring_mappings",
]

SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "sparseety-prof-cupti."
# what follows SHM_PREFIX in a ring's name: the PID, and a random part when the plain name was taken
_RING_NAME = re.compile(r"(?P<pid>[0-9]+)(\.[0-9a-f]{16})?")
MAGIC = 0x49545055434B5053  # b"SPKCUPTI" as a little-endian u64
VERSION = 1
HEADER_SIZE = 4096
CLOCK_CUPTI_DEFAULT = 0
CLOCK_MONOTONIC = 1
FLAG_LATE_ATTACH = 1  # header flags bit: loaded by a late attach (ring_format.h RING_FLAG_LATE_ATTACH)
#: rings larger than this are refused (the library's default is 64 MiB)
MAX_CAPACITY = 1 << 30
#: bytes read per drain (more when the first record is larger); the rest waits for the next drain
DRAIN_WINDOW = 64 << 20
#: records decoded per drain: a drain takes at most about a second, whatever the ring holds
MAX_RECORDS_PER_DRAIN = 500_000

REC_KERNEL, REC_LAUNCH_API, REC_MEMCPY, REC_WATCHED_BUFFER, REC_ERROR, REC_PAD = 1, 2, 3, 4, 5, 0x50
REC_WATCHED_GRAPH_BUFFER = 6

_HDR = struct.Struct("<QIIQIIQQQII")  # magic .. flags (64 bytes)
_OFF_CLOCK, _OFF_FINISHED, _OFF_HEAD, _OFF_TAIL, _OFF_COUNTERS = 28, 56, 64, 128, 192
_N_COUNTERS = 10
_REC = struct.Struct("<IHH")
_KERNEL = struct.Struct("<QQQIIII3i3iIIII")
_LAUNCH = struct.Struct("<QQQIIIHBBII")
_MEMCPY = struct.Struct("<QQQIIIIIBBBB")
_WATCHED = struct.Struct("<QIIIIIIQ4Q")
_WATCHED_GRAPH = struct.Struct("<QII")  # graph_node_id, graph_id, reserved: after _WATCHED
_ERROR = struct.Struct("<iI")

_DTYPES = {
    1: ("int8", 1),
    2: ("uint8", 1),
    3: ("int16", 2),
    4: ("uint16", 2),
    5: ("int32", 4),
    6: ("uint32", 4),
    7: ("int64", 8),
    8: ("uint64", 8),
    9: ("float16", 2),
    10: ("bfloat16", 2),
    11: ("float32", 4),
    12: ("float64", 8),
    13: ("bool", 1),
}
# CUpti_ActivityMemcpyKind -> direction; array copies map to the side the array lives on.
_COPY_KINDS = {1: "HtoD", 2: "DtoH", 3: "HtoD", 4: "DtoH", 5: "DtoD", 6: "DtoD", 7: "DtoD", 8: "DtoD"}
_COPY_KINDS |= {9: "HtoH", 10: "PtoP"}

Record = KernelActivity | LaunchApi | MemcpyActivity | WatchedBuffer


class RingError(Exception):
    """The file is not a readable sparseety-prof CUPTI ring (bad magic/version, truncated, corrupt)."""


@dataclass(frozen=True)
class RingHeader:
    """The fixed fields of a ring's header."""

    version: int
    capacity: int
    pid: int
    clock_domain: int  # CLOCK_MONOTONIC, or CLOCK_CUPTI_DEFAULT when the timestamp callback failed
    start_mono_ns: int
    calib_realtime_ns: int
    calib_mono_ns: int
    flags: int = 0  # FLAG_* bits

    @property
    def late_attach(self) -> bool:
        """The library was loaded into the running process (`--late-attach`), not at its cuInit:
        `start_mono_ns` is the attach time, nothing before it is in the ring."""
        return bool(self.flags & FLAG_LATE_ATTACH)


class ShmRing:
    """One producer process's ring, read and written with pread/pwrite (the reader owns `read_tail`).

    Never mapped: the producer is the profiled process, which may truncate the file at any time,
    and a mapping would then kill the reader with SIGBUS; a short read is an error instead. Every
    position and length read from the file is checked against the capacity before use, so a
    damaged or hostile ring ends in RingError, never in a long walk.

    >>> ring = ShmRing("/dev/shm/sparseety-prof-cupti.12345")  # doctest: +SKIP
    >>> records = ring.drain()  # doctest: +SKIP
    >>> ring.counters().ring_dropped  # doctest: +SKIP
    """

    def __init__(self, path: str | os.PathLike[str], *, fd: int | None = None) -> None:
        """`fd`: the ring already opened (and checked) by the caller; otherwise `path` is opened
        as an untrusted file: no symlink, a regular file of bounded size that only its owner writes."""
        self.path = Path(path)
        if fd is None:
            try:
                fd, _ = open_untrusted(
                    self.path, write=True, follow=False, private=True, max_size=HEADER_SIZE + MAX_CAPACITY
                )
            except FileNotFoundError:
                raise RingError(f"{self.path}: no such ring") from None
            except OSError as e:
                raise RingError(f"{self.path}: not opened: {e.strerror or e}") from None
        self._fd: int | None = fd
        try:
            self._init_header()
        except BaseException:
            self.close()
            raise
        self._errors: list[str] = []

    def _init_header(self) -> None:
        size = os.fstat(self._fd_()).st_size
        if size < HEADER_SIZE:
            raise RingError(f"{self.path}: truncated ({size} bytes, the header alone is {HEADER_SIZE})")
        fields = _HDR.unpack_from(self._pread(0, _HDR.size), 0)
        magic, version, header_size, capacity, pid, clock = fields[:6]
        if magic != MAGIC:
            raise RingError(
                f"{self.path}: bad magic {magic:#018x} (not a sparseety-prof CUPTI ring, or not initialised)"
            )
        if version != VERSION:
            raise RingError(f"{self.path}: ring format version {version}, this reader reads {VERSION}")
        if (
            header_size != HEADER_SIZE
            or capacity < 4096
            or capacity > MAX_CAPACITY
            or capacity & (capacity - 1)
        ):
            raise RingError(f"{self.path}: corrupt header (header_size {header_size}, capacity {capacity})")
        if size < header_size + capacity:
            raise RingError(f"{self.path}: truncated ({size} bytes, header says {header_size + capacity})")
        start, calib_rt, calib_mono, _finished, flags = fields[6:11]
        self.header = RingHeader(version, capacity, pid, clock, start, calib_rt, calib_mono, flags)
        self._cap = capacity
        self._tail = self._u64(_OFF_TAIL)

    # ---------------------------------------------------------------- file access

    def _fd_(self) -> int:
        if self._fd is None:
            raise RingError(f"{self.path}: ring is closed")
        return self._fd

    def _pread(self, offset: int, n: int) -> bytes:
        try:
            data = os.pread(self._fd_(), n, offset)
        except OSError as e:
            raise RingError(f"{self.path}: read failed: {e.strerror or e}") from None
        if len(data) != n:
            raise RingError(f"{self.path}: truncated while being read (short read at byte {offset})")
        return data

    def _pwrite(self, offset: int, data: bytes) -> None:
        try:
            os.pwrite(self._fd_(), data, offset)
        except OSError as e:
            raise RingError(f"{self.path}: write failed: {e.strerror or e}") from None

    def _u64(self, offset: int) -> int:
        return int.from_bytes(self._pread(offset, 8), "little")

    def _check_size(self) -> None:
        size = os.fstat(self._fd_()).st_size
        if size < HEADER_SIZE + self._cap:
            raise RingError(f"{self.path}: truncated to {size} bytes while in use")

    def _read_span(self, pos: int, n: int) -> bytes:
        """`n` bytes of the data area from ring position `pos`, unwrapped."""
        cap = self._cap
        a = pos & (cap - 1)
        if a + n <= cap:
            return self._pread(HEADER_SIZE + a, n)
        return self._pread(HEADER_SIZE + a, cap - a) + self._pread(HEADER_SIZE, n - (cap - a))

    @property
    def read_tail(self) -> int:
        """The reader's position: everything before it was consumed and zeroed."""
        return self._tail

    # ---------------------------------------------------------------- state

    @property
    def finished(self) -> bool:
        """True once the producer flushed at exit: a drain after that returns everything."""
        return self._u32(_OFF_FINISHED) != 0

    @property
    def clock_domain(self) -> int:
        return self._u32(_OFF_CLOCK)

    def _u32(self, offset: int) -> int:
        return int.from_bytes(self._pread(offset, 4), "little")

    def counters(self) -> RingCounters:
        """The producer's counters, with the ERROR messages drained so far."""
        v = self.raw_counters()
        return RingCounters(
            activity_dropped=v["activity_dropped"],
            ring_dropped=v["ring_dropped"],
            buffers_skipped_sampling=v["buffers_skipped_sampling"],
            buffers_skipped_budget=v["buffers_skipped_budget"],
            buffers_failed=v["buffers_failed"],
            callback_ns=v["callback_ns"],
            launches_seen=v["launches_seen"],
            graph_launches=v["graph_launches"],
            errors=list(self._errors),
        )

    def raw_counters(self) -> dict[str, int]:
        """All counters by name, including records_written and buffers_copied."""
        names = [
            "activity_dropped",
            "ring_dropped",
            "buffers_skipped_sampling",
            "buffers_skipped_budget",
            "buffers_failed",
            "callback_ns",
            "launches_seen",
            "graph_launches",
            "records_written",
            "buffers_copied",
        ]
        return dict(
            zip(
                names,
                struct.unpack(f"<{_N_COUNTERS}Q", self._pread(_OFF_COUNTERS, 8 * _N_COUNTERS)),
                strict=True,
            )
        )

    # ---------------------------------------------------------------- draining

    def drain(self, max_records: int | None = None) -> list[Record]:
        """Every committed record since the last drain, oldest first, as `records` dataclasses
        (at most `max_records`, and at most MAX_RECORDS_PER_DRAIN: the rest waits for the next drain).

        ERROR records are not returned: their text goes to ``counters().errors``. Consumed space
        is handed back to the producers."""
        self._check_size()
        cap, tail = self._cap, self._tail
        head = self._u64(_OFF_HEAD)
        avail = head - tail
        if avail < 0 or avail > cap:  # producers never run ahead of the reader by more than the ring
            raise RingError(
                f"{self.path}: corrupt write position {head} (read position {tail}, capacity {cap})"
            )
        if avail == 0:
            return []
        limit = MAX_RECORDS_PER_DRAIN if max_records is None else min(max_records, MAX_RECORDS_PER_DRAIN)
        # The lengths first, then the records they commit, in a second read: a length is stored
        # after its record, and one copy does not promise to load its bytes in order.
        first = int.from_bytes(self._read_span(tail, min(8, avail)).ljust(8, b"\0")[:4], "little")
        window = min(avail, max(DRAIN_WINDOW, first))
        end = self._committed(self._read_span(tail, window), tail, avail, limit)
        if end == 0:
            return []
        data = self._read_span(tail, end)
        out: list[Record] = []
        p = 0
        while p < end:
            off = (tail + p) & (cap - 1)
            length, rtype, _ = _REC.unpack_from(data, p)
            if length % 8 or length < _REC.size or p + length > end:
                raise RingError(f"{self.path}: record at offset {off} changed while being read")
            rec = self._decode(rtype, data[p + _REC.size : p + length], off)
            if rec is not None:
                out.append(rec)
            p += length
        self._release(tail, tail + end)
        return out

    def _committed(self, snap: bytes, tail: int, avail: int, limit: int) -> int:
        """How many bytes from `tail` hold whole committed records (at most `limit` of them)."""
        cap = self._cap
        p = n = 0
        while p + _REC.size <= len(snap) and n < limit:
            length, rtype, _ = _REC.unpack_from(snap, p)
            if length == 0:
                break
            off = (tail + p) & (cap - 1)
            if length % 8 or length < _REC.size or off + length > cap or p + length > avail:
                raise RingError(
                    f"{self.path}: corrupt record at offset {off} (length {length}, type {rtype})"
                )
            if p + length > len(snap):
                break  # beyond this drain's window: the next drain reads it
            p += length
            n += 1
        return p

    def _release(self, start: int, end: int) -> None:
        cap = self._cap
        a, b = start & (cap - 1), end & (cap - 1)
        if end - start >= cap or (b <= a and end != start):
            self._pwrite(HEADER_SIZE + a, bytes(cap - a))
            self._pwrite(HEADER_SIZE, bytes(b))
        else:
            self._pwrite(HEADER_SIZE + a, bytes(b - a))
        self._pwrite(_OFF_TAIL, end.to_bytes(8, "little"))  # one aligned 8-byte store, after the zeroing
        self._tail = end

    def _to_mono(self, t: int) -> int:
        if t == 0 or self.clock_domain == CLOCK_MONOTONIC:
            return t
        h = self.header
        return t - h.calib_realtime_ns + h.calib_mono_ns

    def _decode(self, rtype: int, p: bytes, off: int) -> Record | None:
        try:
            if rtype == REC_KERNEL:
                f = _KERNEL.unpack_from(p)
                start, end, node, corr, dev, ctx, stream = f[:7]
                grid, block, smem, graph, name_len = f[7:10], f[10:13], f[13], f[14], f[15]
                name = _text(p, _KERNEL.size, name_len)
                return KernelActivity(
                    corr,
                    name,
                    self._to_mono(start),
                    self._to_mono(end),
                    dev,
                    ctx,
                    stream,
                    grid,
                    block,
                    smem,
                    graph,
                    node,
                )
            if rtype == REC_LAUNCH_API:
                enter, exit_ns, graph, corr, tid, pid, _cbid, _dom, _, name_len, _ = _LAUNCH.unpack_from(p)
                return LaunchApi(corr, _text(p, _LAUNCH.size, name_len), tid, enter, exit_ns, pid, graph)
            if rtype == REC_MEMCPY:
                start, end, nbytes, corr, dev, _ctx, stream, graph, kind = _MEMCPY.unpack_from(p)[:9]
                return MemcpyActivity(
                    corr,
                    _COPY_KINDS.get(kind, "unknown"),
                    nbytes,
                    self._to_mono(start),
                    self._to_mono(end),
                    dev,
                    stream,
                    graph,
                )
            if rtype in (REC_WATCHED_BUFFER, REC_WATCHED_GRAPH_BUFFER):
                f = _WATCHED.unpack_from(p)
                launch_ns, corr, tid, arg, dtype, ndim, name_len, data_len = f[:8]
                if ndim > 4 or dtype not in _DTYPES:
                    raise RingError(f"{self.path}: corrupt watched buffer at offset {off}")
                name_at, node, graph = _WATCHED.size, 0, 0
                if rtype == REC_WATCHED_GRAPH_BUFFER:
                    node, graph, _ = _WATCHED_GRAPH.unpack_from(p, name_at)
                    name_at += _WATCHED_GRAPH.size
                    if node == 0:
                        raise RingError(f"{self.path}: graph watched buffer at offset {off} has no node id")
                name = _text(p, name_at, name_len)
                start = name_at + (name_len + 7) // 8 * 8
                data = p[start : start + data_len]
                if len(data) != data_len:
                    raise RingError(f"{self.path}: watched buffer at offset {off} is truncated")
                return WatchedBuffer(
                    corr,
                    name,
                    arg,
                    _DTYPES[dtype][0],
                    tuple(f[8 : 8 + ndim]),
                    data,
                    tid,
                    launch_ns,
                    graph_id=graph,
                    graph_node_id=node,
                )
            if rtype == REC_ERROR:
                code, text_len = _ERROR.unpack_from(p)
                self._errors.append(f"{_text(p, _ERROR.size, text_len)} (code {code})")
                return None
        except struct.error as e:
            raise RingError(
                f"{self.path}: record of type {rtype} at offset {off} is too short ({e})"
            ) from None
        return None  # PAD, or a type from a newer library: skipped

    # ---------------------------------------------------------------- lifetime

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def unlink(self) -> None:
        """Remove the ring file (once the producer finished and everything was drained), before
        close: only while the name still is the file this reader has open."""
        try:
            same = os.path.samestat(os.lstat(self.path), os.fstat(self._fd_()))
        except OSError:
            return
        if same:
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> ShmRing:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _text(p: bytes, start: int, n: int) -> str:
    if start + n > len(p):
        raise RingError(f"string of {n} bytes runs past its record")
    return p[start : start + n].decode("utf-8", "replace")


@dataclass(frozen=True)
class RingFile:
    """A ring that a process of the target maps: where to open it from here, and what it must be."""

    path: Path  # through /proc/PID/root when the process is in another mount namespace
    pid: int  # the process that maps it
    mapped: MapsEntry  # the process's own view: its name there, device and inode


def find_rings(pid: int, *, shm_dir: Path = SHM_DIR, proc: Path = Path("/proc")) -> list[RingFile]:
    """The rings that `pid` and its descendants have mapped now (/proc/PID/maps). A file's name
    proves nothing (anyone may create /dev/shm/sparseety-prof-cupti.<pid>): a ring counts only
    where the process maps it, and is opened by open_ring as that very file."""
    out = []
    for q in descendants(pid, proc):
        try:
            maps = mapped_files(q, proc)
        except ProfError:  # exited meanwhile, or not ours to read
            continue
        out += [RingFile(target_path(q, m.path, proc), q, m) for m in ring_mappings(maps, shm_dir)]
    return out


def ring_mappings(maps: list[MapsEntry], shm_dir: Path = SHM_DIR) -> list[MapsEntry]:
    """The mappings of a ring among a process's `maps`: a file of `shm_dir` named as a ring."""
    out = []
    for m in maps:
        where = Path(m.path)
        if m.file_backed and not m.deleted and where.parent == shm_dir and where.name.startswith(SHM_PREFIX):
            out.append(m)
    return out


def open_ring(ring: RingFile, proc: Path = Path("/proc")) -> ShmRing:
    """Open a ring found by find_rings: no symlink, the inode the process maps, owned by the
    process's user (or root) and writable by nobody else, of a size the header accounts for."""
    try:
        owners = process_uids(ring.pid, proc)
        fd, _ = open_untrusted(
            ring.path,
            write=True,
            follow=False,
            identity=(ring.mapped.dev, ring.mapped.inode),
            owners=owners,
            private=True,
            max_size=HEADER_SIZE + MAX_CAPACITY,
        )
    except OSError as e:
        raise RingError(f"{ring.path}: not opened: {e.strerror or e}") from None
    return ShmRing(ring.path, fd=fd)


def remove_stale_rings(shm_dir: Path = SHM_DIR, proc: Path = Path("/proc")) -> list[Path]:
    """Remove the rings of processes that are gone; return what was removed.

    A file is removed only when all of this holds: its name is SHM_PREFIX + a PID that no running
    process has (optionally + "." and 16 hex digits: the name a library takes when its plain one
    was planted); it is a regular file (not a symlink) with a single link; it reads as a ring
    (magic, version, a size the header accounts for) whose header names that same PID. Anything
    else, whoever owns it, is left alone: a file that cannot be proven to be a dead process's
    ring is never deleted."""
    removed = []
    try:
        names = [p for p in shm_dir.iterdir() if p.name.startswith(SHM_PREFIX)]
    except OSError:
        return []
    for path in names:
        m = _RING_NAME.fullmatch(path.name[len(SHM_PREFIX) :])
        if m is None or (proc / m["pid"]).exists():
            continue
        digits = m["pid"]
        try:
            fd, st = open_untrusted(path, follow=False, max_size=HEADER_SIZE + MAX_CAPACITY)
        except OSError:
            continue
        try:
            ring = ShmRing(path, fd=fd)
        except RingError:
            continue
        try:
            proven = ring.header.pid == int(digits) and st.st_nlink == 1
            proven = proven and st.st_size == HEADER_SIZE + ring.header.capacity
        finally:
            ring.close()
        try:
            now = os.lstat(path)
        except OSError:
            continue
        if proven and (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):  # not swapped meanwhile
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed
