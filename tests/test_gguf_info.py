from __future__ import annotations

import ctypes
import hashlib
import importlib.util
from pathlib import Path

import gguf
import numpy as np
import pytest

from sparseety_prof.capture.gguf_info import ModelInfo, Vocab, _Header, read_model_info, sha256_file
from sparseety_prof.errors import ProfError

T = gguf.TokenType


# ------------------------------------------------------------------ tiny GGUF builders
def spm_vocab() -> tuple[list[str], list[int]]:
    """SentencePiece-style vocab: <unk>/<s>/</s>, 256 byte tokens, '▁' pieces, a user-defined
    and an unused token."""
    toks = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    types = [T.UNKNOWN, T.CONTROL, T.CONTROL, *([T.BYTE] * 256)]
    normal = [
        "\u2581",
        "h",
        "e",
        "l",
        "o",
        "\u2581h",
        "\u2581he",
        "\u2581hel",
        "\u2581hell",
        "\u2581hello",
        "he",
        "hello",
        "é",
        "日本",
        "a\u2581b",
        "\u2581\u2581",
        ".",
        "\u2581the",
    ]
    toks += normal
    types += [T.NORMAL] * len(normal)
    toks += ["<|tool|>", "[UNUSED0]"]
    types += [T.USER_DEFINED, T.UNUSED]
    return toks, [int(t) for t in types]


def gpt2_vocab() -> tuple[list[str], list[int], list[str]]:
    """Byte-level BPE vocab: the 256 byte symbols, a few merges, a control token."""
    table = {b: c for c, b in _unicode_to_byte().items()}
    toks = [table[b] for b in range(256)]
    merged = ["Ġt", "Ġth", "Ġthe", "Ã©", "Ċ", "ĠĠ", "he", "llo"]
    toks += [m for m in merged if m not in toks]
    merges = ["Ġ t", "Ġt h", "Ġth e", "Ã ©", "Ġ Ġ", "h e", "l l", "ll o"]
    toks += ["ll", "<|endoftext|>", "<|user_defined|>"]
    types = [T.NORMAL] * (len(toks) - 2) + [T.CONTROL, T.USER_DEFINED]
    return toks, [int(t) for t in types], merges


