"""The consumer's ring-buffer walk (RingReader): the C walk and the Python walk read the same
records out of a synthetic BPF ring, with wrap-around, discarded and busy records, arena growth
and record sizes not known in advance. No BPF needed: the ring's memory layout is built here."""

from __future__ import annotations

import ctypes
import mmap
import struct
import time

import numpy as np
import pytest

from sparseety_prof.capture import bpf_loader as bl
from sparseety_prof.capture import events as ev
from sparseety_prof.capture.ring_hold import RingHold

PAGE = 4096
SIZE = 1 << 16  # data bytes of the synthetic ring (a power of two, as the kernel's)


class FakeRing:
    """[producer page][data][data again]: the kernel maps the data pages twice in a row."""

    def __init__(self, start: int = 0) -> None:
        self.buf = ctypes.create_string_buffer(PAGE + 2 * SIZE)
        self.prod = start
        self.cons = start

    def put(self, payload: bytes, *, busy: bool = False, discard: bool = False) -> None:
        length = (
            len(payload) | (bl.RingReader.BUSY if busy else 0) | (bl.RingReader.DISCARD if discard else 0)
        )
        rec = struct.pack("<II", length, 0) + payload
        rec += b"\0" * (-len(rec) % 8)
        off = self.prod & (SIZE - 1)
        for base in (PAGE + off, PAGE + SIZE + off):  # both mappings
            end = min(base + len(rec), PAGE + 2 * SIZE)
            self._write(base, rec[: end - base])
        if off + len(rec) > SIZE:  # the part past the end is the start of the first mapping
            self._write(PAGE, rec[SIZE - off :])
        self.prod += len(rec)
        struct.pack_into("<Q", self.buf, 0, self.prod)

    def _write(self, at: int, data: bytes) -> None:
        ctypes.memmove(ctypes.addressof(self.buf) + at, data, len(data))

    def reader(self, *, python: bool, sizes: tuple[int, ...] = (), ref_size: int = -1) -> bl.RingReader:
        """A RingReader on this ring; records of `ref_size` are logits records (taken by reference
        while the ring is not filling)."""
        r = bl.RingReader.__new__(bl.RingReader)
        r._fill = {s: bl._Arena(s) for s in sizes}
        r._logits_size = ref_size
        r._refs = bl._Arena(ev.LOGITS_REF_DTYPE.itemsize)
        r._walked = None
        r._hold = RingHold(bl.RingReader.REF_MAX_SHARE)
        r._logits_share = 1.0  # as after a drain of mostly logits records
        r._ring_bytes = r._ring_records = r._seq_at_take = 0
        r.last_take_bytes = r.takes = r.takes_by_ref = 0
        r._next_seq = lambda: 0  # type: ignore[method-assign]  # the BPF counters map: none here
        r._prod_mm = self.buf  # type: ignore[assignment]  # unpack_from reads it like the mmap
        r._cons = ctypes.c_uint64(self.cons)
        r._data_addr = ctypes.addressof(self.buf) + PAGE
        r._data = np.frombuffer(memoryview(self.buf).cast("B"), np.uint8, offset=PAGE)
        r._size = SIZE
        r._page = PAGE
        r.python_walk = python
        return r


def _payload(size: int, i: int) -> bytes:
    return bytes((i * 7 + j) % 251 for j in range(size))


def _fill(ring: FakeRing, n: int) -> list[bytes]:
    want = []
    for i in range(n):
        size = (48, 200, 1000)[i % 3]
        p = _payload(size, i)
        ring.put(p, discard=i % 11 == 5)
        if i % 11 != 5:
            want.append(p)
    return want


def _records(out: dict[int, np.ndarray]) -> dict[int, list[bytes]]:
    return {size: [bytes(buf[k : k + size]) for k in range(0, len(buf), size)] for size, buf in out.items()}


needs_c = pytest.mark.skipif(
    bl._ring_walk is None, reason="libringwalk.so not built (sparseety_prof/native/build.sh)"
)


@needs_c
@pytest.mark.parametrize("start", [0, SIZE - 24, 5 * SIZE - 1000])  # wrap-around inside the first records
def test_c_and_python_walks_read_the_same_records(start: int) -> None:
    results = []
    for python in (True, False):
        ring = FakeRing(start)
        want = _fill(ring, 120)
        r = ring.reader(python=python, sizes=(48,))  # 200 and 1000 are met on the way
        backlog: list[float] = []
        r.CHECK_EVERY = 16
        got = _records(r.take(backlog.append))
        flat = sorted(p for recs in got.values() for p in recs)
        assert flat == sorted(want)
        assert r._cons.value == ring.prod  # everything handed back
        assert len(backlog) >= 1 + 120 // 16 - 1  # told the backlog every CHECK_EVERY records
        results.append(got)
    assert results[0] == results[1]


