"""Find, in an engine's memory, the byte offsets of `struct ggml_tensor` for which every invariant
holds, or check a given set of offsets the same way.

ggml.h is public but its tensor struct changes (GGML_MAX_SRC, removed fields, padding), and the
sparse-decision probes read it at fixed offsets. The model's weights are anchors: their names,
ggml types and shapes are in the GGUF tensor directory, and each one the engine loaded is a
`ggml_tensor` somewhere in its memory, its name a NUL-terminated string. A weight struct must
carry, at offsets fixed relative to its name, the GGUF shape in ne[], the strides that shape and
type give in nb[], the GGUF type, and a non-null data pointer. Offsets relative to the name are
then made absolute by a graph node whose src[0] is a weight struct (llama.cpp names the token
embedding lookup "inp_embd" and the output projection "result_output"): the word of the node equal
to that weight's address is src[0], and the address tells where the weight struct begins. The
type offset comes last, once the struct's start is known. Copies of names outside any struct, and
stale structs in freed memory, fail some invariant and are outvoted: a layout is the one the most
distinct weights hold with, and it must be the only one.

Everything here is pure: a `Memory` is read, never the process itself (tensor_probe.py reads a
live one), so tests feed it synthetic and perturbed structs.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Protocol

import numpy as np

from sparseety_prof.capture.gguf_info import GGML_TYPES, TensorInfo

WINDOW = 512  # bytes before a name searched for the other fields: ggml_tensor's name sat at 256
NAME_MAX = 64  # GGML_MAX_NAME
WEIGHT_SUFFIX = b".weight\x00"  # llama.cpp's GGUF weight names end so: the needle the scan looks for
# Graph nodes llama.cpp builds in every text model's graph, and which of their dimensions is which
# of their weight's: "inp_embd" = get_rows(token_embd, tokens) has ne[0] = the weight's ne[0] (when
# the micro-batch has token ids: the worst-case graph built at start-up may take embeddings
# instead); "result_output" = mul_mat(output, cur) has ne[0] = the weight's ne[1] (n_vocab).
NODES = {b"inp_embd\x00": 0, b"result_output\x00": 1}
MIN_WEIGHTS = 4  # weight structs that must agree before a layout is claimed (fewer if the model has fewer)
USER_PTR_MAX = 1 << 48  # x86-64 / arm64 user address space


class Memory(Protocol):
    def find(self, needles: tuple[bytes, ...]) -> dict[bytes, list[int]]: ...

    def read(self, addr: int, size: int) -> bytes | None: ...


@dataclass
class BytesMemory:
    """Memory given as (start address, bytes) regions: for tests, and for bytes copied from a
    process."""

    regions: list[tuple[int, bytes]]
    _starts: list[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.regions.sort()
        self._starts = [s for s, _ in self.regions]

    def find(self, needles: tuple[bytes, ...]) -> dict[bytes, list[int]]:
        out: dict[bytes, list[int]] = {n: [] for n in needles}
        for start, data in self.regions:
            for n in needles:
                i = data.find(n)
                while i >= 0:
                    out[n].append(start + i)
                    i = data.find(n, i + 1)
        return out

    def read(self, addr: int, size: int) -> bytes | None:
        k = bisect.bisect_right(self._starts, addr) - 1
        if k < 0:
            return None
        start, data = self.regions[k]
        if addr + size > start + len(data):
            return None
        return data[addr - start : addr - start + size]


@dataclass(frozen=True)
class WeightSpec:
    """What the GGUF directory says a weight's ggml_tensor must hold."""

    name: str
    ggml_type: int
    ne: tuple[int, int, int, int]
    nb: tuple[int, int, int, int]


