#!/usr/bin/env python3
"""Deterministic random-weight GGUF test models for llama.cpp, with a working SPM tokenizer.

Same preset + seed + dtype + n_vocab_min + prune => byte-identical file. Needs only numpy and gguf.

    python tests/make_models.py OUT.gguf --preset moe [--seed N] [--dtype f32|f16|q8_0|q4_0]
                                  [--prune N:M|FRACTION]
    python tests/make_models.py --all DIR          # DIR/<preset>.gguf for every preset

    from make_models import make_model, PRESETS
    make_model(tmp_path / "moe.gguf", "moe")
    make_model(tmp_path / "moe-q4.gguf", "moe", dtype="q4_0", prune="2:4")

Presets:
  dense         arch llama, dense SwiGLU FFN                              (4 layers, d128, f32)
  moe           Mixtral-style: arch llama, 8 experts, top-2               (4 layers, d128, f32)
  qwen3moe      arch qwen3moe: q/k norm, expert_feed_forward_length       (4 layers, d128, f32)
  smallthinker  arch smallthinker: ReGLU experts (about half the expert
                activations are exactly zero), gating func SOFTMAX        (4 layers, d128, f32)
  swa           arch olmo2 with sliding-window attention, window 16: layers 0,1,2,4,5,6 attend to
                the last 16 positions only, layers 3 and 7 to the whole context (8 layers, d128, f32)
  token_routed  Mixtral-style MoE, 16 experts top-4, layer 0's attention output zero: layer 0's router
                sees the token embedding alone, so its routing is a function of the token (audit:
                near-total recovery)                                      (4 layers, d128, f32)
  context_routed Mixtral-style MoE whose routing follows the context, not the token: token
                embeddings x0.02, every layer attends uniformly to the prefix (attn_q zero) and its
                attention output x4, so each router sees mostly the running mean of the prompt
                (audit: near chance)                                      (4 layers, d128, f32)
  planted       token_routed's layer 0 (attention output zero) with 8 experts top-2, and the token
                "▁sparse" with an all-zero embedding (layer 0's FFN input for it is exactly 0, so
                are all its activations): anomalies are planted by the tokens a test forces
                (tests/test_anomalies_planted.py)                         (4 layers, d128, f32)
  loud_context  context_routed, except the token "▁expert" has an embedding 1000x the others': the
                row of that token is routed by the token, the rest by the prefix (4 layers, d128, f32)
  bench         Mixtral-style MoE big enough that decode costs a few ms/token, vocab >= 32,000
                (8 layers, d512, 8 heads / 4 kv heads, 8 experts x ff1024, top-2, f16)

``swa_layers(preset)`` lists a preset's SWA layers, ``Preset.n_swa`` is its window. The "swa" preset
writes only ``olmo2.attention.sliding_window`` (no pattern key): llama.cpp's olmo2 loader then applies
its built-in pattern 4 (set_swa_pattern(4, dense_first=false): layer il is SWA iff il % 4 < 3), the
same layout as OLMo-3. A query at position p sees keys p-15..p (masked when p - p_key >= 16).

dtypes (--dtype; default the preset's):
  f32, f16      every weight matrix in that type
  q8_0, q4_0    the weight matrices (attention q/k/v/output, FFN and per-expert FFN, token embedding,
                output) quantized with gguf.quants (ggml blocks of 32 values along each row, symmetric:
                one f16 scale per block, no offset); norms and the MoE router ffn_gate_inp stay f32, as
                in real quantized MoE models. Row lengths (n_embd, n_ff) must be multiples of 32.

Pruning (--prune; static weight sparsity of the FFN weights ffn_gate/ffn_up/ffn_down and
ffn_gate_exps/ffn_up_exps/ffn_down_exps, applied to the f32 values before any f16 cast or
quantization). Rows are the innermost dimension (ggml ne0, the fan-in):
  N:M           in every group of M consecutive values of a row keep the N largest magnitudes and set
                the other M-N to exactly 0 (e.g. 2:4, NVIDIA's semi-structured sparsity);
                1 <= N < M, and M must divide the row lengths (n_embd for gate/up, n_ff for down)
  FRACTION      0 < FRACTION < 1: in every row set the round(FRACTION * row length) smallest
                magnitudes to exactly 0 (e.g. 0.5)
Magnitude ties are broken by position (the earlier value is zeroed), so pruning is deterministic.
The zeros survive q8_0 and q4_0: symmetric block quantization maps 0 to the zero code (q8_0: 0,
q4_0: 8, which dequantizes to (8 - 8) * d), and the generator checks that it did. Pruned files carry
the spec in the extra key "sparseety.prune" (llama.cpp ignores unknown keys).

The tokenizer is SentencePiece-style ("llama" model) with byte fallback: <unk>, <s>, </s>,
256 <0xXX> byte tokens, "▁", single characters, then common English words with every prefix
(an SPM vocab merges two symbols only when their concatenation is itself a token, so without
the prefixes nothing merges). Presets that ask for a larger vocab are padded with unique NORMAL
pieces "▁" + four Greek letters: valid tokens the model may sample, which detokenize to valid
UTF-8, but which tokenizing text never produces (no single Greek letter and no two-symbol piece
of them is in the vocab, so nothing can merge into them; Greek text falls back to bytes).

Weights: router (ffn_gate_inp) scaled x3 so routing differs per token; output.weight scale
4/sqrt(D) so next-token distributions are peaky but not degenerate; norms and router stay f32.
MoE routing in all three MoE archs (llama.cpp build_moe_ffn): softmax over all experts, top-k,
top-k weights renormalized to sum 1 (Preset.expert_gating_func / expert_weights_norm say so).

Measured for the bench preset (llama-cpp-python 0.3.36, this 2-core CPU machine, greedy decode of
64 tokens after load and two warm-up runs, prompt "hello the expert router", n_ctx=256; median of 5):
  file size 280,475,264 bytes (267.5 MiB), generated in ~3-4 s; vocab 32,000
  decode: 1 thread ~5.0-5.6 ms/token;  2 threads ~4.3 ms/token (4.2-4.8)
  (the first run after load is 40-80 ms/token while the mmapped weights fault in)
The small presets are 3.5 MB (dense) or 14.5 MB (MoE, f32), generated in < 0.1 s each, and decode
in ~0.25-0.5 ms/token.
File sizes (MB) and generation times on this machine (noisy, a loaded 2-core VM):
                f32      f16     q8_0     q4_0   generation (pruned: about x2)
  dense        3.47     1.75     0.94     0.51   < 0.1 s
  moe etc.    14.50     7.27     3.89     2.08   0.1-0.25 s (qwen3moe, smallthinker: within 2 KB)
  swa          5.84     2.94     1.58     0.86   < 0.1 s
  bench       560.0    280.5    149.5     79.6   3-8 s; with --prune 2:4 or 0.5: 5-12 s
Quantizing the bench model costs about as much as drawing its weights (numpy quantization); the
fraction pruning of 1024-value rows uses an O(n) selection rather than a sort. Every quantized
and pruned variant of dense, moe, qwen3moe, smallthinker and swa loads and generates in
llama-cpp-python 0.3.36 and (checked for swa, swa q4_0 0.5 and moe q4_0 2:4) in xllamacpp, which
gives the same greedy tokens; routing still differs per token with q8_0/q4_0 (the router is f32).
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import math
import os
import re
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

DTYPES = ("f32", "f16", "q8_0", "q4_0")
#: ggml block-quantized dtypes: weight matrices are written in these, norms and router stay f32
QUANT_TYPES: dict[str, gguf.GGMLQuantizationType] = {
    "q8_0": gguf.GGMLQuantizationType.Q8_0,
    "q4_0": gguf.GGMLQuantizationType.Q4_0,
}
_FILE_TYPES: dict[str, gguf.LlamaFileType] = {
    "f32": gguf.LlamaFileType.ALL_F32,
    "f16": gguf.LlamaFileType.MOSTLY_F16,
    "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
}
ARCHS = ("llama", "qwen3moe", "smallthinker", "olmo2")
MOE_ARCHS = ("qwen3moe", "smallthinker")  # archs that have no dense-FFN variant
#: llama.cpp's olmo2 loader calls load_swa_pattern(ml, 4) with dense_first=false when the GGUF has
#: no sliding_window_pattern key: layer il is SWA iff il % 4 < 4 - 1 (vendored llama.cpp 0c1e570,
#: src/models/olmo2.cpp and llama_hparams::set_swa_pattern)
OLMO2_SWA_PATTERN = 4


@dataclass(frozen=True)
class Preset:
    """Shape of a generated model. ``n_ff`` is the FFN width (per expert for MoE).

    ``n_swa`` is the sliding-attention window (0: none; only arch olmo2 reads it): a query at
    position p sees the keys at p - n_swa + 1 .. p on the layers ``swa_layers`` lists.
    """

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
    n_swa: int = 0
    #: "random" (drawn weights), "token" (layer 0's routing is a function of the token alone) or
    #: "context" (routing dominated by the prefix, nearly independent of the token): see the presets
    routing: str = "random"
    #: a vocabulary piece whose embedding is all zero (a pruned embedding row): with routing "token"
    #: layer 0's FFN input for it is exactly zero, so every activation of that layer is exactly 0
    zero_token: str = ""
    #: a vocabulary piece whose embedding is 1000x the others' under routing "context" (20x the usual
    #: full scale): its own position is routed by the token, not the prefix
    loud_token: str = ""
    description: str = ""

    # Hyper-parameters that the engine fixes per arch (not read from the GGUF), for consumers that
    # recompute what the model does, e.g. the routing weights of a recorded router output.

    @property
    def swa_layers(self) -> list[int]:
        """Layers that use sliding-window attention (window ``n_swa``); the rest attend to all."""
        if not self.n_swa:
            return []
        k = OLMO2_SWA_PATTERN
        return [il for il in range(self.n_layer) if il % k < k - 1]

    @property
    def full_attention_layers(self) -> list[int]:
        swa = set(self.swa_layers)
        return [il for il in range(self.n_layer) if il not in swa]

    @property
    def expert_gating_func(self) -> str | None:
        """How router logits become probabilities: "softmax" for every MoE preset (llama and
        qwen3moe hard-code it; smallthinker reads it from the GGUF, which says SOFTMAX)."""
        return "softmax" if self.n_expert else None

    @property
    def expert_weights_norm(self) -> bool:
        """Whether the top-k routing weights are renormalized to sum 1 (build_moe_ffn norm_w):
        true in all three MoE archs' graphs."""
        return self.n_expert > 0

    @property
    def ffn_activation(self) -> str:
        """Gate activation of the (expert) FFN: ReGLU for smallthinker, SwiGLU otherwise."""
        return "relu" if self.arch == "smallthinker" else "silu"


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
    "swa": Preset(
        arch="olmo2",
        n_layer=8,
        n_swa=16,
        description="OLMo-2/3 dense, sliding-window attention (window 16) on layers 0-2 and 4-6, "
        "full attention on 3 and 7",
    ),
    "token_routed": Preset(
        arch="llama",
        n_ff=64,
        n_expert=16,
        n_expert_used=4,
        routing="token",
        description="MoE whose layer-0 routing is a function of the token (16 experts top-4)",
    ),
    "context_routed": Preset(
        arch="llama",
        n_ff=64,
        n_expert=8,
        n_expert_used=2,
        routing="context",
        description="MoE whose routing follows the running mean of the prefix, not the token",
    ),
    "planted": Preset(
        arch="llama",
        n_expert=8,
        n_expert_used=2,
        routing="token",
        zero_token=SPACE + "sparse",
        description="token_routed's layer 0 with 8 experts top-2, and the token '▁sparse' with an all-zero "
        "embedding: anomalies planted by the tokens fed (tests/test_anomalies_planted.py)",
    ),
    "loud_context": Preset(
        arch="llama",
        n_ff=64,
        n_expert=8,
        n_expert_used=2,
        routing="context",
        loud_token=SPACE + "expert",
        description="context_routed, but the token '▁expert' has an embedding 1000x the others': its "
        "routing jumps",
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


# ---------------------------------------------------------------- pruning


@dataclass(frozen=True)
class Prune:
    """A static weight-sparsity pattern: N:M (``n`` of every ``m`` kept) or a zero ``fraction``."""

    n: int = 0
    m: int = 0
    fraction: float = 0.0

    def __post_init__(self) -> None:
        # a Prune built directly (not by parse_prune) must be as valid as a parsed one
        if self.m or self.n:
            if not 1 <= self.n < self.m or self.fraction:
                raise ValueError(f"bad prune N:M {self.n}:{self.m}: needs 1 <= N < M and no fraction")
        elif not 0.0 < self.fraction < 1.0:
            raise ValueError(f"bad prune fraction {self.fraction!r}: needs 0 < fraction < 1")

    def __str__(self) -> str:
        return f"{self.n}:{self.m}" if self.m else repr(self.fraction)

    def zeros_per_row(self, row_len: int) -> int:
        """How many values of a row of ``row_len`` values are set to 0."""
        if self.m:
            return row_len // self.m * (self.m - self.n)
        return math.floor(self.fraction * row_len + 0.5)  # round half up, not numpy's half-even

    def check_row(self, row_len: int, what: str) -> None:
        if self.m and row_len % self.m:
            raise ValueError(f"prune {self}: M={self.m} does not divide the row length {row_len} of {what}")


_NM_RE = re.compile(r"\s*(\d+)\s*:\s*(\d+)\s*")


def parse_prune(spec: str | float | Prune | None) -> Prune | None:
    """Parse ``"N:M"`` (1 <= N < M) or a fraction ``0 < f < 1`` (``"0.5"`` or ``0.5``).

    Raises ValueError with the accepted forms on anything else (``"3:2"``, ``"0:4"``, ``1.5``,
    ``"abc"``).
    """
    if spec is None or isinstance(spec, Prune):
        return spec
    forms = 'use N:M with 1 <= N < M (e.g. "2:4") or a zero fraction 0 < f < 1 (e.g. "0.5")'
    if isinstance(spec, str):
        if mt := _NM_RE.fullmatch(spec):
            n, m = int(mt.group(1)), int(mt.group(2))
            if not 1 <= n < m:
                raise ValueError(f'bad prune spec {spec!r}: N:M needs 1 <= N < M (e.g. "2:4")')
            return Prune(n=n, m=m)
        try:
            frac = float(spec)
        except ValueError:
            raise ValueError(f"bad prune spec {spec!r}; {forms}") from None
    elif isinstance(spec, int | float) and not isinstance(spec, bool):
        frac = float(spec)
    else:
        raise ValueError(f"bad prune spec {spec!r}; {forms}")
    if not 0.0 < frac < 1.0:  # also rejects nan
        raise ValueError(f"bad prune spec {spec!r}: a fraction must be > 0 and < 1; {forms}")
    return Prune(fraction=frac)


def prune_array(a: npt.NDArray[np.float32], spec: Prune) -> npt.NDArray[np.float32]:
    """``a`` with ``spec`` applied along its last axis (ggml's ne0, a row); returns a new array.

    Each group of M (N:M) or each row (fraction) loses its k smallest magnitudes; among equal
    magnitudes the earlier position is zeroed first, so the result depends on the values only.
    """
    row_len = a.shape[-1]
    spec.check_row(row_len, f"a tensor of shape {a.shape}")
    width = spec.m if spec.m else row_len
    k = spec.m - spec.n if spec.m else spec.zeros_per_row(row_len)
    groups = np.array(a, dtype=np.float32).reshape(-1, width)  # a copy; rows split into groups
    if k == 0:
        return groups.reshape(a.shape)
    mag = np.abs(groups)
    if width <= 64:
        # short groups: a stable argsort is fastest, and its order is the tie rule itself
        order = np.argsort(mag, axis=-1, kind="stable")
        np.put_along_axis(groups, order[:, :k], np.float32(0.0), axis=-1)  # +0.0, never -0.0
    else:
        # long rows (fraction): O(n) selection, ~2.5x faster than sorting 1024-value rows. Zero
        # everything below the k-th smallest magnitude, then as many of the values equal to it,
        # earliest first, as k still needs: the same set a stable argsort's first k would give.
        kth = np.partition(mag, k - 1, axis=-1)[:, k - 1 : k]
        below = mag < kth
        need = k - below.sum(axis=-1, keepdims=True)
        at = mag == kth
        groups[below | (at & (np.cumsum(at, axis=-1) <= need))] = np.float32(0.0)
    return groups.reshape(a.shape)


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


def _check(p: Preset, dtype: str, prune: Prune | None) -> None:
    """Reject what llama.cpp or the quantizer would reject, before writing anything."""
    if p.arch not in ARCHS:
        raise ValueError(f"unsupported arch {p.arch!r}")
    if p.arch in MOE_ARCHS and p.n_expert == 0:
        raise ValueError(f"arch {p.arch} needs experts")
    if p.arch == "olmo2" and p.n_expert:
        raise ValueError("arch olmo2 is dense (its loader has no expert tensors)")
    if p.routing not in ("random", "token", "context") or (p.routing != "random" and not p.n_expert):
        raise ValueError(f"routing {p.routing!r} needs experts and is one of random, token, context")
    if p.zero_token and p.routing != "token":
        raise ValueError("zero_token needs routing 'token' (layer 0 must see the embedding alone)")
    if p.loud_token and p.routing != "context":
        raise ValueError("loud_token needs routing 'context' (the only one that scales embeddings down)")
    if p.n_swa and p.arch != "olmo2":
        # other archs here either ignore the key or (smallthinker) force their own window
        raise ValueError(f"n_swa needs arch olmo2, not {p.arch}")
    if p.n_embd % p.n_head or p.n_head % p.n_head_kv:
        raise ValueError("n_embd must divide by n_head, n_head by n_head_kv")
    # every matrix row (ggml ne0) is n_embd long, except ffn_down's (n_ff); attn_output's is
    # n_head * head_dim == n_embd
    rows = {"n_embd": p.n_embd, "n_ff": p.n_ff}
    if dtype in QUANT_TYPES:
        block = gguf.GGML_QUANT_SIZES[QUANT_TYPES[dtype]][0]
        for what, n in rows.items():
            if n % block:
                raise ValueError(
                    f"dtype {dtype} quantizes rows in blocks of {block} values: {what}={n} of this "
                    f"preset is not a multiple of {block} (use f32/f16)"
                )
    if prune is not None:
        for what, n in rows.items():
            prune.check_row(n, f"the FFN rows ({what})")


def _write_gguf(
    path: Path, p: Preset, *, seed: int, dtype: str, n_vocab_min: int, name: str, prune: Prune | None
) -> None:
    _check(p, dtype, prune)

    rng = np.random.default_rng(seed)
    qtype = QUANT_TYPES.get(dtype)
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
    w.add_file_type(_FILE_TYPES[dtype])
    if p.arch in MOE_ARCHS:  # the dense width is unused, the expert width is its own key
        w.add_feed_forward_length(F * p.n_expert_used)
        w.add_expert_feed_forward_length(F)
    else:
        w.add_feed_forward_length(F)
    if p.arch == "smallthinker":
        # without it build_moe_ffn aborts (the default gating func is "none")
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SOFTMAX)
    if E:
        w.add_expert_count(E)
        w.add_expert_used_count(p.n_expert_used)
    if p.n_swa:
        w.add_sliding_window(p.n_swa)  # olmo2: the key alone turns SWA on, with pattern 4
    if prune is not None:
        w.add_string("sparseety.prune", str(prune))  # only on pruned files: defaults stay v1 bytes

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

    def draw(*shape: int, scale: float | None = None) -> npt.NDArray[np.float32]:
        """Random f32 matrix; numpy shape is ggml's ne reversed, so fan-in is the last axis."""
        s = scale if scale is not None else 1.0 / float(np.sqrt(shape[-1]))
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(s)

    def weight(tname: str, a: npt.NDArray[np.float32], *, ffn: bool = False) -> None:
        """Write weight matrix ``a`` in ``dtype``, pruned first when it is an FFN weight."""
        pruned = ffn and prune is not None
        if pruned:
            assert prune is not None
            a = prune_array(a, prune)
        if qtype is None:
            w.add_tensor(tname, a.astype(np.float32 if dtype == "f32" else np.float16))
            return
        q = gguf.quants.quantize(a, qtype)
        if pruned:
            # symmetric block quants map 0 to the zero code; make sure the file really holds zeros
            back = gguf.quants.dequantize(q, qtype)
            if np.any(back[a == 0] != 0):
                raise AssertionError(f"{tname}: pruned zeros did not survive {dtype} quantization")
        w.add_tensor(tname, q, raw_dtype=qtype)

    def norm(tname: str, n: int) -> None:
        w.add_tensor(tname, np.ones(n, dtype=np.float32))  # norms stay f32

    # "context": embeddings small next to the attention output, so the residual stream (and every
    # router) holds mostly the prefix mean; the draws are the same, only scaled
    embd = draw(n_vocab, D, scale=0.02 if p.routing == "context" else 1.0)
    if p.zero_token:
        embd[vocab.tokens.index(p.zero_token)] = 0.0
    if p.loud_token:
        embd[vocab.tokens.index(p.loud_token)] *= np.float32(1000.0)  # 20x the usual full scale
    weight("token_embd.weight", embd)
    norm("output_norm.weight", D)
    weight("output.weight", draw(n_vocab, D, scale=4.0 / float(np.sqrt(D))))
    for i in range(p.n_layer):
        b = f"blk.{i}."
        if p.arch != "olmo2":  # olmo2 has no pre-norms, only the post-norms below
            norm(b + "attn_norm.weight", D)
        attn_q = draw(p.n_head * hd, D)
        if p.routing == "context":
            attn_q[:] = 0.0  # every score equal: each row attends uniformly to its prefix
        weight(b + "attn_q.weight", attn_q)
        weight(b + "attn_k.weight", draw(p.n_head_kv * hd, D))
        weight(b + "attn_v.weight", draw(p.n_head_kv * hd, D))
        attn_out = draw(D, p.n_head * hd)
        if p.routing == "token" and i == 0:
            attn_out[:] = 0.0  # layer 0's FFN input is the token embedding alone
        elif p.routing == "context":
            attn_out *= np.float32(4.0)
        weight(b + "attn_output.weight", attn_out)
        if p.arch == "qwen3moe":
            norm(b + "attn_q_norm.weight", hd)  # per head
            norm(b + "attn_k_norm.weight", hd)
        elif p.arch == "olmo2":
            norm(b + "attn_q_norm.weight", p.n_head * hd)  # over all heads at once
            norm(b + "attn_k_norm.weight", p.n_head_kv * hd)
            norm(b + "post_attention_norm.weight", D)
        if p.arch != "olmo2":
            norm(b + "ffn_norm.weight", D)
        if E:
            # router x3: peaky, token-dependent routing; kept f32. Version-1 f16 files held the
            # router rounded through f16, so that rounding stays (same bytes as before).
            router = draw(E, D, scale=3.0 / float(np.sqrt(D)))
            if dtype == "f16":
                router = router.astype(np.float16).astype(np.float32)
            w.add_tensor(b + "ffn_gate_inp.weight", router)
            weight(b + "ffn_gate_exps.weight", draw(E, F, D), ffn=True)
            weight(b + "ffn_up_exps.weight", draw(E, F, D), ffn=True)
            weight(b + "ffn_down_exps.weight", draw(E, D, F), ffn=True)
        else:
            weight(b + "ffn_gate.weight", draw(F, D), ffn=True)
            weight(b + "ffn_up.weight", draw(F, D), ffn=True)
            weight(b + "ffn_down.weight", draw(D, F), ffn=True)
        if p.arch == "olmo2":
            norm(b + "post_ffw_norm.weight", D)

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
    prune: str | float | Prune | None = None,
) -> Path:
    """Write preset ``preset`` to ``path`` (atomically) and return the path.

    ``dtype`` (f32/f16/q8_0/q4_0) and ``n_vocab_min`` default to the preset's; ``prune`` ("2:4",
    "0.5", 0.5 or a Prune; see the module docstring) zeroes part of the FFN weights. Deterministic:
    the same arguments give a byte-identical file. A file already at ``path`` with exactly these
    bytes is left as it is (same inode and times): a recorder attaching to an engine on it again
    finds the model's sha256 it remembered (weight_sparsity.model_sha256), as it would in
    production, instead of hashing the file anew on every benchmark run.
    """
    p, dt, nv = _resolve(preset, dtype, n_vocab_min)
    pr = parse_prune(prune)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        _write_gguf(tmp, p, seed=seed, dtype=dt, n_vocab_min=nv, name=f"sparseety-test-{preset}", prune=pr)
        if not _same_bytes(tmp, out):
            os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def _same_bytes(a: Path, b: Path) -> bool:
    """Whether b is a regular file (not a link) holding exactly a's bytes."""
    try:
        if b.is_symlink() or not b.is_file() or a.stat().st_size != b.stat().st_size:
            return False
        with open(a, "rb") as fa, open(b, "rb") as fb:
            while True:
                x, y = fa.read(1 << 20), fb.read(1 << 20)
                if x != y:
                    return False
                if not x:
                    return True
    except OSError:
        return False


