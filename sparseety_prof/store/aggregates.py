"""Always-on aggregates: the rows of the tokens and steps tables folded into counts per wall-clock
bucket (schema.AGGREGATES), so that what a policy drops of the rows still leaves the expert load,
the sparsity and log-prob histograms and the step latency of every moment of the run.

Counts are kept per bucket until the bucket is older than `grace_s` (rows reach the consumer some
time after the engine made them), then handed out once. A row later than that is counted in a new
row of the same bucket, metric, layer and bin: readers sum `count` over those keys
(`Aggregator.combine` does), never assume one row per key."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import polars as pl

from sparseety_prof.store import schema

_KEYS = ["bucket_unix_ms", "metric", "layer", "bin"]
# the columns each aggregated table is counted from
_COUNTED = {
    "tokens": ("ts_unix_ms", "log_prob", "expert_ids", "act_zero_ratio", "act_below_ratio"),
    "steps": ("ts_unix_ms", "t_start_ns", "t_end_ns"),
}


class Aggregator:
    """Folds frames of raw (unredacted) rows into bucketed counts. `layers` is meta.json's
    "layers" (which model layer each element of the tokens table's per-layer lists is);
    `leave_out` names metrics not to count (those a redaction level removes)."""

    def __init__(
        self,
        layers: Mapping[str, Sequence[int]],
        *,
        bucket_s: int = 10,
        grace_s: float = 10.0,
        leave_out: Iterable[str] = (),
    ) -> None:
        if bucket_s < 1:
            raise ValueError("the aggregate bucket must be at least 1 s")
        self.bucket_s = bucket_s
        self.grace_ms = int(grace_s * 1000)
        self.leave_out = frozenset(leave_out)
        self._layers = {k: list(v) for k, v in layers.items()}
        self._pending: list[pl.DataFrame] = []  # counts folded so far (schema.AGGREGATES rows)
        # Rows not counted yet, (table, the columns counted): counting has a fixed cost per call
        # (a dozen group-bys), so rows wait here until a bucket of theirs closes, or until
        # FOLD_ROWS of them wait, instead of being counted at every flush.
        self._raw: list[tuple[str, pl.DataFrame]] = []
        self._raw_rows = 0
        self._raw_first_ms: int | None = None  # the earliest ts_unix_ms among them

    #: rows waiting to be counted at most (bounds the memory they hold at high token rates)
    FOLD_ROWS = 20_000

    def add(self, table: str, df: pl.DataFrame) -> None:
        """Count the rows of a tokens or steps frame (other tables are not aggregated)."""
        if df.height == 0 or table not in _COUNTED:
            return
        wanted = [c for c in _COUNTED[table] if c in df.columns]
        got = df.select(wanted)  # the frame's own buffers, not a copy
        first = got["ts_unix_ms"].min()
        if isinstance(first, int):
            self._raw_first_ms = first if self._raw_first_ms is None else min(self._raw_first_ms, first)
        self._raw.append((table, got))
        self._raw_rows += got.height
        if self._raw_rows >= self.FOLD_ROWS:
            self._fold()

    def take(self, now_unix_ms: int | None = None) -> pl.DataFrame:
        """The counts of buckets that ended more than `grace_s` before `now_unix_ms` (every
        bucket when None: at the end of the recording), as schema.AGGREGATES rows."""
        if now_unix_ms is None or (
            self._raw_first_ms is not None and self._closed_by(self._raw_first_ms, now_unix_ms)
        ):
            self._fold()
        if not self._pending:
            return schema.empty("aggregates")
        counts = combine(pl.concat(self._pending))
        if now_unix_ms is None:
            self._pending = []
            return counts
        closed = pl.col("bucket_unix_ms") + self.bucket_s * 1000 + self.grace_ms <= now_unix_ms
        still_open = counts.filter(~closed)
        self._pending = [still_open] if still_open.height else []
        return counts.filter(closed)

    def _closed_by(self, ts_unix_ms: int, now_unix_ms: int) -> bool:
        """Whether the bucket of `ts_unix_ms` is handed out at `now_unix_ms`."""
        ms = self.bucket_s * 1000
        return (ts_unix_ms // ms) * ms + ms + self.grace_ms <= now_unix_ms

    def _fold(self) -> None:
        """Count the waiting rows into the pending counts."""
        raw, self._raw, self._raw_rows, self._raw_first_ms = self._raw, [], 0, None
        for table in _COUNTED:
            frames = [df for t, df in raw if t == table]
            if not frames:
                continue
            df = pl.concat(frames) if len(frames) > 1 else frames[0]
            if table == "tokens":
                parts = self._token_counts(df)
            else:
                parts = [self._histogram(df, "step_ms", (pl.col("t_end_ns") - pl.col("t_start_ns")) / 1e6)]
            self._pending.extend(p for p in parts if p.height)
        if len(self._pending) > 64:  # keep the pending list short: fold it now and then
            self._pending = [combine(pl.concat(self._pending))]

    # ---------------------------------------------------------------- per metric
    def _token_counts(self, df: pl.DataFrame) -> list[pl.DataFrame]:
        df = df.filter(pl.col("ts_unix_ms").is_not_null())
        parts = [self._finish(df.group_by(self._bucket()).agg(pl.len().alias("count")), "tokens", bin_=0)]
        if "log_prob" not in self.leave_out:
            parts.append(self._histogram(df, "log_prob", pl.col("log_prob")))
        if "expert_load" not in self.leave_out:
            parts.append(self._expert_load(df))
        for ratio in ("act_zero_ratio", "act_below_ratio"):
            if ratio not in self.leave_out:
                parts.append(self._per_layer_histogram(df, ratio))
        return parts

    def _bucket(self) -> pl.Expr:
        ms = self.bucket_s * 1000
        return ((pl.col("ts_unix_ms") // ms) * ms).alias("bucket_unix_ms")

    def _histogram(self, df: pl.DataFrame, metric: str, value: pl.Expr) -> pl.DataFrame:
        got = df.select(self._bucket(), value.alias("v")).drop_nulls()
        if got.height == 0:
            return schema.empty("aggregates")
        got = got.with_columns(pl.Series("bin", _bins(metric, got["v"].to_numpy())))
        return self._finish(got.group_by("bucket_unix_ms", "bin").agg(pl.len().alias("count")), metric)

    def _layer_of(self, kind: str) -> pl.Expr:
        """The model layer of a per-layer list's element (its index in pl.col("i"))."""
        layers = self._layers.get(kind)
        if not layers:
            return pl.col("i").cast(pl.Int32).alias("layer")
        return pl.col("i").replace_strict(
            list(range(len(layers))), layers, default=None, return_dtype=pl.Int32
        )

    def _exploded(self, df: pl.DataFrame, column: str) -> pl.DataFrame:
        """(bucket, i, value) for each element of the per-layer list `column`."""
        got = df.select(self._bucket(), column).filter(pl.col(column).is_not_null())
        if got.height == 0:
            return pl.DataFrame()
        got = got.with_columns(pl.int_ranges(0, pl.col(column).list.len()).alias("i"))
        return got.explode(column, "i").drop_nulls(column)

    def _expert_load(self, df: pl.DataFrame) -> pl.DataFrame:
        got = self._exploded(df, "expert_ids")
        if got.height == 0:
            return schema.empty("aggregates")
        got = got.explode("expert_ids").drop_nulls("expert_ids").filter(pl.col("expert_ids") >= 0)
        got = got.with_columns(self._layer_of("moe").alias("layer"), pl.col("expert_ids").alias("bin"))
        return self._finish(
            got.group_by("bucket_unix_ms", "layer", "bin").agg(pl.len().alias("count")), "expert_load"
        )

    def _per_layer_histogram(self, df: pl.DataFrame, metric: str) -> pl.DataFrame:
        got = self._exploded(df, metric)
        if got.height == 0:
            return schema.empty("aggregates")
        got = got.with_columns(
            self._layer_of(schema.TOKEN_LIST_LAYERS[metric]).alias("layer"),
            pl.Series("bin", _bins(metric, got[metric].to_numpy())),
        )
        return self._finish(
            got.group_by("bucket_unix_ms", "layer", "bin").agg(pl.len().alias("count")), metric
        )

    def _finish(self, counts: pl.DataFrame, metric: str, *, bin_: int | None = None) -> pl.DataFrame:
        if bin_ is not None:
            counts = counts.with_columns(pl.lit(bin_).alias("bin"))
        if "layer" not in counts.columns:
            counts = counts.with_columns(pl.lit(None).alias("layer"))
        return counts.with_columns(
            pl.lit(self.bucket_s).alias("bucket_s"), pl.lit(metric).alias("metric")
        ).select(pl.col(c).cast(t) for c, t in schema.AGGREGATES.items())


def combine(rows: pl.DataFrame) -> pl.DataFrame:
    """schema.AGGREGATES rows with one row per (bucket, metric, layer, bin): counts summed."""
    if rows.height == 0:
        return schema.empty("aggregates")
    out = rows.group_by(*_KEYS, "bucket_s").agg(pl.col("count").sum())
    return out.select(pl.col(c).cast(t) for c, t in schema.AGGREGATES.items()).sort(_KEYS, nulls_last=True)


def _bins(metric: str, values: np.ndarray) -> np.ndarray:
    """The bin of each value in schema.AGGREGATE_EDGES[metric] (out-of-range values clamped)."""
    edges = np.asarray(schema.AGGREGATE_EDGES[metric])
    b = np.searchsorted(edges, values.astype(np.float64), side="right") - 1
    return np.clip(b, 0, len(edges) - 2).astype(np.int32)
