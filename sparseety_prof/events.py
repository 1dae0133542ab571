"""Python mirror of probes/events.h, and batch decoding of raw ring-buffer records.

The reader thread only appends raw bytes; everything here works on whole batches with numpy
structured arrays, so there is no per-event Python work beyond slicing the batch by kind.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

PROBES_DIR = Path(__file__).resolve().parent.parent / "probes"

EV_DECODE_BEGIN = 1
EV_UBATCH = 3
EV_UBATCH_END = 4
EV_SAMPLE_BEGIN = 5
EV_LOGITS = 6
EV_SAMPLE_END = 7
EV_SEQ_RM = 8
EV_MEM_CLEAR = 9

SAMPLER_LLAMA = 1
SAMPLER_COMMON = 2
UB_FLAG_TRUNCATED = 1


def _header_define(name: str) -> int:
    """Read a #define from events.h so the two mirrors cannot drift apart silently."""
    text = (PROBES_DIR / "events.h").read_text()
    m = re.search(rf"#define\s+{name}\s+(\d+)", text)
    if not m:
        raise RuntimeError(f"{name} not defined in probes/events.h")
    return int(m.group(1))


MAX_UB_TOK = _header_define("MAX_UB_TOK")
LOGITS_CHUNK_MAX = _header_define("LOGITS_CHUNK")
MAX_LOGITS_CHUNKS = _header_define("MAX_LOGITS_CHUNKS")


def logits_chunk_for(n_vocab: int) -> int:
    """Floats per logits record: the vocabulary rounded up to a power of two (at least 1,024),
    at most LOGITS_CHUNK_MAX. One record per row for small vocabularies, few for large ones."""
    return min(LOGITS_CHUNK_MAX, max(1024, 1 << (max(n_vocab, 1) - 1).bit_length()))


HDR = [("seq", "<u8"), ("ts_ns", "<u8"), ("ctx", "<u8"), ("tid", "<u4"), ("kind", "<u2"), ("flags", "<u2")]
HDR_DTYPE = np.dtype(HDR)
SMALL_DTYPE = np.dtype([*HDR, ("a", "<i4"), ("b", "<i4"), ("c", "<i4"), ("pad", "<i4"), ("ptr", "<u8")])
UBATCH_DTYPE = np.dtype(
    [
        *HDR,
        ("n_tokens", "<u4"),
        ("n_copied", "<u4"),
        ("row_offset", "<u4"),
        ("pad", "<u4"),
        ("token", "<i4", (MAX_UB_TOK,)),
        ("pos", "<i4", (MAX_UB_TOK,)),
        ("seq_id", "<i4", (MAX_UB_TOK,)),
        ("output", "i1", (MAX_UB_TOK,)),
    ]
)


def logits_dtype(chunk: int) -> np.dtype:
    return np.dtype(
        [
            *HDR,
            ("idx", "<i4"),
            ("chunk", "<u4"),
            ("n_vals", "<u4"),
            ("n_vocab", "<u4"),
            ("vals", "<f4", (chunk,)),
        ]
    )


@dataclass
class EventBatch:
    """Records of one drain, split by layout. Arrays are in arrival order."""

    small: np.ndarray = field(default_factory=lambda: np.empty(0, SMALL_DTYPE))
    ubatch: np.ndarray = field(default_factory=lambda: np.empty(0, UBATCH_DTYPE))
    logits: np.ndarray = field(default_factory=lambda: np.empty(0, logits_dtype(1024)))

    def __len__(self) -> int:
        return len(self.small) + len(self.ubatch) + len(self.logits)

    def seqs(self) -> np.ndarray:
        return np.concatenate([self.small["seq"], self.ubatch["seq"], self.logits["seq"]])


def decode_records(records: list[bytes], logits_chunk: int) -> EventBatch:
    """Split raw records (as copied out of the ring buffer) by layout and view each group as
    a numpy structured array. Records of unknown size are a programming error."""
    ldt = logits_dtype(logits_chunk)
    sizes = {SMALL_DTYPE.itemsize: SMALL_DTYPE, UBATCH_DTYPE.itemsize: UBATCH_DTYPE, ldt.itemsize: ldt}
    groups: dict[int, list[bytes]] = {}
    for r in records:
        groups.setdefault(len(r), []).append(r)
    out = EventBatch()
    for size, recs in groups.items():
        dt = sizes.get(size)
        if dt is None:
            raise ValueError(
                f"ring buffer record of unexpected size {size} (events.h and events.py disagree)"
            )
        arr = np.frombuffer(b"".join(recs), dtype=dt)
        if dt is SMALL_DTYPE:
            out.small = arr
        elif dt is UBATCH_DTYPE:
            out.ubatch = arr
        else:
            out.logits = arr
    return out


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
            self.gaps += expected - len(np.unique(judged))
            self.next_expected = int(judged[-1]) + 1
