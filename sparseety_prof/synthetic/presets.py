"""The shapes of the generated models: one Preset per model, by name in PRESETS.

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
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf

from sparseety_prof.synthetic.vocab import SPACE

DTYPES = ("f32", "f16", "q8_0", "q4_0")
#: ggml block-quantized dtypes: weight matrices are written in these, norms and router stay f32
QUANT_TYPES: dict[str, gguf.GGMLQuantizationType] = {
    "q8_0": gguf.GGMLQuantizationType.Q8_0,
    "q4_0": gguf.GGMLQuantizationType.Q4_0,
}
FILE_TYPES: dict[str, gguf.LlamaFileType] = {
    "f32": gguf.LlamaFileType.ALL_F32,
    "f16": gguf.LlamaFileType.MOSTLY_F16,
    "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
}
ARCHS = ("llama", "qwen3moe", "smallthinker", "olmo2", "deci")
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
    #: per-layer FFN widths (dense arch deci only, which reads feed_forward_length per layer; llama
    #: sizes every layer's FFN by layer 0's): () = n_ff in every layer
    ff_widths: tuple[int, ...] = ()
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
    "wide_layer": Preset(
        arch="deci",
        ff_widths=(256, 256, 256 * 64, 256),
        description="dense llama-like (arch deci: per-layer FFN widths) whose layer 2's FFN is 64x the "
        "others' wide: that layer dominates each step's time (tests/test_layer_times.py)",
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


def resolve(preset: str, dtype: str | None, n_vocab_min: int | None) -> tuple[Preset, str, int]:
    """The preset named ``preset``, and the dtype and vocab floor given or else the preset's."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    p = PRESETS[preset]
    dt = dtype or p.dtype
    if dt not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, not {dt!r}")
    nv = p.n_vocab_min if n_vocab_min is None else n_vocab_min
    return p, dt, nv


def swa_layers(preset: str | Preset) -> list[int]:
    """The layers of ``preset`` (a name or a Preset) with sliding-window attention; [] if none.

    The window is ``PRESETS[name].n_swa`` tokens (a query at p sees keys p - n_swa + 1 .. p).
    """
    p = preset if isinstance(preset, Preset) else resolve(preset, None, None)[0]
    return p.swa_layers
