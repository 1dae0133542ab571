"""Tests for sparseety_prof/synthetic: deterministic GGUF test models that llama.cpp really loads."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import gguf
import llama_cpp
import numpy as np
import pytest

from sparseety_prof.synthetic import (
    BYTE_TOKEN_IDS,
    EOS_ID,
    PRESETS,
    Preset,
    Prune,
    build_vocab,
    make_all,
    make_model,
    model_spec,
    parse_prune,
    prune_array,
    sidecar_path,
    swa_layers,
)
from sparseety_prof.synthetic.__main__ import main
from sparseety_prof.synthetic.presets import QUANT_TYPES

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
            "-m",
            "sparseety_prof.synthetic",
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


# ---------------------------------------------------------------- quantized weights (q8_0, q4_0)

QUANTIZED = (
    "token_embd.weight",
    "output.weight",
    "attn_q.weight",
    "attn_k.weight",
    "attn_v.weight",
    "attn_output.weight",
    "ffn_gate.weight",
    "ffn_up.weight",
    "ffn_down.weight",
    "ffn_gate_exps.weight",
    "ffn_up_exps.weight",
    "ffn_down_exps.weight",
)
FFN = (
    "ffn_gate.weight",
    "ffn_up.weight",
    "ffn_down.weight",
    *(f"ffn_{k}_exps.weight" for k in ("gate", "up", "down")),
)


def _short(name: str) -> str:
    return name.split(".", 2)[-1] if name.startswith("blk.") else name


def _tensors(path: Path, only: tuple[str, ...] | None = None) -> dict[str, np.ndarray]:
    """The tensors (those whose name ends with one of ``only``) as float32 in numpy order (ne
    reversed: rows are the last axis), dequantized."""
    out = {}
    for t in gguf.GGUFReader(path).tensors:
        if only is None or t.name.endswith(only):
            a = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
            out[t.name] = a.reshape(tuple(int(n) for n in reversed(t.shape)))
    return out


_CACHE: dict[tuple[str, str | None], dict[str, np.ndarray]] = {}


def _moe_f32(model_dir: Path, prune: str | None) -> dict[str, np.ndarray]:
    """The f32 moe preset's tensors, unpruned or pruned, generated once per session."""
    key = ("moe", prune)
    if key not in _CACHE:
        path = make_model(model_dir / f"moe-f32-{prune}.gguf".replace(":", "_"), "moe", prune=prune)
        _CACHE[key] = _tensors(path)
    return _CACHE[key]


@pytest.mark.parametrize("dtype", list(QUANT_TYPES))
def test_quantized_types_and_determinism(tmp_path: Path, all_models: dict[str, Path], dtype: str) -> None:
    a = make_model(tmp_path / "a.gguf", "moe", dtype=dtype)
    b = make_model(tmp_path / "b.gguf", "moe", dtype=dtype)
    assert a.read_bytes() == b.read_bytes()
    assert a.stat().st_size < all_models["moe"].stat().st_size / 3
    want = {"q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}[dtype]
    assert _field(a, "general.file_type") == int(want)
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(a).tensors}
    for name, ty in types.items():
        if _short(name) in QUANTIZED:
            assert ty == QUANT_TYPES[dtype], name
        else:  # norms and the router stay f32
            assert ty == gguf.GGMLQuantizationType.F32, name
    assert types["blk.0.ffn_gate_inp.weight"] == gguf.GGMLQuantizationType.F32
    # the quantized weights are the f32 file's weights, up to the quantization error
    names = ("blk.1.attn_q.weight", "blk.1.ffn_down_exps.weight", "blk.1.ffn_gate_inp.weight")
    f32, q = _tensors(all_models["moe"], names), _tensors(a, names)
    for name in ("blk.1.attn_q.weight", "blk.1.ffn_down_exps.weight", "blk.1.ffn_gate_inp.weight"):
        err = np.abs(f32[name] - q[name]).max() / np.abs(f32[name]).max()
        assert err < (0.01 if dtype == "q8_0" else 0.15), (name, err)
    assert np.array_equal(f32["blk.1.ffn_gate_inp.weight"], q["blk.1.ffn_gate_inp.weight"])


def test_quantized_row_length_must_fit_blocks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(PRESETS, "odd", Preset(arch="llama", n_embd=96, n_ff=200))
    make_model(tmp_path / "f32.gguf", "odd")  # unquantized: any width
    with pytest.raises(ValueError, match=r"n_ff=200 .* not a multiple of 32"):
        make_model(tmp_path / "q.gguf", "odd", dtype="q4_0")
    assert not list(tmp_path.glob(".*.tmp"))


LOAD_VARIANTS = [
    *((name, "q4_0", None) for name in ("dense", "moe", "qwen3moe", "smallthinker", "swa")),
    ("dense", "q8_0", None),
    ("moe", "q8_0", None),
    ("moe", "q4_0", "2:4"),
    ("smallthinker", "q8_0", "0.5"),
    ("swa", "f16", "2:4"),
]