def _unicode_to_byte() -> dict[str, int]:
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def write_gguf(
    path: Path,
    *,
    tokenizer: str = "llama",
    tokens: list[str] | None = None,
    types: list[int] | None = None,
    merges: list[str] | None = None,
    n_embd: int = 8,
) -> Path:
    if tokens is None:
        tokens, types = spm_vocab()
    assert types is not None
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-test-moe")
    w.add_context_length(64)
    w.add_embedding_length(n_embd)
    w.add_block_count(2)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_expert_count(4)
    w.add_expert_used_count(2)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model(tokenizer)
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_scores([0.0] * len(tokens))
    if merges is not None:
        w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    rng = np.random.default_rng(0)
    w.add_tensor("token_embd.weight", rng.standard_normal((len(tokens), n_embd), dtype=np.float32))
    w.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    w.add_tensor("blk.0.ffn_gate_inp.weight", rng.standard_normal((4, n_embd), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def spm_model(tmp_path: Path) -> Path:
    return write_gguf(tmp_path / "spm.gguf")


@pytest.fixture
def gpt2_model(tmp_path: Path) -> Path:
    toks, types, merges = gpt2_vocab()
    return write_gguf(tmp_path / "bpe.gguf", tokenizer="gpt2", tokens=toks, types=types, merges=merges)


# ------------------------------------------------------------------ ModelInfo
def test_model_info_reports_architecture_hyperparameters_and_tokenizer(spm_model: Path) -> None:
    info = read_model_info(spm_model)
    assert isinstance(info, ModelInfo)
    assert info.path == spm_model
    assert info.size_bytes == spm_model.stat().st_size
    assert info.architecture == "llama"
    assert info.name == "tiny-test-moe"
    hp = info.hyperparameters
    assert hp["block_count"] == 2
    assert hp["embedding_length"] == 8
    assert hp["context_length"] == 64
    assert hp["feed_forward_length"] == 16
    assert hp["expert_count"] == 4
    assert hp["expert_used_count"] == 2
    assert hp["attention.head_count"] == 2
    assert hp["attention.head_count_kv"] == 1
    assert hp["attention.layer_norm_rms_epsilon"] == pytest.approx(1e-5)
    assert hp["rope.freq_base"] == pytest.approx(10000.0)
    assert hp["file_type"] == 0
    assert hp["file_type_name"] == "ALL_F32"
    assert info.n_vocab == len(spm_vocab()[0])
    assert info.tokenizer_model == "llama"
    assert (info.bos_token_id, info.eos_token_id) == (1, 2)
    assert info.n_tensors == 3
    assert info.n_params == info.n_vocab * 8 + 8 + 4 * 8


def test_model_info_sha256_is_the_file_hash(spm_model: Path) -> None:
    info = read_model_info(spm_model)
    assert info.sha256 == hashlib.sha256(spm_model.read_bytes()).hexdigest()
    assert read_model_info(spm_model, with_sha256=False).sha256 is None


def test_sha256_cache_notices_a_rewritten_file(tmp_path: Path) -> None:
    f = tmp_path / "blob"
    f.write_bytes(b"a" * 10)
    assert sha256_file(f) == hashlib.sha256(b"a" * 10).hexdigest()
    f.write_bytes(b"b" * 11)
    assert sha256_file(f) == hashlib.sha256(b"b" * 11).hexdigest()


def test_model_info_is_json_ready(spm_model: Path) -> None:
    import json

    meta = read_model_info(spm_model).to_meta()
    assert json.loads(json.dumps(meta))["hyperparameters"]["expert_count"] == 4


def test_a_file_that_is_not_gguf_raises_prof_error(tmp_path: Path) -> None:
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(ProfError, match="is not a GGUF model file"):
        read_model_info(bad)
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(ProfError, match="not a readable GGUF"):
        read_model_info(tmp_path / "empty.gguf")
    with pytest.raises(ProfError, match="cannot read model file"):
        read_model_info(tmp_path / "missing.gguf")


@pytest.mark.parametrize("fraction", [0.01, 0.1, 0.3, 0.6])
def test_a_truncated_model_file_raises_prof_error(spm_model: Path, tmp_path: Path, fraction: float) -> None:
    data = spm_model.read_bytes()
    header_end = len(data) - 4 * len(spm_vocab()[0]) * 8  # tensor data is at the end
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(header_end * fraction)])
    with pytest.raises(ProfError, match="truncated or damaged"):
        read_model_info(cut)
    with pytest.raises(ProfError, match="truncated or damaged"):
        Vocab.from_gguf(cut)


