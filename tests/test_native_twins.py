"""Each C helper of sparseety_prof/native and its Python twin, the reference it must equal, on
many random inputs from a seeded generator: one property test per pair, instead of hand-picked
cases kept equal by hand.

- rowstats.c (logits._row_stats_c, at every instruction-set level this CPU runs) and numpy's
  logits._row_stats_numpy: the same top ids and the same NaNs and infinities, and log-probs and
  entropies within float32 summation error (the two sum in different orders: no implementation
  of a float sum in another order is bit-equal, so this is the contract).
- ringwalk.c (RingReader._walk_c) and RingReader._walk_python: the same records, bytes for
  bytes, by size and by reference, and the same consumer position.
- ringwatch.c's follow rule (sparseety_watch_follow) and ring_watch.FollowRule: the same
  decisions (follow the ring or sleep, the wait before the next reading) after every reading of
  random runs of wakeups, timed readings, escalations and rearms.

The C side is built from the current sources into a temporary folder (build.sh, about a second
each), so these check the sources as they are, whether or not the in-tree build is current.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from test_ring_walk import SIZE, FakeRing

from sparseety_prof.capture import bpf_loader as bl
from sparseety_prof.capture import events as ev
from sparseety_prof.correlate import logits
from sparseety_prof.session.ring_watch import FollowRule

ROOT = Path(__file__).resolve().parent.parent
BUILD_SH = ROOT / "sparseety_prof" / "native" / "build.sh"
CASES = 200  # random cases per pair


@pytest.fixture(scope="module")
def native_build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The three libraries built from the current sources."""
    assert shutil.which("gcc"), "gcc is part of the set-up (scripts/setup.sh installs it)"
    out = tmp_path_factory.mktemp("native")
    subprocess.run(["bash", str(BUILD_SH), str(out)], check=True, capture_output=True, timeout=300)
    return out


# ---------------------------------------------------------------- rowstats.c and numpy

#: log-probs and entropies: float32 sums in another order (numpy pairwise, C sequential by lanes)
ROWSTATS_TOL = 2e-5