@pytest.mark.parametrize(("preset", "dtype", "prune"), LOAD_VARIANTS)
def test_variants_load_and_generate(tmp_path: Path, preset: str, dtype: str, prune: str | None) -> None:
    llm = _load(make_model(tmp_path / "m.gguf", preset, dtype=dtype, prune=prune))
    try:
        out = _greedy(llm, llm.tokenize(PROMPT, add_bos=True), 8)
        assert len(out) == 8 and all(0 <= t < llm.n_vocab() for t in out)
        assert len(set(out)) >= 2, out
    finally:
        llm.close()


# ---------------------------------------------------------------- pruning


def test_parse_prune() -> None:
    assert parse_prune(None) is None
    assert parse_prune("2:4") == Prune(n=2, m=4)
    assert parse_prune(" 1 : 8 ") == Prune(n=1, m=8)
    assert parse_prune("0.5") == parse_prune(0.5) == Prune(fraction=0.5)
    assert str(Prune(n=2, m=4)) == "2:4" and str(Prune(fraction=0.25)) == "0.25"
    for bad, why in [("3:2", "1 <= N < M"), ("0:4", "1 <= N < M"), ("4:4", "1 <= N < M"), ("1.5", "< 1")]:
        with pytest.raises(ValueError, match=why):
            parse_prune(bad)
    for kw in ({"n": 3, "m": 2}, {"fraction": 1.0}, {}):
        with pytest.raises(ValueError, match="bad prune"):
            Prune(**kw)
    for bad2 in ("abc", "", "2:", "2:4:8", "0", "1", "-0.5", "nan", 1.5, 0, True):
        with pytest.raises(ValueError, match="bad prune spec"):
            parse_prune(bad2)


def test_prune_array_rule() -> None:
    # N:M: per group of 4, the 2 largest magnitudes stay; ties: the earlier value goes
    a = np.array([[1, -1, 1, 2, -4, 3, 0.5, -0.25]], dtype=np.float32)
    assert prune_array(a, Prune(n=2, m=4)).tolist() == [[0, 0, 1, 2, -4, 3, 0, 0]]
    # fraction on rows longer than 64 (the selection path): round(0.3 * 100) = 30 zeros per row,
    # ties at the threshold zeroed earliest first
    row = np.ones((3, 100), dtype=np.float32)
    row[1, ::2] = -2.0
    out = prune_array(row, Prune(fraction=0.3))
    assert (out == 0).sum(axis=1).tolist() == [30, 30, 30]
    assert (out[0, :30] == 0).all() and (out[0, 30:] == 1).all()
    assert (out[1, 1:60:2] == 0).all() and (out[1, ::2] == -2).all()
    assert not np.signbit(out[out == 0]).any()  # +0.0
    with pytest.raises(ValueError, match="does not divide"):
        prune_array(np.ones((2, 10), dtype=np.float32), Prune(n=1, m=4))


def _check_pattern(w: np.ndarray, spec: Prune, *, exact: bool) -> None:
    rows = w.reshape(-1, w.shape[-1])
    if spec.m:
        nz = (rows.reshape(-1, spec.m) != 0).sum(axis=1)
        assert nz.max() <= spec.n
        if exact:
            assert (nz == spec.n).all()
    else:
        zeros = (rows == 0).sum(axis=1)
        k = spec.zeros_per_row(rows.shape[1])
        assert zeros.min() >= k
        if exact:
            assert (zeros == k).all()


@pytest.mark.parametrize(
    ("dtype", "spec"),
    [("f32", "2:4"), ("f32", "0.5"), ("f16", "2:4"), ("q8_0", "0.5"), ("q4_0", "2:4"), ("q4_0", "0.5")],
)
def test_pruning_pattern_in_file(model_dir: Path, tmp_path: Path, dtype: str, spec: str) -> None:
    pr = parse_prune(spec)
    assert pr is not None
    path = make_model(tmp_path / "p.gguf", "moe", dtype=dtype, prune=pr)
    assert _field(path, "sparseety.prune") == spec
    got = _tensors(path) if dtype == "f32" else _tensors(path, FFN)
    pruned_f32 = _moe_f32(model_dir, spec)
    unpruned = _moe_f32(model_dir, None)
    assert sum(_short(n) in FFN for n in got) == 3 * PRESETS["moe"].n_layer
    for name, w in got.items():
        if _short(name) in FFN:
            _check_pattern(w, pr, exact=dtype in ("f32", "f16"))
            # the zeros sit where the f32 pruning put them: they survive the cast / quantization
            assert (w[pruned_f32[name] == 0] == 0).all(), name
            # and they are the smallest of the unpruned weights (same seed, same random draws)
            if dtype == "f32":
                kept = w != 0
                assert np.array_equal(w[kept], unpruned[name][kept])
        elif dtype == "f32":  # everything else is untouched
            assert np.array_equal(w, unpruned[name]), name


