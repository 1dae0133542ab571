"""Python mirror of probes/events.h, and batch decoding of raw ring-buffer records.

The ring reader hands over raw bytes grouped by record size; everything here works on whole
batches with numpy structured arrays, so there is no per-event Python work beyond slicing the
batch by kind.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from sparseety_prof.capture.logits_rows import LogitsChunk, LogitsStats, StatsRow
from sparseety_prof.capture.resources import PROBES_DIR

EV_DECODE_BEGIN = 1
EV_UBATCH = 3
EV_UBATCH_END = 4
EV_SAMPLE_BEGIN = 5
EV_LOGITS = 6
EV_SAMPLE_END = 7
EV_SEQ_RM = 8
EV_MEM_CLEAR = 9
EV_TENSOR = 10
EV_ACT = 11
EV_ATTN = 12
EV_ACT_MASK = 13
EV_STEP_AGG = 14
EV_HTTP_READ = 15
EV_TASK_POST = 16
EV_SLOT_LAUNCH = 17
EV_SLOT_CHILD = 18
EV_SLOT_RELEASE = 19
EV_SLOT_TOKEN = 20
EV_HEAD_DRAW = 21  # head sampling in the probes: a sequence's draw (token_probes.bpf.c head_keeps)

TAG_EXPERT_IDS = 1
TAG_EXPERT_WEIGHTS = 2
TAG_ROUTER_PROBS = 3
ACT_FLAG_ODD_WIDTH = 1
ACT_FLAG_BUDGET = 2
ATT_FLAG_CACHED = 1
ATT_FLAG_BUDGET = 2
ATT_FLAG_NO_UBATCH = 4
ATT_FLAG_F16 = 8
ATT_FLAG_UNCOUNTED = 16  # aggregate records: no count for the row (the node's mask was counted earlier)
ATT_FLAG_KV_MASK = 32  # counted where the engine writes the mask ("kq_mask-<n>", n-th call of a micro-batch)

SAMPLER_LLAMA = 1
SAMPLER_COMMON = 2
UB_FLAG_TRUNCATED = 1
UB_FLAG_NO_TOKENS = 2  # embeddings input: no token ids


def _header_define(name: str) -> int:
    """Read a #define from events.h so the two mirrors cannot drift apart silently."""
    text = (PROBES_DIR / "events.h").read_text()
    m = re.search(rf"#define\s+{name}\s+(\d+)", text)
    if not m:
        raise RuntimeError(f"{name} not defined in probes/events.h")
    return int(m.group(1))


MAX_UB_TOK = _header_define("MAX_UB_TOK")
UB_SMALL_TOK = _header_define("UB_SMALL_TOK")
LOGITS_CHUNK_MAX = _header_define("LOGITS_CHUNK")
MAX_LOGITS_CHUNKS = _header_define("MAX_LOGITS_CHUNKS")
NAME_LEN = _header_define("NAME_LEN")
TENSOR_BYTES_S = _header_define("TENSOR_BYTES_S")
TENSOR_BYTES_L = _header_define("TENSOR_BYTES_L")
BLOCK_WORDS = _header_define("BLOCK_WORDS")
ACT_BLOCKS = _header_define("ACT_BLOCKS")
ACT_MAX_ROWS = _header_define("ACT_MAX_ROWS")
ATT_MAX_ROWS = _header_define("ATT_MAX_ROWS")
AGG_MAX_LAYERS = _header_define("AGG_MAX_LAYERS")
AGG_MAX_K = _header_define("AGG_MAX_K")
HTTP_BYTES = _header_define("HTTP_BYTES")
LT_THREADS_DEFAULT = _header_define("LT_THREADS")  # thread slots of layer times when none is passed
#: ev_step_agg.active of a pass of several rows: the record holds its layer times alone
AGG_TIMES_ONLY = _header_define("AGG_TIMES_ONLY")


def logits_chunk_for(n_vocab: int) -> int:
    """Floats per logits record: the vocabulary rounded up to a power of two (at least 1,024),
    at most LOGITS_CHUNK_MAX. One record per row for small vocabularies, few for large ones."""
    return min(LOGITS_CHUNK_MAX, max(1024, 1 << (max(n_vocab, 1) - 1).bit_length()))


