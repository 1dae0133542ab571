"""Static weight sparsity of a GGUF model file: how many weights are exactly zero, per tensor,
and whether the zeros follow an N:M structured pattern (as 2:4 pruning leaves them).

A model file does not change, so the analysis is done once per file content and cached as JSON
under the file's sha256 (``<cache_dir>/<sha256>.json``). Tensor data is read through a numpy
memmap in chunks of about `CHUNK_BYTES`, so a multi-GB model needs neither its size in RAM nor
more than a few chunk-sized temporaries.

Which values count as zero (exactly 0 after dequantisation, as llama.cpp would compute them):

- F32, F16, BF16: the value is +0 or -0 (sign bit ignored; NaN is not zero).
- Q8_0 (34-byte blocks of 32 values: f16 scale d, then 32 int8 q; value = d*q): q == 0 or d == ±0.
- Q4_0 (18-byte blocks of 32 values: f16 d, then 16 bytes; value j < 16 is the low nibble of byte
  j, value j + 16 its high nibble; value = d*(nibble - 8)): nibble == 8 or d == ±0.
- Any other type is not analysed: its zero_fraction is None and "reason" says why.

The JSON (what `analyze` returns)::

    {"sha256": "<hex>",
     "tensors": [{"name": "blk.0.ffn_up.weight", "type": "F16", "shape": [512, 1024],
                  "n_values": 524288, "n_zeros": 262144, "zero_fraction": 0.5,
                  "nm_pattern": "2:4"},
                 {"name": ..., "type": "Q6_K", ..., "n_zeros": None, "zero_fraction": None,
                  "nm_pattern": None, "reason": "type Q6_K not analysed"}, ...],
     "summary": {"n_tensors": 75, "n_values": ..., "n_zeros": ...,
                 "zero_fraction_total": 0.12,      # n_zeros / n_values over analysed tensors
                 "pruned_tensors": [...],          # zero_fraction > 0 or an nm_pattern
                 "unanalysed_tensors": [...]}}

"shape" is ggml's ne[] order: ne[0], the contiguous row, first.

The cache holds facts derived from the weights only, but this project treats everything it
writes as private: directories it creates are 0700, cache files 0600, written under a temporary
name and renamed so that a reader never sees half a file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import tempfile
import warnings
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from sparseety_prof.capture.gguf_info import TensorInfo, read_tensor_infos, sha256_file, stat_identity
from sparseety_prof.capture.untrusted_files import PinnedFile, open_source
from sparseety_prof.errors import ModelFileError, UsageError

__all__ = [
    "CACHE_FORMAT",
    "CACHE_VERSION",
    "NM_GROUP_SIZES",
    "analyze",
    "default_cache_dir",
    "model_sha256",
    "nm_pattern",
]

CACHE_FORMAT = "sparseety-prof-weight-sparsity"
#: Bumped whenever the analysis or the JSON changes: older cache files are then recomputed.
CACHE_VERSION = 1
#: Bytes of tensor data per chunk: large enough that numpy's per-call overhead vanishes, small
#: enough that the chunk's temporaries (a few times its size) stay in cache-friendly tens of MB.
CHUNK_BYTES = 16 * 1024 * 1024
NM_GROUP_SIZES = (4, 8, 16)
DIR_MODE = 0o700
FILE_MODE = 0o600

_SHA256_RE = re.compile(r"[0-9a-f]{64}")
# Value bits without the sign: a float is ±0 exactly when these are all zero.
_FLOAT_MAGNITUDE: dict[str, tuple[str, int]] = {
    "F32": ("u4", 0x7FFF_FFFF),
    "F16": ("u2", 0x7FFF),
    "BF16": ("u2", 0x7FFF),
}
_BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18}
_QK = 32  # values per Q8_0 / Q4_0 block
ANALYSED_TYPES = frozenset(_FLOAT_MAGNITUDE) | frozenset(_BLOCK_BYTES)

Progress = Callable[[int, int], object]
BoolArray = npt.NDArray[np.bool_]
U8Array = npt.NDArray[np.uint8]


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/sparseety-prof/weights``, or ``~/.cache/sparseety-prof/weights``."""
    base = os.environ.get("XDG_CACHE_HOME")
    # The XDG spec says a relative XDG_CACHE_HOME is invalid and must be ignored.
    root = Path(base) if base and os.path.isabs(base) else Path.home() / ".cache"
    return root / "sparseety-prof" / "weights"


