"""What the correlator keeps between records: the micro-batches (steps) it has seen, each engine
context's decode in progress, each sequence's request, and the counts of what could not be
resolved. Plain data: the logic that moves it lives in the correlator's other modules."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from sparseety_prof.capture.logits_rows import LogitsChunk
from sparseety_prof.correlate.serving import RequestAgg
from sparseety_prof.correlate.step_sparse import StepSparse

_ROW0 = np.zeros(1, dtype=np.int64)


# rows up to which a step's rows are grouped by sequence in Python rather than numpy (seq_rows)
_FEW_ROWS = 16


@dataclass
class Step:
    """One micro-batch (a forward pass): its rows as the probe copied them."""

    step_id: int
    ctx_id: int
    decode_id: int
    tid: int
    t_start: int
    t_end: int | None
    token: np.ndarray
    pos: np.ndarray
    seq: np.ndarray
    output: np.ndarray
    n_tokens: int
    truncated: bool
    row_offset: int = 0  # rows [0, row_offset) of a truncated micro-batch were not copied
    decode_rows: int = 0  # rows that feed back a token sampled for their sequence (the rest: prompt)
    sparse: StepSparse | None = None  # routing, activation and attention records of this pass
    _output_index: dict[int, int] | None = None
    _seq_rows: dict[int, np.ndarray] | None = None
    _over_slots: bool | None = None

    def over_slots(self) -> bool:
        """Several rows, all copied, every one an output: a step over several slots (a
        llama-server decode), asked a few times per row, so worked out once."""
        if self._over_slots is None:
            n = len(self.seq)
            self._over_slots = (
                n > 1 and self.row_offset == 0 and n == self.n_tokens and all(self.output.tolist())
            )
        return self._over_slots

    def seq_rows(self) -> dict[int, np.ndarray]:
        """Sequence id -> its row indices (in batch order). One-row steps, the bulk of a decode,
        skip numpy's unique/flatnonzero (microseconds each, per token)."""
        if self._seq_rows is None:
            if len(self.seq) == 1:
                self._seq_rows = {int(self.seq[0]): _ROW0}
            elif len(self.seq) <= _FEW_ROWS:  # a server step over a few slots: unique/flatnonzero cost more
                rows: dict[int, list[int]] = {}
                for i, v in enumerate(self.seq.tolist()):
                    rows.setdefault(v, []).append(i)
                self._seq_rows = {v: np.array(rows[v], dtype=np.intp) for v in sorted(rows)}
            elif not (self.seq != self.seq[0]).any():  # one sequence's rows: a prompt
                self._seq_rows = {int(self.seq[0]): np.arange(len(self.seq))}
            else:
                self._seq_rows = {int(v): np.flatnonzero(self.seq == v) for v in np.unique(self.seq)}
        return self._seq_rows

    def output_index(self) -> dict[int, int]:
        """Batch row -> ordinal among the rows that produce logits (the rows a tensor has when
        the engine computed a layer for output rows only)."""
        if self._output_index is None:
            off = self.row_offset
            if len(self.output) <= _FEW_ROWS:  # (numpy's calls cost more on a few rows)
                rows = [i + off for i, o in enumerate(self.output.tolist()) if o]
            else:
                rows = (np.flatnonzero(self.output) + off).tolist()
            self._output_index = {r: k for k, r in enumerate(rows)}
        return self._output_index


@dataclass
class SeqState:
    """The request a sequence of one context is serving."""

    request_id: str
    partial: bool
    max_pos: int
    agg: RequestAgg | None = None  # the request's row-to-be (None once it was emitted)
    launch_serial: int = 0  # server: the slot launch this request came from
    samples: int = 0
    expect_token: int | None = None  # token sampled last, not yet fed back
    next_input_pending: tuple[Step, int] | None = None  # output row awaiting a next_input token
    head_judged: bool = False  # its request's head verdict (the probes' draw) is taken


