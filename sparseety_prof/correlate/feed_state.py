"""What the correlator's record handlers and its fast paths share while records are fed.

The correlator (correlator.py) owns one FeedState and hands it to the fast paths, which are
functions over it: the one-row decode step and sampler call (fast_step.py), the runs of plain
decode steps (plain_run.py) and the runs of per-layer sparse records (sparse_run.py). Each does
what the record handlers do to this state, and nothing else: what they read and change is named
here, and none of them imports the correlator.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from sparseety_prof.capture.plans import LayerSet
from sparseety_prof.correlate.agg_record import AggRow
from sparseety_prof.correlate.attention_map import AttentionMap
from sparseety_prof.correlate.request_tokens import RequestTokens
from sparseety_prof.correlate.routes import RoutesTables
from sparseety_prof.correlate.server_layout_check import ServerLayoutCheck
from sparseety_prof.correlate.serving import ServingTracker
from sparseety_prof.correlate.state import Counters, CtxState, Step
from sparseety_prof.correlate.step_sparse import Problems
from sparseety_prof.correlate.steps_table import StepsTable


class UnmadeStep(NamedTuple):
    """The last one-row step of fast_step whose Step is not made yet: what make_unmade needs to
    make it when anything may read it (dropped when its context's next decode replaces it)."""

    c: CtxState
    step_id: int
    decode_id: int
    tid: int
    t_start: int
    t_end: int
    rows: tuple[np.ndarray, ...]  # FastColumns.ub_rows: row 0's token, position, sequence, output
    u: int  # the micro-batch's index in those
    pre: AggRow


#: c.rows and c.outputs of a context whose last step is not made yet: never read (make_unmade
#: replaces it first), never changed in place (both are always assigned anew)
UNMADE_ROWS: list[Any] = [None]


def _seen_sections() -> dict[str, set[int]]:
    return {"moe": set(), "ffn": set(), "attn": set()}


@dataclass(eq=False)
class FeedState:
    """The model's shape, the tables and trackers records feed, and the steps in progress."""

    layers: LayerSet
    n_vocab: int
    n_expert: int
    n_expert_used: int
    slot_tokens: bool  # llama-server: samples wait for the call that names their slot
    serving: ServingTracker | None
    counters: Counters
    problems: Problems
    requests: RequestTokens
    routes: RoutesTables
    steps: StepsTable
    attn_map: AttentionMap
    server_check: ServerLayoutCheck = field(default_factory=ServerLayoutCheck)  # fed only when serving
    ctxs: dict[int, CtxState] = field(default_factory=dict)  # by context pointer
    open_steps: dict[int, Step] = field(default_factory=dict)  # by tid
    pending_clears: dict[int, list[tuple[int, int]]] = field(default_factory=dict)  # by tid: (seq, p0)
    next_step_id: int = 0
    layers_seen: dict[str, set[int]] = field(default_factory=_seen_sections)
    agg_pre: dict[int, AggRow] = field(default_factory=dict)  # this drain's aggregate records, by seq
    unmade: UnmadeStep | None = None

    def ctx(self, ptr: int) -> CtxState:
        """The state of the engine context at `ptr`, made when first seen."""
        st = self.ctxs.get(ptr)
        if st is None:
            st = self.ctxs[ptr] = CtxState(ctx_id=len(self.ctxs))
        return st

    def task_post(self, tid: int, task: int, b: int, span_bytes: int) -> None:
        """llama-server's loop posted a task (its serving state's; no step reads it)."""
        if self.serving is not None:
            self.server_check.on_task_post(tid, task)
            self.serving.on_task_post(tid, task, b == 1, span_bytes)
