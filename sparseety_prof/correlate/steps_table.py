"""The steps table: one row per finished micro-batch, kept until the correlator's take_tables.

With head sampling's rows set apart (Correlator's `head_rows_apart`), a row all of whose
sequences' requests drew drop goes to a buffer of its own (take_apart), as the policy would drop
it; a row over no sequence is kept, as the policy keeps it.
"""

from __future__ import annotations

from sparseety_prof.correlate.state import HeadDropped, Step
from sparseety_prof.correlate.tables import STEP_ROW, RowBuffer
from sparseety_prof.store.schema import PHASE_DECODE, Columns


class StepsTable:
    def __init__(
        self, *, pid: int, wall_offset_ns: int, head_dropped: HeadDropped | None, apart: bool
    ) -> None:
        self.pid = pid
        self.wall_offset_ns = wall_offset_ns
        self.head_dropped = head_dropped
        self._rows = RowBuffer(STEP_ROW)
        self._apart = RowBuffer(STEP_ROW) if apart else None

    def rows_for(self, ctx_id: int, seq_ids: list[int]) -> RowBuffer:
        """Where a steps row over `seq_ids` goes: set apart when every one's request drew drop."""
        apart = self._apart
        if apart is not None and self.head_dropped and self.head_dropped.holds_seqs(ctx_id, seq_ids):
            return apart
        return self._rows

    def add_step(
        self,
        step: Step,
        n_outputs: int,
        phase: str,
        seq_ids: list[int],
        token_ids: list[int],
        positions: list[int],
        row_seq_ids: list[int],
        output_rows: list[int],
    ) -> None:
        """The row of a finished micro-batch."""
        self.add_values(
            step.step_id,
            step.ctx_id,
            step.decode_id,
            step.t_start,
            step.t_end,
            step.n_tokens,
            n_outputs,
            phase,
            step.decode_rows,
            seq_ids,
            token_ids,
            positions,
            row_seq_ids,
            output_rows,
            step.truncated,
            step.tid,
        )

    def add_values(
        self,
        step_id: int,
        ctx_id: int,
        decode_id: int,
        t_start: int,
        t_end: int | None,
        n_tokens: int,
        n_outputs: int,
        phase: str,
        decode_rows: int,
        seq_ids: list[int],
        token_ids: list[int],
        positions: list[int],
        row_seq_ids: list[int],
        output_rows: list[int],
        truncated: bool,
        tid: int,
    ) -> None:
        """The same from the step's values (a tuple in STEP_ROW order: one per micro-batch, no
        keyword dict; fast_step's steps whose Step is not made yet)."""
        self.rows_for(ctx_id, seq_ids).add_values(
            (
                step_id,
                ctx_id,
                decode_id,
                t_start,
                t_end,
                (t_start + self.wall_offset_ns) // 1_000_000,
                n_tokens,
                n_outputs,
                phase,
                n_tokens - decode_rows,
                decode_rows,
                seq_ids,
                token_ids,
                positions,
                row_seq_ids,
                output_rows,
                truncated,
                self.pid,
                tid,
            )
        )

    def add_one_row_run(
        self,
        ctx_id: int,
        seq: int,
        tid: int,
        step_ids: list[int],
        decode0: int,
        t_starts: list[int],
        t_ends: list[int],
        tokens: list[int],
        positions: list[int],
    ) -> None:
        """The rows of a run of one-row decode steps of one sequence (plain_run.py), as columns
        zipped into rows: no Python call per row."""
        m = len(step_ids)
        one = [1] * m
        wall = self.wall_offset_ns
        self.rows_for(ctx_id, [seq]).extend_values(
            zip(
                step_ids,
                [ctx_id] * m,
                range(decode0, decode0 + m),
                t_starts,
                t_ends,
                [(t + wall) // 1_000_000 for t in t_starts],
                one,
                one,
                [PHASE_DECODE] * m,
                [0] * m,
                one,
                [[seq] for _ in range(m)],
                [[t] for t in tokens],
                [[p] for p in positions],
                [[seq] for _ in range(m)],
                [[0] for _ in range(m)],
                [False] * m,
                [self.pid] * m,
                [tid] * m,
                strict=True,
            )
        )

    def take(self) -> Columns:
        """The rows kept since the last call, as columns."""
        return self._rows.take()

    def take_apart(self) -> Columns | None:
        """The rows set apart since the last call, as columns (None when rows are never set apart)."""
        return self._apart.take() if self._apart is not None else None
