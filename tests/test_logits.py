"""Logits statistics, both backends (C in sparseety_prof/native, numpy), against a plain float64
reference."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from sparseety_prof.correlate import logits
from sparseety_prof.correlate.logits import RowStats, row_stats, top_k
from sparseety_prof.store.schema import TOP_K

ROOT = Path(__file__).resolve().parent.parent
BUILD_SH = ROOT / "sparseety_prof" / "native" / "build.sh"
TOL = 1e-5

Backend = Callable[[np.ndarray, np.ndarray], RowStats]


def _reference(row: np.ndarray, tok: int) -> tuple[float, list[int], float]:
    x = row.astype(np.float64)
    lp = x - x.max() - np.log(np.exp(x - x.max()).sum())
    order = sorted(range(len(x)), key=lambda i: (-lp[i], i))[:5]
    return float(lp[tok]), order, float(-(np.exp(lp) * lp).sum())


def _reference64(row: np.ndarray, tok: int) -> tuple[float, np.ndarray, np.ndarray, float]:
    """(log_prob, top ids, top log-probs, entropy) in float64 from the float32 row. Top ids: value
    descending, id ascending on ties; -inf entries have probability 0 and log-prob -inf."""
    x = row.astype(np.float64)
    m = x.max()
    z = x - m
    lse = np.log(np.exp(z).sum())
    lp = z - lse
    k = min(TOP_K, len(x))
    top = np.lexsort((np.arange(len(x)), -x))[:k]
    p = np.exp(lp)
    ent = float(-(p[p > 0] * lp[p > 0]).sum())
    lp_tok = float(lp[tok]) if 0 <= tok < len(x) else float("nan")
    return lp_tok, top, lp[top], ent


def _close(a: np.ndarray | float, b: np.ndarray | float, tol: float = TOL) -> bool:
    """Within tol, where equal infinities and NaNs count as equal."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    same = (a == b) | (np.isnan(a) & np.isnan(b))
    with np.errstate(invalid="ignore"):  # inf - inf
        return bool(np.all(same | (np.abs(a - b) <= tol)))


def _check(st: RowStats, rows: np.ndarray, toks: np.ndarray, what: str) -> None:
    for i, row in enumerate(rows):
        lp, top, top_lp, ent = _reference64(row, int(toks[i]))
        tag = f"{what} row {i} (width {rows.shape[1]})"
        assert _close(st.log_prob[i], lp), f"{tag}: log_prob {st.log_prob[i]} vs {lp}"
        assert st.top_ids[i].tolist() == top.tolist(), f"{tag}: top ids {st.top_ids[i]} vs {top}"
        assert _close(st.top_log_probs[i], top_lp), f"{tag}: top lp {st.top_log_probs[i]} vs {top_lp}"
        assert _close(st.entropy[i], ent), f"{tag}: entropy {st.entropy[i]} vs {ent}"


