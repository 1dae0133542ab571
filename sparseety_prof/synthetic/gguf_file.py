"""Write one generated model as a GGUF file: hyper-parameters, the tokenizer, and weights drawn
from a seeded generator (same preset, seed, dtype, vocab floor and pruning: the same bytes).

Weights: router (ffn_gate_inp) scaled x3 so routing differs per token; output.weight scale
4/sqrt(D) so next-token distributions are peaky but not degenerate; norms and router stay f32.
MoE routing in all three MoE archs (llama.cpp build_moe_ffn): softmax over all experts, top-k,
top-k weights renormalized to sum 1 (Preset.expert_gating_func / expert_weights_norm say so).

dtypes: f32 and f16 write every weight matrix in that type; q8_0 and q4_0 quantize the weight
matrices (attention q/k/v/output, FFN and per-expert FFN, token embedding, output) with gguf.quants
(ggml blocks of 32 values along each row, symmetric: one f16 scale per block, no offset); norms
and the MoE router ffn_gate_inp stay f32, as in real quantized MoE models. Row lengths (n_embd,
n_ff) must be multiples of 32.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import numpy.typing as npt

from sparseety_prof.synthetic.presets import ARCHS, FILE_TYPES, MOE_ARCHS, QUANT_TYPES, Preset
from sparseety_prof.synthetic.prune import Prune, prune_array
from sparseety_prof.synthetic.vocab import BOS_ID, EOS_ID, UNK_ID, build_vocab


def check_preset(p: Preset, dtype: str, prune: Prune | None) -> None:
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
    if p.ff_widths and (p.arch != "deci" or p.n_expert or len(p.ff_widths) != p.n_layer):
        raise ValueError("ff_widths: one width per layer, arch deci, no experts")
    if p.arch == "deci" and p.n_expert:
        raise ValueError("arch deci is dense here (the generator writes no expert tensors for it)")
    # every matrix row (ggml ne0) is n_embd long, except ffn_down's (n_ff); attn_output's is
    # n_head * head_dim == n_embd
    rows = {"n_embd": p.n_embd, "n_ff": p.n_ff}
    rows.update({f"ff_widths[{i}]": n for i, n in enumerate(p.ff_widths)})
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


def write_gguf(
    path: Path, p: Preset, *, seed: int, dtype: str, n_vocab_min: int, name: str, prune: Prune | None
) -> None:
    """Write preset ``p`` to ``path`` (in place: make_model writes a temporary file and renames it)."""
    check_preset(p, dtype, prune)

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
    w.add_file_type(FILE_TYPES[dtype])
    if p.arch in MOE_ARCHS:  # the dense width is unused, the expert width is its own key
        w.add_feed_forward_length(F * p.n_expert_used)
        w.add_expert_feed_forward_length(F)
    elif p.ff_widths:  # one width per layer: an array under the same key
        w.add_array(gguf.Keys.LLM.FEED_FORWARD_LENGTH.format(arch=p.arch), list(p.ff_widths))
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
            fi = p.ff_widths[i] if p.ff_widths else F
            weight(b + "ffn_gate.weight", draw(fi, D), ffn=True)
            weight(b + "ffn_up.weight", draw(fi, D), ffn=True)
            weight(b + "ffn_down.weight", draw(D, fi), ffn=True)
        if p.arch == "olmo2":
            norm(b + "post_ffw_norm.weight", D)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