HDR = [("seq", "<u8"), ("ts_ns", "<u8"), ("ctx", "<u8"), ("tid", "<u4"), ("kind", "<u2"), ("flags", "<u2")]
HDR_DTYPE = np.dtype(HDR)
# what a, b, c, ptr (and ctx) hold depends on the kind: the table at struct ev_small in probes/events.h
SMALL_DTYPE = np.dtype([*HDR, ("a", "<i4"), ("b", "<i4"), ("c", "<i4"), ("pad", "<i4"), ("ptr", "<u8")])


def _ubatch_dtype(rows: int) -> np.dtype:
    """struct ev_ubatch (MAX_UB_TOK rows) or ev_ubatch_s (UB_SMALL_TOK): the same fields."""
    return np.dtype(
        [
            *HDR,
            ("n_tokens", "<u4"),
            ("n_copied", "<u4"),
            ("row_offset", "<u4"),
            ("pad", "<u4"),
            ("token", "<i4", (rows,)),
            ("pos", "<i4", (rows,)),
            ("seq_id", "<i4", (rows,)),
            ("output", "i1", (rows,)),
        ]
    )


UBATCH_DTYPE = _ubatch_dtype(MAX_UB_TOK)
#: a micro-batch of up to UB_SMALL_TOK rows: EventBatch.ubatch_s, a layout of its own
UBATCH_S_DTYPE = _ubatch_dtype(UB_SMALL_TOK)


TENSOR_HDR = [
    *HDR,
    ("name", f"S{NAME_LEN}"),
    ("tag", "<u2"),
    ("type", "<u2"),
    ("row0", "<u4"),
    ("n_rows", "<u4"),
    ("rows_total", "<u4"),
    ("ne0", "<u4"),
    ("row_stride", "<u4"),
    ("n_bytes", "<u4"),
    ("tpad", "<u4"),
]
# Raw payloads are void fields: tolist() turns a whole group into tuples at C speed, with each
# payload as one bytes object (a uint8 subarray would become a list of ints).
TENSOR_S_DTYPE = np.dtype([*TENSOR_HDR, ("data", f"V{TENSOR_BYTES_S}")])
TENSOR_L_DTYPE = np.dtype([*TENSOR_HDR, ("data", f"V{TENSOR_BYTES_L}")])
ACT_FIELDS = [
    *HDR,
    ("name", f"S{NAME_LEN}"),
    ("ne0", "<u4"),
    ("ne1", "<u4"),
    ("ir0", "<u4"),
    ("n_rows", "<u4"),
    ("nr_total", "<u4"),
    ("ith", "<u4"),
    ("aflags", "<u4"),
    ("apad", "<u4"),
    ("zeros", "<u4", (ACT_MAX_ROWS,)),
    ("below", "<u4", (ACT_MAX_ROWS,)),
]
ACT_DTYPE = np.dtype(ACT_FIELDS)
ACT_MASK_DTYPE = np.dtype([*ACT_FIELDS, ("bits", f"V{ACT_BLOCKS * 2 * 8}")])
ATTN_DTYPE = np.dtype(
    [
        *HDR,
        ("name", f"S{NAME_LEN}"),
        ("mask", "<u8"),
        ("n_kv", "<u4"),
        ("n_rows", "<u4"),
        ("n_counted", "<u4"),
        ("aflags", "<u4"),
        ("row", "<u4", (ATT_MAX_ROWS,)),
        ("attended", "<u4", (ATT_MAX_ROWS,)),
    ]
)


def step_agg_dtype(layers: int, threads: int = LT_THREADS_DEFAULT) -> np.dtype:
    """struct ev_step_agg holding `layers` layers (AGG_LAYERS: see agg_layers_for) and the layer
    times of `threads` engine threads (LT_THREADS: see lt_threads_for)."""
    return np.dtype(
        [
            *HDR,
            ("serial", "<u8"),
            ("active", "<u4"),
            ("overlap", "<u4"),
            ("k_ids", "<u4", (layers,)),
            ("k_wts", "<u4", (layers,)),
            ("ids", "<i4", (layers, AGG_MAX_K)),
            ("wts", "<f4", (layers, AGG_MAX_K)),
            ("act_zero", "<u4", (layers,)),
            ("act_below", "<u4", (layers,)),
            ("act_rows", "<u4", (layers,)),
            ("act_nr", "<u4", (layers,)),
            ("act_ne0", "<u4", (layers,)),
            ("act_slots", "<u4", (layers,)),
            ("att_n", "<u4"),
            ("att_pad", "<u4"),
            ("att_mask", "<u8", (layers,)),
            ("att_layer", "<i4", (layers,)),
            ("att_count", "<u4", (layers,)),
            ("att_flags", "<u4", (layers,)),
            ("t0_ns", "<u8"),
            ("lt_lost", "<u4"),
            ("lt_pad", "<u4"),
            ("lt_tid", "<u4", (threads,)),
            ("lt_off", "<u4", (threads, layers)),
        ]
    )