@dataclass
class SampleState:
    """A sampler call in progress on one thread: the logits row chunks read so far."""

    idx: int
    tid: int
    chunks: dict[int, LogitsChunk] = field(default_factory=dict)
    n_vocab: int = 0
    chunk_len: int = 1


@dataclass
class CtxState:
    """One engine context (a draft or embedding context in the same process never mixes)."""

    ctx_id: int
    decode_id: int = -1
    decode_seen: bool = False
    rows: list[tuple[Step, int] | None] = field(default_factory=list)  # the decode's rows, batch order
    outputs: list[tuple[Step, int]] = field(default_factory=list)  # rows that produce logits
    public_batch: tuple[int, int, int] | None = None  # (n_tokens, tok0, pos0) to verify
    sampler_seen: bool = False
    # micro-batches recorded on this context: a sample before the first one finishes a decode
    # that ran before the probes were in (attach boundary), not one the recording lost
    ubatches_seen: int = 0
    seqs: dict[int, SeqState] = field(default_factory=dict)
    # sequences that may have run steps the consumer never saw (records were lost since their
    # last step): a lone token past position 0 there is a request seen mid-way, not a new one
    unsure: set[int] = field(default_factory=set)
    requests: int = 0
    sampling: dict[int, SampleState] = field(default_factory=dict)  # by tid
    # head sampling in the probes: each sequence's last draw (EV_HEAD_DRAW), True = logits copied
    head_draw: dict[int, bool] = field(default_factory=dict)


class HeadDropped:
    """Head sampling in the probes: the sequences, (ctx_id, seq_id), whose current request the
    probes drew to drop. Judged by the draw while the request has no token yet
    (Correlator._on_head_draw) and at its first token (RequestTokens._add_token_row, the verdict
    the policy takes), forgotten at the sequence's next request. RoutesTables counts their rows
    instead of making them."""

    def __init__(self) -> None:
        self._keys: set[tuple[int, int]] = set()

    def __bool__(self) -> bool:
        return bool(self._keys)

    def judge(self, ctx_id: int, seq: int, keep: bool) -> None:
        if keep:
            self._keys.discard((ctx_id, seq))
        else:
            self._keys.add((ctx_id, seq))

    def forget(self, ctx_id: int, seq: int) -> None:
        self._keys.discard((ctx_id, seq))

    def holds(self, ctx_id: int, seq: int) -> bool:
        return (ctx_id, seq) in self._keys

    def holds_all(self, step: Step) -> bool:
        """Whether every sequence with rows in the step is held."""
        return self.holds_seqs(step.ctx_id, set(step.seq.tolist()))

    def holds_seqs(self, ctx_id: int, seqs: Iterable[int]) -> bool:
        """Whether `seqs` (a steps row's sequences) are some and all held."""
        keys = self._keys
        if not keys:
            return False
        seen = False
        for q in seqs:
            if (ctx_id, q) not in keys:
                return False
            seen = True
        return seen


@dataclass
class Counters:
    samples_unresolved: int = 0  # sampler index that matches no row of the last decode
    logits_incomplete: int = 0  # token rows whose logits row lost a chunk
    verified_ubatches: int = 0
    verified_decodes: int = 0  # micro-batches checked against the public llama_batch
    sparse_unattributed: int = 0  # graph-op records while no (or more than one) micro-batch ran
    sparse_unmapped_rows: int = 0  # tensor rows that match neither the batch nor its outputs
    verified_sparse: int = 0  # routing records checked against the model's expert counts
    slot_tokens_unresolved: int = 0  # server samples whose slot has no output row in the decode
    samples_before_first_step: int = 0  # samples of a decode that ran before the attach
    sparse_before_first_step: int = 0  # graph-op records of the forward pass running at attach
    # passes whose activations the probes left uncounted: one-row passes by --act-every or head
    # sampling (the aggregate's active = 2), passes of several head-dropped rows (EV_UBATCH_END a)
    act_sampled_out: int = 0
    head_draws_kept: int = 0  # head sampling in the probes: sequences that drew keep (EV_HEAD_DRAW)
    head_draws_dropped: int = 0  # ... and drop