def swa_layers(preset: str | Preset) -> list[int]:
    """The layers of ``preset`` (a name or a Preset) with sliding-window attention; [] if none.

    The window is ``PRESETS[name].n_swa`` tokens (a query at p sees keys p - n_swa + 1 .. p).
    """
    p = preset if isinstance(preset, Preset) else _resolve(preset, None, None)[0]
    return p.swa_layers


# ---------------------------------------------------------------- --all with sidecars


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def model_spec(
    preset: str, *, seed: int = 1234, dtype: str | None = None, prune: str | float | Prune | None = None
) -> dict[str, Any]:
    """What determines a generated file's bytes (recorded in the sidecar next to it)."""
    p, dt, nv = _resolve(preset, dtype, None)
    pr = parse_prune(prune)
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
        "prune": None if pr is None else str(pr),
    }


def _gguf_dist_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gguf")
    except PackageNotFoundError:
        return None


def sidecar_path(model_path: Path) -> Path:
    return model_path.with_name(model_path.name + ".json")


def ensure_model(
    path: Path,
    preset: str,
    *,
    seed: int = 1234,
    dtype: str | None = None,
    prune: str | float | Prune | None = None,
) -> bool:
    """Generate ``path`` unless it exists with matching sidecar spec and content hash.

    Returns True when the file was (re)generated, False when it was up to date.
    """
    spec = model_spec(preset, seed=seed, dtype=dtype, prune=prune)
    side = sidecar_path(path)
    if path.exists() and side.exists():
        try:
            rec = json.loads(side.read_text())
        except (OSError, ValueError):
            rec = None
        if isinstance(rec, dict) and rec.get("spec") == spec and rec.get("sha256") == _file_sha256(path):
            return False
    make_model(path, preset, seed=seed, dtype=dtype, prune=prune)
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
    prune: str | float | Prune | None = None,
) -> dict[str, Path]:
    """Write every preset (or ``presets``) as ``out_dir/<preset>.gguf``; returns name -> path."""
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    names = list(presets) if presets is not None else list(PRESETS)
    result: dict[str, Path] = {}
    for i, name in enumerate(names, 1):
        path = d / f"{name}.gguf"
        t0 = time.perf_counter()
        made = ensure_model(path, name, seed=seed, dtype=dtype, prune=prune)
        dt = time.perf_counter() - t0
        if log is not None:
            what = "wrote" if made else "up to date"
            size_mb = path.stat().st_size / 1e6
            print(f"[{i}/{len(names)}] {name:<13} {what:<10} {path} ({size_mb:.1f} MB, {dt:.2f} s)", file=log)
        result[name] = path
    return result


