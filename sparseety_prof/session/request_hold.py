"""The bounded window of unflushed requests behind the per-request policies (head, tail, anomaly):
the rows of a request wait here until it is decided, then go to the recording or are counted as
dropped.

Which request a row belongs to: tokens rows name it (request_id). Routes and masks rows, and steps
rows, are keyed by step and sequence: on one (ctx_id, seq_id) requests run one after the other, so
a request owns the steps of its sequence after the previous request's last token step, up to its own
last token step (the prompt's micro-batches before its first token included). A row is matched to
the first request of its sequence whose last token step so far is at or after the row's step; a row
after every known request of its sequence waits. A steps row (the batch context the requests in it
share) is kept when any request in it is kept, and dropped once all of them are dropped; with the
anomaly policy, also when it lies within STEPS_AROUND steps of a step where a detector fired.

Bounds: when the rows held exceed `max_bytes`, the oldest undecided requests are decided early,
KEPT (their rows from then on pass straight through), and counted in `overflow_requests`: a full
window makes the recording bigger, never loses what a policy would have kept. Rows no request can be
matched to (a sequence without tokens) are kept once the window needs their room or at the end.
Tables that are not per request (requests, kernels, aggregates) pass through."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import polars as pl

from sparseety_prof.session.request_verdicts import Anomaly, Head, Tail, Verdict
from sparseety_prof.store.array_rows import ArrayRows

HELD_TABLES = ("tokens", "steps", "routes", "masks")
#: the anomaly policy keeps the steps rows this many steps either side of a detector firing
STEPS_AROUND = 8
#: steps rows dropped lately, which a later firing within STEPS_AROUND may still keep
RECENT_DROPPED_STEPS = 4096
#: ranges remembered per sequence once decided (for rows that come after their request's end)
RANGES_KEPT = 16
DEFAULT_WINDOW_BYTES = 64 << 20

_RANGE_SCHEMA = {"ctx_id": pl.Int32(), "seq_id": pl.Int32(), "hi": pl.Int64(), "request_id": pl.String()}


#: the columns of a frame the hold learns requests from without holding it (set_apart)
LEARNED_COLUMNS = {"tokens": frozenset({"request_id", "ctx_id", "seq_id", "step_id"})}


class RequestHold:
    def __init__(self, verdicts: list[Verdict], *, max_bytes: int = DEFAULT_WINDOW_BYTES) -> None:
        self.verdicts = verdicts
        self.max_bytes = max_bytes
        self._at_start = [v for v in verdicts if isinstance(v, Head)]
        self._at_end = [v for v in verdicts if isinstance(v, Tail | Anomaly)]
        self._pending: dict[str, list[pl.DataFrame]] = {t: [] for t in HELD_TABLES}
        self._bytes: int = 0
        self._ended: list[dict[str, Any]] = []  # requests rows not yet judged
        self._decision: dict[str, bool] = {}  # request id -> kept
        self._started: set[str] = set()  # requests the head policies have judged
        # (ctx, seq) -> [last token step so far, request id], in order
        self._ranges: dict[tuple[int, int], list[list[Any]]] = {}
        self._keep_around: list[tuple[int, int]] = []  # step ranges the anomaly policy keeps
        self._recent_dropped_steps = pl.DataFrame()
        self.rows_dropped: dict[str, int] = {}
        self.judged: dict[str, dict[str, int]] = {v.name: {"kept": 0, "dropped": 0} for v in verdicts}
        self.requests = {"kept": 0, "dropped": 0}
        self.overflow_requests = 0
        self.unattributed_rows = 0
        self.peak_bytes = 0

    # ------------------------------------------------------------------ in
    def add(self, table: str, df: pl.DataFrame) -> pl.DataFrame | None:
        """One frame of rows: held (None) or, for a table not held, handed back to be written."""
        if table == "requests":
            self._ended += df.select(
                "request_id",
                "ctx_id",
                "seq_id",
                "t_received_ns",
                "t_started_ns",
                "t_last_token_ns",
                "output_tokens",
            ).to_dicts()
            return df
        if table not in self._pending:
            return df
        self._pending[table].append(df)
        self._bytes += int(df.estimated_size())
        self.peak_bytes = max(self.peak_bytes, self._bytes)
        return None

    def set_apart(self, table: str, parts: list[ArrayRows]) -> None:
        """Rows of requests dropped at their start, never held (RecordingPolicy.set_apart):
        counted dropped; token rows teach the requests and their steps as held ones would (the
        steps still held are owned by them), from LEARNED_COLUMNS."""
        n = sum(p.n for p in parts)
        if not n:
            return
        if table == "tokens":
            last: dict[tuple[int, int, str], int] = {}  # first seen first, as _learn's group-by
            for p in parts:
                cols = (p.column(c) for c in ("ctx_id", "seq_id", "request_id", "step_id"))
                for ctx, seq, rid, step in zip(*cols, strict=True):
                    if rid is None:
                        continue
                    key = (int(ctx), int(seq), str(rid))
                    hi = last.get(key)
                    if hi is None or int(step) > hi:
                        last[key] = int(step)
            self._learn_ranges((ctx, seq, rid, hi) for (ctx, seq, rid), hi in last.items())
        self.rows_dropped[table] = self.rows_dropped.get(table, 0) + n

    # ------------------------------------------------------------------ decide
    def settle(self, *, final: bool = False) -> list[tuple[str, pl.DataFrame]]:
        """Decide what can be decided; the rows to write now. Call it once every frame of the
        requests that ended has been added (after a flush: the requests rows come last)."""
        frames = {t: pl.concat(fs, how="vertical") for t, fs in self._pending.items() if fs}
        tokens = frames.get("tokens")
        if tokens is not None:
            self._learn(tokens)
        self._judge(self._ended, tokens)
        self._ended = []
        out = self._resolve(frames)
        while self._bytes > self.max_bytes or (final and self._bytes):
            if not self._decide_oldest_early(final=final):
                out += self._release_unattributed()
                break
            out += self._resolve({t: pl.concat(fs, how="vertical") for t, fs in self._pending.items() if fs})
        self._prune()
        return out

    def _learn(self, tokens: pl.DataFrame) -> None:
        """Requests seen in these tokens: their last step so far, and the head policies' verdict
        at their start."""
        seen = (
            tokens.filter(pl.col("request_id").is_not_null())
            .group_by("ctx_id", "seq_id", "request_id", maintain_order=True)
            .agg(pl.col("step_id").max())
        )
        self._learn_ranges(seen.iter_rows())

    def _learn_ranges(self, seen: Iterable[tuple[Any, ...]]) -> None:
        """(ctx_id, seq_id, request_id, its last step so far) of requests seen in token rows."""
        for ctx, seq, rid, hi in seen:
            ranges = self._ranges.setdefault((ctx, seq), [])
            for r in ranges:
                if r[1] == rid:
                    r[0] = max(r[0], hi)
                    break
            else:
                ranges.append([hi, rid])
                self._start(rid)

    def _start(self, rid: str) -> None:
        if rid in self._started or rid in self._decision:
            return
        self._started.add(rid)
        kept = [v.keeps_at_start(rid) for v in self._at_start]
        for v, k in zip(self._at_start, kept, strict=True):
            self.judged[v.name]["kept" if k else "dropped"] += 1
        if any(kept):
            self._decide(rid, True)
        elif not self._at_end:
            self._decide(rid, False)

    def _judge(self, ended: list[dict[str, Any]], tokens: pl.DataFrame | None) -> None:
        """Requests ended, in the order they ended: the end policies' verdicts. Tail sees every
        request, so that its quantile is over all of them; anomaly only those still undecided
        (a request kept at its start or on overflow has its tokens written already)."""
        ended = [r for r in ended if r["request_id"] is not None]
        for req in ended:
            self._start(req["request_id"])
        undecided = [r["request_id"] for r in ended if r["request_id"] not in self._decision]
        mine = (
            tokens.filter(pl.col("request_id").is_in(undecided))
            if tokens is not None and undecided
            else pl.DataFrame()
        )
        fired = {v.name: v.fire(mine) for v in self._at_end if isinstance(v, Anomaly) and undecided}
        pending = set(undecided)
        for req in ended:
            rid = req["request_id"]
            keep = False
            for v in self._at_end:
                if isinstance(v, Anomaly):
                    if rid not in pending:
                        continue
                    steps = fired[v.name].get(rid)
                    k = steps is not None
                    self._keep_around += [(s - STEPS_AROUND, s + STEPS_AROUND) for s in steps or ()]
                else:
                    k = v.keeps_at_end(req)
                self.judged[v.name]["kept" if k else "dropped"] += 1
                keep = keep or k
            if rid in pending:
                pending.discard(rid)
                self._decide(rid, keep)

    def _decide(self, rid: str, kept: bool) -> None:
        self._decision[rid] = kept
        self.requests["kept" if kept else "dropped"] += 1

    def _decide_oldest_early(self, *, final: bool) -> bool:
        """The window is full (or the recording ends): keep the undecided request that started
        first. False when none is left."""
        oldest: tuple[int, str] | None = None
        for ranges in self._ranges.values():
            for hi, rid in ranges:
                if rid not in self._decision and (oldest is None or hi < oldest[0]):
                    oldest = (hi, rid)
        if oldest is None:
            return False
        if not final:
            self.overflow_requests += 1
        self._decide(oldest[1], True)
        return True

    # ------------------------------------------------------------------ rows out
    def _resolve(self, frames: dict[str, pl.DataFrame]) -> list[tuple[str, pl.DataFrame]]:
        decided = pl.DataFrame(
            {"request_id": list(self._decision), "kept": list(self._decision.values())},
            schema={"request_id": pl.String(), "kept": pl.Boolean()},
        )
        ranges = self._range_frame()
        out: list[tuple[str, pl.DataFrame]] = []
        self._pending = {t: [] for t in HELD_TABLES}
        self._bytes = 0
        for table, df in frames.items():
            if table == "tokens":
                kept = df.join(decided, on="request_id", how="left", maintain_order="left").with_columns(
                    pl.when(pl.col("request_id").is_null()).then(True).otherwise(pl.col("kept")).alias("kept")
                )["kept"]
            elif table == "steps":
                kept = self._steps_kept(df, ranges, decided)
            else:
                kept = _owner_kept(df, ranges, decided)
            keep, drop, wait = kept.fill_null(False), ~kept.fill_null(True), kept.is_null()
            if table == "steps":
                dropped = df.filter(drop)
                self._recent_dropped_steps = pl.concat([self._recent_dropped_steps, dropped], how="diagonal")
                self._recent_dropped_steps = self._recent_dropped_steps.tail(RECENT_DROPPED_STEPS)
                rescued = self._rescue_steps()
                if rescued.height:
                    out.append(("steps", rescued))
            n_drop = int(drop.sum())
            if n_drop:
                self.rows_dropped[table] = self.rows_dropped.get(table, 0) + n_drop
            if keep.any():
                out.append((table, df.filter(keep)))
            if wait.any():
                held = df.filter(wait)
                self._pending[table].append(held)
                self._bytes += int(held.estimated_size())
        return out

    def _steps_kept(self, steps: pl.DataFrame, ranges: pl.DataFrame, decided: pl.DataFrame) -> pl.Series:
        """Per steps row: True when a request in it is kept (or it lies near an anomaly), False when
        every request in it is dropped, null while one is undecided."""
        rows = (
            steps.select("step_id", "ctx_id", "seq_ids")
            .with_row_index("_i")
            .explode("seq_ids")
            .rename({"seq_ids": "seq_id"})
            .with_columns(pl.col("seq_id").cast(pl.Int32()))
        )
        with_seq = rows.drop_nulls("seq_id")
        per_seq = _owner_kept(with_seq, ranges, decided)
        agg = (
            with_seq.select("_i")
            .with_columns(per_seq.alias("kept"))
            .group_by("_i")
            .agg(
                pl.col("kept").any().alias("any"),
                pl.col("kept").is_null().any().alias("waits"),
            )
        )
        out = (
            steps.select("step_id")
            .with_row_index("_i")
            .join(agg, on="_i", how="left", maintain_order="left")
            .select(
                pl.when(pl.col("any").fill_null(False))
                .then(True)
                .when(pl.col("waits").fill_null(False))
                .then(None)
                .when(self._near_anomaly(pl.col("step_id")))
                .then(True)
                .when(pl.col("any").is_null() & pl.col("waits").is_null())
                .then(True)  # no sequence in it: nothing to judge it by
                .otherwise(False)
                .alias("kept")
            )
        )
        return out["kept"]

    def _near_anomaly(self, step: pl.Expr) -> pl.Expr:
        expr = pl.lit(False)
        for lo, hi in self._keep_around[-64:]:
            expr = expr | step.is_between(lo, hi)
        return expr

    def _rescue_steps(self) -> pl.DataFrame:
        """Steps rows dropped lately that a firing since then keeps."""
        df = self._recent_dropped_steps
        if df.is_empty() or not self._keep_around:
            return pl.DataFrame()
        near = df.select(self._near_anomaly(pl.col("step_id")).alias("near"))["near"]
        if not near.any():
            return pl.DataFrame()
        self._recent_dropped_steps = df.filter(~near)
        rescued = df.filter(near)
        self.rows_dropped["steps"] -= rescued.height
        return rescued

    def _release_unattributed(self) -> list[tuple[str, pl.DataFrame]]:
        out = []
        for table, fs in self._pending.items():
            for df in fs:
                self.unattributed_rows += df.height
                out.append((table, df))
        self._pending = {t: [] for t in HELD_TABLES}
        self._bytes = 0
        return out

    def _range_frame(self) -> pl.DataFrame:
        rows = [(c, s, hi, rid) for (c, s), rs in self._ranges.items() for hi, rid in rs]
        return pl.DataFrame(rows, schema=_RANGE_SCHEMA, orient="row").sort("hi")

    def _prune(self) -> None:
        for ranges in self._ranges.values():
            # oldest first: the rows set apart teach their requests before the held ones of the
            # same flush (set_apart), so a sequence's list is not always in step order
            decided = sorted((r for r in ranges if r[1] in self._decision), key=lambda r: r[0])
            for r in decided[:-RANGES_KEPT]:
                ranges.remove(r)
        live = {r[1] for rs in self._ranges.values() for r in rs}
        if len(self._decision) > 4 * len(live) + 1024:
            self._decision = {k: v for k, v in self._decision.items() if k in live}
            self._started &= live
        self._keep_around = self._keep_around[-64:]

    def meta(self) -> dict[str, Any]:
        return {
            "requests": dict(self.requests),
            "by_policy": {k: dict(v) for k, v in self.judged.items()},
            "anomalies_fired": {
                k: n for v in self.verdicts if isinstance(v, Anomaly) for k, n in sorted(v.fired.items())
            },
            "window": {
                "max_bytes": self.max_bytes,
                "peak_bytes": self.peak_bytes,
                "overflow_requests": self.overflow_requests,
                "overflow_decision": "kept",
                "unattributed_rows": self.unattributed_rows,
            },
        }


def _owner_kept(rows: pl.DataFrame, ranges: pl.DataFrame, decided: pl.DataFrame) -> pl.Series:
    """Per row of (step_id, ctx_id, seq_id): whether its request is kept (null: no request known
    yet, or not decided), in the rows' order."""
    keyed = (
        rows.select(pl.col("step_id").cast(pl.Int64()), "ctx_id", "seq_id")
        .with_row_index("_r")
        .sort("step_id")
    )
    owner = keyed.join_asof(
        ranges,
        left_on="step_id",
        right_on="hi",
        by=["ctx_id", "seq_id"],
        strategy="forward",
        check_sortedness=False,
    )
    return owner.join(decided, on="request_id", how="left").sort("_r")["kept"]