#: the layer counts an aggregate record is built for (AGG_LAYERS: powers of two, so that the
#: probes bound an index with one AND)
AGG_LAYER_CHOICES = (8, 16, 32, 64, AGG_MAX_LAYERS)
#: attention nodes a pass may add past one per layer (the set_input_kq_mask calls: one per kind
#: of mask, full and sliding-window)
AGG_ATTN_EXTRA = 2
#: the engine threads an aggregate record times (LT_THREADS: powers of two, bounded by one AND)
LT_THREAD_CHOICES = (4, 8, 16, 32)
#: every layout of the aggregate record: (layers, threads) -> dtype
STEP_AGG_LAYOUTS = {
    (lay, thr): step_agg_dtype(lay, thr) for lay in AGG_LAYER_CHOICES for thr in LT_THREAD_CHOICES
}
#: the layouts with the header's default thread slots, by layers
STEP_AGG_DTYPES = {layers: STEP_AGG_LAYOUTS[layers, LT_THREADS_DEFAULT] for layers in AGG_LAYER_CHOICES}
STEP_AGG_DTYPE = STEP_AGG_DTYPES[AGG_MAX_LAYERS]


def lt_threads_for(cpus: int | None) -> int:
    """The engine threads an aggregate record times on a host of `cpus` CPUs: the smallest
    choice with a slot for each CPU (an engine rarely runs more compute threads than CPUs; those
    past the slots are counted in lt_lost, not timed), the largest choice beyond it. The slots
    are cleared and copied once per token: 4 bytes per thread and layer."""
    want = max(int(cpus or 1), 1)
    return next((c for c in LT_THREAD_CHOICES if c >= want), LT_THREAD_CHOICES[-1])


def agg_layers_for(n_layer: int | None) -> int:
    """The layers the aggregate records of a model of `n_layer` layers hold: the smallest choice
    with room for every layer and every attention node of a pass (one per layer, plus the mask
    writes), AGG_MAX_LAYERS when unknown. The record is cleared and copied twice per token: at
    128 layers it is 14.6 KiB, at 16 (an 8-layer model) 1.9 KiB."""
    if n_layer is None or n_layer <= 0:
        return AGG_MAX_LAYERS
    need = n_layer + AGG_ATTN_EXTRA
    return next((c for c in AGG_LAYER_CHOICES if c >= need), AGG_MAX_LAYERS)


HTTP_DTYPE = np.dtype(
    [
        *HDR,
        ("fd", "<i4"),
        ("len", "<u4"),
        ("n_copied", "<u4"),
        ("hpad", "<u4"),
        ("buf", "<u8"),
        ("data", f"V{HTTP_BYTES}"),
    ]
)


def http_copied(rec: np.void) -> bytes:
    """The bytes an EV_HTTP_READ record actually holds: its buffer is reserved uncleared in the
    ring, so what lies past `n_copied` is a stale earlier record's (another request's headers)."""
    data = bytes(rec["data"])
    return data[: max(0, min(int(rec["n_copied"]), int(rec["len"]), len(data)))]


_LOGITS_HEAD = [*HDR, ("idx", "<i4"), ("chunk", "<u4"), ("n_vals", "<u4"), ("n_vocab", "<u4")]


def logits_dtype(chunk: int) -> np.dtype:
    return np.dtype([*_LOGITS_HEAD, ("vals", "<f4", (chunk,))])


#: A logits record taken by reference (RingReader.take): its header fields, then `at`, the byte
#: offset of its floats in EventBatch.logits_data (the ring's memory, or the copied records).
LOGITS_REF_DTYPE = np.dtype([*_LOGITS_HEAD, ("at", "<u8")])
LOGITS_HEAD_BYTES = np.dtype(_LOGITS_HEAD).itemsize  # the bytes before `vals`
#: the key of the logits references among RingReader.take()'s groups (sizes are never 0)
LOGITS_REF = 0


