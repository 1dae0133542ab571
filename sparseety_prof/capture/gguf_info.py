"""Facts about the GGUF model file an engine has open: identity (size, sha256), architecture and
hyperparameters for the recording's metadata, and the vocabulary that turns token ids into text.

Token text follows llama.cpp's ``llama_token_to_piece(vocab, id, buf, len, lstrip=0, special=false)``
for one token, decoded as UTF-8 with ``errors="replace"`` (what ``llama_cpp.Llama.detokenize([id])
.decode("utf-8", errors="replace")`` gives for any token but BOS):

- SPM-style vocabs ("llama", and "bert"/"t5" which share llama.cpp's branch): NORMAL pieces with
  '▁' (U+2581) replaced by a space; BYTE tokens ``<0xXX>`` as that single byte, so ASCII bytes give
  their character and a byte >= 0x80 (one fragment of a multi-byte character) gives U+FFFD;
  USER_DEFINED pieces verbatim.
- BPE ("gpt2"): the GPT-2 byte-level alphabet mapped back to bytes, then UTF-8 decoded; a lone
  fragment of a multi-byte character again gives U+FFFD. USER_DEFINED pieces verbatim; BYTE
  tokens render as "" (llama.cpp's BPE branch has no byte case).
- Everywhere: CONTROL and UNKNOWN tokens (``<s>``, ``</s>``, ``<unk>``), UNUSED and undefined
  types render as "" (special=false), and ids outside the vocabulary as None.

Types come from ``tokenizer.ggml.token_type``; llama.cpp's load-time overrides for a few
misconverted models (e.g. forcing "<|im_end|>" to CONTROL when a converter marked it NORMAL)
are not replicated.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import numpy.typing as npt

from sparseety_prof.capture.untrusted_files import PinnedFile, open_source
from sparseety_prof.errors import ModelFileError

__all__ = [
    "GGML_TYPES",
    "ModelInfo",
    "TensorInfo",
    "Vocab",
    "read_model_info",
    "read_tensor_infos",
    "sha256_file",
    "stat_identity",
]

SHA256_CHUNK = 8 * 1024 * 1024
SPM_SPACE = "\u2581"
GGUF_DEFAULT_ALIGNMENT = 32  # when general.alignment is absent (gguf.md)

_KEY_ARCH = gguf.Keys.General.ARCHITECTURE
_KEY_NAME = gguf.Keys.General.NAME
_KEY_FILE_TYPE = gguf.Keys.General.FILE_TYPE
_KEY_TOK_MODEL = gguf.Keys.Tokenizer.MODEL
_KEY_TOKENS = gguf.Keys.Tokenizer.LIST
_KEY_TOKEN_TYPES = gguf.Keys.Tokenizer.TOKEN_TYPE
_KEY_BOS = gguf.Keys.Tokenizer.BOS_ID
_KEY_EOS = gguf.Keys.Tokenizer.EOS_ID

_SPM_LIKE = frozenset({"llama", "bert", "t5"})  # llama.cpp's SPM, WPM and UGM share one branch
_BPE = frozenset({"gpt2"})

#: arrays of arrays deeper than this are refused (gguf writers nest one level; a crafted file
#: could otherwise nest until the parser's recursion runs out)
MAX_ARRAY_NESTING = 8

#: the first read of a GGUF header (a 150k-token vocabulary and its merges take a few MB)
HEADER_READ_BYTES = 16 << 20
#: the most of a file read as its header (the largest real vocabularies take ~10 MB): a crafted
#: size in a multi-GB file must not have the whole file read into memory
MAX_HEADER_BYTES = 64 << 20

# (path, *stat_identity) -> hex digest
_sha256_cache: dict[tuple[str, int, int, int, int, int], str] = {}


@dataclass(frozen=True)
class ModelInfo:
    """What a recording says about the model. `hyperparameters` holds the GGUF ``<arch>.*``
    scalar keys without the prefix (``block_count``, ``expert_count``, ``attention.head_count``...)
    plus ``file_type`` (``general.file_type``) and ``file_type_name``."""

    path: Path
    size_bytes: int
    sha256: str | None  # None when read with with_sha256=False
    architecture: str
    name: str | None
    hyperparameters: dict[str, int | float | str | bool] = field(default_factory=dict)
    n_vocab: int = 0
    tokenizer_model: str | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    n_tensors: int = 0
    n_params: int = 0

    def to_meta(self) -> dict[str, Any]:
        """A JSON-ready dict for the recording's meta.json."""
        return {
            "path": str(self.path),
            "size_bytes": self.size_bytes,
            "sha256": self.sha256,
            "architecture": self.architecture,
            "name": self.name,
            "hyperparameters": dict(self.hyperparameters),
            "n_vocab": self.n_vocab,
            "tokenizer_model": self.tokenizer_model,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "n_tensors": self.n_tensors,
            "n_params": self.n_params,
        }


