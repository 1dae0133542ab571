"""Private struct layouts of known engine builds, and how a process's build is identified.

`struct llama_ubatch` is private to llama.cpp and changes between versions, so a layout is only
used for a build we know, and is verified against live data at attach time (verify.py). A build
we do not know is refused with UnsupportedEngineBuild rather than recorded as garbage.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from .errors import UnsupportedEngineBuild


@dataclass(frozen=True)
class UbatchLayout:
    """Byte offsets of the llama_ubatch fields the probe reads (x86-64)."""

    n_tokens: int
    token: int
    pos: int
    n_seq_id: int
    seq_id: int
    output: int

    def cflags(self) -> list[str]:
        return [
            f"-DUB_N_TOKENS={self.n_tokens}",
            f"-DUB_TOKEN={self.token}",
            f"-DUB_POS={self.pos}",
            f"-DUB_N_SEQ_ID={self.n_seq_id}",
            f"-DUB_SEQ_ID={self.seq_id}",
            f"-DUB_OUTPUT={self.output}",
        ]


@dataclass(frozen=True)
class TensorLayout:
    """Byte offsets in ggml's `struct ggml_tensor` and `struct ggml_compute_params` (x86-64) that
    the sparse-decision probes read. ggml.h's public struct; checked on live data at attach time
    (tensor names must parse, shapes must match the model's hyper-parameters)."""

    type: int = 0
    ne: int = 16
    nb: int = 48
    src: int = 152
    data: int = 248
    name: int = 256
    params_ith: int = 0
    params_nth: int = 4

    def cflags(self) -> list[str]:
        return [
            f"-DT_TYPE={self.type}",
            f"-DT_NE={self.ne}",
            f"-DT_NB={self.nb}",
            f"-DT_SRC={self.src}",
            f"-DT_DATA={self.data}",
            f"-DT_NAME={self.name}",
            f"-DP_ITH={self.params_ith}",
            f"-DP_NTH={self.params_nth}",
        ]


# ggml_tensor (336 bytes): type@0 buffer@8 ne[4]@16 nb[4]@48 op@80 op_params@84 flags@148 src[10]@152
# view_src@232 view_offs@240 data@248 name[64]@256 extra@320 (offsetof() on the vendored ggml.h of
# llama-cpp-python 0.3.36; the same in xllamacpp 2026.10.11549, verified on live graphs)
_TENSOR_GGML_2026 = TensorLayout()


@dataclass(frozen=True)
class ServerLayout:
    """Byte offsets in llama-server's private structs that the serving-context probes read. Each
    id is the struct's first member in llama-server's sources (server_task::id, server_slot::id,
    completion_token_output::tok); checked on live data (slot ids must be the sequence ids of
    the slot's micro-batch rows, task ids must grow)."""

    task_id: int = 0
    slot_id: int = 0
    token_out_tok: int = 0

    def cflags(self) -> list[str]:
        return [
            f"-DSRV_TASK_ID={self.task_id}",
            f"-DSRV_SLOT_ID={self.slot_id}",
            f"-DSRV_TOKOUT_TOK={self.token_out_tok}",
        ]


@dataclass(frozen=True)
class EngineBuild:
    engine: str  # "llama-cpp-python" | "xllamacpp"
    version: str  # package version
    llama_cpp_commit: str  # the llama.cpp source it bundles, where known
    ubatch: UbatchLayout
    tensor: TensorLayout = _TENSOR_GGML_2026
    server: ServerLayout = ServerLayout()  # measured on xllamacpp 2026.10.11549's live slots and tasks


# b_equal_seqs@0 n_tokens@4 n_seq_tokens@8 n_seqs@12 n_seqs_unq@16 n_pos@20 token@24 embd@32 pos@40
# n_seq_id@48 seq_id@56 seq_id_unq@64 seq_idx@72 output@80 (offsets dumped with offsetof() from the
# vendored llama-batch.h of llama-cpp-python 0.3.36)
_LAYOUT_0C1E570 = UbatchLayout(n_tokens=4, token=24, pos=40, n_seq_id=48, seq_id=56, output=80)
# xllamacpp 2026.10.11549: one more pointer between embd and pos (measured on live micro-batches)
_LAYOUT_XLLAMACPP_2026_10 = UbatchLayout(n_tokens=4, token=24, pos=48, n_seq_id=56, seq_id=64, output=88)

KNOWN_BUILDS: dict[tuple[str, str], EngineBuild] = {
    ("llama-cpp-python", "0.3.36"): EngineBuild("llama-cpp-python", "0.3.36", "0c1e570", _LAYOUT_0C1E570),
    ("xllamacpp", "2026.10.11549"): EngineBuild("xllamacpp", "2026.10.11549", "", _LAYOUT_XLLAMACPP_2026_10),
}

# package directory name next to the library -> distribution name
_PACKAGES = {"llama_cpp": "llama-cpp-python", "xllamacpp": "xllamacpp"}


def identify(lib: Path) -> tuple[str, str]:
    """(engine, version) of the package that ships `lib`, from its dist-info next to it."""
    for parent in lib.parents:
        pkg = _PACKAGES.get(parent.name)
        if pkg is None:
            continue
        site = parent.parent
        dist = pkg.replace("-", "_")
        for info in sorted(site.glob("*.dist-info")):
            m = re.fullmatch(rf"{re.escape(dist)}-([^-]+)\.dist-info", info.name, flags=re.IGNORECASE)
            if m:
                return pkg, m.group(1)
        return pkg, "unknown"
    return "unknown", "unknown"


def resolve(lib: Path) -> EngineBuild:
    engine, version = identify(lib)
    build = KNOWN_BUILDS.get((engine, version))
    if build is None:
        known = ", ".join(f"{e} {v}" for e, v in KNOWN_BUILDS)
        raise UnsupportedEngineBuild(
            f"unsupported engine build: {lib} is {engine} {version}, whose private llama_ubatch layout "
            f"is not known to this version of sparseety-prof (known: {known}). Recording it would "
            f"produce garbage, so nothing was attached."
        )
    return build
