"""Infer the private `struct llama_ubatch` layout of a llama.cpp build from live data.

The discovery probe (probes/discover_ubatch.bpf.c) copies, for a few forward passes, the raw
struct, what each of its words points to, the public `llama_batch` the micro-batches were cut
from and the sampled tokens. Here every candidate set of offsets is tested against invariants
that hold for any real micro-batch and fail for a wrong offset; discovery succeeds when exactly
one candidate holds on every record and the records were informative enough to tell the
candidates apart. Pure functions over the records: tests feed them perturbed memory.

Structural facts used (unchanged in llama-batch.h since the struct was introduced in 2023): the
counts (`n_tokens` first among them) come before the pointers, and the pointers the probes read
come in the order token, pos, n_seq_id, seq_id, output.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

from sparseety_prof.capture.layouts import UbatchLayout

# mirrors of probes/discover_ubatch.bpf.c
DSC_STRUCT = 256
DSC_SLOTS = DSC_STRUCT // 8
DSC_BYTES = 256
DSC_DEREF = 16
DSC_BATCH_ROWS = 64
DSC_UBATCH, DSC_BATCH, DSC_SAMPLE = 1, 2, 3

HDR = [("serial", "<u8"), ("ctx", "<u8"), ("tid", "<u4"), ("kind", "<u4")]
UBATCH_DTYPE = np.dtype(
    [
        *HDR,
        ("raw", "u1", (DSC_STRUCT,)),
        ("pointee", "u1", (DSC_SLOTS, DSC_BYTES)),
        ("deref", "<i4", (DSC_SLOTS, DSC_DEREF)),
        ("pointee_ok", "<u4"),
        ("raw_ok", "<u4"),
        ("deref_ok", "<u2", (DSC_SLOTS,)),
    ]
)
BATCH_DTYPE = np.dtype(
    [
        *HDR,
        ("n_tokens", "<i4"),
        ("has", "<u4"),
        ("token", "<i4", (DSC_BATCH_ROWS,)),
        ("pos", "<i4", (DSC_BATCH_ROWS,)),
        ("seq", "<i4", (DSC_BATCH_ROWS,)),
        ("logits", "i1", (DSC_BATCH_ROWS,)),
    ]
)
SAMPLE_DTYPE = np.dtype([*HDR, ("token", "<i4"), ("pad", "<u4")])
DTYPES = {DSC_UBATCH: UBATCH_DTYPE, DSC_BATCH: BATCH_DTYPE, DSC_SAMPLE: SAMPLE_DTYPE}

MAX_N_TOKENS = 1 << 16  # llama.cpp's n_ubatch is far below this
MAX_SEQ = 1 << 16  # sequence ids (LLAMA_MAX_SEQ is 256 today; generous on purpose)
MAX_POS = 1 << 26

# The invariants, by the names the refusal message uses.
INV_N = "n_tokens in [1, 65536]"
INV_TOKEN = "token ids in [0, n_vocab)"
INV_POS = "positions in [0, 2^26)"
INV_NSEQ = "n_seq_id of every row in [1, 65536]"
INV_SEQ = "sequence ids readable and in [0, 65536)"
INV_OUT = "output flags 0/1"
INV_CONSEC = "positions consecutive per sequence"
INV_BATCH_N = "micro-batch sizes add up to the public llama_batch's n_tokens"
INV_BATCH_ROWS = "rows equal the public llama_batch's (token, position, sequence, output)"
INV_SAMPLE = "the sampled token is the next decode step's input"
INV_OUTPUT_USED = "a micro-batch read by a sampler call has an output row"


@dataclass
class Ubatch:
    """One micro-batch as copied: raw struct words and what they point to."""

    raw: bytes
    pointee: list[bytes | None]  # per 8-byte word: DSC_BYTES bytes at that pointer, or None
    deref: list[list[int | None]]  # per word: the int32s its first DSC_DEREF entries point to
    batch: Batch | None = None  # the public batch this micro-batch was the first of
    batch_total: int | None = None  # n_tokens of the batch when this is its LAST micro-batch
    batch_first: int | None = None  # index of its batch's first micro-batch: the batch's id
    sampled_after: bool = False  # a sampler call read logits before the next forward pass
    gap_before: bool = False  # records were skipped or lost just before: no continuity across
    next_input: list[int] = field(default_factory=list)  # tokens sampled right before this one


@dataclass
class Batch:
    n_tokens: int
    token: list[int] | None
    pos: list[int] | None
    seq: list[int] | None
    logits: list[int] | None


@dataclass(frozen=True)
class Verdict:
    layout: UbatchLayout | None
    candidates: int  # layouts consistent with every record
    ubatches: int
    reason: str  # why there is no layout (empty when there is one)
    evidence: tuple[str, ...] = ()  # the anchors that were checked and held


def parse(records: list[bytes]) -> list[Ubatch]:
    """Raw ring records -> micro-batches with their anchors attached, in serial order. Anchors
    link records of one engine thread only, and never across a gap in the serial numbers (a
    record the probe skipped or the ring had no room for)."""
    parsed: list[tuple[int, int, np.void]] = []
    for r in records:
        if len(r) < 24:
            continue
        kind = int.from_bytes(r[20:24], "little")
        dt = DTYPES.get(kind)
        if dt is None or len(r) < dt.itemsize:
            continue
        a = np.frombuffer(r[: dt.itemsize], dtype=dt)[0]
        parsed.append((int(a["serial"]), kind, a))
    parsed.sort(key=lambda x: x[0])
    out: list[Ubatch] = []
    threads: dict[int, _Thread] = {}
    prev = None
    for serial, kind, a in parsed:
        if prev is not None and serial != prev + 1:
            threads = {}  # a gap: start every thread afresh
            gap = True
        else:
            gap = prev is None
        prev = serial
        th = threads.setdefault(int(a["tid"]), _Thread(gap_pending=gap))
        if kind == DSC_BATCH:
            if th.last is not None and th.first_of_batch is not None and th.batch is not None:
                th.last.batch_total = th.batch.n_tokens  # the batch is complete: check its sum
            th.batch, th.first_of_batch, th.last = _batch(a), None, None
        elif kind == DSC_SAMPLE:
            if th.last is not None:
                th.last.sampled_after = True
            th.pending.append(int(a["token"]))
        else:
            u = _ubatch(a)
            u.next_input, th.pending = th.pending, []
            u.gap_before, th.gap_pending = th.gap_pending, False
            if th.batch is not None and th.first_of_batch is None:
                u.batch = th.batch
                th.first_of_batch = len(out)
            u.batch_first = th.first_of_batch
            out.append(u)
            th.last = u
    return out


@dataclass
class _Thread:
    """What parse() links across the records of one engine thread."""

    gap_pending: bool
    batch: Batch | None = None
    first_of_batch: int | None = None  # index (in the output) of the batch's first micro-batch
    pending: list[int] = field(default_factory=list)  # tokens sampled since the last micro-batch
    last: Ubatch | None = None


def _batch(a: np.void) -> Batch:
    n = int(a["n_tokens"])
    m = max(0, min(n, DSC_BATCH_ROWS))
    has = int(a["has"])
    return Batch(
        n_tokens=n,
        token=[int(x) for x in a["token"][:m]] if has & 1 else None,
        pos=[int(x) for x in a["pos"][:m]] if has & 2 else None,
        seq=[int(x) for x in a["seq"][:m]] if has & 8 else None,
        logits=[int(x) for x in a["logits"][:m]] if has & 4 else None,
    )


def _ubatch(a: np.void) -> Ubatch:
    raw = bytes(a["raw"]) if int(a["raw_ok"]) else bytes(DSC_STRUCT)
    ok = int(a["pointee_ok"])
    pointee = [bytes(a["pointee"][k]) if ok >> k & 1 else None for k in range(DSC_SLOTS)]
    deref = []
    for k in range(DSC_SLOTS):
        dok = int(a["deref_ok"][k])
        deref.append([int(a["deref"][k][j]) if dok >> j & 1 else None for j in range(DSC_DEREF)])
    return Ubatch(raw=raw, pointee=pointee, deref=deref)


def _i32(b: bytes, m: int) -> np.ndarray:
    return np.frombuffer(b, dtype="<i4", count=min(m, len(b) // 4))


@dataclass
class _Slots:
    """What each pointer word can be, on every micro-batch, for one n_tokens offset."""

    token: set[int]
    pos: set[int]
    nseq: set[int]
    seq: set[int]
    out: set[int]


def discover(ubatches: list[Ubatch], n_vocab: int, *, min_ubatches: int = 2) -> Verdict:
    """The one layout consistent with every micro-batch, or why there is none."""
    n_ub = len(ubatches)
    if n_ub == 0:
        return Verdict(None, 0, 0, "no forward pass was seen")
    survivors, evidence = _survivors(ubatches, n_vocab)
    if len(survivors) == 1:
        if n_ub < min_ubatches or not evidence:
            anchors = sorted(evidence) or "none"
            return Verdict(
                None, 1, n_ub, f"not enough evidence yet ({n_ub} micro-batches, anchors: {anchors})"
            )
        return Verdict(survivors[0], 1, n_ub, "", tuple(sorted(evidence)))
    if survivors:
        return Verdict(
            None, len(survivors), n_ub, f"{len(survivors)} layouts fit the {n_ub} micro-batches seen so far"
        )
    return Verdict(None, 0, n_ub, "no layout satisfies every invariant: " + _diagnose(ubatches, n_vocab))


def _survivors(ubatches: list[Ubatch], n_vocab: int) -> tuple[list[UbatchLayout], set[str]]:
    fits: list[tuple[UbatchLayout, set[str]]] = []
    for n_off in range(0, 32, 4):
        ns = _counts(ubatches, n_off)
        if ns is None:
            continue
        for lay in _ordered(_slot_roles(ubatches, ns, n_vocab, n_off), n_off):
            failed, used = _joint(ubatches, ns, lay)
            if not failed:
                fits.append((lay, used))
    if not fits:
        return [], set()
    # n_tokens is the first count of the struct: among counts that hold equally, the lowest offset
    low = min(lay.n_tokens for lay, _ in fits)
    fits = [(lay, used) for lay, used in fits if lay.n_tokens == low]
    return [lay for lay, _ in fits], set().union(*(used for _, used in fits))


def _counts(ubatches: list[Ubatch], n_off: int) -> list[int] | None:
    ns = [int.from_bytes(u.raw[n_off : n_off + 4], "little") for u in ubatches]
    return ns if all(1 <= n <= MAX_N_TOKENS for n in ns) else None


def _diagnose(ubatches: list[Ubatch], n_vocab: int) -> str:
    """Which invariant broke the layouts that fit the longest run of micro-batches."""
    for j in range(len(ubatches) - 1, 0, -1):
        fitting, _ = _survivors(ubatches[:j], n_vocab)
        if fitting:
            broken = sorted({_why(ubatches[: j + 1], lay, n_vocab) for lay in fitting})
            return (
                f"micro-batch {j} breaks {'; '.join(broken)} for the {len(fitting)} layout(s) that fit the "
                f"{j} before it"
            )
    failed: list[str] = []
    for n_off in range(0, 32, 4):
        ns = _counts(ubatches, n_off)
        if ns is None:
            failed.append(INV_N)
            continue
        sl = _slot_roles(ubatches, ns, n_vocab, n_off)
        for inv, slots in (
            (INV_TOKEN, sl.token),
            (INV_POS, sl.pos),
            (INV_NSEQ, sl.nseq),
            (INV_SEQ, sl.seq),
            (INV_OUT, sl.out),
        ):
            if not slots:
                failed.append(inv)
    for n_off in range(0, 32, 4):
        ns = _counts(ubatches, n_off)
        if ns is not None:
            failed += [
                _joint(ubatches, ns, lay)[0]
                for lay in _ordered(_slot_roles(ubatches, ns, n_vocab, n_off), n_off)
            ]
    counts = {inv: failed.count(inv) for inv in dict.fromkeys(failed)}
    return "; ".join(
        f"{inv} (no candidate word for {c} of 8 count offsets)" for inv, c in counts.items()
    ) or ("no ordered set of words fits")


def _why(ubatches: list[Ubatch], lay: UbatchLayout, n_vocab: int) -> str:
    ns = _counts(ubatches, lay.n_tokens)
    if ns is None:
        return INV_N
    sl = _slot_roles(ubatches, ns, n_vocab, lay.n_tokens)
    for inv, slots, off in (
        (INV_TOKEN, sl.token, lay.token),
        (INV_POS, sl.pos, lay.pos),
        (INV_NSEQ, sl.nseq, lay.n_seq_id),
        (INV_SEQ, sl.seq, lay.seq_id),
        (INV_OUT, sl.out, lay.output),
    ):
        if off // 8 not in slots:
            return inv
    return _joint(ubatches, ns, lay)[0] or "no invariant (it fits)"


def _slot_roles(ubatches: list[Ubatch], ns: list[int], n_vocab: int, n_off: int) -> _Slots:
    first = (n_off + 4 + 7) // 8  # pointers follow the counts
    roles = _Slots(*(set(range(first, DSC_SLOTS)) for _ in range(5)))
    for u, n in zip(ubatches, ns, strict=True):
        for k in range(first, DSC_SLOTS):
            b = u.pointee[k]
            if b is None:
                for r in (roles.token, roles.pos, roles.nseq, roles.seq, roles.out):
                    r.discard(k)
                continue
            v = _i32(b, n)
            if not ((v >= 0) & (v < n_vocab)).all():
                roles.token.discard(k)
            if not ((v >= 0) & (v < MAX_POS)).all():
                roles.pos.discard(k)
            if not ((v >= 1) & (v <= MAX_SEQ)).all():
                roles.nseq.discard(k)
            o = np.frombuffer(b, dtype="i1", count=min(n, len(b)))
            if not np.isin(o, (0, 1)).all():
                roles.out.discard(k)
            ids = u.deref[k][: min(n, DSC_DEREF)]
            if any(x is None or not 0 <= x < MAX_SEQ for x in ids):
                roles.seq.discard(k)
    return roles


def _ordered(sl: _Slots, n_off: int) -> list[UbatchLayout]:
    return [
        UbatchLayout(n_tokens=n_off, token=t * 8, pos=p * 8, n_seq_id=q * 8, seq_id=s * 8, output=o * 8)
        for t in sorted(sl.token)
        for p in sorted(x for x in sl.pos if x > t)
        for q in sorted(x for x in sl.nseq if x > p)
        for s in sorted(x for x in sl.seq if x > q)
        for o in sorted(x for x in sl.out if x > s)
    ]


def _joint(ubatches: list[Ubatch], ns: list[int], lay: UbatchLayout) -> tuple[str, set[str]]:
    """The first invariant `lay` breaks ("" if none) and the anchors that were exercised."""
    t, p, s, o = lay.token // 8, lay.pos // 8, lay.seq_id // 8, lay.output // 8
    used: set[str] = set()
    last_pos: dict[int, int] = {}
    batches: dict[int, list[int]] = {}  # batch id -> its micro-batches
    for j, u in enumerate(ubatches):
        if u.batch_first is not None:
            batches.setdefault(u.batch_first, []).append(j)
    for u, n in zip(ubatches, ns, strict=True):
        if u.gap_before:
            last_pos.clear()
        tok = _i32(u.pointee[t] or b"", n)
        pos = _i32(u.pointee[p] or b"", n)
        out = np.frombuffer(u.pointee[o] or b"", dtype="i1", count=min(n, DSC_BYTES))
        seq = [x for x in u.deref[s][: min(n, DSC_DEREF)] if x is not None]
        rows = min(len(seq), len(pos))
        by_seq: dict[int, list[int]] = {}
        for r in range(rows):
            by_seq.setdefault(seq[r], []).append(int(pos[r]))
        for ps in by_seq.values():
            if len(ps) > 1:
                if any(b - a != 1 for a, b in itertools.pairwise(ps)):
                    return INV_CONSEC, used
                used.add(INV_CONSEC)
        if u.batch is not None:
            bt = u.batch
            if n > bt.n_tokens:
                return INV_BATCH_N, used
            k = min(n, len(tok))
            if bt.seq is not None and len(set(bt.seq)) > 1:
                k = 0  # several sequences: llama.cpp may regroup the rows; only the count is compared
            checks = [
                (bt.token, tok[:k]),
                (bt.pos, pos[:k]),
                (bt.seq, np.asarray(seq[: min(k, len(seq))])),
                (bt.logits, out[: min(k, len(out))]),
            ]
            for want, got in checks:
                if want is None or not len(got):
                    continue
                m = min(len(want), len(got))
                # llama.cpp fills in what the caller left NULL (pos, seq, logits): compare only
                # what the caller gave
                if not np.array_equal(np.asarray(want[:m]), got[:m]):
                    return INV_BATCH_ROWS, used
                used.add(INV_BATCH_ROWS)
        if u.batch_total is not None and u.batch_first is not None:
            total = sum(ns[j] for j in batches[u.batch_first])
            if total != u.batch_total:
                return INV_BATCH_N, used
            used.add(INV_BATCH_N)
        # where no public batch is seen (llama-server decodes through its own batch type): the
        # token sampled last for a sequence is the input of its next one-row step, when that
        # step continues the sequence (a cached prompt re-evaluated instead starts elsewhere)
        continues = bool(len(pos)) and bool(seq) and last_pos.get(seq[0]) == int(pos[0]) - 1
        if u.batch is None and u.next_input and n == 1 and len(tok) and continues:
            if int(tok[0]) not in u.next_input:
                return INV_SAMPLE, used
            used.add(INV_SAMPLE)
        for r in range(rows):
            last_pos[seq[r]] = int(pos[r])
        if u.sampled_after and len(out) and not out.any():
            return INV_OUTPUT_USED, used
    return "", used