@dataclass
class EventBatch:
    """Records of one drain, split by layout. Arrays are in arrival order."""

    small: np.ndarray = field(default_factory=lambda: np.empty(0, SMALL_DTYPE))
    ubatch: np.ndarray = field(default_factory=lambda: np.empty(0, UBATCH_DTYPE))
    ubatch_s: np.ndarray = field(default_factory=lambda: np.empty(0, UBATCH_S_DTYPE))
    # logits records as references (LOGITS_REF_DTYPE): their floats lie in logits_data
    logits: np.ndarray = field(default_factory=lambda: np.empty(0, LOGITS_REF_DTYPE))
    tensor_s: np.ndarray = field(default_factory=lambda: np.empty(0, TENSOR_S_DTYPE))
    tensor_l: np.ndarray = field(default_factory=lambda: np.empty(0, TENSOR_L_DTYPE))
    act: np.ndarray = field(default_factory=lambda: np.empty(0, ACT_DTYPE))
    act_mask: np.ndarray = field(default_factory=lambda: np.empty(0, ACT_MASK_DTYPE))
    attn: np.ndarray = field(default_factory=lambda: np.empty(0, ATTN_DTYPE))
    step_agg: np.ndarray = field(default_factory=lambda: np.empty(0, STEP_AGG_DTYPE))
    http: np.ndarray = field(default_factory=lambda: np.empty(0, HTTP_DTYPE))
    logits_data: np.ndarray = field(default_factory=lambda: np.empty(0, np.uint8))
    logits_chunk: int = 1024  # floats per logits record
    # logits records reduced when drained (correlate/logits_reduce.py): their `at` is a row of
    # this table, and logits_data is empty
    logits_stats: LogitsStats | None = None

    def logits_vals(self, row: int) -> LogitsChunk:
        """The `logits_chunk` floats of logits record `row` (the first n_vals are the row's), a
        view where they lie: valid as long as the records are (until the next drain's take). Of
        reduced records, their statistics (capture/logits_rows.py)."""
        at = int(self.logits["at"][row])
        if self.logits_stats is not None:
            return StatsRow(self.logits_stats, at if at < len(self.logits_stats) else -1, self.logits_chunk)
        return self.logits_data[at : at + 4 * self.logits_chunk].view("<f4")

    def groups(self) -> list[np.ndarray]:
        return [
            self.small,
            self.ubatch,
            self.logits,
            self.tensor_s,
            self.tensor_l,
            self.act,
            self.act_mask,
            self.attn,
            self.step_agg,
            self.http,
            self.ubatch_s,
        ]

    def __len__(self) -> int:
        return sum(len(g) for g in self.groups())

    def seqs(self) -> np.ndarray:
        return np.concatenate([g["seq"] for g in self.groups()])


def _layouts(
    logits_chunk: int, agg_layers: int | None = None, lt_threads: int = LT_THREADS_DEFAULT
) -> dict[int, tuple[str, np.dtype]]:
    """Record size -> (EventBatch field, dtype). Every layout has a distinct size (checked here),
    so the size alone routes a record. The aggregate record's size depends on the layers and
    threads it was built for: `agg_layers` and `lt_threads`, or every choice of both
    (STEP_AGG_LAYOUTS) when `agg_layers` is None."""
    ldt = logits_dtype(logits_chunk)
    aggs = (
        [STEP_AGG_LAYOUTS[agg_layers, lt_threads]]
        if agg_layers is not None
        else list(STEP_AGG_LAYOUTS.values())
    )
    entries = [
        ("small", SMALL_DTYPE),
        ("ubatch", UBATCH_DTYPE),
        ("ubatch_s", UBATCH_S_DTYPE),
        ("logits", ldt),
        ("tensor_s", TENSOR_S_DTYPE),
        ("tensor_l", TENSOR_L_DTYPE),
        ("act", ACT_DTYPE),
        ("act_mask", ACT_MASK_DTYPE),
        ("attn", ATTN_DTYPE),
        *(("step_agg", dt) for dt in aggs),
        ("http", HTTP_DTYPE),
    ]
    by_size = {dt.itemsize: (name, dt) for name, dt in entries}
    if len(by_size) != len(entries):  # pragma: no cover - a layout change made two sizes collide
        raise RuntimeError("two record layouts have the same size; give one of them padding")
    return by_size