def stat_identity(st: os.stat_result) -> tuple[int, int, int, int, int]:
    """What changes whenever a file's content can have: device, inode, size, modification and
    status-change times. A write sets both times; a process may set the modification time back
    (utime), but setting the status-change time takes root (it is the clock of the change)."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def sha256_file(path: Path | PinnedFile, *, progress: Callable[[int, int], object] | None = None) -> str:
    """Hex sha256 of a file, read in 8 MB chunks; cached per (path, inode, size, mtime, ctime).

    `progress(done_bytes, total_bytes)` is called after each chunk when the file is actually
    read (not on a cache hit): hashing a multi-GB model takes seconds.

    The file may belong to the target: only a regular file is read (capture/untrusted_files.py),
    and no further than the size it had when opened (a file that grows is not followed); a
    PinnedFile is read through its opening, whatever its name now leads to.
    """
    fd, st = open_source(path)
    with os.fdopen(fd, "rb", buffering=0) as f:
        key = (str(path), *stat_identity(st))
        hit = _sha256_cache.get(key)
        if hit is not None:
            return hit
        h = hashlib.sha256()
        buf = bytearray(SHA256_CHUNK)
        view = memoryview(buf)
        done = 0
        while done < st.st_size and (n := f.readinto(view[: min(SHA256_CHUNK, st.st_size - done)])):
            h.update(view[:n])
            done += n
            if progress is not None:
                progress(done, st.st_size)
    digest = h.hexdigest()
    _sha256_cache[key] = digest
    return digest


_V = gguf.GGUFValueType
_SCALAR_FORMATS: dict[int, str] = {
    _V.UINT8: "B", _V.INT8: "b", _V.UINT16: "H", _V.INT16: "h", _V.UINT32: "I", _V.INT32: "i",
    _V.FLOAT32: "f", _V.BOOL: "?", _V.UINT64: "Q", _V.INT64: "q", _V.FLOAT64: "d",
}  # fmt: skip

Scalar = int | float | str | bool

# ggml_type id -> (name, elements per block, bytes per block), as in ggml.h / ggml.c's type_traits
# (and gguf-py's GGML_QUANT_SIZES, which tests/test_weight_sparsity.py checks this against). Kept
# here rather than read from gguf-py so that sizing tensors does not depend on the installed
# gguf-py knowing every type of the file's ggml version. Ids 4, 5 (Q4_2/Q4_3) and 31-33 (Q4_0_4_4
# and friends) were removed from ggml; a file using them gets a TensorInfo with nbytes None.
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40),
    10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292), 16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74),
    18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50), 20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1), 25: ("I16", 1, 2),
    26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2),
    34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66), 39: ("MXFP4", 32, 17), 40: ("NVFP4", 64, 36),
    41: ("Q1_0", 128, 18),
}  # fmt: skip


@dataclass(frozen=True)
class TensorInfo:
    """One entry of a GGUF file's tensor directory.

    `shape` is ggml's ne[] order: ne[0] (the innermost, contiguous dimension: one row) first, the
    same order as gguf.GGUFReader's ``tensor.shape``. `offset` is absolute in the file (the data
    section start, aligned to ``general.alignment``, plus the tensor's own offset). `nbytes` is None
    for a ggml type this module does not know (or a row length that is not a whole number of
    blocks), since then its size cannot be computed. `byte_order` is the file's: "<" or ">".
    """

    name: str
    ggml_type: int
    shape: tuple[int, ...]
    offset: int
    nbytes: int | None
    byte_order: str = "<"

    @property
    def type_name(self) -> str:
        t = GGML_TYPES.get(self.ggml_type)
        return t[0] if t is not None else f"TYPE_{self.ggml_type}"

    @property
    def n_values(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class _StringArray:
    """A string array left undecoded in the file until someone asks for it."""

    offset: int
    count: int


class _Header:
    """The key/value and tensor-info sections of a GGUF file.

    gguf.GGUFReader builds numpy views for every element of every array field, which takes
    seconds per read on a real 150k-token vocabulary (plus as many merges); this walks the same
    layout with struct (format: github.com/ggml-org/ggml/blob/master/docs/gguf.md), decodes
    string arrays only on request and never touches tensor data. tests/test_gguf_info.py checks
    it against GGUFReader.
    """

    def __init__(self, src: Path | PinnedFile) -> None:
        path = self.path = _display(src)
        # Read, not mapped: the file may be the target's, and truncating a mapped file would kill
        # the reader with SIGBUS. The header is read from the start of the file, a larger prefix
        # each time it runs past the one read.
        try:
            fd, st = open_source(src)  # a regular file, opened without blocking
            with os.fdopen(fd, "rb", buffering=0) as f:
                self._read_header(f.fileno(), st.st_size)
        except OSError as e:
            raise ModelFileError(f"cannot read model file {path}: {e.strerror or e}") from e
        except (struct.error, ValueError, IndexError, UnicodeDecodeError, OverflowError, MemoryError) as e:
            raise ModelFileError(
                f"{path} is not a readable GGUF model file (truncated or damaged: {e})"
            ) from e
        self.size = st.st_size

    def _read_header(self, fd: int, size: int) -> None:
        if size == 0:
            raise ValueError("empty file")
        n = min(size, HEADER_READ_BYTES)
        while True:
            self._mm = os.pread(fd, n, 0)
            self.fields: dict[str, Scalar | npt.NDArray[Any] | _StringArray | list[Any]] = {}
            self.tensors: list[tuple[str, tuple[int, ...]]] = []
            self.tensor_types: list[tuple[int, int]] = []  # (ggml type, offset in the data section)
            self.directory_end = 0  # file offset just past the tensor directory
            try:
                self._parse()
                return
            except (struct.error, ValueError, IndexError):
                if len(self._mm) < n or n >= size:  # the whole file was read (or it shrank)
                    raise
                if n >= MAX_HEADER_BYTES:  # sizes in the file claim more: not read into memory
                    raise ValueError(f"its header claims more than {MAX_HEADER_BYTES >> 20} MiB") from None
                n = min(size, n * 4, MAX_HEADER_BYTES)

    def close(self) -> None:
        self._mm = b""

    def __enter__(self) -> _Header:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _parse(self) -> None:
        mm = self._mm
        if mm[:4] != b"GGUF":
            raise ModelFileError(f"{self.path} is not a GGUF model file (no GGUF magic number)")
        self._e = "<"
        (version,) = struct.unpack_from("<I", mm, 4)
        if version & 0xFFFF == 0:  # written on a big-endian host
            self._e = ">"
            (version,) = struct.unpack_from(">I", mm, 4)
        if version not in (2, 3):
            raise ModelFileError(f"{self.path}: GGUF version {version} is not supported (2 and 3 are)")
        n_tensors, n_kv = struct.unpack_from(self._e + "QQ", mm, 8)
        off = 24
        for _ in range(n_kv):
            key, off = self._string(off)
            (vtype,) = struct.unpack_from(self._e + "I", mm, off)
            self.fields[key], off = self._value(vtype, off + 4)
        for _ in range(n_tensors):
            name, off = self._string(off)
            (n_dims,) = struct.unpack_from(self._e + "I", mm, off)
            dims = struct.unpack_from(f"{self._e}{n_dims}Q", mm, off + 4)
            off += 4 + 8 * n_dims
            ggml_type, rel = struct.unpack_from(self._e + "IQ", mm, off)
            off += 4 + 8
            self.tensors.append((name, tuple(dims)))
            self.tensor_types.append((ggml_type, rel))
        if off > len(mm):
            raise ValueError("header runs past the end of the file")
        self.directory_end = off

    def tensor_infos(self) -> list[TensorInfo]:
        """The tensor directory with absolute data offsets. Checked here rather than in _parse
        so that a bad general.alignment only fails callers that need tensor data."""
        align = self.fields.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
        if not isinstance(align, int) or isinstance(align, bool) or align <= 0 or align & (align - 1):
            raise ModelFileError(
                f"{self.path} is not a readable GGUF model file (general.alignment is {align!r}, "
                "not a positive power of two)"
            )
        data_offset = (self.directory_end + align - 1) // align * align  # gguf.md: data section start
        return [
            TensorInfo(name, ggml_type, dims, data_offset + rel, _nbytes(ggml_type, dims), self._e)
            for (name, dims), (ggml_type, rel) in zip(self.tensors, self.tensor_types, strict=True)
        ]

    def _string(self, off: int) -> tuple[str, int]:
        (n,) = struct.unpack_from(self._e + "Q", self._mm, off)
        end = off + 8 + n
        if end > len(self._mm):
            raise ValueError(f"string at offset {off} runs past the end of the file")
        return self._mm[off + 8 : end].decode("utf-8", errors="replace"), end

    def _value(self, vtype: int, off: int, depth: int = 0) -> tuple[Any, int]:
        e, mm = self._e, self._mm
        if vtype == _V.STRING:
            return self._string(off)
        fmt = _SCALAR_FORMATS.get(vtype)
        if fmt is not None:
            (v,) = struct.unpack_from(e + fmt, mm, off)
            return v, off + struct.calcsize(fmt)
        if vtype != _V.ARRAY:
            raise ValueError(f"unknown value type {vtype} at offset {off}")
        itype, count = struct.unpack_from(e + "IQ", mm, off)
        off += 12
        fmt = _SCALAR_FORMATS.get(itype)
        if fmt is not None:
            dtype = np.dtype(e + fmt)
            if off + count * dtype.itemsize > len(mm):
                raise ValueError(f"array at offset {off} runs past the end of the file")
            return np.frombuffer(
                mm, dtype=dtype, count=count, offset=off
            ).copy(), off + count * dtype.itemsize
        if itype == _V.STRING:
            start = off
            unpack = struct.Struct(e + "Q").unpack_from
            for _ in range(count):
                off += 8 + unpack(mm, off)[0]
            if off > len(mm):
                raise ValueError(f"string array at offset {start} runs past the end of the file")
            return _StringArray(start, count), off
        if depth >= MAX_ARRAY_NESTING:
            raise ValueError(f"arrays nested deeper than {MAX_ARRAY_NESTING} levels at offset {off}")
        items = []
        for _ in range(count):  # arrays of arrays: rare, decoded eagerly
            v, off = self._value(itype, off, depth + 1)
            items.append(v)
        return items, off

    def scalar(self, key: str) -> Scalar | None:
        v = self.fields.get(key)
        return v if isinstance(v, int | float | str | bool) else None

    def str_(self, key: str) -> str | None:
        v = self.fields.get(key)
        return v if isinstance(v, str) else None

    def int_(self, key: str) -> int | None:
        v = self.fields.get(key)
        return v if isinstance(v, int) and not isinstance(v, bool) else None

    def strings(self, key: str) -> list[str] | None:
        v = self.fields.get(key)
        if not isinstance(v, _StringArray):
            return None
        mm, out, off = self._mm, [], v.offset
        unpack = struct.Struct(self._e + "Q").unpack_from
        for _ in range(v.count):
            (n,) = unpack(mm, off)
            out.append(mm[off + 8 : off + 8 + n].decode("utf-8", errors="replace"))
            off += 8 + n
        return out

    def array_len(self, key: str) -> int | None:
        v = self.fields.get(key)
        if isinstance(v, _StringArray):
            return v.count
        if isinstance(v, np.ndarray | list):
            return len(v)
        return None

    def ints(self, key: str) -> npt.NDArray[np.int64] | None:
        v = self.fields.get(key)
        return v.astype(np.int64) if isinstance(v, np.ndarray) and v.dtype.kind in "iu" else None


def _nbytes(ggml_type: int, shape: tuple[int, ...]) -> int | None:
    t = GGML_TYPES.get(ggml_type)
    if t is None:
        return None
    _, block, size = t
    ne0 = shape[0] if shape else 1
    if ne0 % block:
        return None  # ggml requires whole blocks per row; anything else is not a tensor we can size
    return math.prod(shape) // block * size


def read_tensor_infos(path: Path | PinnedFile) -> list[TensorInfo]:
    """The tensor directory of a GGUF (v2 or v3) file, in file order; no tensor data is read.

    Raises ModelFileError when the file cannot be read, is not GGUF, or when a tensor of known size
    lies (partly) beyond the end of the file (a truncated download or copy).
    """
    with _Header(path) as h:
        infos = h.tensor_infos()
        size = h.size
        name = h.path
    for t in infos:
        if t.nbytes is not None and t.offset + t.nbytes > size:
            raise ModelFileError(
                f"{name} is not a readable GGUF model file (truncated or damaged: tensor {t.name!r} "
                f"ends at byte {t.offset + t.nbytes} of a {size}-byte file)"
            )
    return infos


def read_model_info(path: Path | PinnedFile, *, with_sha256: bool = True) -> ModelInfo:
    """Read a GGUF file's metadata (tensor data is not read, except to compute sha256).

    Raises ModelFileError when the file cannot be read or is not GGUF.
    """
    with _Header(path) as h:
        arch = h.str_(_KEY_ARCH) or ""
        hparams: dict[str, Scalar] = {}
        prefix = arch + "."
        for key in h.fields:
            v = h.scalar(key)
            if arch and key.startswith(prefix) and v is not None:
                hparams[key[len(prefix) :]] = v
        file_type = h.int_(_KEY_FILE_TYPE)
        if file_type is not None:
            hparams["file_type"] = file_type
            with contextlib.suppress(ValueError):
                hparams["file_type_name"] = gguf.LlamaFileType(file_type).name
        n_vocab = h.array_len(_KEY_TOKENS)
        if n_vocab is None:
            n_vocab = h.int_(f"{arch}.vocab_size") or 0
        return ModelInfo(
            path=_display(path),
            size_bytes=h.size,
            sha256=_model_sha256(path) if with_sha256 else None,
            architecture=arch,
            name=h.str_(_KEY_NAME),
            hyperparameters=hparams,
            n_vocab=n_vocab,
            tokenizer_model=h.str_(_KEY_TOK_MODEL),
            bos_token_id=h.int_(_KEY_BOS),
            eos_token_id=h.int_(_KEY_EOS),
            n_tensors=len(h.tensors),
            n_params=sum(math.prod(dims) for _, dims in h.tensors),
        )


def _model_sha256(path: Path | PinnedFile) -> str:
    try:
        return sha256_file(path)
    except OSError as e:
        raise ModelFileError(f"cannot read model file {_display(path)}: {e.strerror or e}") from e


def _display(src: Path | PinnedFile) -> Path:
    """The name to show for a model file (a pinned one is read through its opening, not this)."""
    return src.path if isinstance(src, PinnedFile) else Path(src)


@cache
def _gpt2_unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: printable bytes map to themselves, the rest to 256+n."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def _bpe_piece_bytes(piece: str) -> bytes:
    """llama.cpp's llama_decode_text: byte-level alphabet back to bytes (unknown code points are
    rendered the way llama.cpp does: "[UNK_BYTE_0x<utf8 hex><piece>]")."""
    table = _gpt2_unicode_to_byte()
    out = bytearray()
    for ch in piece:
        b = table.get(ch)
        if b is not None:
            out.append(b)
        else:
            out += b"[UNK_BYTE_0x" + ch.encode("utf-8").hex().encode() + piece.encode("utf-8") + b"]"
    return bytes(out)


def _spm_byte(piece: str) -> int | None:
    """Value of a "<0xXX>" byte piece (llama.cpp parses the hex digits after "<0x")."""
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return int(piece[3:5], 16)
        except ValueError:
            return None
    return None


class Vocab:
    """Token id -> piece and rendered text, for one GGUF vocabulary.

    All texts are computed once at construction; `texts` then only indexes.
    """

    def __init__(self, pieces: Sequence[str], token_types: Sequence[int] | None, model: str | None) -> None:
        n = len(pieces)
        types = [int(t) for t in token_types] if token_types is not None else [gguf.TokenType.NORMAL] * n
        if len(types) != n:
            raise ValueError(f"{n} tokens but {len(types)} token types")
        self.model = model
        self._pieces = list(pieces)
        self._types = types
        self._bytes = [self._render(p, t) for p, t in zip(self._pieces, types, strict=True)]
        texts = [b.decode("utf-8", errors="replace") for b in self._bytes]
        self._texts: npt.NDArray[np.object_] = np.empty(n + 1, dtype=object)
        self._texts[:n] = texts
        self._texts[n] = None  # target of every out-of-range id

    @classmethod
    def from_gguf(cls, path: Path | PinnedFile) -> Vocab:
        with _Header(path) as h:
            pieces = h.strings(_KEY_TOKENS)
            types = h.ints(_KEY_TOKEN_TYPES)
            model = h.str_(_KEY_TOK_MODEL)
        if pieces is None:
            raise ModelFileError(
                f"{_display(path)} has no tokenizer vocabulary ({_KEY_TOKENS}): token text is unavailable"
            )
        try:
            return cls(pieces, None if types is None else types.tolist(), model)
        except ValueError as e:  # the file's token types do not match its tokens
            raise ModelFileError(
                f"{_display(path)} is not a readable GGUF model file (damaged vocabulary: {e})"
            ) from None

    def _render(self, piece: str, ttype: int) -> bytes:
        """The bytes llama_token_to_piece(special=false) writes for one token."""
        T = gguf.TokenType
        if ttype in (T.CONTROL, T.UNKNOWN):
            return b""
        if ttype == T.USER_DEFINED:
            return piece.encode("utf-8")
        if self.model in _SPM_LIKE:
            if ttype == T.NORMAL:
                return piece.replace(SPM_SPACE, " ").encode("utf-8")
            if ttype == T.BYTE:
                b = _spm_byte(piece)
                return b"" if b is None else bytes([b])
            return b""
        if self.model in _BPE:
            return _bpe_piece_bytes(piece) if ttype == T.NORMAL else b""
        # Other vocab types (rwkv, plamo2, ...): the raw piece is the best we can say.
        return piece.encode("utf-8") if ttype == T.NORMAL else b""

    def __len__(self) -> int:
        return len(self._pieces)

    def piece(self, token_id: int) -> str:
        """The raw vocabulary entry (e.g. "▁the", "<0x0A>", "Ġthe"). IndexError when out of range."""
        if not 0 <= token_id < len(self._pieces):
            raise IndexError(f"token id {token_id} outside the vocabulary (0..{len(self._pieces) - 1})")
        return self._pieces[token_id]

    def token_type(self, token_id: int) -> int:
        """The GGUF token type (gguf.TokenType: NORMAL, CONTROL, BYTE...)."""
        self.piece(token_id)  # range check
        return self._types[token_id]

    def token_bytes(self, token_id: int) -> bytes | None:
        """The exact bytes llama.cpp renders (a byte token may be part of a UTF-8 character)."""
        return self._bytes[token_id] if 0 <= token_id < len(self._bytes) else None

    def text(self, token_id: int | None) -> str | None:
        if token_id is None or not 0 <= token_id < len(self._pieces):
            return None
        return str(self._texts[token_id])

    def texts(self, ids: npt.ArrayLike | Sequence[int | None]) -> list[str | None]:
        """Rendered text of each id; None for ids outside the vocabulary (and for null ids)."""
        arr = np.asarray(ids)
        if arr.ndim != 1:
            arr = arr.reshape(-1)
        if arr.dtype.kind == "f":  # e.g. a nullable integer column through numpy: NaN = null
            valid = np.isfinite(arr)
            idx = np.full(arr.shape, len(self._pieces), dtype=np.int64)
            idx[valid] = arr[valid].astype(np.int64)
        elif arr.dtype.kind in "iu":
            idx = arr.astype(np.int64, copy=False)
        elif arr.size == 0:
            return []
        else:  # lists holding None, object arrays
            return [self.text(None if x is None else int(x)) for x in arr.tolist()]
        idx = np.where((idx >= 0) & (idx < len(self._pieces)), idx, len(self._pieces))
        out: list[str | None] = self._texts[idx].tolist()
        return out
