"""Tests for scripts/make_models.py: deterministic GGUF test models that llama.cpp really loads."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import gguf
import llama_cpp
import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `scripts` lives at the repository root
    sys.path.insert(0, str(ROOT))

from scripts.make_models import (  # noqa: E402
    BYTE_TOKEN_IDS,
    EOS_ID,
    PRESETS,
    build_vocab,
    main,
    make_all,
    make_model,
    sidecar_path,
)

PROMPT = b"hello the expert router"
SMALL = [name for name in PRESETS if name != "bench"]


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def all_models(model_dir: Path) -> dict[str, Path]:
    """Every preset generated once per session (the bench model takes a few seconds)."""
    return make_all(model_dir)


def _load(path: Path) -> llama_cpp.Llama:
    return llama_cpp.Llama(model_path=str(path), n_ctx=256, n_threads=2, verbose=False)


@pytest.fixture(params=list(PRESETS))
def loaded(
    request: pytest.FixtureRequest, all_models: dict[str, Path]
) -> Iterator[tuple[str, llama_cpp.Llama]]:
    name: str = request.param
    llm = _load(all_models[name])
    try:
        yield name, llm
    finally:
        llm.close()


def _greedy(llm: llama_cpp.Llama, prompt: list[int], n: int) -> list[int]:
    out: list[int] = []
    for tok in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
        out.append(tok)
        if len(out) >= n:
            break
    return out


def _field(path: Path, key: str) -> object:
    field = gguf.GGUFReader(path).fields.get(key)
    assert field is not None, f"{key} missing from {path.name}"
    return field.contents()


# ---------------------------------------------------------------- determinism


@pytest.mark.parametrize("preset", SMALL)
def test_same_seed_byte_identical(tmp_path: Path, all_models: dict[str, Path], preset: str) -> None:
    a = make_model(tmp_path / "a.gguf", preset)
    b = make_model(tmp_path / "b.gguf", preset, seed=1234)
    assert a.read_bytes() == b.read_bytes() == all_models[preset].read_bytes()


def test_different_seed_differs(tmp_path: Path) -> None:
    a = make_model(tmp_path / "a.gguf", "moe", seed=1)
    b = make_model(tmp_path / "b.gguf", "moe", seed=2)
    assert a.stat().st_size == b.stat().st_size
    assert a.read_bytes() != b.read_bytes()


def test_dtype_and_vocab_overrides(tmp_path: Path) -> None:
    f32 = make_model(tmp_path / "f32.gguf", "moe")
    f16 = make_model(tmp_path / "f16.gguf", "moe", dtype="f16")
    assert f16.stat().st_size < f32.stat().st_size
    big = make_model(tmp_path / "big.gguf", "dense", n_vocab_min=5000)
    assert len(_field(big, "tokenizer.ggml.tokens")) == 5000  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        make_model(tmp_path / "x.gguf", "nope")


def test_cli_single_matches_api(tmp_path: Path) -> None:
    out = tmp_path / "cli.gguf"
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "make_models.py"),
            str(out),
            "--preset",
            "qwen3moe",
            "--seed",
            "7",
            "--dtype",
            "f16",
        ],
        check=True,
        capture_output=True,
        cwd=tmp_path,
    )
    api = make_model(tmp_path / "api.gguf", "qwen3moe", seed=7, dtype="f16")
    assert out.read_bytes() == api.read_bytes()


def test_all_skips_up_to_date_and_repairs(
    all_models: dict[str, Path], model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--all", str(model_dir)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(PRESETS)
    assert all("up to date" in line for line in lines), lines

    # a damaged file is regenerated, to the same bytes
    d = make_all(tmp_path, presets=["dense"])["dense"]
    good = d.read_bytes()
    assert sidecar_path(d).exists()
    d.write_bytes(good[:-16])
    make_all(tmp_path, presets=["dense"])
    assert d.read_bytes() == good


# ---------------------------------------------------------------- llama.cpp loads and runs them


def test_loads_tokenizes_and_generates(loaded: tuple[str, llama_cpp.Llama]) -> None:
    name, llm = loaded
    p = PRESETS[name]
    assert llm.n_vocab() == len(build_vocab(p.n_vocab_min).tokens)

    toks = llm.tokenize(PROMPT, add_bos=False)
    assert len(toks) == 4, toks  # "▁hello" "▁the" "▁expert" "▁router": merged pieces
    assert not set(toks) & set(BYTE_TOKEN_IDS)
    assert llm.detokenize(toks).strip() == PROMPT

    prompt = llm.tokenize(PROMPT, add_bos=True)
    out = _greedy(llm, prompt, 16)
    assert len(out) == 16
    assert all(0 <= t < llm.n_vocab() for t in out)
    assert len(set(out)) >= 2, out
    assert _greedy(llm, prompt, 16) == out  # greedy is reproducible
    llm.detokenize(out)  # must not raise


def test_bench_vocab_padding(all_models: dict[str, Path]) -> None:
    llm = _load(all_models["bench"])
    try:
        n = llm.n_vocab()
        assert n >= 32_000
        n_base = build_vocab().n_base
        for t in (n_base, n_base + 1, (n_base + n) // 2, n - 1):
            text = llm.detokenize([t]).decode("utf-8")  # valid UTF-8
            assert text.strip(), t
            # padding pieces never come out of tokenizing text
            assert t not in llm.tokenize(text.encode(), add_bos=False)
        assert llm.token_eos() == EOS_ID
    finally:
        llm.close()


def test_smallthinker_metadata(all_models: dict[str, Path]) -> None:
    path = all_models["smallthinker"]
    assert _field(path, "smallthinker.expert_gating_func") == int(gguf.ExpertGatingFuncType.SOFTMAX)
    assert _field(path, "smallthinker.expert_feed_forward_length") == PRESETS["smallthinker"].n_ff


def test_qwen3moe_metadata(all_models: dict[str, Path]) -> None:
    path = all_models["qwen3moe"]
    p = PRESETS["qwen3moe"]
    assert _field(path, "qwen3moe.expert_feed_forward_length") == p.n_ff
    assert _field(path, "qwen3moe.expert_count") == p.n_expert
    names = {t.name for t in gguf.GGUFReader(path).tensors}
    assert "blk.0.attn_q_norm.weight" in names and "blk.0.attn_k_norm.weight" in names


def test_moe_metadata(all_models: dict[str, Path]) -> None:
    for name in ("moe", "bench"):
        assert _field(all_models[name], "llama.expert_count") == 8
        assert _field(all_models[name], "llama.expert_used_count") == 2
    assert gguf.GGUFReader(all_models["dense"]).fields.get("llama.expert_count") is None
