"""Logits rows already reduced to their statistics when their records were drained
(correlate/logits_reduce.py): what a logits record stands for once its floats are gone.

A drain that reduces its logits records hands the correlator, instead of the ring's memory, a
`LogitsStats` table (one row per sampler call whose row was complete, with the sampled token
the statistics were computed for) and records whose `at` is their row in that table. Where the
correlator takes a record's floats (EventBatch.logits_vals), it gets a `StatsRow`: it has the
length of the floats it stands for, slices like them, and leads the statistics step
(correlate/logit_stats.py) to the table's values instead of a row to compute."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

import numpy as np


@dataclass
class LogitsStats:
    """Statistics of logits rows, computed for the token their sampler call returned."""

    token: np.ndarray  # (n,) int64: the token the log-prob is of (the sampler call's result)
    log_prob: np.ndarray  # (n,) float64
    top_ids: np.ndarray  # (n, k) int64
    top_log_probs: np.ndarray  # (n, k) float64
    entropy: np.ndarray  # (n,) float64

    def __len__(self) -> int:
        return len(self.token)

    @staticmethod
    def empty() -> LogitsStats:
        return LogitsStats(
            np.empty(0, np.int64),
            np.empty(0, np.float64),
            np.empty((0, 1), np.int64),
            np.empty((0, 1), np.float64),
            np.empty(0, np.float64),
        )

    @staticmethod
    def concat(parts: list[LogitsStats]) -> LogitsStats:
        """One table of several, in order (row j of part p at p's offset + j)."""
        parts = [p for p in parts if len(p)]
        if not parts:
            return LogitsStats.empty()
        if len(parts) == 1:
            return parts[0]
        if any(p.top_ids.shape[1] != parts[0].top_ids.shape[1] for p in parts):
            # rows of another width have another k (min(TOP_K, width)): a model has one vocabulary,
            # so this is a recording of two models' contexts; kept apart by padding would lie
            raise ValueError("logits statistics of rows with different numbers of alternatives")
        return LogitsStats(
            np.concatenate([p.token for p in parts]),
            np.concatenate([p.log_prob for p in parts]),
            np.concatenate([p.top_ids for p in parts]),
            np.concatenate([p.top_log_probs for p in parts]),
            np.concatenate([p.entropy for p in parts]),
        )


class StatsRow:
    """A logits record's floats, reduced: `n` floats that stand for row `j` of `table` (j < 0:
    a record whose row was not complete, or that a later read of the same chunk replaced; the
    correlator drops or counts such rows as it would have with the floats)."""

    __slots__ = ("j", "n", "table")

    def __init__(self, table: LogitsStats, j: int, n: int) -> None:
        self.table, self.j, self.n = table, j, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, key: slice) -> StatsRow:
        if not isinstance(key, slice) or key.step not in (None, 1) or key.start not in (None, 0):
            raise TypeError("a reduced logits row is only cut at its end")
        return StatsRow(self.table, self.j, len(range(self.n)[key]))


#: what the correlator holds of one logits record: its floats, or their statistics
LogitsChunk: TypeAlias = "np.ndarray | StatsRow"


def owned(chunk: LogitsChunk) -> LogitsChunk:
    """A chunk that outlives the drain it came in: floats are copied out of the drained records
    (the next drain reuses that memory), statistics are kept as they are."""
    return chunk if isinstance(chunk, StatsRow) else np.array(chunk)
