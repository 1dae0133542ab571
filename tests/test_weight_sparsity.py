"""Static weight sparsity (sparseety_prof.capture.weight_sparsity) and the tensor directory it reads
(gguf_info.read_tensor_infos), on small GGUF files written here with gguf.GGUFWriter.

Expected zero counts are built into the data; every file is also cross-checked against gguf-py's
own reader and dequantiser, which the module itself does not use.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from sparseety_prof.capture import weight_sparsity as ws
from sparseety_prof.capture.gguf_info import GGML_TYPES, read_tensor_infos
from sparseety_prof.errors import ProfError, UsageError

Q = gguf.GGMLQuantizationType
ROWS, NE0 = 8, 64  # every tensor: 8 rows of 64 values (two Q8_0/Q4_0 blocks per row)
FAKE_SHA = "ab" * 32


# ------------------------------------------------------------------ data with known zeros
def magnitudes(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Non-zero values in ±[1, 2): no value of a block is below half its largest, so neither Q8_0
    (|q| >= 63) nor Q4_0 (|nibble - 8| >= 4) can round one to zero."""
    signs = rng.choice(np.array([-1.0, 1.0], dtype=np.float32), size=shape)
    return (signs * rng.uniform(1.0, 2.0, size=shape)).astype(np.float32)


