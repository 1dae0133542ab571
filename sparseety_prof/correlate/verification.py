"""Checks of the first records read with this build's struct layout, on live data: a layout read
wrongly fails here, with UnsupportedEngineBuild, instead of recording garbage."""

from __future__ import annotations

import numpy as np

from sparseety_prof.correlate.state import Counters, CtxState, Step
from sparseety_prof.correlate.step_sparse import StepSparse
from sparseety_prof.errors import UnsupportedEngineBuild

VERIFY_UBATCHES = 16  # micro-batches (and routing records) checked at attach time
MAX_SEQ_ID = 1 << 16
MAX_BATCH_ROWS = 1 << 20  # rows of one batch: more is a misread layout (and, later, a clamp)


def verify_ubatch(c: CtxState, step: Step, counters: Counters, n_vocab: int, *, has_tokens: bool) -> None:
    """Sanity-check one of the first micro-batches; compare it with the public llama_batch
    (stable C API) where the decode probe could read it."""
    if counters.verified_ubatches >= VERIFY_UBATCHES:
        return
    problems = []
    if not 0 < step.n_tokens <= MAX_BATCH_ROWS:
        problems.append(f"n_tokens={step.n_tokens}")
    m = len(step.token)
    if m:
        if has_tokens and (step.token.min() < 0 or step.token.max() >= n_vocab):
            problems.append(f"token ids outside [0, {n_vocab})")
        if not np.isin(step.output, (0, 1)).all():
            problems.append("output flags not 0/1")
        if step.seq.min() < 0 or step.seq.max() >= MAX_SEQ_ID:
            problems.append("sequence ids out of range")
        for s in np.unique(step.seq):
            p = step.pos[step.seq == s]
            if len(p) > 1 and not (np.diff(p) == 1).all():
                problems.append(f"positions of sequence {int(s)} not consecutive")
                break
        if step.pos.min() < 0:
            problems.append("negative positions")
    if c.public_batch is not None and m:
        n, tok0, pos0 = c.public_batch
        c.public_batch = None
        # a truncated micro-batch starts row_offset rows into the batch (positions are
        # consecutive within a prompt); its first token is not among the copied rows
        off = step.row_offset
        if (
            step.n_tokens > n
            or (has_tokens and off == 0 and tok0 != int(step.token[0]))
            or (pos0 >= 0 and pos0 + off != int(step.pos[0]))
        ):
            problems.append(
                f"micro-batch (n={step.n_tokens}, row {off}: token={int(step.token[0])}, "
                f"pos={int(step.pos[0])}) does not match the public llama_batch "
                f"(n={n}, token0={tok0}, pos0={pos0})"
            )
        else:
            counters.verified_decodes += 1
    if problems:
        raise failed_verification("llama_ubatch layout", problems)
    counters.verified_ubatches += 1


def verifying_sparse(counters: Counters, n_expert: int) -> bool:
    """The first routing records of an MoE model are still to be checked against the model."""
    return counters.verified_sparse < VERIFY_UBATCHES and bool(n_expert)


def verify_routing(sp: StepSparse, counters: Counters, n_expert: int, n_expert_used: int) -> None:
    """Check one of the first routing tensors against the model: k values per row, expert ids
    in range."""
    if not verifying_sparse(counters, n_expert):
        return
    problems = []
    for layer, rows in sp.ids.items():
        k = rows.values.shape[1]
        if n_expert_used and k != n_expert_used:
            problems.append(f"layer {layer}: {k} experts per row, the model selects {n_expert_used}")
        filled = rows.values[rows.filled]
        if filled.size and (filled.min() < 0 or filled.max() >= n_expert):
            problems.append(f"layer {layer}: expert ids outside [0, {n_expert})")
    if problems:
        raise failed_verification("routing tensors", problems[:3])
    counters.verified_sparse += 1


def failed_verification(what: str, problems: list[str]) -> UnsupportedEngineBuild:
    return UnsupportedEngineBuild(
        f"unsupported engine build: the {what} failed verification on live data ("
        + "; ".join(problems)
        + "). Nothing more was recorded."
    )
