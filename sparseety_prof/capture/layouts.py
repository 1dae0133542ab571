"""Private struct layouts of llama.cpp builds: the table of layouts verified on live data (the
fast path), and which one, if any, a process's build gets.

`struct llama_ubatch` is private to llama.cpp and changes between versions. A build whose ggml
version falls in a verified range starts with that range's layout, which the correlator checks
on the first live micro-batches (a mismatch is refused, exit 6). Any other build gets no layout
from here: the recorder learns it from live forward passes first (layout_discovery).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from sparseety_prof.capture import target as tg
from sparseety_prof.capture.buildinfo import BuildIdentity, identify, version_key


@dataclass(frozen=True)
class UbatchLayout:
    """Byte offsets of the llama_ubatch fields the probe reads (x86-64)."""

    n_tokens: int
    token: int
    pos: int
    n_seq_id: int
    seq_id: int
    output: int

    def describe(self) -> str:
        return " ".join(f"{k}@{v}" for k, v in self.__dict__.items())

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
    the sparse-decision probes read. ggml.h's public struct, but it changes: the table's offsets are
    checked on the engine's live weight structs and graph nodes at attach time, and replaced by the
    ones discovered there when they fail (tensor_probe.py)."""

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
    completion_token_output::tok); checked on the first live requests (slot ids must be the
    sequence ids of the slot's micro-batch rows, task ids must grow: correlate/server_layout_check.py)."""

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
    engine: str  # "llama-cpp-python" | "xllamacpp" | the executable's name (llama-server, ...)
    version: str  # package version, else the llama.cpp build number or ggml version
    identity: BuildIdentity
    ubatch: UbatchLayout | None  # None: not in the table, to be discovered on live data
    layout_source: str  # where `ubatch` came from (table range, discovery)
    tensor: TensorLayout = _TENSOR_GGML_2026
    server: ServerLayout = ServerLayout()  # measured on xllamacpp 2026.10.11549's live slots and tasks

    @property
    def llama_cpp_commit(self) -> str:
        return self.identity.commit or ""


# Offsets dumped with offsetof() from llama-batch.h and measured on live micro-batches:
# b_equal_seqs@0 n_tokens@4 n_seq_tokens@8 n_seqs@12 n_seqs_unq@16 n_pos@20 token@24 embd@32 pos@40
# n_seq_id@48 seq_id@56 seq_id_unq@64 seq_idx@72 output@80
_UBATCH_2025 = UbatchLayout(n_tokens=4, token=24, pos=40, n_seq_id=48, seq_id=56, output=80)
# one more pointer between embd and pos
_UBATCH_2026_10 = UbatchLayout(n_tokens=4, token=24, pos=48, n_seq_id=56, seq_id=64, output=88)


@dataclass(frozen=True)
class VerifiedRange:
    """Builds whose llama_ubatch layout is `ubatch`: llama.cpp build numbers [first_build,
    last_build] where the build number is known, else ggml versions [first_ggml, last_ggml]
    (None: no ggml range, the ggml version alone does not decide). `verified_on` names builds of
    the test matrix on which layout discovery found exactly this layout."""

    first_build: int
    last_build: int
    first_ggml: str | None
    last_ggml: str | None
    ubatch: UbatchLayout
    verified_on: tuple[str, ...]

    def contains(self, build_number: int | None, ggml_version: str | None) -> bool:
        if build_number:
            return self.first_build <= build_number <= self.last_build
        k = version_key(ggml_version)
        return (
            bool(k)
            and self.first_ggml is not None
            and self.last_ggml is not None
            and version_key(self.first_ggml) <= k <= version_key(self.last_ggml)
        )


# llama-batch.h kept token..output at these offsets from b8672 (ggml 0.9.11) through b11434;
# `float * embd_state` went in between embd and pos after b11434 and by b11549. ggml's version is
# 0.26.0 on both sides of that change (b11434 and b11549), so it decides only up to 0.25.3; past
# that the build number must, and a build without one gets layout discovery.
VERIFIED: tuple[VerifiedRange, ...] = (
    VerifiedRange(
        8672,
        11434,
        "0.9.11",
        "0.25.3",
        _UBATCH_2025,
        (
            "xllamacpp 2026.4.8672 (ggml 0.9.11)",
            "llama-cpp-python 0.3.20 (ggml 0.9.11)",
            "xllamacpp 2026.6.9538 (ggml 0.13.1)",
            "xllamacpp 2026.8.10229 (ggml 0.18.0)",
            "xllamacpp 2026.9.10809 (ggml 0.23.0)",
            "llama-cpp-python 0.3.36 (ggml 0.25.3)",
        ),
    ),
    VerifiedRange(11549, 11549, None, None, _UBATCH_2026_10, ("xllamacpp 2026.10.11549 (ggml 0.26.0)",)),
)


def package_build_number(package: str, version: str) -> int | None:
    """The llama.cpp build a package release bundles, where its version says so: xllamacpp's
    versions end in it (2026.10.11549 = b11549; the wheels' own LLAMA_BUILD_NUMBER is 0)."""
    if package == "xllamacpp":
        m = re.fullmatch(r"\d{4}\.\d{1,2}\.(\d{4,6})", version)
        return int(m.group(1)) if m else None
    return None


# package directory name next to the library -> distribution name
_PACKAGES = {"llama_cpp": "llama-cpp-python", "xllamacpp": "xllamacpp"}


def package_of(lib: Path) -> tuple[str, str]:
    """(distribution, version) of the Python package that ships `lib`, from its dist-info next
    to it: a hint only; ("unknown", "unknown") for a built binary."""
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


def resolve(identity: BuildIdentity, exe: str) -> EngineBuild:
    """The build's name and, where its build number (or, below 0.26, its ggml version) is in a
    verified range, its layout."""
    engine = identity.package or Path(exe).name
    version = identity.package_version or (
        f"b{identity.build_number}" if identity.build_number else (identity.ggml_version or "unknown")
    )
    build = identity.build_number or package_build_number(identity.package, identity.package_version)
    for r in VERIFIED:
        if r.contains(build, identity.ggml_version):
            key = f"b{r.first_build}..b{r.last_build}" if build else f"ggml {r.first_ggml}..{r.last_ggml}"
            src = f"table: {key} (verified on {len(r.verified_on)} builds)"
            return EngineBuild(engine, version, identity, r.ubatch, src)
    return EngineBuild(engine, version, identity, None, "to be discovered")


def supported_range() -> tuple[str, str]:
    """The first and last llama.cpp builds of the verified ranges."""
    return f"b{min(r.first_build for r in VERIFIED)}", f"b{max(r.last_build for r in VERIFIED)}"


def identify_build(t: tg.Target, where: dict[str, Path]) -> EngineBuild:
    """The build's identity from its own binaries (every llama/ggml file it maps, and the files
    holding probe points), and its layout where the table has one."""
    files = sorted(
        {*where.values(), *(m.path for m in t.libs if "ggml" in m.path.name or "llama" in m.path.name)}
    )
    identity = identify(
        files, package_of(where[tg.SYM_UBATCH]), [tg.build_id(f) or "" for f in sorted(set(where.values()))]
    )
    return resolve(identity, t.exe)