def nm_pattern(max_nonzeros: dict[int, int]) -> str | None:
    """The tightest N:M pattern given, per group size M, the most non-zeros in any one group.

    A pattern N:M holds when N = max_nonzeros[M] < M. Among those that hold, the one with the
    smallest ratio N/M wins, and among equal ratios the smallest M (so an exactly 2:4-pruned
    tensor, whose groups of 8 then hold at most 4, reports "2:4" rather than "4:8"). Because a
    group of 2M is two groups of M, N(2M) <= 2 N(M): a larger M is never looser, and it only wins
    when it is strictly tighter (1:4 pruning with some empty groups of 8 can give "1:8"). None when
    no M holds.
    """
    holding = [(Fraction(n, m), m, n) for m, n in max_nonzeros.items() if n < m]
    if not holding:
        return None
    _, m, n = min(holding)
    return f"{n}:{m}"


# ------------------------------------------------------------------ per-type non-zero masks
def _float_nonzero(raw: U8Array, type_name: str, byte_order: str) -> BoolArray:
    kind, magnitude = _FLOAT_MAGNITUDE[type_name]
    x = raw.view(np.dtype(byte_order + kind))
    out: BoolArray = (x & magnitude) != 0
    return out


def _float_count_nonzero(raw: U8Array, type_name: str, byte_order: str) -> int:
    # Faster than counting a bool mask: one pass, no bool temporary; used once the N:M search is
    # over (for a dense tensor, after the first chunk).
    kind, magnitude = _FLOAT_MAGNITUDE[type_name]
    return int(np.count_nonzero(raw.view(np.dtype(byte_order + kind)) & magnitude))


def _scale_nonzero(blocks: U8Array, byte_order: str) -> BoolArray:
    """Whether each block's f16 scale d (its first two bytes) is non-zero, ignoring the sign."""
    lo, hi = (0, 1) if byte_order == "<" else (1, 0)
    out: BoolArray = (blocks[:, lo] != 0) | ((blocks[:, hi] & 0x7F) != 0)
    return out


def _q8_0_nonzero(raw: U8Array, byte_order: str) -> BoolArray:
    blocks = raw.reshape(-1, _BLOCK_BYTES["Q8_0"])
    nz: BoolArray = blocks[:, 2:] != 0  # int8 q == 0 exactly when its byte is 0
    d_nz = _scale_nonzero(blocks, byte_order)
    if not d_nz.all():
        nz &= d_nz[:, None]
    return nz.reshape(-1)


def _q4_0_nonzero(raw: U8Array, byte_order: str) -> BoolArray:
    blocks = raw.reshape(-1, _BLOCK_BYTES["Q4_0"])
    qs = blocks[:, 2:]
    nz: BoolArray = np.empty((blocks.shape[0], _QK), dtype=np.bool_)
    np.not_equal(qs & 0x0F, 8, out=nz[:, :16])  # values 0..15 of the block: low nibbles
    np.not_equal(qs >> 4, 8, out=nz[:, 16:])  # values 16..31: high nibbles
    d_nz = _scale_nonzero(blocks, byte_order)
    if not d_nz.all():
        nz &= d_nz[:, None]
    return nz.reshape(-1)


def _nonzero(raw: U8Array, type_name: str, byte_order: str) -> BoolArray:
    if type_name in _FLOAT_MAGNITUDE:
        return _float_nonzero(raw, type_name, byte_order)
    if type_name == "Q8_0":
        return _q8_0_nonzero(raw, byte_order)
    return _q4_0_nonzero(raw, byte_order)