@needs_c
def test_arena_growth_keeps_earlier_records() -> None:
    ring = FakeRing()
    want = [_payload(1000, i) for i in range(60)]  # beyond an arena's first 64 KiB
    for p in want:
        ring.put(p)
    r = ring.reader(python=False, sizes=(1000,))
    assert _records(r.take())[1000] == want


@pytest.mark.parametrize("python", [True, False])
def test_walk_stops_at_a_busy_record_and_resumes(python: bool) -> None:
    if not python and bl._ring_walk is None:
        pytest.skip("libringwalk.so not built")
    ring = FakeRing()
    ring.put(_payload(48, 1))
    busy_at = ring.prod
    ring.put(_payload(48, 2), busy=True)  # reserved, not submitted yet
    r = ring.reader(python=python, sizes=(48,))
    assert _records(r.take()) == {48: [_payload(48, 1)]}
    assert r._cons.value == busy_at  # not past the busy record
    # the producer submits it: clear the busy bit in both mappings
    for base in (PAGE + busy_at, PAGE + SIZE + busy_at):
        struct.pack_into("<I", ring.buf, base, 48)
    assert _records(r.take()) == {48: [_payload(48, 2)]}
    assert r._cons.value == ring.prod
    assert r.take() == {}


REF = 1000  # the record size standing for the logits records below


@pytest.mark.parametrize("python", [True, False])
@pytest.mark.parametrize("start", [0, SIZE - 600])  # a referenced record across the end of the first mapping
def test_logits_records_are_taken_by_reference_and_handed_back_on_release(python: bool, start: int) -> None:
    if not python and bl._ring_walk is None:
        pytest.skip("libringwalk.so not built")
    ring = FakeRing(start)
    want = _fill(ring, 30)
    r = ring.reader(python=python, sizes=(48, 200), ref_size=REF)
    out = r.take()
    assert REF not in out  # the big records are not copied...
    refs = out[ev.LOGITS_REF].view(ev.LOGITS_REF_DTYPE)
    head = ev.LOGITS_HEAD_BYTES
    big = [p for p in want if len(p) == REF]
    assert len(refs) == len(big) > 0
    data = r.data
    for ref, p in zip(refs, big, strict=True):
        assert bytes(ref.tobytes()[:head]) == p[:head]  # ...their header fields are
        at = int(ref["at"])
        assert bytes(data[at : at + REF - head]) == p[head:]  # and the rest is where the offset says
    copied = _records({size: buf for size, buf in out.items() if size != ev.LOGITS_REF})
    assert sorted(p for recs in copied.values() for p in recs) == sorted(p for p in want if len(p) != REF)
    assert r._cons.value == start  # held while the floats are read
    # the ring bytes drained, the referenced records' whole (the consumer paces its drains on them)
    assert r.last_take_bytes == ring.prod - start
    assert (r.takes, r.takes_by_ref) == (1, 1)
    r.release()
    assert r._cons.value == ring.prod
    r.release()  # idempotent
    assert r._cons.value == ring.prod


@pytest.mark.parametrize("python", [True, False])
def test_a_filling_ring_has_its_logits_records_copied_and_space_handed_back_at_once(python: bool) -> None:
    if not python and bl._ring_walk is None:
        pytest.skip("libringwalk.so not built")
    ring = FakeRing()
    want = _fill(ring, 3 * int(SIZE * bl.RingReader.REF_MAX_SHARE / 400))  # past REF_MAX_SHARE
    assert (ring.prod - ring.cons) / SIZE >= bl.RingReader.REF_MAX_SHARE
    r = ring.reader(python=python, sizes=(48, 200), ref_size=REF)
    out = r.take()
    assert ev.LOGITS_REF not in out
    assert sorted(p for recs in _records(out).values() for p in recs) == sorted(want)
    assert r._cons.value == ring.prod  # handed back by the walk itself
    assert r.last_take_bytes == ring.prod
    ring.put(_payload(REF, 1))
    at = ring.prod
    assert ev.LOGITS_REF in r.take()  # drained: by reference again
    assert r.last_take_bytes == 8 + REF == at - r._cons.value  # (header and payload, still held)
    assert (r.takes, r.takes_by_ref) == (2, 1)
    assert r.take() == {} and (r.takes, r.last_take_bytes) == (2, 0)  # an empty take counts nothing