def _random_rows(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """A block of logits rows as engines make them, and odder ones: broad and peaky rows, ties,
    masked (-inf) entries, rows without a distribution, huge magnitudes; tokens in and out of
    range."""
    n = int(rng.integers(1, 9))
    width = int(rng.choice([1, 2, 3, 7, 16, 63, 64, 65, 255, 257, 1000, 4099, int(rng.integers(1, 40000))]))
    kind = int(rng.integers(0, 6))
    if kind == 0:
        rows = rng.standard_normal((n, width)) * rng.uniform(0.1, 40)
    elif kind == 1:  # ties: few distinct values
        rows = rng.integers(-3, 3, (n, width)).astype(np.float64)
    elif kind == 2:  # huge and tiny magnitudes
        rows = rng.standard_normal((n, width)) * 10.0 ** rng.uniform(-6, 30)
    else:
        rows = rng.uniform(-30, 5, (n, width))
    rows = rows.astype(np.float32)
    if kind >= 4:  # masked entries; now and then a whole row (no distribution: NaN)
        rows[rng.random((n, width)) < rng.uniform(0, 1)] = -np.inf
        if rng.random() < 0.2:
            rows[int(rng.integers(0, n))] = -np.inf
    toks = rng.integers(-2, width + 2, n)
    return rows, toks


def _same_stats(c: logits.RowStats, py: logits.RowStats, tag: str) -> None:
    assert np.array_equal(c.top_ids, py.top_ids), f"{tag}: top ids"
    for name in ("log_prob", "top_log_probs", "entropy"):
        a, b = getattr(c, name), getattr(py, name)
        assert a.shape == b.shape, f"{tag}: {name} shape"
        assert np.array_equal(np.isnan(a), np.isnan(b)), f"{tag}: {name} NaNs"
        inf_a, inf_b = np.where(np.isinf(a), np.sign(a), 0), np.where(np.isinf(b), np.sign(b), 0)
        assert np.array_equal(inf_a, inf_b), f"{tag}: {name} infinities"
        finite = np.isfinite(a) & np.isfinite(b)
        assert np.all(np.abs(a[finite] - b[finite]) <= ROWSTATS_TOL), f"{tag}: {name} {a} vs {b}"


def test_rowstats_equals_numpy(native_build: Path) -> None:
    lib = logits._load_library(native_build / "librowstats.so")
    assert lib is not None, "the freshly built librowstats.so did not load"
    best = int(lib.sparseety_rowstats_level())
    levels = [lvl for lvl in (4, 3, 1) if lvl <= best]
    rng = np.random.default_rng(20261207)
    for case in range(CASES):
        rows, toks = _random_rows(rng)
        before = rows.copy()
        with np.errstate(invalid="ignore", over="ignore"):  # (rows without a distribution: NaN)
            want = logits._row_stats_numpy(rows, toks)
        for level in levels:
            got = logits._row_stats_c(lib, rows, toks, level=level)
            _same_stats(got, want, f"case {case} level {level} ({rows.shape})")
        assert np.array_equal(rows, before, equal_nan=True), f"case {case}: the rows were changed"


# ---------------------------------------------------------------- ringwalk.c and the Python walk


def _random_ring(rng: np.random.Generator) -> tuple[FakeRing, dict[str, object]]:
    """A ring holding random records from a random position (wrapping anywhere): sizes known in
    advance or met on the way, discarded records, now and then a busy one; and how the reader
    is set up (its known sizes, the size taken by reference, its check interval)."""
    start = int(rng.choice([0, int(rng.integers(0, 8 * SIZE)), SIZE - 8 * int(rng.integers(1, 200))]))
    ring = FakeRing(start)
    sizes = sorted({int(s) for s in rng.choice([8, 24, 48, 200, 1000, 1004, 3000], int(rng.integers(1, 5)))})
    ref_size = int(rng.choice([-1, *sizes]))
    budget = int(rng.integers(0, SIZE // 2))  # bytes of records: past REF_MAX_SHARE or not
    busy_at = int(rng.integers(0, 60)) if rng.random() < 0.3 else -1
    k = 0
    while ring.prod - start < budget:
        size = int(rng.choice(sizes))
        payload = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        ring.put(payload, busy=k == busy_at, discard=rng.random() < 0.1)
        k += 1
    known = tuple(int(s) for s in sizes if rng.random() < 0.5)
    return ring, {"sizes": known, "ref_size": ref_size, "check_every": int(rng.choice([1, 3, 16, 256]))}


def _walk(ring_bytes: bytes, start: int, prod: int, setup: dict[str, object], python: bool) -> list[object]:
    """Everything a take() leaves from a copy of the ring: the records by size (refs included),
    the consumer position (held, then after release), the counters. (Not where the backlog is
    read: every CHECK_EVERY records counted from the pass's start in Python, from each call's
    in C, which ends a call at a size met first or an arena to grow.)"""
    ring = FakeRing(start)
    ctypes.memmove(ring.buf, ring_bytes, len(ring_bytes))
    ring.prod = prod
    sizes = setup["sizes"]
    ref_size = setup["ref_size"]
    assert isinstance(sizes, tuple) and isinstance(ref_size, int)
    r = ring.reader(python=python, sizes=sizes, ref_size=ref_size)
    r.CHECK_EVERY = int(str(setup["check_every"]))
    out = r.take(lambda share: None)
    got = {size: bytes(buf) for size, buf in out.items()}
    held = r._cons.value
    r.release()
    return [got, held, r._cons.value, r.last_take_bytes, r.takes, r.takes_by_ref]


def test_ringwalk_equals_the_python_walk(native_build: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    walk = bl._load_walk(native_build / "libringwalk.so")
    assert walk is not None, "the freshly built libringwalk.so did not load"
    monkeypatch.setattr(bl, "_ring_walk", walk)
    rng = np.random.default_rng(7122026)
    by_ref = busy = 0
    for case in range(CASES):
        ring, setup = _random_ring(rng)
        raw = bytes(ring.buf)
        got = _walk(raw, ring.cons, ring.prod, setup, python=False)
        want = _walk(raw, ring.cons, ring.prod, setup, python=True)
        assert got == want, f"case {case}: {setup}"
        by_ref += ev.LOGITS_REF in want[0]  # type: ignore[operator]
        busy += want[2] != ring.prod
    assert by_ref > CASES // 10 and busy > CASES // 10  # both paths of the walk were met


# ---------------------------------------------------------------- ringwatch.c's follow rule


class _Follow(ctypes.Structure):
    """struct sparseety_follow (ringwatch.c)."""

    _fields_ = [
        ("following", ctypes.c_int),
        ("arms_seen", ctypes.c_uint64),
        ("wait_ms", ctypes.c_int),
        ("last", ctypes.c_double),
    ]


def test_ringwatch_follows_the_ring_as_the_python_watch(native_build: Path) -> None:
    lib = ctypes.CDLL(str(native_build / "libringwatch.so"))
    follow = lib.sparseety_watch_follow
    follow.argtypes = [ctypes.POINTER(_Follow), ctypes.c_int, ctypes.c_int, ctypes.c_uint64, ctypes.c_double]
    follow.restype = None
    rng = np.random.default_rng(1207)
    seen: set[tuple[bool, int]] = set()
    for case in range(CASES):
        c, py = _Follow(wait_ms=round(FollowRule().wait * 1000)), FollowRule()
        arms, share = 0, 0.0
        for step in range(int(rng.integers(1, 60))):
            # a reading: a producer's wakeup (any time) or the timer's (while following); the
            # consumer drained and rearmed meanwhile, or not; the share moved by a little or a lot
            woke = not py.following or rng.random() < 0.2
            arms += int(rng.random() < 0.15)
            share = float(np.clip(share + rng.choice([0.0, 0.01, 0.049, 0.05, 0.2, -0.3]), 0.0, 1.0))
            escalated = rng.random() < 0.1
            follow(ctypes.byref(c), woke, escalated, arms, share)
            py.reading(woke, escalated, arms, share)
            got = (bool(c.following), c.wait_ms, c.last, c.arms_seen if c.following else None)
            want = (py.following, round(py.wait * 1000), py.last, py.arms_seen if py.following else None)
            assert got == want, f"case {case} step {step}"
            seen.add((py.following, got[1]))
    # every wait of the doubling was met, while following
    assert {w for f, w in seen if f} == {20, 40, 80, 160, 250}