def _group_max_nonzeros(nz: BoolArray, sizes: list[int]) -> dict[int, int]:
    """Most non-zeros in any aligned group of each size in `sizes` (a subset of 4, 8, 16) of a
    flat mask whose length is a multiple of each of them.

    Counts groups of 4 by viewing 4 mask bytes (each 0 or 1) as one uint32 and multiplying by
    0x01010101: the top byte of the (wrapping) product is their sum. Groups of 8 and 16 are sums
    of adjacent groups of 4. Much faster than ``reshape(-1, M).sum(axis=1)`` for all three sizes.
    """
    c4 = (nz.view(np.uint8).view(np.uint32) * np.uint32(0x0101_0101)) >> np.uint32(24)
    out: dict[int, int] = {}
    if 4 in sizes:
        out[4] = int(c4.max())
    if 8 in sizes or 16 in sizes:
        c8 = c4[0::2] + c4[1::2]
        if 8 in sizes:
            out[8] = int(c8.max())
        if 16 in sizes:
            out[16] = int((c8[0::2] + c8[1::2]).max())
    return out


# ------------------------------------------------------------------ one tensor
class _FileBytes:
    """Byte ranges of the model file, read with pread: never mapped, because the file may be the
    target's, and a file truncated under a mapping kills the reader with SIGBUS."""

    def __init__(self, src: Path | PinnedFile) -> None:
        self.path = src.path if isinstance(src, PinnedFile) else src
        self._fd, _ = open_source(src)  # a regular file, opened without blocking

    def __getitem__(self, span: slice) -> U8Array:
        start, stop = int(span.start), int(span.stop)
        raw = os.pread(self._fd, stop - start, start)
        if len(raw) != stop - start:
            raise ModelFileError(
                f"{self.path} shrank while its weights were read (short read at byte {start})"
            )
        return np.frombuffer(raw, dtype=np.uint8)

    def close(self) -> None:
        os.close(self._fd)


