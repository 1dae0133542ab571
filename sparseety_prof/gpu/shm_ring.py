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
    56  u32 finished                60 u32 flags
    64  u64 write_head (producers)  128 u64 read_tail (this reader)
    192 u64 counters[10]: activity_dropped, ring_dropped, buffers_skipped_sampling,
        buffers_skipped_budget, buffers_failed, callback_ns, launches_seen, graph_launches,
        records_written, buffers_copied

Records start at `read_tail % capacity`, 8-byte aligned, never wrap (a PAD record fills the end of
the data area), each with an 8-byte header ``u32 length, u16 type, u16 reserved``. `length` is the
commit word: producers store it last with release semantics, so 0 means "not written yet" and the
reader stops there. The reader zeroes every byte it consumed before it advances `read_tail`
(a single aligned 8-byte store), which keeps reserved-but-unwritten space reading as 0. The
reader relies on the hardware not reordering its loads (x86-64's TSO; CPython issues no fences).

Record payloads (after the 8-byte header):

- KERNEL (1): ``u64 start, end, graph_node_id; u32 correlation_id, device, context, stream;
  i32 grid[3], block[3]; u32 shared_mem, graph_id, name_len, reserved`` (80 bytes), then the name.
- LAUNCH_API (2): ``u64 enter_ns, exit_ns, graph_exec_id; u32 correlation_id, tid, pid;
  u16 cbid; u8 domain, reserved; u32 name_len, reserved`` (48 bytes), then the API name.
- MEMCPY (3): ``u64 start, end, bytes; u32 correlation_id, device, context, stream, graph_id;
  u8 copy_kind, src_kind, dst_kind, flags`` (48 bytes).
- WATCHED_BUFFER (4): ``u64 launch_ns; u32 correlation_id, tid, arg_index, dtype, ndim, name_len;
  u64 data_len; u64 shape[4]`` (72 bytes), the kernel name padded to 8, then the data.
- ERROR (5): ``i32 code; u32 text_len`` then the UTF-8 text.
- PAD (0x50): no payload; skipped.

Kernel and memcpy times are CLOCK_MONOTONIC when `clock_domain` is 1; otherwise CUPTI's own clock
(CLOCK_REALTIME on Linux) and :meth:`ShmRing.drain` converts them with the calibration pair. Launch
API and watched-buffer times are always CLOCK_MONOTONIC (taken by the library itself).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

try:
    # relative on purpose: loaded by file path, an absolute import would pull in the package
    from .records import KernelActivity, LaunchApi, MemcpyActivity, RingCounters, WatchedBuffer
except ImportError:  # loaded by file path (scripts/gpu_check.py): records was loaded as "records"
    from records import (  # type: ignore[no-redef]
        KernelActivity,
        LaunchApi,
        MemcpyActivity,
        RingCounters,
        WatchedBuffer,
    )

__all__ = [
    "CLOCK_CUPTI_DEFAULT",
    "CLOCK_MONOTONIC",
    "SHM_DIR",
    "SHM_PREFIX",
    "Record",
    "RingError",
    "RingHeader",
    "ShmRing",
    "descendants",
    "find_rings",
]

SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "sparseety-prof-cupti."
MAGIC = 0x49545055434B5053  # b"SPKCUPTI" as a little-endian u64
VERSION = 1
HEADER_SIZE = 4096
CLOCK_CUPTI_DEFAULT = 0
CLOCK_MONOTONIC = 1

REC_KERNEL, REC_LAUNCH_API, REC_MEMCPY, REC_WATCHED_BUFFER, REC_ERROR, REC_PAD = 1, 2, 3, 4, 5, 0x50

_HDR = struct.Struct("<QIIQIIQQQII")  # magic .. flags (64 bytes)
_OFF_HEAD, _OFF_TAIL, _OFF_COUNTERS = 64, 128, 192
_N_COUNTERS = 10
_REC = struct.Struct("<IHH")
_KERNEL = struct.Struct("<QQQIIII3i3iIIII")
_LAUNCH = struct.Struct("<QQQIIIHBBII")
_MEMCPY = struct.Struct("<QQQIIIIIBBBB")
_WATCHED = struct.Struct("<QIIIIIIQ4Q")
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


class ShmRing:
    """One producer process's ring, mapped read-write (the reader owns `read_tail`).

    >>> ring = ShmRing("/dev/shm/sparseety-prof-cupti.12345")  # doctest: +SKIP
    >>> records = ring.drain()  # doctest: +SKIP
    >>> ring.counters().ring_dropped  # doctest: +SKIP
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            raise RingError(f"{self.path}: no such ring") from None
        try:
            size = os.fstat(fd).st_size
            if size < HEADER_SIZE:
                raise RingError(f"{self.path}: truncated ({size} bytes, the header alone is {HEADER_SIZE})")
            self._mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        fields = _HDR.unpack_from(self._mm, 0)
        magic, version, header_size, capacity, pid, clock = fields[:6]
        if magic != MAGIC:
            self.close()
            raise RingError(
                f"{self.path}: bad magic {magic:#018x} (not a sparseety-prof CUPTI ring, or not initialised)"
            )
        if version != VERSION:
            self.close()
            raise RingError(f"{self.path}: ring format version {version}, this reader reads {VERSION}")
        if header_size != HEADER_SIZE or capacity < 4096 or capacity & (capacity - 1):
            self.close()
            raise RingError(f"{self.path}: corrupt header (header_size {header_size}, capacity {capacity})")
        if size < header_size + capacity:
            self.close()
            raise RingError(f"{self.path}: truncated ({size} bytes, header says {header_size + capacity})")
        self.header = RingHeader(version, capacity, pid, clock, *fields[6:9])
        self._cap = capacity
        self._head = ctypes.c_uint64.from_buffer(self._mm, _OFF_HEAD)
        self._tail = ctypes.c_uint64.from_buffer(self._mm, _OFF_TAIL)
        self._finished = ctypes.c_uint32.from_buffer(self._mm, 56)
        self._clock = ctypes.c_uint32.from_buffer(self._mm, 28)
        self._errors: list[str] = []

    # ---------------------------------------------------------------- state

    @property
    def finished(self) -> bool:
        """True once the producer flushed at exit: a drain after that returns everything."""
        return self._finished.value != 0

    @property
    def clock_domain(self) -> int:
        return int(self._clock.value)

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
        return dict(zip(names, struct.unpack_from(f"<{_N_COUNTERS}Q", self._mm, _OFF_COUNTERS), strict=True))

    # ---------------------------------------------------------------- draining

    def drain(self, max_records: int | None = None) -> list[Record]:
        """Every committed record since the last drain, oldest first, as `records` dataclasses.

        ERROR records are not returned: their text goes to ``counters().errors``. Consumed space
        is handed back to the producers."""
        out: list[Record] = []
        mm, cap = self._mm, self._cap
        tail = self._tail.value
        consumed_from = tail
        while max_records is None or len(out) < max_records:
            off = tail & (cap - 1)
            base = HEADER_SIZE + off
            length = ctypes.c_uint32.from_buffer(mm, base).value
            if length == 0:
                break
            _, rtype, _ = _REC.unpack_from(mm, base)
            if length % 8 or length < _REC.size or off + length > cap or tail + length > self._head.value:
                raise RingError(
                    f"{self.path}: corrupt record at offset {off} (length {length}, type {rtype})"
                )
            rec = self._decode(rtype, bytes(mm[base + _REC.size : base + length]), off)
            if rec is not None:
                out.append(rec)
            tail += length
        if tail != consumed_from:
            self._release(consumed_from, tail)
        return out

    def _release(self, start: int, end: int) -> None:
        cap = self._cap
        a, b = start & (cap - 1), end & (cap - 1)
        if end - start >= cap or (b <= a and end != start):
            self._mm[HEADER_SIZE + a : HEADER_SIZE + cap] = bytes(cap - a)
            self._mm[HEADER_SIZE : HEADER_SIZE + b] = bytes(b)
        else:
            self._mm[HEADER_SIZE + a : HEADER_SIZE + b] = bytes(b - a)
        self._tail.value = end  # one aligned 8-byte store, after the zeroing

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
            if rtype == REC_WATCHED_BUFFER:
                f = _WATCHED.unpack_from(p)
                launch_ns, corr, tid, arg, dtype, ndim, name_len, data_len = f[:8]
                if ndim > 4 or dtype not in _DTYPES:
                    raise RingError(f"{self.path}: corrupt watched buffer at offset {off}")
                name = _text(p, _WATCHED.size, name_len)
                start = _WATCHED.size + (name_len + 7) // 8 * 8
                data = p[start : start + data_len]
                if len(data) != data_len:
                    raise RingError(f"{self.path}: watched buffer at offset {off} is truncated")
                return WatchedBuffer(
                    corr, name, arg, _DTYPES[dtype][0], tuple(f[8 : 8 + ndim]), data, tid, launch_ns
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
        for name in ("_head", "_tail", "_finished", "_clock"):
            if hasattr(self, name):
                delattr(self, name)  # ctypes views pin the mmap: drop them before closing it
        self._mm.close()

    def unlink(self) -> None:
        """Remove the ring file (once the producer finished and everything was drained)."""
        self.path.unlink(missing_ok=True)

    def __enter__(self) -> ShmRing:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _text(p: bytes, start: int, n: int) -> str:
    if start + n > len(p):
        raise RingError(f"string of {n} bytes runs past its record")
    return p[start : start + n].decode("utf-8", "replace")


def descendants(pid: int, proc: Path = Path("/proc")) -> list[int]:
    """`pid` and every live descendant (engine workers inherit CUDA_INJECTION64_PATH), from /proc/*/stat."""
    children: dict[int, list[int]] = {}
    for d in proc.iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        # The command name is in parentheses and may contain spaces: the ppid follows the last ')'.
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def find_rings(pid: int, *, shm_dir: Path = SHM_DIR, proc: Path = Path("/proc")) -> list[Path]:
    """The ring files of `pid` and its descendant processes that exist now."""
    return [p for q in descendants(pid, proc) if (p := shm_dir / f"{SHM_PREFIX}{q}").exists()]