@pytest.fixture(scope="session")
def fresh_lib(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    """The C library built from the current source into a temporary directory (about a second),
    so these tests check rowstats.c as it is, whether or not the in-tree build is current."""
    assert shutil.which("gcc"), "gcc is part of the set-up (scripts/setup.sh installs it)"
    out = tmp_path_factory.mktemp("rowstats")
    subprocess.run(["bash", str(BUILD_SH), str(out)], check=True, capture_output=True)
    lib = logits._load_library(out / "librowstats.so")
    assert lib is not None, "the freshly built librowstats.so did not load"
    return lib


def _levels(lib: ctypes.CDLL) -> list[int]:
    """The instruction-set levels this CPU can run: the best one, and every one below it."""
    best = int(lib.sparseety_rowstats_level())
    return [lvl for lvl in (4, 3, 1) if lvl <= best]


@pytest.fixture(params=["numpy", "c4", "c3", "c1"])
def backend(request: pytest.FixtureRequest) -> Backend:
    name: str = request.param
    if name == "numpy":
        return lambda rows, toks: logits._row_stats_numpy(rows, toks)
    lib = request.getfixturevalue("fresh_lib")
    level = int(name[1:])
    if level not in _levels(lib):
        # a CPU without AVX-512 / AVX2 cannot run that level's code at all: test the levels it has
        level = max(_levels(lib))
    return lambda rows, toks: logits._row_stats_c(lib, rows, toks, level=level)


# ---------------------------------------------------------------- both backends, every shape


@pytest.mark.parametrize(
    "width", [1, 2, 3, 5, 6, 7, 15, 63, 64, 65, 255, 256, 257, 1023, 1025, 4099, 32000, 152064]
)
def test_random_rows_match_float64_reference(backend: Backend, width: int) -> None:
    rng = np.random.default_rng(width)
    rows = np.stack(
        [
            rng.standard_normal(width) * 3,  # broad
            rng.standard_normal(width) * 40,  # very peaky: most terms underflow
            rng.uniform(-30, 5, width),
        ]
    ).astype(np.float32)
    toks = rng.integers(0, width, len(rows))
    before = rows.copy()
    _check(backend(rows, toks), rows, toks, "random")
    assert np.array_equal(rows, before), "row_stats without overwrite changed its input"


def test_many_rows_in_one_block(backend: Backend) -> None:
    rng = np.random.default_rng(7)
    rows = (rng.standard_normal((37, 3001)) * rng.uniform(0.5, 20, (37, 1))).astype(np.float32)
    toks = rng.integers(0, 3001, 37)
    _check(backend(rows, toks), rows, toks, "block")


@pytest.mark.parametrize("width", [7, 300, 32000])
def test_masked_tokens(backend: Backend, width: int) -> None:
    rng = np.random.default_rng(11)
    half = (rng.standard_normal(width) * 3).astype(np.float32)
    half[rng.random(width) < 0.5] = -np.inf
    half[1] = -np.inf  # the chosen token below is masked: log-prob -inf
    only = np.full(width, -np.inf, np.float32)
    only[width // 2] = 2.5  # everything masked but the chosen token
    first = np.full(width, -np.inf, np.float32)
    first[0] = -3.0
    rows = np.stack([half, only, first])
    toks = np.array([1, width // 2, 0])
    st = backend(rows, toks)
    _check(st, rows, toks, "masked")
    assert st.log_prob[0] == -np.inf
    assert st.log_prob[1] == 0.0 and abs(st.entropy[1]) < 1e-12
    assert st.top_ids[1].tolist() == [width // 2, *[i for i in range(6) if i != width // 2][:4]]
    assert not np.isnan(st.entropy).any() and not np.isnan(st.top_log_probs).any()


@pytest.mark.parametrize("width", [1, 4, 5, 9, 257, 32000, 32001])
def test_all_equal_rows_tie_to_lowest_ids(backend: Backend, width: int) -> None:
    rows = np.stack([np.zeros(width), np.full(width, 7.5), np.full(width, -1e4)]).astype(np.float32)
    toks = np.array([0, width - 1, width // 2])
    st = backend(rows, toks)
    _check(st, rows, toks, "equal")
    k = min(TOP_K, width)
    assert (st.top_ids == np.arange(k)).all()
    assert np.allclose(st.entropy, np.log(width), atol=TOL, rtol=0)
    assert np.allclose(st.log_prob, -np.log(width), atol=TOL, rtol=0)


@pytest.mark.parametrize("width", [33, 4097, 152064])
def test_huge_and_tiny_magnitudes(backend: Backend, width: int) -> None:
    rng = np.random.default_rng(5)
    n = rng.standard_normal(width)
    sub = rng.uniform(-110, -80, width)  # exp(z) in and around float32's subnormal range
    sub[3] = 0.0
    sub[width - 1] = -86.5
    rows = np.stack(
        [
            1e4 + n * 3,
            -1e4 + n * 3,
            n * 1e4,  # one token takes it all
            sub,
            n * 1e-30,  # all but equal: a uniform distribution, order from the tiny differences
            np.where(n > 0, 3e4, -3e4),  # two values far apart, many ties
        ]
    ).astype(np.float32)
    toks = rng.integers(0, width, len(rows))
    toks[3] = width - 1
    _check(backend(rows, toks), rows, toks, "magnitudes")


def test_out_of_range_tokens_give_nan(backend: Backend) -> None:
    rows = np.random.default_rng(1).standard_normal((4, 10)).astype(np.float32)
    toks = np.array([-1, 10, 1 << 40, 9])
    st = backend(rows, toks)
    assert np.isnan(st.log_prob[:3]).all() and not np.isnan(st.log_prob[3])
    assert not np.isnan(st.entropy).any() and not np.isnan(st.top_log_probs).any()


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy's inf - inf
def test_rows_without_a_distribution_give_nan(backend: Backend) -> None:
    rows = np.zeros((3, 100), np.float32)
    rows[0, :] = -np.inf
    rows[1, 40] = np.nan
    rows[2, 7] = np.inf
    st = backend(rows, np.array([0, 1, 7]))
    assert np.isnan(st.log_prob).all() and np.isnan(st.entropy).all()


def test_empty_block_and_other_dtypes(backend: Backend) -> None:
    st = backend(np.zeros((0, 50), np.float32), np.zeros(0, np.int64))
    assert st.log_prob.shape == (0,) and st.top_ids.shape == (0, TOP_K)
    rng = np.random.default_rng(2)
    wide = rng.standard_normal((3, 2000)) * 4  # float64, and a strided view of it
    toks = np.array([5, 6, 7], np.int32)
    view = wide[:, ::2]
    _check(backend(view, toks), view.astype(np.float32), toks, "strided float64")
    one = backend(wide[0].astype(np.float32), np.array(5))  # a single 1-d row
    assert one.top_ids.shape == (1, TOP_K)


@pytest.mark.parametrize("width", [300, 4099, 32000])
def test_maximum_met_late_or_rising(backend: Backend, width: int) -> None:
    """The C pass sums exp terms relative to the largest value met so far and moves the sums when
    a later block holds a larger one: rows whose maximum keeps rising, comes after many blocks,
    sits in the last partial block or among the first entries, or follows masked blocks."""
    rng = np.random.default_rng(width)
    noise = rng.standard_normal(width)
    rising = np.linspace(-60.0, 40.0, width)  # a new maximum in every block
    late = noise * 3
    late[width - width // 7] = 30.0  # after many blocks, then more blocks below it
    tail = noise * 3
    tail[width - 2] = 25.0  # in the entries past the last whole block
    seed = noise * 3
    seed[1] = 25.0  # among the first k entries, which the blocks do not cover
    masked = noise * 3
    masked[: min(width - 10, 700)] = -np.inf  # blocks of -inf before the first finite value
    steps = np.repeat(np.arange(width // 50 + 1) * 3.0, 50)[:width] + noise  # rises in steps
    rows = np.stack([rising, late, tail, seed, masked, steps]).astype(np.float32)
    toks = np.array([width - 1, width - width // 7, 0, 1, width - 5, width // 2])
    _check(backend(rows, toks), rows, toks, "late maximum")


# ---------------------------------------------------------------- dispatch and fallback


def test_backend_reports_what_row_stats_uses() -> None:
    assert logits.BACKEND in ("c", "numpy")
    assert (logits._lib is not None) == (logits.BACKEND == "c")
    assert (logits.native_level() is None) == (logits.BACKEND == "numpy")


def test_row_stats_uses_the_c_library_when_loaded(
    fresh_lib: ctypes.CDLL, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(4)
    rows = (rng.standard_normal((5, 32000)) * 3).astype(np.float32)
    toks = rng.integers(0, 32000, 5)
    monkeypatch.setattr(logits, "_lib", fresh_lib)
    c = row_stats(rows.copy(), toks, overwrite=True)
    monkeypatch.setattr(logits, "_lib", None)
    py = row_stats(rows.copy(), toks, overwrite=True)
    assert np.array_equal(c.top_ids, py.top_ids)
    for a, b in ((c.log_prob, py.log_prob), (c.top_log_probs, py.top_log_probs), (c.entropy, py.entropy)):
        assert np.abs(a - b).max() < 2 * TOL
    _check(c, rows, toks, "row_stats/c")
    _check(py, rows, toks, "row_stats/numpy")


def test_rows_read_where_they_lie_equal_the_contiguous_block(
    fresh_lib: ctypes.CDLL, monkeypatch: pytest.MonkeyPatch
) -> None:
    """row_stats_at (the consumer's path: rows inside drained records, at any addresses) gives
    exactly what row_stats gives for the same rows in one block."""
    rng = np.random.default_rng(5)
    rows = (rng.standard_normal((4, 32000)) * 3).astype(np.float32)
    toks = rng.integers(0, 32000, 4)
    monkeypatch.setattr(logits, "_lib", fresh_lib)
    # the rows as logits records lay them out: a header before each, records back to back
    records = np.zeros((4, 32768 + 12), dtype=np.float32)
    records[:, 12 : 12 + 32000] = rows
    order = [2, 0, 3, 1]  # addresses in any order
    addresses = np.array([records[i, 12:].ctypes.data for i in order], dtype=np.int64)
    at = logits.row_stats_at(addresses, 32000, toks[order])
    block = row_stats(rows[order].copy(), toks[order])
    for a, b in (
        (at.log_prob, block.log_prob),
        (at.top_log_probs, block.top_log_probs),
        (at.entropy, block.entropy),
    ):
        assert np.array_equal(a, b)
    assert np.array_equal(at.top_ids, block.top_ids)
    with pytest.raises(ValueError, match="rows"):
        logits.row_stats_at(addresses, 32000, toks[:2])


def test_missing_or_broken_library_is_not_loaded(tmp_path: Path) -> None:
    assert logits._load_library(tmp_path / "librowstats.so") is None
    junk = tmp_path / "junk.so"
    junk.write_bytes(b"not an ELF file")
    assert logits._load_library(junk) is None


def test_numpy_fallback_when_the_library_is_absent(tmp_path: Path) -> None:
    """A copy of the module with no native/build next to it: it imports, says numpy, and is right."""
    pkg = tmp_path / "sparseety_prof"
    for name in ("correlate/logits.py", "store/schema.py", "capture/resources.py"):
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        for init in (pkg / "__init__.py", (pkg / name).parent / "__init__.py"):
            init.write_text("")
        shutil.copy(ROOT / "sparseety_prof" / name, pkg / name)
    script = textwrap.dedent(
        """
        import sys
        import numpy as np
        from sparseety_prof.correlate import logits
        assert logits.__file__.startswith(sys.argv[1]), logits.__file__
        rng = np.random.default_rng(9)
        rows = (rng.standard_normal((3, 32000)) * 3).astype(np.float32)
        st = logits.row_stats(rows, np.array([1, 2, 3]))
        np.savez(sys.argv[2], lp=st.log_prob, top=st.top_ids, tlp=st.top_log_probs, ent=st.entropy, rows=rows)
        print(logits.BACKEND, logits.native_level())
        """
    )
    argv = [sys.executable, "-c", script, str(pkg), str(tmp_path / "out.npz")]
    res = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["numpy", "None"]
    out = np.load(tmp_path / "out.npz")
    st = RowStats(out["lp"], out["top"], out["tlp"], out["ent"])
    _check(st, out["rows"], np.array([1, 2, 3]), "fallback")


# ---------------------------------------------------------------- the public API, as before


def test_matches_reference_on_wide_and_peaky_rows() -> None:
    rng = np.random.default_rng(3)
    rows = np.stack(
        [
            rng.standard_normal(32000).astype(np.float32) * 3,  # broad
            rng.standard_normal(32000).astype(np.float32) * 40,  # very peaky: most terms underflow
            np.zeros(32000, np.float32),  # uniform: ties everywhere
        ]
    )
    toks = np.array([17, 31999, 5])
    st = row_stats(rows, toks)
    for i, row in enumerate(rows):
        lp, top, ent = _reference(row, int(toks[i]))
        assert abs(st.log_prob[i] - lp) < 1e-5
        assert st.top_ids[i].tolist() == top
        assert abs(st.entropy[i] - ent) < 1e-4
        assert np.allclose(
            st.top_log_probs[i],
            [
                lp_
                for lp_ in (
                    row.astype(np.float64)
                    - row.max()
                    - np.log(np.exp(row.astype(np.float64) - row.max()).sum())
                )[top]
            ],
            atol=1e-5,
        )


def test_out_of_range_token_gives_nan_not_garbage() -> None:
    st = row_stats(np.zeros((1, 10), np.float32), np.array([10]))
    assert np.isnan(st.log_prob[0])


def test_top_k_does_not_touch_its_input_unless_asked() -> None:
    rows = np.array([[1.0, 3.0, 2.0]], np.float32)
    assert top_k(rows, 2).tolist() == [[1, 2]]
    assert rows.tolist() == [[1.0, 3.0, 2.0]]


def test_top_k_past_the_masked_entries() -> None:
    rows = np.array([[-np.inf, 2.0, -np.inf, -np.inf, 1.0, -np.inf]], np.float32)
    assert top_k(rows, 5).tolist() == [[1, 4, 0, 2, 3]]