def test_header_parser_agrees_with_gguf_reader(spm_model: Path, gpt2_model: Path) -> None:
    for path in (spm_model, gpt2_model):
        reader = gguf.GGUFReader(path)
        with _Header(path) as h:
            fields = {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.")}
            assert list(h.fields) == list(fields)
            for key, f in fields.items():
                want = f.contents()
                if f.types[0] == gguf.GGUFValueType.ARRAY and f.types[-1] == gguf.GGUFValueType.STRING:
                    assert h.strings(key) == want, key
                elif f.types[0] == gguf.GGUFValueType.ARRAY:
                    assert h.fields[key].tolist() == pytest.approx(want), key  # type: ignore[union-attr]
                else:
                    assert h.fields[key] == pytest.approx(want), key
            assert [(n, d) for n, d in h.tensors] == [
                (t.name, tuple(t.shape.tolist())) for t in reader.tensors
            ]


# ------------------------------------------------------------------ Vocab
def test_spm_vocab_renders_like_token_to_piece(spm_model: Path) -> None:
    v = Vocab.from_gguf(spm_model)
    toks, _ = spm_vocab()
    assert len(v) == len(toks)
    idx = {t: i for i, t in enumerate(toks)}
    assert v.piece(idx["\u2581hello"]) == "\u2581hello"
    cases = {
        "<unk>": "",
        "<s>": "",
        "</s>": "",
        "<0x0A>": "\n",
        "<0x41>": "A",
        "<0xE2>": "\ufffd",  # one byte of a multi-byte character
        "\u2581": " ",
        "\u2581hello": " hello",
        "hello": "hello",
        "é": "é",
        "日本": "日本",
        "a\u2581b": "a b",
        "\u2581\u2581": "  ",
        "<|tool|>": "<|tool|>",  # user-defined: verbatim
        "[UNUSED0]": "",
    }
    ids = [idx[t] for t in cases]
    assert v.texts(ids) == list(cases.values())
    assert v.token_bytes(idx["<0xE2>"]) == b"\xe2"


def test_gpt2_vocab_maps_byte_level_alphabet_back(gpt2_model: Path) -> None:
    v = Vocab.from_gguf(gpt2_model)
    toks, _, _ = gpt2_vocab()
    idx = {t: i for i, t in enumerate(toks)}
    cases = {
        "Ġthe": " the",
        "Ċ": "\n",
        "Ã©": "é",
        "Ã": "\ufffd",  # lone lead byte of a two-byte character
        "ĠĠ": "  ",
        "!": "!",
        "<|endoftext|>": "",
        "<|user_defined|>": "<|user_defined|>",
    }
    assert v.texts([idx[t] for t in cases]) == list(cases.values())
    assert v.piece(idx["Ġthe"]) == "Ġthe"


def test_texts_handles_out_of_range_nulls_and_numpy_input(spm_model: Path) -> None:
    v = Vocab.from_gguf(spm_model)
    n = len(v)
    assert v.texts([-1, n, n + 100]) == [None, None, None]
    assert v.texts(np.array([259, -5, n], dtype=np.int32)) == [" ", None, None]
    assert v.texts(np.array([259.0, np.nan])) == [" ", None]
    assert v.texts([259, None]) == [" ", None]
    assert v.texts([]) == []
    assert v.text(None) is None
    with pytest.raises(IndexError):
        v.piece(n)


def test_vocab_from_a_file_without_tokens_raises(tmp_path: Path) -> None:
    path = tmp_path / "novocab.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_tensor("x", np.zeros(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ProfError, match="no tokenizer vocabulary"):
        Vocab.from_gguf(path)
    assert read_model_info(path).n_vocab == 0


# ------------------------------------------------------------------ against llama.cpp itself
def _llama_pieces(path: Path) -> tuple[list[bytes], list[bytes], int]:
    """Per id: llama_token_to_piece(lstrip=0, special=False) through the C API, and
    Llama.detokenize([id]) through the high-level API; plus the BOS id."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    n = llama_cpp.llama_vocab_n_tokens(vocab)
    buf = ctypes.create_string_buffer(1024)
    pieces = []
    for i in range(n):
        k = llama_cpp.llama_token_to_piece(vocab, i, buf, len(buf), 0, False)
        assert 0 <= k <= len(buf)
        pieces.append(buf.raw[:k])
    # detokenize uses a 32-byte buffer and strips a leading space after BOS: only short pieces.
    detok = [llm.detokenize([i]) if len(pieces[i]) <= 32 else pieces[i] for i in range(n)]
    bos = llm.token_bos()
    llm.close()
    return pieces, detok, bos


needs_llama_cpp = pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is not installed"
)


@needs_llama_cpp
@pytest.mark.parametrize("kind", ["spm", "gpt2"])
def test_texts_match_llama_cpp_for_every_token(kind: str, spm_model: Path, gpt2_model: Path) -> None:
    path = spm_model if kind == "spm" else gpt2_model
    pieces, detok, bos = _llama_pieces(path)
    v = Vocab.from_gguf(path)
    assert len(pieces) == len(v)
    ours = v.texts(np.arange(len(v)))
    for i, (raw, text) in enumerate(zip(pieces, ours, strict=True)):
        assert v.token_bytes(i) == raw, f"id {i} piece {v.piece(i)!r}"
        assert text == raw.decode("utf-8", errors="replace"), f"id {i} piece {v.piece(i)!r}"
        if i != bos:
            assert text == detok[i].decode("utf-8", errors="replace"), f"id {i} piece {v.piece(i)!r}"