def weight_specs(infos: Iterable[TensorInfo]) -> dict[bytes, WeightSpec]:
    """Weights usable as anchors, by NUL-terminated name: a ".weight" name that fits ggml's name
    field, of a type whose block size is known, at most 4 dimensions of whole blocks."""
    out: dict[bytes, WeightSpec] = {}
    for t in infos:
        raw = t.name.encode() + b"\x00"
        traits = GGML_TYPES.get(t.ggml_type)
        if not raw.endswith(WEIGHT_SUFFIX) or len(raw) > NAME_MAX or traits is None or len(t.shape) > 4:
            continue
        _, blck, size = traits
        ne = (*t.shape, *(1,) * (4 - len(t.shape)))
        if not t.shape or ne[0] % blck:
            continue
        nb0, nb1 = size, size * (ne[0] // blck)
        nb = (nb0, nb1, nb1 * ne[1], nb1 * ne[1] * ne[2])
        out[raw] = WeightSpec(t.name, t.ggml_type, ne, nb)  # type: ignore[arg-type]
    return out


@dataclass(frozen=True)
class Relative:
    """Distances from the name back to ne, nb and data (name - field offset)."""

    ne: int
    nb: int
    data: int


@dataclass(frozen=True)
class Solved:
    """Absolute offsets of the ggml_tensor fields the probes read."""

    type: int
    ne: int
    nb: int
    src: int
    data: int
    name: int


@dataclass(frozen=True)
class Verdict:
    layout: Solved | None
    weights: int  # distinct weights (by name) whose structs hold with the layout
    nodes: int  # graph nodes ("inp_embd", "result_output") on which it holds
    reason: str  # the invariant that failed (layout None), else what was proven


def _words(mem: Memory, end: int) -> np.ndarray | None:
    """The WINDOW bytes before `end` as little-endian u64 words (word k at end - WINDOW + 8k)."""
    raw = mem.read(end - WINDOW, WINDOW)
    return None if raw is None else np.frombuffer(raw, dtype="<u8")


def _runs(words: np.ndarray, want: tuple[int, ...]) -> list[int]:
    """Distances back from the window's end of every place the words `want` appear in a row."""
    n = len(want)
    hits = np.ones(len(words) - n + 1, dtype=bool)
    for j, v in enumerate(want):
        hits &= words[j : len(words) - n + 1 + j] == np.uint64(v)
    return [WINDOW - 8 * int(k) for k in np.flatnonzero(hits)]


def _weight_hits(mem: Memory, specs: dict[bytes, WeightSpec], ends: list[int]) -> dict[int, WeightSpec]:
    """Name addresses (8-aligned, as every offset the probes use) of anchor weights: each place a
    ".weight" name ends is looked back from for the start of a known name."""
    out: dict[int, WeightSpec] = {}
    for end in ends:
        stop = end + len(WEIGHT_SUFFIX)
        for start in range((stop - NAME_MAX + 7) & ~7, end + 1, 8):
            raw = mem.read(start, stop - start)
            if raw is not None and raw in specs:
                out[start] = specs[raw]
    return out


# The chain of invariants, in the order a struct is checked: a refusal names the one at which the
# candidate that got furthest failed (names also sit in plain strings, which fail at 'ne').
INVARIANTS = {
    "name": "a NUL-terminated weight name from the model's GGUF tensor directory",
    "ne": "ne[] equal to the weight's GGUF shape",
    "nb": "nb[] equal to the strides of that shape and ggml type (nb[0] the type's block size)",
    "order": "fields in ggml.h's order type < ne < nb < src < data < name",
    "data": "a non-null data pointer",
    "src": 'a graph node "inp_embd" or "result_output" whose src[0] points at a weight struct that '
    "parses, and that parses itself (printable name, known type, ne[0] from the weight's shape, "
    "src[1] a tensor that parses)",
    "type": "type equal to the weight's GGUF ggml type",
    "agree": "single layout that the most weights (at least MIN_WEIGHTS) and the graph nodes agree on",
}


def _fail(key: str, detail: str) -> str:
    return f"invariant '{key}' failed: no {INVARIANTS[key]} ({detail})"


def _at(words: np.ndarray, mask: np.ndarray) -> list[int]:
    return [WINDOW - 8 * int(k) for k in np.flatnonzero(mask)]


def _relative_candidates(words: np.ndarray, spec: WeightSpec, fails: Counter[str]) -> set[Relative]:
    """The (ne, nb, data) distances back from a weight's name at which its struct holds; the stage
    it failed at counted in `fails` when none does."""
    ne_at = _runs(words, spec.ne)
    nb_at = _runs(words, spec.nb)
    data_at = _at(words, (words >= 0x1000) & (words < USER_PTR_MAX))
    # ne[4], nb[4], src..., data, name: src[] lies between nb and data
    pairs = [(e, b) for e in ne_at for b in nb_at if e - 32 >= b]
    out = {Relative(e, b, d) for e, b in pairs for d in data_at if b - 32 > d}
    if not out:
        fails["ne" if not ne_at else "nb" if not nb_at else "order" if not pairs else "data"] += 1
    return out


def _type_offsets(mem: Memory, name: int, spec: WeightSpec, lay: Solved) -> set[int]:
    """Offsets before ne (8-aligned, as the probes need) whose int32 is the weight's GGUF type."""
    raw = mem.read(name - lay.name, lay.ne)
    if raw is None:
        return set()
    return {o for o in range(0, lay.ne, 8) if int.from_bytes(raw[o : o + 4], "little") == spec.ggml_type}


def _parses(mem: Memory, t: int, lay: Solved) -> bool:
    """A tensor at `t` that holds together: printable NUL-terminated name, known type, ne >= 1."""
    raw = mem.read(t, lay.name + NAME_MAX)
    if raw is None:
        return False
    name = raw[lay.name :].split(b"\x00", 1)
    if len(name) < 2 or not all(0x20 <= c < 0x7F for c in name[0]):
        return False
    ne = np.frombuffer(raw[lay.ne : lay.ne + 32], dtype="<i8")
    typ = int.from_bytes(raw[lay.type : lay.type + 4], "little")
    return typ in GGML_TYPES and bool(np.all(ne >= 1)) and bool(np.all(ne < 1 << 40))


def _node_supports(
    mem: Memory, node_name: int, dim: int, rel: Relative, weights: dict[int, WeightSpec], type_at: int | None
) -> set[Solved]:
    """The layouts under which the graph node named at `node_name` has src[0] pointing at a weight
    that parses with `rel`, and parses itself. `type_at` None: any type offset before ne at
    which the node parses (the weights decide it), and the layouts come back with type -1."""
    words = _words(mem, node_name)
    if words is None:
        return set()
    out: set[Solved] = set()
    for k, v in enumerate(words.tolist()):
        d_src = WINDOW - 8 * k
        if not rel.nb - 32 >= d_src > rel.data:
            continue
        for name_off in range(rel.ne, WINDOW, 8):
            spec = weights.get(v + name_off)
            if spec is None:
                continue
            lay = Solved(
                -1, name_off - rel.ne, name_off - rel.nb, name_off - d_src, name_off - rel.data, name_off
            )
            types = range(0, lay.ne, 8) if type_at is None else (type_at,)
            node = node_name - name_off
            raw = mem.read(node, name_off)
            if raw is None:
                continue
            ne0 = int.from_bytes(raw[lay.ne : lay.ne + 8], "little")
            src1 = int.from_bytes(raw[lay.src + 8 : lay.src + 16], "little")
            if ne0 != spec.ne[dim] or not src1:
                continue
            for t in types:
                typed = replace(lay, type=t)
                if _parses(mem, node, typed) and _parses(mem, src1, typed):
                    out.add(lay if type_at is None else typed)
                    break
    return out


def _nodes(mem: Memory, found: dict[bytes, list[int]], rel: Relative, weights: dict[int, WeightSpec],
           type_at: int | None) -> Counter[Solved]:  # fmt: skip
    out: Counter[Solved] = Counter()
    for needle, dim in NODES.items():
        for n in found[needle]:
            if n % 8 == 0:
                out.update(_node_supports(mem, n, dim, rel, weights, type_at))
    return out


def _anchors(
    mem: Memory, specs: dict[bytes, WeightSpec]
) -> tuple[dict[bytes, list[int]], dict[int, WeightSpec]]:
    found = mem.find((WEIGHT_SUFFIX, *NODES))
    return found, _weight_hits(mem, specs, found[WEIGHT_SUFFIX])


def _node_count(found: dict[bytes, list[int]]) -> str:
    return ", ".join(f"{len(found[n])} named {n[:-1].decode()}" for n in NODES)


def solve(mem: Memory, specs: dict[bytes, WeightSpec]) -> Verdict:
    """The one ggml_tensor layout every anchor in `mem` agrees on, or None naming the invariant
    that failed."""
    if not specs:
        return Verdict(None, 0, 0, _fail("name", "the model has no usable '.weight' tensor"))
    found, weights = _anchors(mem, specs)
    named = len({spec.name for spec in weights.values()})
    if named < min(MIN_WEIGHTS, len(specs)):
        return Verdict(
            None, 0, 0, _fail("name", f"{named} of {len(specs)} weight names are in the memory read")
        )
    fails: Counter[str] = Counter()
    support: dict[Relative, set[str]] = {}  # -> the weights (by name) whose structs hold with it
    for addr, spec in weights.items():
        words = _words(mem, addr)
        for rel in _relative_candidates(words, spec, fails) if words is not None else ():
            support.setdefault(rel, set()).add(spec.name)
    best = max(map(len, support.values()), default=0)
    need = min(MIN_WEIGHTS, len(specs))
    if best < need:
        # too few structs hold: the others say why
        furthest = max(fails, key=list(INVARIANTS).index, default="ne")
        detail = f"{len(weights)} weight names found, {best} structs hold, failed: {dict(fails)}"
        return Verdict(None, best, 0, _fail(furthest, detail))
    top = [r for r, names in support.items() if len(names) == best]
    if len(top) > 1:
        return Verdict(None, best, 0, _fail("agree", f"{len(top)} layouts fit {best} weights each"))
    rel = top[0]
    nodes = _nodes(mem, found, rel, weights, None)
    if not nodes:
        return Verdict(None, best, 0, _fail("src", f"graph nodes found: {_node_count(found)}"))
    # the type offset: where the weights that parse have their own GGUF type (a stale copy of a
    # struct in freed memory may hold a name, shape and strides, but not the rest)
    name_offs = {lay.name for lay in nodes}
    if len(name_offs) > 1:
        return Verdict(None, best, 0, _fail("agree", f"the nodes put the name at {sorted(name_offs)}"))
    base = next(iter(nodes))
    types: dict[int, set[str]] = {}  # type offset -> the weights (by name) that parse with it
    for addr, spec in weights.items():
        words = _words(mem, addr)
        if words is not None and rel in _relative_candidates(words, spec, Counter()):
            for t in _type_offsets(mem, addr, spec, base):
                types.setdefault(t, set()).add(spec.name)
    most_typed = max(map(len, types.values()), default=0)
    top_types = [t for t, names in types.items() if len(names) == most_typed]
    if most_typed < need or len(top_types) > 1:
        key = "type" if most_typed < need else "agree"
        counts = {t: len(names) for t, names in types.items()}
        return Verdict(None, best, 0, _fail(key, f"weights per type offset: {counts}"))
    best = most_typed
    lay = replace(base, type=top_types[0])
    typed = _nodes(mem, found, rel, weights, lay.type)[lay]
    if not typed:
        return Verdict(None, best, 0, _fail("src", "no node parses with the type offset the weights give"))
    return Verdict(lay, best, typed, f"{best} weights and {typed} graph nodes agree")


def check(mem: Memory, specs: dict[bytes, WeightSpec], lay: Solved) -> Verdict:
    """`lay` checked on the anchors in `mem`: it holds when at least MIN_WEIGHTS weights (all if
    fewer) and one graph node parse with it; else None naming the first invariant that no
    anchor passed."""
    found, weights = _anchors(mem, specs)
    named = len({spec.name for spec in weights.values()})
    if named < min(MIN_WEIGHTS, len(specs)):
        return Verdict(
            None, 0, 0, _fail("name", f"{named} of {len(specs)} weight names are in the memory read")
        )
    passed: Counter[str] = Counter()
    ok_names: set[str] = set()
    for addr, spec in weights.items():
        raw = mem.read(addr - lay.name, lay.name)
        if raw is None:
            continue
        ne = tuple(np.frombuffer(raw[lay.ne : lay.ne + 32], dtype="<u8").tolist())
        nb = tuple(np.frombuffer(raw[lay.nb : lay.nb + 32], dtype="<u8").tolist())
        data = int.from_bytes(raw[lay.data : lay.data + 8], "little")
        typ = int.from_bytes(raw[lay.type : lay.type + 4], "little")
        steps = (("ne", ne == spec.ne), ("nb", nb == spec.nb), ("data", 0x1000 <= data < USER_PTR_MAX))
        for key, good in (*steps, ("type", typ == spec.ggml_type)):
            if not good:
                break
            passed[key] += 1
        else:
            ok_names.add(spec.name)
    ok = len(ok_names)
    need = min(MIN_WEIGHTS, len(specs))
    if ok < need:
        for key in ("ne", "nb", "data", "type"):
            if passed[key] < need:
                return Verdict(
                    None, ok, 0, _fail(key, f"{passed[key]} of {len(weights)} weight names found pass")
                )
        return Verdict(None, ok, 0, _fail("agree", f"{ok} distinct weights parse, {need} needed"))
    rel = Relative(lay.name - lay.ne, lay.name - lay.nb, lay.name - lay.data)
    nodes = _nodes(mem, found, rel, weights, lay.type)[lay]
    if not nodes:
        return Verdict(None, ok, 0, _fail("src", f"graph nodes found: {_node_count(found)}"))
    return Verdict(lay, ok, nodes, f"{ok} weights and {nodes} graph nodes parse")