def test_referenced_and_copied_logits_decode_alike() -> None:
    """decode_groups makes copied logits records references into their own bytes: the
    correlator reads both the same way (EventBatch.logits_vals)."""
    chunk = 1024
    dt = ev.logits_dtype(chunk)
    recs = np.zeros(3, dt)
    recs["kind"] = ev.EV_LOGITS
    recs["chunk"] = [0, 1, 2]
    recs["n_vals"] = [chunk, chunk, 7]
    recs["vals"] = np.arange(3 * chunk, dtype=np.float32).reshape(3, chunk)
    raw = recs.view(np.uint8).reshape(-1)
    copied = ev.decode_groups({dt.itemsize: raw}, chunk)
    # the same records in a "ring", taken by reference: header, then the offset of the floats
    refs = np.zeros(3, ev.LOGITS_REF_DTYPE)
    for name in ev.LOGITS_REF_DTYPE.names or ():
        if name != "at":
            refs[name] = recs[name]
    refs["at"] = np.arange(3) * dt.itemsize + ev.LOGITS_HEAD_BYTES
    by_ref = ev.decode_groups({ev.LOGITS_REF: refs.view(np.uint8)}, chunk, ring_data=raw)
    for b in (copied, by_ref):
        assert b.logits["chunk"].tolist() == [0, 1, 2]
        for i in range(3):
            vals = b.logits_vals(i)
            assert isinstance(vals, np.ndarray) and np.array_equal(vals, recs["vals"][i])
    with pytest.raises(ValueError, match="no ring memory"):
        ev.decode_groups({ev.LOGITS_REF: refs.view(np.uint8)}, chunk)


def test_stop_with_a_view_of_the_ring_still_alive_leaves_the_mapping_to_the_view() -> None:
    """An error raised while a drain was handled keeps that drain's logits views alive in its
    traceback: stop() must not fail there (mmap refuses to unmap under a view), which would hide
    the error and its exit code."""
    ring = FakeRing()
    r = ring.reader(python=True, sizes=(48,), ref_size=REF)
    cons_mm = mmap.mmap(-1, PAGE)
    prod_mm = mmap.mmap(-1, PAGE + 2 * SIZE)
    prod_mm[: PAGE + 2 * SIZE] = bytes(ring.buf)
    r._cons_mm, r._prod_mm = cons_mm, prod_mm
    r._cons = ctypes.c_uint64.from_buffer(cons_mm)
    r._data = np.frombuffer(prod_mm, np.uint8, offset=PAGE)
    r._data_addr = r._data.ctypes.data
    view = r.data[:16]  # the last drain's rows, still referenced
    assert r.stop() == {}
    assert cons_mm.closed and not prod_mm.closed  # unmapped once the view goes
    assert bytes(view) == bytes(16)
    del view
    prod_mm.close()


@pytest.mark.parametrize("python", [True, False])
def test_logits_records_are_copied_where_they_are_a_small_share_of_the_bytes(python: bool) -> None:
    """A small vocabulary at a high token rate: holding the whole drain for the few logits bytes
    is not worth it (the next drain copies them, and hands its space back at once)."""
    if not python and bl._ring_walk is None:
        pytest.skip("libringwalk.so not built")
    ring = FakeRing()
    for i in range(20):
        ring.put(_payload(200, i))  # other records
        if i % 10 == 0:
            ring.put(_payload(REF, i))
    r = ring.reader(python=python, sizes=(48, 200), ref_size=REF)
    assert ev.LOGITS_REF in r.take()  # the first drain, as the last one's share said
    r.release()
    assert r._logits_share < bl.RingReader.REF_MIN_LOGITS  # 2 x 1000 B of 6,000 B
    ring.put(_payload(REF, 99))
    out = r.take()
    assert ev.LOGITS_REF not in out and REF in out
    assert r._cons.value == ring.prod  # nothing held


@pytest.mark.parametrize("python", [True, False])
def test_a_ring_handled_quickly_is_held_past_the_unmeasured_share(python: bool) -> None:
    """Once drains have been handled quickly, one that starts with more than REF_MAX_SHARE
    pending still reads its logits records in the ring (ring_hold.py): what the producers add
    while it is handled is small."""
    if not python and bl._ring_walk is None:
        pytest.skip("libringwalk.so not built")
    ring = FakeRing()
    r = ring.reader(python=python, sizes=(48, 200), ref_size=REF)
    now = time.monotonic()
    r._hold.taken(now - 1.0)
    r._hold.released(now - 0.999)  # a drain handled in 1 ms, a second ago
    want = _fill(ring, 54)  # 18 x (56 + 208 + 1,008) bytes: 35% of the ring
    pending = (ring.prod - r._cons.value) / SIZE
    assert bl.RingReader.REF_MAX_SHARE <= pending < RingHold.MAX_HELD - 0.05
    out = r.take()
    assert ev.LOGITS_REF in out  # held, past the share the fixed rule stopped at
    assert len(out[ev.LOGITS_REF].view(ev.LOGITS_REF_DTYPE)) == sum(len(p) == REF for p in want)
    assert r._cons.value == 0 < ring.prod  # the space held until release
    r.release()
    assert r._cons.value == ring.prod
