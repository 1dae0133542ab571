"""Layout discovery on synthetic records in the probe's exact binary format: the right layout is
found for each layout llama.cpp has had, nothing is claimed on too little evidence, and perturbed
structs or another program's memory are refused naming the invariant that failed."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from sparseety_prof.capture import layout_discovery as ld
from sparseety_prof.capture.layouts import _UBATCH_2025, _UBATCH_2026_10, UbatchLayout

N_VOCAB = 32000


class Memory:
    """Fake process memory: arrays at fake addresses, and records made from it as the BPF side
    would copy them."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.serial = itertools.count()
        self.next_addr = 0x7F0000000000

    def addr(self) -> int:
        self.next_addr += 0x10000
        return self.next_addr

    def ubatch(
        self,
        lay: UbatchLayout,
        tokens: list[int],
        pos: list[int],
        seq: list[int],
        out: list[int],
        *,
        tid: int = 7,
        decoys: bool = True,
    ) -> bytes:
        n = len(tokens)
        a = np.zeros(1, dtype=ld.UBATCH_DTYPE)[0]
        a["serial"], a["tid"], a["kind"], a["raw_ok"] = next(self.serial), tid, ld.DSC_UBATCH, 1
        raw = bytearray(ld.DSC_STRUCT)
        raw[0] = 0  # equal_seqs
        for off, val in ((4, n), (8, 1), (12, n)):  # n_tokens, n_seq_tokens, n_seqs (split_simple)
            raw[off : off + 4] = val.to_bytes(4, "little")
        arrays: dict[int, bytes] = {
            lay.token: np.asarray(tokens, "<i4").tobytes(),
            lay.pos: np.asarray(pos, "<i4").tobytes(),
            lay.n_seq_id: np.ones(n, "<i4").tobytes(),
            lay.output: np.asarray(out, "i1").tobytes(),
        }
        uniq = sorted(set(seq))
        if decoys:  # seq_id_unq and seq_idx follow seq_id in the real struct
            arrays[lay.seq_id + 8] = np.asarray(uniq, "<i4").tobytes()
            idx = np.full(64, -1, "<i4")
            for i, s in enumerate(uniq):
                idx[s] = i
            arrays[lay.seq_id + 16] = idx.tobytes()
        ok = 0
        for off, data in arrays.items():
            k = off // 8
            raw[off : off + 8] = self.addr().to_bytes(8, "little")
            buf = np.zeros(ld.DSC_BYTES, "u1")
            buf[: min(len(data), ld.DSC_BYTES)] = np.frombuffer(data[: ld.DSC_BYTES], "u1")
            a["pointee"][k] = buf
            ok |= 1 << k
        # seq_id: an array of pointers to each row's sequence ids
        k = lay.seq_id // 8
        raw[lay.seq_id : lay.seq_id + 8] = self.addr().to_bytes(8, "little")
        ptrs = np.asarray([self.addr() for _ in range(ld.DSC_BYTES // 8)], "<u8")
        a["pointee"][k] = np.frombuffer(ptrs.tobytes(), "u1")
        ok |= 1 << k
        dok = 0
        for j in range(min(n, ld.DSC_DEREF)):
            a["deref"][k][j] = seq[j]
            dok |= 1 << j
        a["deref_ok"][k] = dok
        a["pointee_ok"] = ok
        a["raw"] = np.frombuffer(bytes(raw), "u1")
        return a.tobytes()

    def batch(
        self, tokens: list[int], pos: list[int], seq: list[int], logits: list[int], tid: int = 7
    ) -> bytes:
        a = np.zeros(1, dtype=ld.BATCH_DTYPE)[0]
        a["serial"], a["tid"], a["kind"] = next(self.serial), tid, ld.DSC_BATCH
        n = len(tokens)
        a["n_tokens"], a["has"] = n, 1 | 2 | 4 | 8
        m = min(n, ld.DSC_BATCH_ROWS)
        a["token"][:m], a["pos"][:m], a["seq"][:m], a["logits"][:m] = tokens[:m], pos[:m], seq[:m], logits[:m]
        return a.tobytes()

    def sample(self, token: int, tid: int = 7) -> bytes:
        a = np.zeros(1, dtype=ld.SAMPLE_DTYPE)[0]
        a["serial"], a["tid"], a["kind"], a["token"] = next(self.serial), tid, ld.DSC_SAMPLE, token
        return a.tobytes()


def generation(
    mem: Memory, lay: UbatchLayout, *, public_batch: bool, n_prompt: int = 6, n_gen: int = 4, seq: int = 0
) -> list[bytes]:
    """A prompt then one-row decode steps, each followed by a sampler call."""
    rng = mem.rng
    recs: list[bytes] = []
    prompt = [rng.randrange(N_VOCAB) for _ in range(n_prompt)]
    rows = [(prompt, list(range(n_prompt)), [0] * (n_prompt - 1) + [1])]
    p = n_prompt
    for _ in range(n_gen):
        rows.append(([rng.randrange(N_VOCAB)], [p], [1]))
        p += 1
    for i, (tok, pos, out) in enumerate(rows):
        if i > 0:
            tok = [int(np.frombuffer(recs[-1][24:28], "<i4")[0])]  # the previous sample is the input
        if public_batch:
            recs.append(mem.batch(tok, pos, [seq] * len(tok), out))
        recs.append(mem.ubatch(lay, tok, pos, [seq] * len(tok), out))
        recs.append(mem.sample(rng.randrange(N_VOCAB)))
    return recs


@pytest.mark.parametrize("lay", [_UBATCH_2025, _UBATCH_2026_10], ids=["pos@40", "pos@48"])
@pytest.mark.parametrize("public_batch", [True, False], ids=["llama_batch", "server"])
def test_finds_each_layout_llama_cpp_has_had(lay: UbatchLayout, public_batch: bool) -> None:
    mem = Memory(random.Random(1))
    v = ld.discover(ld.parse(generation(mem, lay, public_batch=public_batch)), N_VOCAB)
    assert v.layout == lay, v
    assert v.candidates == 1
    assert ld.INV_CONSEC in v.evidence
    assert (ld.INV_BATCH_ROWS in v.evidence) == public_batch
    if not public_batch:
        assert ld.INV_SAMPLE in v.evidence


def test_an_unseen_layout_is_found_too() -> None:
    """A layout no build had (fields moved by two more words): discovery does not need a table."""
    lay = UbatchLayout(n_tokens=4, token=40, pos=64, n_seq_id=72, seq_id=96, output=120)
    mem = Memory(random.Random(2))
    v = ld.discover(ld.parse(generation(mem, lay, public_batch=False, n_gen=6)), N_VOCAB)
    assert v.layout == lay, v


def test_no_claim_on_too_little_evidence() -> None:
    mem = Memory(random.Random(3))
    one_step = [mem.ubatch(_UBATCH_2025, [17], [40], [0], [1])]
    v = ld.discover(ld.parse(one_step), N_VOCAB)
    assert v.layout is None and v.candidates >= 1, v
    assert ld.discover([], N_VOCAB).reason == "no forward pass was seen"


@pytest.mark.parametrize(
    ("perturb", "invariant"),
    [
        ("tokens", ld.INV_TOKEN),
        ("positions", ld.INV_CONSEC),
        ("batch", ld.INV_BATCH_ROWS),
        ("output", ld.INV_OUTPUT_USED),
    ],
)
def test_perturbed_structs_are_refused_naming_the_invariant(perturb: str, invariant: str) -> None:
    mem = Memory(random.Random(4))
    lay = _UBATCH_2025
    recs = generation(mem, lay, public_batch=True)
    tok, pos, out = [5, 6, 7, 8, 9], [0, 1, 2, 3, 4], [0, 0, 0, 0, 1]
    btok = list(tok)
    if perturb == "tokens":
        tok = [5, 6, N_VOCAB + 3, 8, 9]
        btok = tok
    elif perturb == "positions":
        pos = [0, 1, 5, 3, 4]
    elif perturb == "batch":
        btok = [5, 6, 7, 8, 10]
    elif perturb == "output":
        out = [0, 0, 0, 0, 0]
    recs += [mem.batch(btok, pos, [1] * 5, out), mem.ubatch(lay, tok, pos, [1] * 5, out), mem.sample(3)]
    v = ld.discover(ld.parse(recs), N_VOCAB)
    assert v.layout is None and v.candidates == 0, v
    assert invariant in v.reason, v.reason


def test_another_programs_memory_is_refused() -> None:
    """Random words and random pointees (what a probe on an unrelated function would copy)."""
    rng = np.random.default_rng(5)
    recs = []
    for i in range(8):
        a = np.zeros(1, dtype=ld.UBATCH_DTYPE)[0]
        a["serial"], a["tid"], a["kind"], a["raw_ok"] = i, 1, ld.DSC_UBATCH, 1
        a["raw"] = rng.integers(0, 256, ld.DSC_STRUCT, dtype=np.uint8)
        a["pointee"] = rng.integers(0, 256, (ld.DSC_SLOTS, ld.DSC_BYTES), dtype=np.uint8)
        a["pointee_ok"] = 0xFFFFFFFF
        recs.append(a.tobytes())
    v = ld.discover(ld.parse(recs), N_VOCAB)
    assert v.layout is None and v.candidates == 0, v
    assert "no layout satisfies" in v.reason


def test_truncated_and_unknown_records_are_skipped() -> None:
    mem = Memory(random.Random(6))
    recs = generation(mem, _UBATCH_2025, public_batch=True)
    garbage = [b"", b"\x01" * 10, (99).to_bytes(24, "little"), recs[0][:100]]
    assert ld.parse(garbage) == []
    v = ld.discover(ld.parse(garbage + recs), N_VOCAB)
    assert v.layout == _UBATCH_2025


def test_lost_records_break_no_anchor() -> None:
    """A batch record lost in the ring (a serial gap) must not pair its micro-batches with the
    previous batch: the true layout still holds, linked anchors resume after the gap."""
    mem = Memory(random.Random(7))
    recs = generation(mem, _UBATCH_2025, public_batch=True)
    lost = [i for i, r in enumerate(recs) if int.from_bytes(r[20:24], "little") == ld.DSC_BATCH][2]
    v = ld.discover(ld.parse(recs[:lost] + recs[lost + 1 :]), N_VOCAB)
    assert v.layout == _UBATCH_2025, v


def test_two_threads_interleaved() -> None:
    """Two engine threads (two contexts) decoding at once: anchors stay within a thread."""
    mem = Memory(random.Random(8))
    a = generation(mem, _UBATCH_2025, public_batch=True)
    mem2 = Memory(random.Random(9))
    b = generation(mem2, _UBATCH_2025, public_batch=True, seq=1)
    # one serial counter for the process, records of the two threads alternating
    mixed = []
    for n, r in enumerate(x for pair in itertools.zip_longest(a, b) for x in pair if x is not None):
        arr = bytearray(r)
        arr[0:8] = n.to_bytes(8, "little")
        arr[16:20] = (7 if r in a else 8).to_bytes(4, "little")
        mixed.append(bytes(arr))
    v = ld.discover(ld.parse(mixed), N_VOCAB)
    assert v.layout == _UBATCH_2025, v


@pytest.mark.parametrize(
    ("build", "ggml", "package", "want"),
    [
        (11434, "0.26.0", ("", ""), _UBATCH_2025),  # llama-server b11434: ggml 0.26.0, the old layout
        (None, "0.26.0", ("xllamacpp", "2026.10.11549"), _UBATCH_2026_10),  # build from the version
        (None, "0.26.0", ("", ""), None),  # 0.26.0 alone spans both layouts: discovery
        (None, "0.25.3", ("llama-cpp-python", "0.3.36"), _UBATCH_2025),
        (10068, "0.17.0", ("", ""), _UBATCH_2025),
        (12000, "0.27.0", ("", ""), None),  # past the verified range: discovery
        (8000, "0.9.11", ("", ""), None),  # a build number before the range decides, not ggml
    ],
)
def test_table_fast_path(
    build: int | None, ggml: str, package: tuple[str, str], want: UbatchLayout | None
) -> None:
    from sparseety_prof.capture.buildinfo import BuildIdentity
    from sparseety_prof.capture.layouts import resolve

    ident = BuildIdentity(ggml, build, None, package[0], package[1], ())
    got = resolve(ident, "/usr/bin/llama-server")
    assert got.ubatch == want, got.layout_source
