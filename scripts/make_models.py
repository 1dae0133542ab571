#!/usr/bin/env python3
"""Deterministic random-weight GGUF test models for llama.cpp, with a working SPM tokenizer.

Same preset + seed + dtype + n_vocab_min => byte-identical file. Needs only numpy and gguf.

    python scripts/make_models.py OUT.gguf --preset moe [--seed N] [--dtype f32|f16]
    python scripts/make_models.py --all DIR          # DIR/<preset>.gguf for every preset

    from scripts.make_models import make_model, PRESETS
    make_model(tmp_path / "moe.gguf", "moe")

Presets:
  dense         arch llama, dense SwiGLU FFN                              (4 layers, d128, f32)
  moe           Mixtral-style: arch llama, 8 experts, top-2               (4 layers, d128, f32)
  qwen3moe      arch qwen3moe: q/k norm, expert_feed_forward_length       (4 layers, d128, f32)
  smallthinker  arch smallthinker: ReGLU experts (about half the expert
                activations are exactly zero), gating func SOFTMAX        (4 layers, d128, f32)
  bench         Mixtral-style MoE big enough that decode costs a few ms/token, vocab >= 32,000
                (8 layers, d512, 8 heads / 4 kv heads, 8 experts x ff1024, top-2, f16)

The tokenizer is SentencePiece-style ("llama" model) with byte fallback: <unk>, <s>, </s>,
256 <0xXX> byte tokens, "▁", single characters, then common English words with every prefix
(an SPM vocab merges two symbols only when their concatenation is itself a token, so without
the prefixes nothing merges). Presets that ask for a larger vocab are padded with unique NORMAL
pieces "▁" + four Greek letters: valid tokens the model may sample, which detokenize to valid
UTF-8, but which tokenizing text never produces (no single Greek letter and no two-symbol piece
of them is in the vocab, so nothing can merge into them; Greek text falls back to bytes).

Weights: router (ffn_gate_inp) scaled x3 so routing differs per token; output.weight scale
4/sqrt(D) so next-token distributions are peaky but not degenerate; norms and router stay f32.

Measured for the bench preset (llama-cpp-python 0.3.36, this 2-core CPU machine, greedy decode of
64 tokens after load and two warm-up runs, prompt "hello the expert router", n_ctx=256; median of 5):
  file size 280,475,264 bytes (267.5 MiB), generated in ~3-4 s; vocab 32,000
  decode: 1 thread ~5.0-5.6 ms/token;  2 threads ~4.3 ms/token (4.2-4.8)
  (the first run after load is 40-80 ms/token while the mmapped weights fault in)
The small presets are 3.5 MB (dense) or 14.5 MB (MoE, f32), generated in < 0.1 s each, and decode
in ~0.25-0.5 ms/token.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import numpy.typing as npt

GENERATOR_VERSION = 1

UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
#: token ids of the 256 byte-fallback tokens <0x00>..<0xFF>
BYTE_TOKEN_IDS = range(3, 3 + 256)
SPACE = "\u2581"  # '▁', SentencePiece's word-boundary marker

DTYPES = ("f32", "f16")
ARCHS = ("llama", "qwen3moe", "smallthinker")


@dataclass(frozen=True)
class Preset:
    """Shape of a generated model. ``n_ff`` is the FFN width (per expert for MoE)."""

    arch: str
    n_layer: int = 4
    n_embd: int = 128
    n_head: int = 4
    n_head_kv: int = 2
    n_ff: int = 256
    n_expert: int = 0
    n_expert_used: int = 0
    n_ctx: int = 1024
    dtype: str = "f32"
    n_vocab_min: int = 0
    description: str = ""


PRESETS: dict[str, Preset] = {
    "dense": Preset(arch="llama", description="dense llama (SwiGLU FFN)"),
    "moe": Preset(
        arch="llama", n_expert=8, n_expert_used=2, description="Mixtral-style MoE, 8 experts top-2"
    ),
    "qwen3moe": Preset(
        arch="qwen3moe", n_expert=8, n_expert_used=2, description="Qwen3-MoE: q/k norm, expert FFN width"
    ),
    "smallthinker": Preset(
        arch="smallthinker",
        n_expert=8,
        n_expert_used=2,
        description="SmallThinker MoE with ReGLU experts (exact-zero activations)",
    ),
    "bench": Preset(
        arch="llama",
        n_layer=8,
        n_embd=512,
        n_head=8,
        n_head_kv=4,
        n_ff=1024,
        n_expert=8,
        n_expert_used=2,
        n_ctx=2048,
        dtype="f16",
        n_vocab_min=32_000,
        description="Mixtral-style MoE sized for overhead measurements, vocab >= 32000",
    ),
}

# ---------------------------------------------------------------- tokenizer

_CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?;:'\"-()"
_WORDS_TEXT = (
    "the of and to in is it that was for on are with as be at by this had not but from or have an "
    "they which one you were her all she there would their we him been has when who will more no "
    "if out so said what up its about into than them can only other new some could time these two "
    "may then do first any my now such like our over man me even most made after also did many "
    "before must through back years where much your way well down should because each just those "
    "people how too little state good very make world still own see men work long get here between "
    "both life being under never day same another know while last might us great old year off come "
    "since against go came right used take three hello token expert router sparse decode sample"
)
_WORDS = _WORDS_TEXT.split()
# Greek lowercase without final sigma: 24 letters -> 24**4 = 331,776 padding pieces available
_PAD_ALPHABET = "".join(chr(c) for c in range(0x03B1, 0x03CA) if c != 0x03C2)
_PAD_LEN = 4


@dataclass(frozen=True)
class Vocab:
    tokens: list[str]
    scores: list[float]
    types: list[int]
    n_base: int  # tokens before padding; ids >= n_base are padding pieces


def build_vocab(n_vocab_min: int = 0) -> Vocab:
    """SPM ('llama') vocab with byte fallback, padded to at least ``n_vocab_min`` entries."""
    T = gguf.TokenType
    tokens: list[str] = []
    scores: list[float] = []
    types: list[int] = []
    seen: set[str] = set()

    def add(text: str, score: float, ty: gguf.TokenType) -> None:
        if text in seen:
            raise AssertionError(f"duplicate token {text!r}")
        seen.add(text)
        tokens.append(text)
        scores.append(float(score))
        types.append(int(ty))

    add("<unk>", 0.0, T.UNKNOWN)
    add("<s>", 0.0, T.CONTROL)
    add("</s>", 0.0, T.CONTROL)
    for b in range(256):
        add(f"<0x{b:02X}>", 0.0, T.BYTE)
    add(SPACE, -1.0, T.NORMAL)
    for i, c in enumerate(_CHARS):
        add(c, -2.0 - i * 1e-3, T.NORMAL)  # below merged pieces, so merges win
    for w in _WORDS:
        for piece in (SPACE + w, w):
            for k in range(2, len(piece) + 1):
                pre = piece[:k]
                if pre not in seen:
                    add(pre, -1.0 + 0.1 * len(pre), T.NORMAL)  # longer pieces preferred
    n_base = len(tokens)

    n_pad = max(0, n_vocab_min - n_base)
    if n_pad > len(_PAD_ALPHABET) ** _PAD_LEN:
        raise ValueError(f"n_vocab_min={n_vocab_min} is larger than this generator can pad to")
    for letters in itertools.islice(itertools.product(_PAD_ALPHABET, repeat=_PAD_LEN), n_pad):
        add(SPACE + "".join(letters), -1000.0, T.NORMAL)
    return Vocab(tokens, scores, types, n_base)


# ---------------------------------------------------------------- model


def _resolve(preset: str, dtype: str | None, n_vocab_min: int | None) -> tuple[Preset, str, int]:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    p = PRESETS[preset]
    dt = dtype or p.dtype
    if dt not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, not {dt!r}")
    nv = p.n_vocab_min if n_vocab_min is None else n_vocab_min
    return p, dt, nv


def _write_gguf(path: Path, p: Preset, *, seed: int, dtype: str, n_vocab_min: int, name: str) -> None:
    if p.arch not in ARCHS:
        raise ValueError(f"unsupported arch {p.arch!r}")
    if p.arch != "llama" and p.n_expert == 0:
        raise ValueError(f"arch {p.arch} needs experts")
    if p.n_embd % p.n_head or p.n_head % p.n_head_kv:
        raise ValueError("n_embd must divide by n_head, n_head by n_head_kv")

    rng = np.random.default_rng(seed)
    wdt: type[np.floating[Any]] = np.float32 if dtype == "f32" else np.float16
    vocab = build_vocab(n_vocab_min)
    n_vocab = len(vocab.tokens)
    E, D, F, hd = p.n_expert, p.n_embd, p.n_ff, p.n_embd // p.n_head

    w = gguf.GGUFWriter(str(path), p.arch)
    w.add_name(name)
    w.add_context_length(p.n_ctx)
    w.add_embedding_length(D)
    w.add_block_count(p.n_layer)
    w.add_head_count(p.n_head)
    w.add_head_count_kv(p.n_head_kv)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(n_vocab)
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if dtype == "f32" else gguf.LlamaFileType.MOSTLY_F16)
    if p.arch == "llama":
        w.add_feed_forward_length(F)
    else:  # qwen3moe / smallthinker: dense width unused, the expert width is its own key
        w.add_feed_forward_length(F * p.n_expert_used)
        w.add_expert_feed_forward_length(F)
    if p.arch == "smallthinker":
        # without it build_moe_ffn aborts (the default gating func is "none")
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SOFTMAX)
    if E:
        w.add_expert_count(E)
        w.add_expert_used_count(p.n_expert_used)

    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(vocab.tokens)
    w.add_token_scores(vocab.scores)
    w.add_token_types(vocab.types)
    w.add_unk_token_id(UNK_ID)
    w.add_bos_token_id(BOS_ID)
    w.add_eos_token_id(EOS_ID)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)

    def mat(*shape: int, scale: float | None = None) -> npt.NDArray[Any]:
        """Random matrix; numpy shape is ggml's ne reversed, so fan-in is the last axis."""
        s = scale if scale is not None else 1.0 / float(np.sqrt(shape[-1]))
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(s)).astype(wdt)

    def norm(n: int) -> npt.NDArray[np.float32]:
        return np.ones(n, dtype=np.float32)  # norms stay f32

    w.add_tensor("token_embd.weight", mat(n_vocab, D, scale=1.0))
    w.add_tensor("output_norm.weight", norm(D))
    w.add_tensor("output.weight", mat(n_vocab, D, scale=4.0 / float(np.sqrt(D))))
    for i in range(p.n_layer):
        b = f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", norm(D))
        w.add_tensor(b + "attn_q.weight", mat(p.n_head * hd, D))
        w.add_tensor(b + "attn_k.weight", mat(p.n_head_kv * hd, D))
        w.add_tensor(b + "attn_v.weight", mat(p.n_head_kv * hd, D))
        w.add_tensor(b + "attn_output.weight", mat(D, p.n_head * hd))
        if p.arch == "qwen3moe":
            w.add_tensor(b + "attn_q_norm.weight", norm(hd))
            w.add_tensor(b + "attn_k_norm.weight", norm(hd))
        w.add_tensor(b + "ffn_norm.weight", norm(D))
        if E:
            # router x3: peaky, token-dependent routing; kept f32
            router = mat(E, D, scale=3.0 / float(np.sqrt(D))).astype(np.float32)
            w.add_tensor(b + "ffn_gate_inp.weight", router)
            w.add_tensor(b + "ffn_gate_exps.weight", mat(E, F, D))
            w.add_tensor(b + "ffn_up_exps.weight", mat(E, F, D))
            w.add_tensor(b + "ffn_down_exps.weight", mat(E, D, F))
        else:
            w.add_tensor(b + "ffn_gate.weight", mat(F, D))
            w.add_tensor(b + "ffn_up.weight", mat(F, D))
            w.add_tensor(b + "ffn_down.weight", mat(D, F))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def make_model(
    path: str | os.PathLike[str],
    preset: str,
    *,
    seed: int = 1234,
    dtype: str | None = None,
    n_vocab_min: int | None = None,
) -> Path:
    """Write preset ``preset`` to ``path`` (atomically) and return the path.

    ``dtype`` (f32/f16) and ``n_vocab_min`` default to the preset's. Deterministic: the same
    arguments give a byte-identical file.
    """
    p, dt, nv = _resolve(preset, dtype, n_vocab_min)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        _write_gguf(tmp, p, seed=seed, dtype=dt, n_vocab_min=nv, name=f"sparseety-test-{preset}")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