def test_pruning_dense_ffn_down_and_no_key_by_default(tmp_path: Path, all_models: dict[str, Path]) -> None:
    path = make_model(tmp_path / "d.gguf", "dense", prune="1:8")
    w = _tensors(path)
    assert w["blk.0.ffn_down.weight"].shape == (128, 256)  # rows of n_ff values
    _check_pattern(w["blk.0.ffn_down.weight"], Prune(n=1, m=8), exact=True)
    assert gguf.GGUFReader(all_models["dense"]).fields.get("sparseety.prune") is None
    assert model_spec("dense", prune="2:4")["prune"] == "2:4" and model_spec("dense")["prune"] is None
    with pytest.raises(ValueError, match="does not divide"):
        make_model(tmp_path / "x.gguf", "dense", prune="2:3")


def test_cli_prune_and_quant(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cli.gguf"
    assert main([str(out), "--preset", "dense", "--dtype", "q4_0", "--prune", "2:4"]) == 0
    api = make_model(tmp_path / "api.gguf", "dense", dtype="q4_0", prune="2:4")
    assert out.read_bytes() == api.read_bytes()
    for bad in ("3:2", "0:4", "1.5", "abc"):
        with pytest.raises(SystemExit) as e:
            main([str(tmp_path / "bad.gguf"), "--preset", "dense", "--prune", bad])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert "--prune" in err and "bad prune spec" in err, err
    with pytest.raises(SystemExit):
        main([str(tmp_path / "bad.gguf"), "--preset", "dense", "--prune", "3:5"])
    assert "does not divide" in capsys.readouterr().err
    assert not (tmp_path / "bad.gguf").exists()


# ---------------------------------------------------------------- sliding-window attention


def test_swa_metadata(all_models: dict[str, Path]) -> None:
    p = PRESETS["swa"]
    path = all_models["swa"]
    assert _field(path, "general.architecture") == "olmo2"
    assert _field(path, "olmo2.attention.sliding_window") == p.n_swa == 16
    assert _field(path, "olmo2.block_count") == p.n_layer == 8
    assert p.n_ctx >= 256
    # no pattern key: llama.cpp's olmo2 default (pattern 4, every 4th layer full) applies
    assert gguf.GGUFReader(path).fields.get("olmo2.attention.sliding_window_pattern") is None
    assert swa_layers("swa") == p.swa_layers == [0, 1, 2, 4, 5, 6]
    assert p.full_attention_layers == [3, 7]
    assert swa_layers("moe") == [] and PRESETS["moe"].full_attention_layers == [0, 1, 2, 3]
    names = {t.name for t in gguf.GGUFReader(path).tensors}
    assert {"blk.0.post_attention_norm.weight", "blk.0.post_ffw_norm.weight"} <= names
    assert "blk.0.attn_norm.weight" not in names


def test_swa_window_applies(
    tmp_path: Path, all_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Same weights without the window key: identical logits while the prompt fits in the window,
    different from the first position that sees past it (position 16 cannot see position 0)."""
    monkeypatch.setitem(PRESETS, "swa_off", dataclasses.replace(PRESETS["swa"], n_swa=0))
    off = make_model(tmp_path / "off.gguf", "swa_off")

    def logits(path: Path) -> np.ndarray:
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=256, n_threads=2, verbose=False, logits_all=True)
        try:
            toks = [1] + [260 + (i * 37) % 700 for i in range(23)]
            llm.eval(toks)
            return np.array(llm.scores[: len(toks)])
        finally:
            llm.close()

    diff = np.abs(logits(all_models["swa"]) - logits(off)).max(axis=1)
    assert (diff[:16] < 1e-4).all(), diff
    assert (diff[16:] > 1e-2).all(), diff


def test_preset_hyperparameters() -> None:
    for name in ("moe", "qwen3moe", "smallthinker", "bench"):
        p = PRESETS[name]
        assert p.expert_weights_norm and p.expert_gating_func == "softmax"
    assert PRESETS["smallthinker"].ffn_activation == "relu" and PRESETS["moe"].ffn_activation == "silu"
    assert not PRESETS["dense"].expert_weights_norm and PRESETS["dense"].expert_gating_func is None


def test_an_identical_file_is_left_as_it_is(tmp_path: Path) -> None:
    """Rewriting the same model keeps its inode and times (the recorder's remembered sha256 stays
    valid); other bytes, or a symlink at the path, are replaced, the link's target untouched."""
    out = make_model(tmp_path / "m.gguf", "dense")
    before = out.stat()
    make_model(out, "dense")
    after = out.stat()
    assert (after.st_ino, after.st_mtime_ns, after.st_ctime_ns) == (
        before.st_ino,
        before.st_mtime_ns,
        before.st_ctime_ns,
    )
    make_model(out, "dense", seed=7)
    assert out.stat().st_ino != before.st_ino
    target = tmp_path / "elsewhere.gguf"
    target.write_bytes(make_model(tmp_path / "d.gguf", "dense").read_bytes())
    link = tmp_path / "link.gguf"
    link.symlink_to(target)
    make_model(link, "dense")
    assert not link.is_symlink() and link.read_bytes() == target.read_bytes()