def _prune_arg(text: str) -> Prune:
    try:
        pr = parse_prune(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    assert pr is not None
    return pr


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="Write deterministic random-weight GGUF test models (llama.cpp).",
        epilog="presets: " + "; ".join(f"{k}: {v.description}" for k, v in PRESETS.items()),
    )
    ap.add_argument("out", nargs="?", help="output .gguf path (single-model mode)")
    ap.add_argument("--preset", choices=list(PRESETS), help="model preset (single-model mode)")
    ap.add_argument("--all", metavar="DIR", dest="all_dir", help="write every preset as DIR/<preset>.gguf")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument(
        "--dtype",
        choices=list(DTYPES),
        default=None,
        help="weight type (default: the preset's); q8_0/q4_0 quantize the weight matrices, while "
        "norms and the MoE router stay f32",
    )
    ap.add_argument(
        "--prune",
        type=_prune_arg,
        default=None,
        metavar="N:M|FRACTION",
        help="zero part of the FFN weights (ffn_gate/up/down and their *_exps), per row (ne0), before "
        "any quantization: N:M keeps the N largest magnitudes of every M consecutive values (e.g. "
        "2:4; 1 <= N < M, M divides the row); a fraction 0 < f < 1 zeroes the round(f * row) "
        "smallest magnitudes of each row (e.g. 0.5). The zeros are exact, also after q8_0/q4_0",
    )
    ap.add_argument("--n-vocab-min", type=int, default=None, help="pad the vocab to at least this size")
    a = ap.parse_args(argv)

    if a.all_dir is not None:
        if a.out is not None or a.preset is not None or a.n_vocab_min is not None:
            ap.error("--all takes no OUT, --preset or --n-vocab-min")
        try:
            make_all(a.all_dir, seed=a.seed, dtype=a.dtype, log=sys.stdout, prune=a.prune)
        except ValueError as e:  # e.g. a prune group size that does not divide a preset's rows
            ap.error(str(e))
        return 0
    if a.out is None or a.preset is None:
        ap.error("give OUT.gguf --preset NAME, or --all DIR")
    t0 = time.perf_counter()
    try:
        path = make_model(
            a.out, a.preset, seed=a.seed, dtype=a.dtype, n_vocab_min=a.n_vocab_min, prune=a.prune
        )
    except ValueError as e:
        ap.error(str(e))
    size_mb = path.stat().st_size / 1e6
    print(f"{a.preset}: wrote {path} ({size_mb:.1f} MB, {time.perf_counter() - t0:.2f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
