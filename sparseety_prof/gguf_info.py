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
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import numpy.typing as npt

from .errors import ProfError

__all__ = ["ModelInfo", "Vocab", "read_model_info", "sha256_file"]

SHA256_CHUNK = 8 * 1024 * 1024
SPM_SPACE = "\u2581"

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

# (path, st_dev, st_ino, size, mtime_ns) -> hex digest
_sha256_cache: dict[tuple[str, int, int, int, int], str] = {}


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


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 8 MB chunks; cached per (path, inode, size, mtime)."""
    st = os.stat(path)
    key = (str(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    hit = _sha256_cache.get(key)
    if hit is not None:
        return hit
    h = hashlib.sha256()
    buf = bytearray(SHA256_CHUNK)
    view = memoryview(buf)
    with Path(path).open("rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    digest = h.hexdigest()
    _sha256_cache[key] = digest
    return digest


def _reader(path: Path) -> gguf.GGUFReader:
    try:
        return gguf.GGUFReader(path, "r")
    except OSError as e:
        raise ProfError(f"cannot read model file {path}: {e.strerror or e}") from e
    except (ValueError, KeyError, IndexError) as e:
        raise ProfError(f"{path} is not a readable GGUF model file ({e})") from e


def _scalar(f: gguf.ReaderField) -> int | float | str | bool | None:
    """The value of a scalar field; None for arrays."""
    if not f.types or f.types[0] == gguf.GGUFValueType.ARRAY:
        return None
    if f.types[0] == gguf.GGUFValueType.STRING:
        return bytes(f.parts[-1]).decode("utf-8", errors="replace")
    value = f.parts[-1][0]
    if f.types[0] == gguf.GGUFValueType.BOOL:
        return bool(value)
    if f.types[0] in (gguf.GGUFValueType.FLOAT32, gguf.GGUFValueType.FLOAT64):
        return float(value)
    return int(value)


def _get_scalar(reader: gguf.GGUFReader, key: str) -> int | float | str | bool | None:
    f = reader.get_field(key)
    return None if f is None else _scalar(f)


def _get_str(reader: gguf.GGUFReader, key: str) -> str | None:
    v = _get_scalar(reader, key)
    return v if isinstance(v, str) else None


def _get_int(reader: gguf.GGUFReader, key: str) -> int | None:
    v = _get_scalar(reader, key)
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _string_array(reader: gguf.GGUFReader, key: str) -> list[str] | None:
    f = reader.get_field(key)
    if f is None or len(f.types) < 2 or f.types[-1] != gguf.GGUFValueType.STRING:
        return None
    return [bytes(f.parts[i]).decode("utf-8", errors="replace") for i in f.data]


def _int_array(reader: gguf.GGUFReader, key: str) -> npt.NDArray[np.int64] | None:
    f = reader.get_field(key)
    if f is None or len(f.types) < 2 or f.types[0] != gguf.GGUFValueType.ARRAY:
        return None
    if not f.data:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([f.parts[i] for i in f.data]).astype(np.int64)


def read_model_info(path: Path, *, with_sha256: bool = True) -> ModelInfo:
    """Read a GGUF file's header (memory-mapped; tensor data is not touched except for sha256)."""
    path = Path(path)
    reader = _reader(path)
    arch = _get_str(reader, _KEY_ARCH) or ""
    hparams: dict[str, int | float | str | bool] = {}
    prefix = arch + "."
    for key, f in reader.fields.items():
        if arch and key.startswith(prefix):
            v = _scalar(f)
            if v is not None:
                hparams[key[len(prefix) :]] = v
    file_type = _get_int(reader, _KEY_FILE_TYPE)
    if file_type is not None:
        hparams["file_type"] = file_type
        with contextlib.suppress(ValueError):
            hparams["file_type_name"] = gguf.LlamaFileType(file_type).name
    tokens_field = reader.get_field(_KEY_TOKENS)
    if tokens_field is not None:
        n_vocab = len(tokens_field.data)
    else:
        n_vocab = _get_int(reader, f"{arch}.vocab_size") or 0
    info = ModelInfo(
        path=path,
        size_bytes=os.stat(path).st_size,
        sha256=sha256_file(path) if with_sha256 else None,
        architecture=arch,
        name=_get_str(reader, _KEY_NAME),
        hyperparameters=hparams,
        n_vocab=n_vocab,
        tokenizer_model=_get_str(reader, _KEY_TOK_MODEL),
        bos_token_id=_get_int(reader, _KEY_BOS),
        eos_token_id=_get_int(reader, _KEY_EOS),
        n_tensors=len(reader.tensors),
        n_params=sum(int(t.n_elements) for t in reader.tensors),
    )
    del reader  # drop the memory map now
    return info


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
    def from_gguf(cls, path: Path) -> Vocab:
        reader = _reader(Path(path))
        pieces = _string_array(reader, _KEY_TOKENS)
        if pieces is None:
            raise ProfError(f"{path} has no tokenizer vocabulary ({_KEY_TOKENS}): token text is unavailable")
        types = _int_array(reader, _KEY_TOKEN_TYPES)
        model = _get_str(reader, _KEY_TOK_MODEL)
        del reader
        return cls(pieces, None if types is None else types.tolist(), model)

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