def _analyse_tensor(data: _FileBytes | None, t: TensorInfo, tick: Callable[[int], None]) -> dict[str, Any]:
    """Per-tensor entry of the JSON; `tick(n)` is told of every n bytes scanned. `data` is the
    whole file (None only when no tensor has any data)."""
    type_name = t.type_name
    entry: dict[str, Any] = {
        "name": t.name,
        "type": type_name,
        "shape": list(t.shape),
        "n_values": t.n_values,
        "n_zeros": None,
        "zero_fraction": None,
        "nm_pattern": None,
    }
    if type_name not in ANALYSED_TYPES or t.nbytes is None:
        entry["reason"] = f"type {type_name} not analysed"
        if type_name in ANALYSED_TYPES:  # known type, but read_tensor_infos could not size it
            entry["reason"] = f"row length {t.shape[0]} is not a whole number of {type_name} blocks"
        tick(t.nbytes or 0)
        return entry
    if t.n_values == 0 or data is None:
        entry["reason"] = "empty tensor"
        return entry

    # Chunks cover whole groups of 16 values (and whole blocks), so N:M groups never straddle
    # two chunks: a group starts at a multiple of M in the flat tensor because ne0 % M == 0.
    if type_name in _BLOCK_BYTES:
        unit_bytes = _BLOCK_BYTES[type_name]  # one block: 32 values
    else:
        unit_bytes = 16 * np.dtype(_FLOAT_MAGNITUDE[type_name][0]).itemsize
    chunk = max(1, CHUNK_BYTES // unit_bytes) * unit_bytes

    ne0 = t.shape[0] if t.shape else 1
    live = [m for m in NM_GROUP_SIZES if ne0 % m == 0]  # group sizes not yet ruled out
    max_nz = dict.fromkeys(live, 0)
    nonzeros = 0
    for start in range(t.offset, t.offset + t.nbytes, chunk):
        raw = data[start : min(start + chunk, t.offset + t.nbytes)]
        if live:
            nz = _nonzero(raw, type_name, t.byte_order)
            nonzeros += int(np.count_nonzero(nz))
            for m, n in _group_max_nonzeros(nz, live).items():
                max_nz[m] = max(max_nz[m], n)
            # A fully dense group rules M out for good; a dense tensor drops to the counting fast
            # path after its first chunk.
            live = [m for m in live if max_nz[m] < m]
        elif type_name in _FLOAT_MAGNITUDE:
            nonzeros += _float_count_nonzero(raw, type_name, t.byte_order)
        else:
            nonzeros += int(np.count_nonzero(_nonzero(raw, type_name, t.byte_order)))
        tick(len(raw))
    zeros = t.n_values - nonzeros
    entry["n_zeros"] = zeros
    entry["zero_fraction"] = zeros / t.n_values
    if zeros:
        entry["nm_pattern"] = nm_pattern(max_nz)
    return entry


def _analyse_file(
    path: Path | PinnedFile, sha256: str, progress: Progress | None, done0: int, total: int
) -> dict[str, Any]:
    infos = read_tensor_infos(path)
    done = done0

    def tick(n: int) -> None:
        nonlocal done
        done += n
        if progress is not None and n:
            progress(min(done, total), total)

    data = _FileBytes(path) if any(t.nbytes for t in infos) else None
    try:
        tensors = [_analyse_tensor(data, t, tick) for t in infos]
    finally:
        if data is not None:
            data.close()

    analysed = [e for e in tensors if e["n_zeros"] is not None]
    n_values = sum(e["n_values"] for e in analysed)
    n_zeros = sum(e["n_zeros"] for e in analysed)
    summary = {
        "n_tensors": len(tensors),
        "n_values": n_values,
        "n_zeros": n_zeros,
        "zero_fraction_total": n_zeros / n_values if n_values else None,
        "pruned_tensors": [e["name"] for e in analysed if e["n_zeros"] > 0 or e["nm_pattern"]],
        "unanalysed_tensors": [e["name"] for e in tensors if e["n_zeros"] is None],
    }
    return {"sha256": sha256, "tensors": tensors, "summary": summary}


# ------------------------------------------------------------------ cache
def _load_cache(file: Path, sha256: str) -> dict[str, Any] | None:
    """The cached analysis, or None when absent, unreadable, damaged or from another version."""
    try:
        doc = json.loads(file.read_bytes())
    except (OSError, ValueError):  # missing, unreadable, or not JSON (UnicodeDecodeError is a ValueError)
        return None
    if not (
        isinstance(doc, dict)
        and doc.get("format") == CACHE_FORMAT
        and doc.get("version") == CACHE_VERSION
        and doc.get("sha256") == sha256
        and isinstance(doc.get("tensors"), list)
        and all(isinstance(e, dict) and "name" in e and "zero_fraction" in e for e in doc["tensors"])
        and isinstance(doc.get("summary"), dict)
    ):
        return None
    return {"sha256": sha256, "tensors": doc["tensors"], "summary": doc["summary"]}


def _make_private_dirs(d: Path, *, tighten: tuple[Path, ...]) -> None:
    """Create `d` and any missing parents as 0700 (whatever the umask). Existing directories are
    left as they are, except those in `tighten` (the project's own default directories), which
    lose group/other access: chmod-ing an existing directory the caller named (say /tmp, as
    root) would be a much worse surprise than a cache file in it."""
    missing: list[Path] = []
    q = d
    while not q.exists():
        missing.append(q)
        if q.parent == q:
            break
        q = q.parent
    for p in reversed(missing):
        with contextlib.suppress(FileExistsError):  # a concurrent analyze created it
            p.mkdir(mode=DIR_MODE)
            os.chmod(p, DIR_MODE)  # mkdir's mode is filtered by the umask
    for p in tighten:
        st = p.stat()
        if st.st_uid == os.geteuid() and st.st_mode & 0o077:
            os.chmod(p, DIR_MODE)


def _write_cache(file: Path, doc: dict[str, Any], *, tighten: tuple[Path, ...]) -> None:
    _make_private_dirs(file.parent, tighten=tighten)
    data = (json.dumps(doc, indent=1) + "\n").encode()
    # A unique temporary name (mkstemp: O_EXCL, mode 0600) so two processes analysing the same
    # model never write into one temp file; the rename is atomic, the last writer wins.
    fd, tmp = tempfile.mkstemp(dir=file.parent, prefix=f".{file.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, FILE_MODE)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, file)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


# ------------------------------------------------------------------ the file's hash, remembered
SHA256_CACHE_FORMAT = "sparseety-prof-file-sha256"


def _identity(path: Path | PinnedFile) -> str:
    """gguf_info.stat_identity of the file, as text (the cache entry's name and check)."""
    fd, st = open_source(path)
    os.close(fd)
    return ":".join(str(v) for v in stat_identity(st))


def model_sha256(
    path: Path | PinnedFile, *, cache_dir: Path | str | None = None, progress: Progress | None = None
) -> str:
    """gguf_info.sha256_file, remembered across runs by the file's identity (`_identity`) in
    ``<cache_dir>/<digest of the identity>.json`` (default: ``sha256`` beside the weights cache).
    A model of tens of GB takes a core for a minute and as much disk reading to hash: every
    attach did it. A hash is kept only when the identity was the same before and after the
    read (a file written meanwhile is hashed again next time); a cache that cannot be read or
    written costs a hash, never the recording."""
    tighten: tuple[Path, ...]
    if cache_dir is None:
        cache_dir = default_cache_dir().parent / "sha256"
        tighten = (cache_dir.parent, cache_dir)
    else:
        cache_dir = Path(cache_dir)
        tighten = ()
    before = _identity(path)
    entry = cache_dir / (hashlib.sha256(before.encode()).hexdigest()[:32] + ".json")
    try:
        doc = json.loads(entry.read_bytes())
        if (
            isinstance(doc, dict)
            and doc.get("format") == SHA256_CACHE_FORMAT
            and doc.get("identity") == before
            and isinstance(doc.get("sha256"), str)
            and _SHA256_RE.fullmatch(doc["sha256"])
        ):
            return str(doc["sha256"])
    except (OSError, ValueError):
        pass
    digest = sha256_file(path, progress=progress)
    if _identity(path) == before:
        doc = {"format": SHA256_CACHE_FORMAT, "identity": before, "path": str(path), "sha256": digest}
        with contextlib.suppress(OSError):
            _write_cache(entry, doc, tighten=tighten)
    return digest


# ------------------------------------------------------------------ entry point
def analyze(
    path: Path | str | PinnedFile,
    *,
    sha256: str | None = None,
    cache_dir: Path | str | None = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Static weight sparsity of the GGUF file at `path` (see the module docstring for the JSON).

    `sha256`: the file's hex sha256 when the caller already has it (a recording's metadata does);
    it is trusted, not checked, and names the cache entry. Otherwise the file is hashed (once per
    process: gguf_info.sha256_file caches by path, inode, size, mtime and ctime).

    `cache_dir`: where ``<sha256>.json`` lives; default `default_cache_dir()`. A missing, damaged
    or other-version cache file is (re)computed and rewritten. If the cache cannot be written
    the analysis is still returned, with a RuntimeWarning.

    `progress(done_bytes, total_bytes)`: called as work proceeds; `total_bytes` is fixed for one
    call of analyze (the file size, twice over when the file must be hashed: once for hashing,
    once for scanning), `done_bytes` only grows, and the last call is always (total, total).

    Raises ModelFileError when the file cannot be read or is not GGUF (gguf_info.read_tensor_infos),
    UsageError when `sha256` is not 64 hex digits.
    """
    if isinstance(path, PinnedFile):  # read through its opening, whatever its name leads to now
        size = path.size
    else:
        path = Path(path)
        size = os.stat(path).st_size
    total = size * (2 if sha256 is None else 1)
    if sha256 is None:
        # sha256_file counts to the file size; restate that against the whole job's total.
        hashed = None if progress is None else (lambda done, _size: progress(done, total))
        sha256 = sha256_file(path, progress=hashed)
    else:
        sha256 = sha256.lower()
        if not _SHA256_RE.fullmatch(sha256):  # it becomes a file name: no paths, no surprises
            raise UsageError(f"sha256 must be 64 hex digits, got {sha256!r}")
    done0 = total - size  # the hashing share, whether or not sha256_file had it cached

    tighten: tuple[Path, ...]
    if cache_dir is None:
        cache_dir = default_cache_dir()
        tighten = (cache_dir.parent, cache_dir)  # .../sparseety-prof and .../weights are ours
    else:
        cache_dir = Path(cache_dir)
        tighten = ()
    cache_file = cache_dir / f"{sha256}.json"

    result = _load_cache(cache_file, sha256)
    if result is None:
        result = _analyse_file(path, sha256, progress, done0, total)
        doc = {"format": CACHE_FORMAT, "version": CACHE_VERSION, **result}
        try:
            _write_cache(cache_file, doc, tighten=tighten)
        except OSError as e:
            warnings.warn(
                f"weight sparsity of {path} not cached: cannot write {cache_file}: {e.strerror or e}",
                RuntimeWarning,
                stacklevel=2,
            )
    if progress is not None:
        progress(total, total)
    return result