# ---------------------------------------------------------------- --all with sidecars


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def model_spec(preset: str, *, seed: int = 1234, dtype: str | None = None) -> dict[str, Any]:
    """What determines a generated file's bytes (recorded in the sidecar next to it)."""
    p, dt, nv = _resolve(preset, dtype, None)
    return {
        "generator_version": GENERATOR_VERSION,
        "generator_sha256": _file_sha256(Path(__file__)),
        "gguf_version": getattr(gguf, "__version__", None) or _gguf_dist_version(),
        "numpy_version": np.__version__,
        "preset": preset,
        "params": asdict(p),
        "seed": seed,
        "dtype": dt,
        "n_vocab_min": nv,
    }


def _gguf_dist_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gguf")
    except PackageNotFoundError:
        return None


def sidecar_path(model_path: Path) -> Path:
    return model_path.with_name(model_path.name + ".json")


def ensure_model(path: Path, preset: str, *, seed: int = 1234, dtype: str | None = None) -> bool:
    """Generate ``path`` unless it exists with matching sidecar spec and content hash.

    Returns True when the file was (re)generated, False when it was up to date.
    """
    spec = model_spec(preset, seed=seed, dtype=dtype)
    side = sidecar_path(path)
    if path.exists() and side.exists():
        try:
            rec = json.loads(side.read_text())
        except (OSError, ValueError):
            rec = None
        if isinstance(rec, dict) and rec.get("spec") == spec and rec.get("sha256") == _file_sha256(path):
            return False
    make_model(path, preset, seed=seed, dtype=dtype)
    rec = {"spec": spec, "sha256": _file_sha256(path), "size": path.stat().st_size}
    side.write_text(json.dumps(rec, indent=1, sort_keys=True) + "\n")
    return True


