"""`--preset vllm|sglang|llamacpp`: watch rules for the MoE routing kernels of those engines
(llama.cpp's ggml-cuda: llamacpp_kernels.py).

Each rule was read from the engine's CUDA source (the revision in `source`), never copied: the
kernel's name and argument list give the pattern, the argument that holds the top-k ids and the
arguments that give their shape. C++ kernels are matched by their mangled names (what CUPTI and
cuFuncGetName report), so a pattern can pick one template instantiation: vLLM's top-k kernels are
templates over the index type (int32, uint32 or int64; vLLM's Python `fused_topk` allocates int32
unless a modular kernel asks for another), and the index type is a template argument of the mangled
name, so there is one rule per type. `example` is the name g++ gives one instantiation of the
declared signature (Itanium ABI, as nvcc's host side); `layout` is the argument list in short
(`p` a pointer, `i32`, `i64` a 64-bit integer or size_t, `b` a bool), which the tests use to play
the launch on the stub driver and check that the library copies the shape the rule says.

Only the top-k producers give 2-D (rows, k) buffers, which become `routes` rows; the
moe_align_block_size kernels read the same ids flattened (their element count is a size_t
argument; the rule grammar cannot divide it by k) and are watched 1-D, so `buffer_captured` marks
them without a second set of `routes` rows for the same layer. The library copies every matching
launch: `--sample-every` thins them out.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from sparseety_prof.gpu import llamacpp_kernels, watch_rules
from sparseety_prof.gpu.preset_rule import PresetRule, Source

VLLM_TOPK = Source(
    "vllm-project/vllm", "csrc/moe/topk_softmax_kernels.cu", "0112cf233e0c60674c2844a09695ddeb2b901dc0"
)
VLLM_ALIGN = Source(
    "vllm-project/vllm", "csrc/moe/moe_align_sum_kernels.cu", "1377b4e02fb7ea047d1d714258d90f300008214a"
)
SGL_TOPK = Source(
    "sgl-project/sglang",
    "sgl-kernel/csrc/moe/moe_topk_softmax_kernels.cu",
    "a535425d2601a55e7a2cc9e6f543ab285d1cdbde",
)
SGL_GATE = Source(
    "sgl-project/sglang", "sgl-kernel/csrc/moe/moe_fused_gate.cu", "6e2b2c9dc653b6e2b3dfa58848221ac954450837"
)
SGL_ALIGN = Source(
    "sgl-project/sglang",
    "sgl-kernel/csrc/moe/moe_align_kernel.cu",
    "ce3781545c8ba6625e63fa96952c1d3938f6055c",
)

# vLLM topkGatingSoftmax<VPT, NUM_EXPERTS, WARPS_PER_CTA, BYTES_PER_LDG, WARP_SIZE, IndType>:
# (input, finished, output, num_rows, indices, source_rows, k, start_expert, end_expert);
# indices [num_rows, k]. The experts count is a template argument, so the name cannot be matched
# with its type; the pattern is the index type closing the template arguments followed by this
# argument list, which only this kernel has.
_VLLM_GATING_LAYOUT = ("p", "p", "p", "i32", "p", "p", "i32", "i32", "i32")
_VLLM_GATING_NAME = "_ZN4vllm3moe17topkGatingSoftmaxILi4ELi16ELi4ELi16ELi32E{t}EEvPKfPKbPfiPT4_Piiii"
# vLLM moeTopK<TPB=256, IndType> (experts not a power of two, or > 256): (inputs_after_softmax,
# finished, output, indices, source_rows, num_experts, k, start_expert, end_expert); one block per row.
_VLLM_TOPK_LAYOUT = ("p", "p", "p", "p", "p", "i32", "i32", "i32", "i32")
_VLLM_TOPK_NAME = "_ZN4vllm3moe7moeTopKILi256E{t}EEvPKfPKbPfPT0_Piiiii"
# vLLM moe_align_block_size_kernel<scalar_t>: (topk_ids, sorted_token_ids, expert_ids,
# total_tokens_post_pad, expert_map, num_experts, padded_num_experts, experts_per_warp, block_size,
# numel [size_t], cumsum, max_num_tokens_padded, topk_num, has_expert_map)
_VLLM_ALIGN_LAYOUT = ("p", "p", "p", "p", "p", "i32", "i32", "i32", "i32", "i64", "p", "i32", "i32", "b")
_VLLM_ALIGN_NAME = "_ZN4vllm3moe27moe_align_block_size_kernelI{t}EEvPKT_PiS5_S5_S5_iiiimS5_iib"
# vLLM moe_align_block_size_small_batch_expert_kernel<scalar_t, fill_threads>: (topk_ids,
# sorted_token_ids, expert_ids, total_tokens_post_pad, expert_map, num_experts, block_size,
# numel [size_t], max_num_tokens_padded, topk_num, has_expert_map)
_VLLM_SMALL_LAYOUT = ("p", "p", "p", "p", "p", "i32", "i32", "i64", "i32", "i32", "b")
_VLLM_SMALL_NAME = (
    "_ZN4vllm3moe46moe_align_block_size_small_batch_expert_kernelI{t}Li256EEEvPKT_PiS5_S5_S5_iimiib"
)

_ITANIUM = {"int32": "i", "uint32": "j", "int64": "l"}  # the mangled codes of int, unsigned, int64_t


def _vllm() -> tuple[PresetRule, ...]:
    rules = []
    for dtype, t in _ITANIUM.items():
        rules.append(
            PresetRule(
                f"E{t}EEvPKfPKbPfiPT:4:{dtype}:arg3,arg6",
                VLLM_TOPK,
                _VLLM_GATING_NAME.format(t=t),
                _VLLM_GATING_LAYOUT,
            )
        )
        rules.append(
            PresetRule(
                f"moeTopKILi256E{t}E:3:{dtype}:grid.x,arg6",
                VLLM_TOPK,
                _VLLM_TOPK_NAME.format(t=t),
                _VLLM_TOPK_LAYOUT,
            )
        )
    for dtype in ("int32", "int64"):  # topk_ids as fused_topk hands them on
        t = _ITANIUM[dtype]
        rules.append(
            PresetRule(
                f"moe_align_block_size_kernelI{t}:0:{dtype}:arg9.i64",
                VLLM_ALIGN,
                _VLLM_ALIGN_NAME.format(t=t),
                _VLLM_ALIGN_LAYOUT,
            )
        )
        rules.append(
            PresetRule(
                f"moe_align_block_size_small_batch_expert_kernelI{t}:0:{dtype}:arg7.i64",
                VLLM_ALIGN,
                _VLLM_SMALL_NAME.format(t=t),
                _VLLM_SMALL_LAYOUT,
            )
        )
    return tuple(rules)


def _sglang() -> tuple[PresetRule, ...]:
    return (
        # topkGatingSoftmax<T, VPT, NUM_EXPERTS, WARPS_PER_CTA, BYTES_PER_LDG>: (input, finished,
        # output, num_rows, indices [int*], k, start_expert, end_expert, renormalize)
        PresetRule(
            "topkGatingSoftmax:4:int32:arg3,arg5",
            SGL_TOPK,
            "_Z17topkGatingSoftmaxIfLi8ELi64ELi4ELi16EEvPKT_PKbPfiPiiiib",
            ("p", "p", "p", "i32", "p", "i32", "i32", "i32", "b"),
        ),
        # moeTopK<TPB>: (inputs_after_softmax, finished, output, indices [int*], num_experts, k,
        # start_expert, end_expert, renormalize); one block per row
        PresetRule(
            "moeTopK:3:int32:grid.x,arg5",
            SGL_TOPK,
            "_Z7moeTopKILi256EEvPKfPKbPfPiiiiib",
            ("p", "p", "p", "p", "i32", "i32", "i32", "i32", "b"),
        ),
        # moe_fused_gate_kernel_dynamic<T>: (input, bias, output_ptr, indices_ptr [int32*], num_rows,
        # num_experts, num_expert_group, topk_group, topk), the 64-bit integers int64_t. Before the
        # static kernel's entry: that name is a prefix of this one.
        PresetRule(
            "moe_fused_gate_kernel_dynamic:3:int32:arg4.i64,arg8.i64",
            SGL_GATE,
            "_Z29moe_fused_gate_kernel_dynamicIN7cutlass10bfloat16_tEEvPvS2_PfPilllll",
            ("p", "p", "p", "p", "i64", "i64", "i64", "i64", "i64"),
        ),
        # moe_fused_gate_kernel<T, VPT, NUM_EXPERTS, THREADS_PER_ROW, ROWS_PER_WARP, ROWS_PER_CTA,
        # WARPS_PER_CTA>: (input, bias, output_ptr, indices_ptr [int32*], num_rows, topk_group, topk)
        PresetRule(
            "moe_fused_gate_kernel:3:int32:arg4.i64,arg6.i64",
            SGL_GATE,
            "_Z21moe_fused_gate_kernelIN7cutlass10bfloat16_tELi32ELi256ELi8ELi4ELi24ELi6EEvPvS2_PfPilll",
            ("p", "p", "p", "p", "i64", "i64", "i64"),
        ),
        # moe_align_block_size_kernel<scalar_t>: (topk_ids, sorted_token_ids, expert_ids,
        # total_tokens_post_pad, num_experts, padded_num_experts, experts_per_warp, block_size,
        # numel [size_t], cumsum)
        *(
            PresetRule(
                f"moe_align_block_size_kernelI{_ITANIUM[d]}:0:{d}:arg8.i64",
                SGL_ALIGN,
                f"_Z27moe_align_block_size_kernelI{_ITANIUM[d]}EvPKT_PiS3_S3_iiiimS3_",
                ("p", "p", "p", "p", "i32", "i32", "i32", "i32", "i64", "p"),
            )
            for d in ("int32", "int64")
        ),
        # moe_align_block_size_small_batch_expert_kernel<scalar_t>: (topk_ids, sorted_token_ids,
        # expert_ids, total_tokens_post_pad, num_experts, block_size, numel [size_t])
        *(
            PresetRule(
                f"moe_align_block_size_small_batch_expert_kernelI{_ITANIUM[d]}:0:{d}:arg6.i64",
                SGL_ALIGN,
                f"_Z46moe_align_block_size_small_batch_expert_kernelI{_ITANIUM[d]}EvPKT_PiS3_S3_iim",
                ("p", "p", "p", "p", "i32", "i32", "i64"),
            )
            for d in ("int32", "int64")
        ),
    )


PRESETS: dict[str, tuple[PresetRule, ...]] = {
    "vllm": _vllm(),
    "sglang": _sglang(),
    # the rules for the kernels of the built revision; `watch_spec` derives them from the engine's
    # own kernel names instead (llamacpp_kernels.py), and refuses a layout it does not know
    "llamacpp": llamacpp_kernels.rules(llamacpp_kernels.BUILT_REVISION_KERNELS),
}


def watch_spec(
    explicit: str | None, presets: list[str] | None, engine_files: Sequence[Path] = ()
) -> str | None:
    """The SPARSEETY_WATCH value: the explicit --watch entries first (the library applies the first
    matching entry, so they win), then each preset's. Raises WatchSpecError when the result is not
    a spec the library accepts (a bad entry, more than 16 entries).

    The llamacpp preset is read from the engine: `engine_files` are the executable and the
    libraries its CUDA kernels may be in (llamacpp_kernels.engine_files); without them it is
    refused (WatchSpecError), and a kernel argument layout it does not know raises
    UnsupportedEngineBuild."""
    parts = [explicit] if explicit else []
    for name in presets or []:
        if name not in PRESETS:
            raise watch_rules.WatchSpecError(f"unknown preset {name!r} (one of {', '.join(PRESETS)})")
        if name == "llamacpp":
            if not engine_files:
                raise watch_rules.WatchSpecError(
                    "preset 'llamacpp' reads the kernels of the engine's own ggml-cuda build: use it "
                    "with `launch -- llama-server ...` (or name them with --watch)"
                )
            parts += [r.entry for r in llamacpp_kernels.rules(llamacpp_kernels.kernel_names(engine_files))]
            continue
        parts += [r.entry for r in PRESETS[name]]
    if not parts:
        return None
    spec = ";".join(parts)
    watch_rules.parse(spec)
    return spec