def layout_names(logits_chunk: int) -> dict[int, str]:
    """Record size -> the kind of record of that size (its EventBatch field: "logits", "act",
    "step_agg", ...), for every layout a session may use."""
    return {size: name for size, (name, _) in _layouts(logits_chunk).items()}


def record_sizes(
    logits_chunk: int, agg_layers: int = AGG_MAX_LAYERS, lt_threads: int = LT_THREADS_DEFAULT
) -> list[int]:
    """Sizes of every record layout of a session (its logits and aggregate records' included)."""
    return sorted(_layouts(logits_chunk, agg_layers, lt_threads))


def _unexpected(size: int) -> ValueError:
    return ValueError(f"ring buffer record of unexpected size {size} (events.h and events.py disagree)")


def decode_records(records: list[bytes], logits_chunk: int) -> EventBatch:
    """Split raw records (as copied out of the ring buffer) by layout and view each group as
    a numpy structured array. Records of unknown size are a programming error."""
    groups: dict[int, list[bytes]] = {}
    for r in records:
        groups.setdefault(len(r), []).append(r)
    return decode_groups(
        {size: np.frombuffer(b"".join(recs), np.uint8) for size, recs in groups.items()}, logits_chunk
    )


def decode_groups(
    groups: dict[int, np.ndarray], logits_chunk: int, ring_data: np.ndarray | None = None
) -> EventBatch:
    """Like decode_records, for records already packed by size: {record size: bytes of the
    records back to back} (what RingReader.take() returns), and the logits records taken by
    reference under LOGITS_REF, whose offsets point into `ring_data`. Views, no copies, but for
    the header fields of logits records copied whole (made references into their own bytes)."""
    by_size = _layouts(logits_chunk)
    out = EventBatch(logits_chunk=logits_chunk)
    for size, buf in groups.items():
        if size == LOGITS_REF:
            if ring_data is None:
                raise ValueError("logits records taken by reference, but no ring memory given")
            out.logits, out.logits_data = buf.view(LOGITS_REF_DTYPE), ring_data
            continue
        entry = by_size.get(size)
        if entry is None:
            raise _unexpected(size)
        name, dt = entry
        if name == "logits":
            if len(out.logits):
                raise ValueError("logits records both copied and taken by reference in one drain")
            out.logits, out.logits_data = _as_refs(buf, dt), buf
        else:
            if name == "step_agg" and len(out.step_agg):
                raise ValueError("aggregate records of two sizes in one drain")
            setattr(out, name, buf.view(dt))
    return out


def _as_refs(buf: np.ndarray, dt: np.dtype) -> np.ndarray:
    """Copied logits records (`dt`) as references into `buf`, their own bytes."""
    full = buf.view(dt)
    refs = np.empty(len(full), LOGITS_REF_DTYPE)
    for name in LOGITS_REF_DTYPE.names or ():
        if name != "at":
            refs[name] = full[name]
    refs["at"] = np.arange(len(full), dtype=np.uint64) * dt.itemsize + LOGITS_HEAD_BYTES
    return refs


class SeqTracker:
    """Counts records lost between the probe and the consumer from gaps in the sequence numbers.
    Records of one drain may arrive out of order across CPUs, so gaps are judged on the sorted
    union of everything seen, with the maximum seen so far carried between drains."""

    def __init__(self) -> None:
        self.next_expected = 0
        self.seen = 0
        self.gaps = 0
        self._pending: np.ndarray = np.empty(0, np.uint64)

    def update(self, seqs: np.ndarray, *, final: bool = False) -> None:
        if len(seqs) == 0 and not final:
            return
        allseq = np.sort(np.concatenate([self._pending, seqs.astype(np.uint64)]))
        self.seen += len(seqs)
        # Hold back the last few records: a record reserved earlier on another CPU may still be
        # in flight. Everything up to the hold-back point is judged now.
        hold = 0 if final else min(len(allseq), 64)
        judged, self._pending = allseq[: len(allseq) - hold], allseq[len(allseq) - hold :]
        if len(judged):
            expected = int(judged[-1]) - self.next_expected + 1
            # distinct values of the sorted sequence numbers (np.unique would import numpy.ma,
            # a slow import, inside the first drain of a generation)
            distinct = 1 + int(np.count_nonzero(judged[1:] != judged[:-1]))
            self.gaps += expected - distinct
            self.next_expected = int(judged[-1]) + 1