def make_all(
    out_dir: str | os.PathLike[str],
    *,
    seed: int = 1234,
    dtype: str | None = None,
    presets: Sequence[str] | None = None,
    log: Any = None,
) -> dict[str, Path]:
    """Write every preset (or ``presets``) as ``out_dir/<preset>.gguf``; returns name -> path."""
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    names = list(presets) if presets is not None else list(PRESETS)
    result: dict[str, Path] = {}
    for i, name in enumerate(names, 1):
        path = d / f"{name}.gguf"
        t0 = time.perf_counter()
        made = ensure_model(path, name, seed=seed, dtype=dtype)
        dt = time.perf_counter() - t0
        if log is not None:
            what = "wrote" if made else "up to date"
            size_mb = path.stat().st_size / 1e6
            print(f"[{i}/{len(names)}] {name:<13} {what:<10} {path} ({size_mb:.1f} MB, {dt:.2f} s)", file=log)
        result[name] = path
    return result


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="Write deterministic random-weight GGUF test models (llama.cpp).",
        epilog="presets: " + "; ".join(f"{k}: {v.description}" for k, v in PRESETS.items()),
    )
    ap.add_argument("out", nargs="?", help="output .gguf path (single-model mode)")
    ap.add_argument("--preset", choices=list(PRESETS), help="model preset (single-model mode)")
    ap.add_argument("--all", metavar="DIR", dest="all_dir", help="write every preset as DIR/<preset>.gguf")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--dtype", choices=list(DTYPES), default=None, help="default: the preset's")
    ap.add_argument("--n-vocab-min", type=int, default=None, help="pad the vocab to at least this size")
    a = ap.parse_args(argv)

    if a.all_dir is not None:
        if a.out is not None or a.preset is not None or a.n_vocab_min is not None:
            ap.error("--all takes no OUT, --preset or --n-vocab-min")
        make_all(a.all_dir, seed=a.seed, dtype=a.dtype, log=sys.stdout)
        return 0
    if a.out is None or a.preset is None:
        ap.error("give OUT.gguf --preset NAME, or --all DIR")
    t0 = time.perf_counter()
    path = make_model(a.out, a.preset, seed=a.seed, dtype=a.dtype, n_vocab_min=a.n_vocab_min)
    size_mb = path.stat().st_size / 1e6
    print(f"{a.preset}: wrote {path} ({size_mb:.1f} MB, {time.perf_counter() - t0:.2f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