def keep_mask(kind: str, rng: np.random.Generator) -> np.ndarray:
    """Which values stay non-zero, per pattern (shape ROWS x NE0)."""
    if kind == "none":
        return np.ones((ROWS, NE0), dtype=bool)
    if kind in ("2:4", "1:4"):
        n = int(kind[0])
        groups = np.zeros((ROWS * NE0 // 4, 4), dtype=bool)
        for g in groups:  # a different choice of kept positions in every group
            g[rng.choice(4, size=n, replace=False)] = True
        return groups.reshape(ROWS, NE0)
    if kind == "random":  # about 30% zeros, anywhere
        return rng.random((ROWS, NE0)) >= 0.3
    if kind == "unstructured50":  # exactly half zeros, anywhere; one dense group of 16 rules out N:M
        flat = np.zeros(ROWS * NE0, dtype=bool)
        flat[rng.permutation(ROWS * NE0)[: ROWS * NE0 // 2]] = True
        m = flat.reshape(ROWS, NE0)
        row, col = 3, 16
        dense = m[row, col : col + 16].copy()
        n_move = int((~dense).sum())
        m[row, col : col + 16] = True  # move that group's zeros elsewhere in the row
        spare = [c for c in range(NE0) if not col <= c < col + 16 and m[row, c]]
        m[row, spare[:n_move]] = False
        assert m.sum() == ROWS * NE0 // 2
        return m
    raise AssertionError(kind)


PATTERNS: dict[str, tuple[str | None, float | None]] = {
    # kind: (nm_pattern, exact zero fraction; None = whatever the random draw gave)
    "none": (None, 0.0),
    "2:4": ("2:4", 0.5),
    "1:4": ("1:4", 0.75),
    "unstructured50": (None, 0.5),
    "random": ("reference", None),  # whatever gguf-py's reference says for this draw
}


def write_model(
    path: Path,
    tensors: dict[str, np.ndarray | tuple[np.ndarray, gguf.GGMLQuantizationType]],
    *,
    alignment: int | None = None,
    endianess: gguf.GGUFEndian = gguf.GGUFEndian.LITTLE,
) -> Path:
    """Tensors given as float arrays (F32 or F16 by dtype) or (raw bytes, quantisation type)."""
    w = gguf.GGUFWriter(str(path), "llama", endianess=endianess)
    w.add_name("sparsity-test")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    for name, t in tensors.items():
        if isinstance(t, tuple):
            w.add_tensor(name, t[0], raw_dtype=t[1])
        else:
            w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def encode(values: np.ndarray, type_name: str) -> np.ndarray | tuple[np.ndarray, gguf.GGMLQuantizationType]:
    if type_name == "F32":
        return values.astype(np.float32)
    if type_name == "F16":
        return values.astype(np.float16)
    qt: gguf.GGMLQuantizationType = getattr(Q, type_name)
    return gguf.quants.quantize(values.astype(np.float32), qt), qt


def reference_zeros(path: Path) -> dict[str, tuple[int, dict[int, int]]]:
    """Per tensor, via gguf-py: exact zeros after dequantisation, and the most non-zeros in any
    row-aligned group of 4/8/16 (for the group sizes that divide ne0)."""
    out = {}
    for t in gguf.GGUFReader(path).tensors:
        if t.tensor_type not in (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0):
            continue
        values = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(-1)
        ne0 = int(t.shape[0])
        nz = values != 0
        max_nz = {m: int(nz.reshape(-1, m).sum(axis=1).max()) for m in (4, 8, 16) if ne0 % m == 0}
        out[t.name] = (int((~nz).sum()), max_nz)
    return out


@pytest.fixture(params=["default", "tiny"])
def chunking(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run pattern tests both in one chunk per tensor and in many tiny chunks (a few blocks or
    48 floats each), which exercises chunk boundaries and the switch to the counting fast path."""
    if request.param == "tiny":
        monkeypatch.setattr(ws, "CHUNK_BYTES", 96)
    return str(request.param)


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    return tmp_path / "cache"


# ------------------------------------------------------------------ tensor directory
def test_ggml_type_table_matches_gguf_py() -> None:
    for qt, (block, size) in gguf.GGML_QUANT_SIZES.items():
        assert GGML_TYPES[int(qt)] == (qt.name, block, size), qt


@pytest.mark.parametrize("alignment", [None, 64, 256])
def test_read_tensor_infos_agrees_with_gguf_reader(tmp_path: Path, alignment: int | None) -> None:
    rng = np.random.default_rng(1)
    x = magnitudes(rng, (ROWS, 256))
    path = write_model(
        tmp_path / "m.gguf",
        {
            "a.f32": x[:3, :5].copy(),  # odd sizes: the next tensor's offset is padded
            "b.f16": x.astype(np.float16),
            "c.bf16": (gguf.quants.quantize(x, Q.BF16), Q.BF16),
            "d.q8_0": (gguf.quants.quantize(x, Q.Q8_0), Q.Q8_0),
            "e.q4_0": (gguf.quants.quantize(x, Q.Q4_0), Q.Q4_0),
            "f.q6_k": (rng.integers(0, 256, size=(ROWS, 210), dtype=np.uint8), Q.Q6_K),
            "g.1d": x[0].copy(),
        },
        alignment=alignment,
    )
    infos = read_tensor_infos(path)
    reader = gguf.GGUFReader(path)
    assert [t.name for t in infos] == [t.name for t in reader.tensors]
    for t, r in zip(infos, reader.tensors, strict=True):
        assert t.ggml_type == int(r.tensor_type)
        assert t.type_name == r.tensor_type.name
        assert t.shape == tuple(int(d) for d in r.shape)
        assert t.offset == r.data_offset
        assert t.offset % (alignment or 32) == 0
        assert t.nbytes == r.n_bytes
        assert t.n_values == r.n_elements
        assert t.byte_order == "<"


def test_read_tensor_infos_reports_a_truncated_file(tmp_path: Path) -> None:
    path = write_model(tmp_path / "m.gguf", {"w": np.ones((4, 64), dtype=np.float32)})
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ProfError, match=r"truncated or damaged.*'w'"):
        read_tensor_infos(cut)
    with pytest.raises(ProfError, match="truncated or damaged"):
        ws.analyze(cut, cache_dir=tmp_path / "cache")


def test_a_file_that_is_not_gguf_raises_prof_error(tmp_path: Path) -> None:
    f = tmp_path / "x.gguf"
    f.write_bytes(b"not a model" * 10)
    with pytest.raises(ProfError, match="not a GGUF"):
        ws.analyze(f, cache_dir=tmp_path / "cache")


# ------------------------------------------------------------------ zeros and N:M patterns
@pytest.mark.parametrize("type_name", ["F32", "F16", "BF16", "Q8_0", "Q4_0"])
def test_zero_fraction_and_nm_pattern_per_type(
    tmp_path: Path, cache: Path, type_name: str, chunking: str
) -> None:
    rng = np.random.default_rng(42)
    tensors: dict[str, Any] = {}
    expected: dict[str, tuple[str | None, int]] = {}
    for kind in PATTERNS:
        keep = keep_mask(kind, rng)
        values = np.where(keep, magnitudes(rng, keep.shape), np.float32(0.0))
        if type_name in ("F32", "F16", "BF16"):
            values[~keep & (rng.random(keep.shape) < 0.5)] = -0.0  # -0 is zero too
        tensors[f"{kind}.weight"] = encode(values, type_name)
        expected[f"{kind}.weight"] = (PATTERNS[kind][0], int((~keep).sum()))
    path = write_model(tmp_path / f"{type_name}.gguf", tensors)
    ref = reference_zeros(path)

    result = ws.analyze(path, sha256=FAKE_SHA, cache_dir=cache)

    by_name = {e["name"]: e for e in result["tensors"]}
    assert list(by_name) == list(tensors)
    for name, (pattern, zeros) in expected.items():
        e = by_name[name]
        assert e["type"] == type_name
        assert e["shape"] == [NE0, ROWS]
        assert e["n_values"] == ROWS * NE0
        assert e["n_zeros"] == zeros == ref[name][0], name
        assert e["zero_fraction"] == zeros / (ROWS * NE0)
        want = PATTERNS[name.split(".")[0]][1]
        if want is not None:
            assert e["zero_fraction"] == want
        assert e["nm_pattern"] == (ws.nm_pattern(ref[name][1]) if zeros else None)
        if pattern != "reference":
            assert e["nm_pattern"] == pattern, name
        assert "reason" not in e
    s = result["summary"]
    assert s["n_tensors"] == len(tensors)
    assert s["n_values"] == len(tensors) * ROWS * NE0
    assert s["n_zeros"] == sum(z for _, z in expected.values())
    assert s["zero_fraction_total"] == s["n_zeros"] / s["n_values"]
    assert s["pruned_tensors"] == [n for n in tensors if not n.startswith("none")]
    assert s["unanalysed_tensors"] == []


def test_nm_groups_are_aligned_at_each_row_start(tmp_path: Path, cache: Path, chunking: str) -> None:
    """ne0 = 12: only groups of 4 fit a row. Flat groups of 8 or 16 would straddle rows and see
    "2:8" or "2:16" in this tensor; row-aligned groups of 4 see 2:4."""
    row = np.array([1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], dtype=np.float32)
    path = write_model(tmp_path / "m.gguf", {"w": np.tile(row, (16, 1))})
    (e,) = ws.analyze(path, sha256=FAKE_SHA, cache_dir=cache)["tensors"]
    assert e["zero_fraction"] == 10 / 12
    assert e["nm_pattern"] == "2:4"


def test_no_nm_pattern_when_no_group_size_divides_the_row(tmp_path: Path, cache: Path) -> None:
    path = write_model(tmp_path / "m.gguf", {"w": np.tile(np.array([1, 0, 0, 0, 0, 0], np.float32), (4, 1))})
    (e,) = ws.analyze(path, sha256=FAKE_SHA, cache_dir=cache)["tensors"]
    assert e["n_zeros"] == 20
    assert e["nm_pattern"] is None


def test_a_dense_group_late_in_a_pruned_tensor_rules_the_pattern_out(
    tmp_path: Path, cache: Path, chunking: str
) -> None:
    values = np.tile(np.array([3, 0, 0, 5], np.float32), (64, 16))
    values[-1, -4:] = 7.0  # the very last group of 4 is dense: 6 of its 8, 10 of its 16
    path = write_model(tmp_path / "m.gguf", {"w": values})
    (e,) = ws.analyze(path, sha256=FAKE_SHA, cache_dir=cache)["tensors"]
    assert e["n_zeros"] == values.size // 2 - 2
    # 2:4 and 4:8 fail in the last group alone; 10:16 (ratio 0.625 < 6/8) is the tightest left.
    assert e["nm_pattern"] == "10:16"


def test_q8_0_block_with_a_zero_scale_is_all_zeros(tmp_path: Path, cache: Path) -> None:
    x = magnitudes(np.random.default_rng(3), (2, 64))
    raw = gguf.quants.quantize(x, Q.Q8_0)
    raw[0, 34 : 34 + 2] = [0x00, 0x80]  # block 1 of row 0: d = -0.0, q left non-zero
    path = write_model(tmp_path / "m.gguf", {"w": (raw, Q.Q8_0)})
    (e,) = ws.analyze(path, sha256=FAKE_SHA, cache_dir=cache)["tensors"]
    assert e["n_zeros"] == 32 == reference_zeros(path)["w"][0]
    assert e["nm_pattern"] is None  # the other blocks are dense


def test_q4_0_low_nibbles_are_the_first_half_of_a_block(tmp_path: Path, cache: Path) -> None:
    """Byte j holds value j (low nibble) and value j + 16 (high nibble): nibble 8 is zero.

    Swapping the two halves would not change any count (they are whole groups of 16), but reading
    the nibbles interleaved (value 2j low, 2j + 1 high) would, and would report 2:4 here."""
    block = np.zeros(18, dtype=np.uint8)
    block[:2] = np.array([1.0], dtype="<f2").view(np.uint8)  # d = 1
    block[2:] = 0x8F  # values 0..15: nibble 15 (7.0); values 16..31: nibble 8 (0.0)
    raw = np.tile(block, (4, 1))
    path = write_model(tmp_path / "m.gguf", {"w": (raw, Q.Q4_0)})
    (e,) = ws.analyze(path, sha256=FAKE_SHA, cache_dir=cache)["tensors"]
    assert e["zero_fraction"] == 0.5
    # Per row: 16 non-zeros then 16 zeros, so groups of 4, 8 and 16 are all dense somewhere.
    assert e["nm_pattern"] is None
    assert reference_zeros(path)["w"] == (64, {4: 4, 8: 8, 16: 16})


def test_big_endian_float_files(tmp_path: Path, cache: Path) -> None:
    values = np.tile(np.array([0, 2, -0.0, 3], np.float32), (4, 8))
    path = write_model(
        tmp_path / "be.gguf",
        {"a": values.copy(), "b": values.astype(np.float16)},
        endianess=gguf.GGUFEndian.BIG,
    )
    assert {t.byte_order for t in read_tensor_infos(path)} == {">"}
    for e in ws.analyze(path, sha256=FAKE_SHA, cache_dir=cache)["tensors"]:
        assert (e["zero_fraction"], e["nm_pattern"]) == (0.5, "2:4"), e["name"]


def test_unsupported_types_are_reported_not_analysed(tmp_path: Path, cache: Path) -> None:
    rng = np.random.default_rng(5)
    path = write_model(
        tmp_path / "m.gguf",
        {
            "k": (rng.integers(0, 256, size=(4, 210), dtype=np.uint8), Q.Q6_K),
            "w": np.tile(np.array([0, 1, 0, 0], np.float32), (4, 4)),
        },
    )
    result = ws.analyze(path, sha256=FAKE_SHA, cache_dir=cache)
    k, w = result["tensors"]
    assert k == {
        "name": "k",
        "type": "Q6_K",
        "shape": [256, 4],
        "n_values": 1024,
        "n_zeros": None,
        "zero_fraction": None,
        "nm_pattern": None,
        "reason": "type Q6_K not analysed",
    }
    assert (w["zero_fraction"], w["nm_pattern"]) == (0.75, "1:4")
    s = result["summary"]
    assert s["n_tensors"] == 2
    assert s["zero_fraction_total"] == 0.75  # over analysed tensors only
    assert s["pruned_tensors"] == ["w"]
    assert s["unanalysed_tensors"] == ["k"]


@pytest.mark.parametrize(
    ("max_nonzeros", "want"),
    [
        ({4: 2, 8: 4, 16: 8}, "2:4"),  # equal ratios: the smallest M
        ({4: 1, 8: 2, 16: 4}, "1:4"),
        ({4: 2, 8: 3, 16: 6}, "3:8"),  # strictly tighter at M = 8
        ({4: 1, 8: 1, 16: 2}, "1:8"),  # 1/8 == 2/16: the smaller M
        ({4: 4, 8: 7, 16: 13}, "13:16"),
        ({4: 4, 8: 8, 16: 16}, None),
        ({4: 0, 8: 0, 16: 0}, "0:4"),
        ({4: 3}, "3:4"),
        ({}, None),
    ],
)
def test_nm_pattern_rule(max_nonzeros: dict[int, int], want: str | None) -> None:
    assert ws.nm_pattern(max_nonzeros) == want


# ------------------------------------------------------------------ cache
def small_model(tmp_path: Path) -> Path:
    return write_model(tmp_path / "m.gguf", {"w": np.tile(np.array([0, 1, 0, 2], np.float32), (4, 4))})


def mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_second_call_is_a_cache_hit_that_reads_no_tensor_data(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = small_model(tmp_path)
    first = ws.analyze(path, cache_dir=cache)
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    assert first["sha256"] == sha
    assert (cache / f"{sha}.json").is_file()

    def boom(*a: object, **k: object) -> None:
        raise AssertionError("tensor data read on a cache hit")

    monkeypatch.setattr(ws, "read_tensor_infos", boom)
    monkeypatch.setattr(ws, "_analyse_tensor", boom)
    monkeypatch.setattr(ws.np, "memmap", boom)
    assert ws.analyze(path, cache_dir=cache) == first
    assert ws.analyze(path, sha256=sha.upper(), cache_dir=cache) == first


def test_a_given_sha256_is_used_without_hashing(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = small_model(tmp_path)

    def no_hash(*a: object, **k: object) -> str:
        raise AssertionError("hashed although sha256 was given")

    monkeypatch.setattr(ws, "sha256_file", no_hash)
    result = ws.analyze(path, sha256=FAKE_SHA, cache_dir=cache)
    assert result["sha256"] == FAKE_SHA
    assert [p.name for p in cache.iterdir()] == [f"{FAKE_SHA}.json"]


@pytest.mark.parametrize("bad", ["", "abc", "g" * 64, "../" * 21 + "a", "a" * 65])
def test_a_malformed_sha256_is_refused(tmp_path: Path, cache: Path, bad: str) -> None:
    with pytest.raises(UsageError, match="64 hex digits"):
        ws.analyze(small_model(tmp_path), sha256=bad, cache_dir=cache)
    assert not cache.exists()


@pytest.mark.parametrize(
    "damage",
    [
        b"",
        b"{not json",
        b"\xff\xfe garbage",
        b"[]",
        b'{"format": "sparseety-prof-weight-sparsity", "version": 1}',
        b"version-0",  # a well-formed file of an older version: see below
        b"other-sha",
    ],
)
def test_a_corrupt_or_stale_cache_file_is_ignored_and_rewritten(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch, damage: bytes
) -> None:
    path = small_model(tmp_path)
    good = ws.analyze(path, sha256=FAKE_SHA, cache_dir=cache)
    file = cache / f"{FAKE_SHA}.json"
    doc = json.loads(file.read_bytes())
    if damage == b"version-0":
        damage = json.dumps({**doc, "version": 0}).encode()
    elif damage == b"other-sha":
        damage = json.dumps({**doc, "sha256": "cd" * 32}).encode()
    file.write_bytes(damage)
    file.chmod(0o644)

    calls = []
    real = ws._analyse_file

    def counted(*a: Any) -> dict[str, Any]:
        calls.append(1)
        return real(*a)

    monkeypatch.setattr(ws, "_analyse_file", counted)
    assert ws.analyze(path, sha256=FAKE_SHA, cache_dir=cache) == good
    assert calls == [1]
    assert json.loads(file.read_bytes()) == doc  # rewritten
    assert mode(file) == 0o600
    assert sorted(p.name for p in cache.iterdir()) == [file.name]  # no temp files left behind
    ws.analyze(path, sha256=FAKE_SHA, cache_dir=cache)
    assert calls == [1]  # and now a hit


@pytest.mark.parametrize("umask", [0o000, 0o022, 0o077])
def test_cache_directories_are_0700_and_files_0600(tmp_path: Path, umask: int) -> None:
    path = small_model(tmp_path)
    cache = tmp_path / "a" / "b" / "cache"
    old = os.umask(umask)
    try:
        ws.analyze(path, sha256=FAKE_SHA, cache_dir=cache)
    finally:
        os.umask(old)
    for d in (tmp_path / "a", tmp_path / "a" / "b", cache):
        assert mode(d) == 0o700, d
    assert mode(cache / f"{FAKE_SHA}.json") == 0o600


def test_an_existing_cache_dir_named_by_the_caller_is_left_alone(tmp_path: Path) -> None:
    cache = tmp_path / "shared"
    cache.mkdir()
    cache.chmod(0o755)
    ws.analyze(small_model(tmp_path), sha256=FAKE_SHA, cache_dir=cache)
    assert mode(cache) == 0o755
    assert mode(cache / f"{FAKE_SHA}.json") == 0o600


def test_default_cache_dir_follows_xdg_and_is_made_private(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/is/ignored")
    assert ws.default_cache_dir() == tmp_path / "home" / ".cache" / "sparseety-prof" / "weights"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert ws.default_cache_dir() == tmp_path / "home" / ".cache" / "sparseety-prof" / "weights"

    xdg = tmp_path / "xdg"
    monkeypatch.setenv("XDG_CACHE_HOME", str(xdg))
    ours = xdg / "sparseety-prof"
    ours.mkdir(parents=True, mode=0o755)  # e.g. left by an older version, or made by hand
    ours.chmod(0o755)
    xdg.chmod(0o755)
    ws.analyze(small_model(tmp_path), sha256=FAKE_SHA)
    assert (ours / "weights" / f"{FAKE_SHA}.json").is_file()
    assert mode(ours) == mode(ours / "weights") == 0o700  # the project's own directories
    assert mode(xdg) == 0o755  # the user's cache root is not ours to change


def test_a_cache_that_cannot_be_written_warns_and_still_returns(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.warns(RuntimeWarning, match="not cached"):
        result = ws.analyze(small_model(tmp_path), sha256=FAKE_SHA, cache_dir=blocker / "cache")
    assert result["tensors"][0]["zero_fraction"] == 0.5


# ------------------------------------------------------------------ progress
@pytest.mark.parametrize("given", [True, False])
def test_progress_grows_to_a_fixed_total(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch, given: bool
) -> None:
    monkeypatch.setattr(ws, "CHUNK_BYTES", 64)
    rng = np.random.default_rng(9)
    path = write_model(
        tmp_path / "m.gguf",
        {"a": magnitudes(rng, (16, 64)), "k": (rng.integers(0, 256, size=(4, 210), dtype=np.uint8), Q.Q6_K)},
    )
    sha = FAKE_SHA if given else None  # a new file: sha256_file's per-process cache misses
    calls: list[tuple[int, int]] = []
    ws.analyze(path, sha256=sha, cache_dir=cache, progress=lambda d, t: calls.append((d, t)))
    size = path.stat().st_size
    total = size if given else 2 * size
    assert len(calls) > 16  # one per 64-byte chunk of "a", at least
    assert {t for _, t in calls} == {total}
    done = [d for d, _ in calls]
    assert done == sorted(done)
    assert calls[-1] == (total, total)

    calls.clear()
    ws.analyze(path, sha256=sha, cache_dir=cache, progress=lambda d, t: calls.append((d, t)))
    assert calls[-1] == (total, total)  # a cache hit still completes the bar


# ------------------------------------------------------------------ the model file's hash, remembered
def test_a_models_hash_is_remembered_across_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, cache = tmp_path / "m.gguf", tmp_path / "cache" / "sha256"
    model.write_bytes(b"weights" * 1000)
    want = hashlib.sha256(model.read_bytes()).hexdigest()
    assert ws.model_sha256(model, cache_dir=cache) == want
    (entry,) = cache.iterdir()
    assert stat.S_IMODE(entry.stat().st_mode) == 0o600
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700

    def no_hash(*a: object, **k: object) -> str:
        raise AssertionError("hashed again")

    monkeypatch.setattr(ws, "sha256_file", no_hash)  # a later run (the per-process cache aside)
    assert ws.model_sha256(model, cache_dir=cache) == want


def test_a_rewritten_model_is_hashed_again_even_with_its_times_put_back(tmp_path: Path) -> None:
    """The attack: same size, new content, modification time set back. The status-change time
    moves anyway (only root sets it), so the remembered hash is not used."""
    model, cache = tmp_path / "m.gguf", tmp_path / "cache"
    model.write_bytes(b"a" * 4096)
    assert ws.model_sha256(model, cache_dir=cache) == hashlib.sha256(b"a" * 4096).hexdigest()
    st = model.stat()
    with open(model, "r+b") as f:  # the same inode, rewritten in place
        f.write(b"b" * 4096)
    os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert model.stat().st_mtime_ns == st.st_mtime_ns and model.stat().st_size == st.st_size
    assert ws.model_sha256(model, cache_dir=cache) == hashlib.sha256(b"b" * 4096).hexdigest()


def test_planted_or_damaged_hash_entries_are_not_believed(tmp_path: Path) -> None:
    model, cache = tmp_path / "m.gguf", tmp_path / "cache"
    model.write_bytes(b"c" * 100)
    want = hashlib.sha256(b"c" * 100).hexdigest()
    ws.model_sha256(model, cache_dir=cache)
    (entry,) = cache.iterdir()
    doc = json.loads(entry.read_text())
    for bad in (
        {**doc, "sha256": FAKE_SHA, "identity": "1:2:3:4:5"},  # another file's entry under this name
        {**doc, "sha256": "../" * 21 + "a"},  # not a hash
        "not json {",
    ):
        entry.write_text(bad if isinstance(bad, str) else json.dumps(bad))
        assert ws.model_sha256(model, cache_dir=cache) == want
    assert json.loads(entry.read_text())["sha256"] == want  # rewritten


def test_a_model_written_while_it_is_hashed_is_not_remembered(tmp_path: Path) -> None:
    model, cache = tmp_path / "m.gguf", tmp_path / "cache"
    model.write_bytes(b"d" * 100)

    def write_meanwhile(done: int, total: int) -> None:
        with open(model, "r+b") as f:
            f.write(b"e")

    ws.model_sha256(model, cache_dir=cache, progress=write_meanwhile)
    assert not cache.exists() or not list(cache.iterdir())
