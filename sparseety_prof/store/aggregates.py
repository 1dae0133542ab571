"""Always-on aggregates: the rows of the tokens and steps tables folded into counts per wall-clock
bucket (schema.AGGREGATES), so that what a policy drops of the rows still leaves the expert load,
the sparsity and log-prob histograms and the step latency of every moment of the run.

Counts are kept per bucket until the bucket is older than `grace_s` (rows reach the consumer some
time after the engine made them), then handed out once. A row later than that is counted in a new
row of the same bucket, metric, layer and bin: readers sum `count` over those keys
(`Aggregator.combine` does), never assume one row per key."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence

import numpy as np
import polars as pl

from sparseety_prof.store import schema
from sparseety_prof.store.aggregate_counts import NO_LAYER, count_keys, flat_list, layer_of, valid
from sparseety_prof.store.array_rows import ArrayRows

_KEYS = ["bucket_unix_ms", "metric", "layer", "bin"]
# the columns each aggregated table is counted from
_COUNTED = {
    "tokens": ("ts_unix_ms", "log_prob", "expert_ids", "act_zero_ratio", "act_below_ratio"),
    "steps": ("ts_unix_ms", "t_start_ns", "t_end_ns"),
}
#: the same, as sets: what a frame of those tables must hold to be counted (the rows a policy sets
#: apart before they are made whole: Correlator head_rows_apart)
COUNTED = {table: frozenset(cols) for table, cols in _COUNTED.items()}


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
        # rows held as arrays (add_rows), counted with the frames
        self._raw_arrays: list[tuple[str, ArrayRows]] = []
        self._raw_rows = 0
        self._raw_first_ms: int | None = None  # the earliest ts_unix_ms among them

    #: rows waiting to be counted at most (bounds the memory they hold at high token rates)
    FOLD_ROWS = 20_000

    def add(self, table: str, df: pl.DataFrame) -> None:
        """Count the rows of a tokens or steps frame (other tables are not aggregated)."""
        if df.height == 0 or table not in _COUNTED:
            return
        wanted = [c for c in _COUNTED[table] if c in df.columns]
        # the frame's own buffers, not a copy; and no query (`select` plans and runs one: a fixed
        # cost each frame pays, and with a journal a frame comes after every drain)
        got = pl.DataFrame([df.get_column(c) for c in wanted])
        first = got["ts_unix_ms"].min()
        if isinstance(first, int):
            self._raw_first_ms = first if self._raw_first_ms is None else min(self._raw_first_ms, first)
        self._raw.append((table, got))
        self._raw_rows += got.height
        if self._raw_rows >= self.FOLD_ROWS:
            self._fold()

    def add_rows(self, table: str, parts: list[ArrayRows]) -> None:
        """Count rows of a tokens or steps table held as ArrayRows (the rows set apart by the
        correlator, Correlator head_rows_apart) as `add` counts their frame, without making it:
        their per-layer arrays are counted as they are."""
        if table not in _COUNTED:
            return
        for p in parts:
            if not p.n:
                continue
            ts = _floats(p.arrays.get("ts_unix_ms"), p.n)
            if not np.isnan(ts).all():
                first = int(np.nanmin(ts))
                self._raw_first_ms = first if self._raw_first_ms is None else min(self._raw_first_ms, first)
            self._raw_arrays.append((table, p))
            self._raw_rows += p.n
        if self._raw_rows >= self.FOLD_ROWS:
            self._fold()

    def take(self, now_unix_ms: int | None = None) -> pl.DataFrame:
        """The counts of buckets that ended more than `grace_s` before `now_unix_ms` (every
        bucket when None: at the end of the recording), as schema.AGGREGATES rows."""
        for _ in self.fold_steps(now_unix_ms):
            pass
        return self._take_folded(now_unix_ms)

    def take_steps(self, now_unix_ms: int | None, out: list[pl.DataFrame]) -> Iterator[str]:
        """`take` in steps, for a caller that does other work between them (the recorder's
        flush, session/flush_round.py): a yield after each metric's counts (naming it); the
        rows go to `out` at the end. Rows added in between wait for a later take."""
        yield from self.fold_steps(now_unix_ms)
        out.append(self._take_folded(now_unix_ms))

    def fold_steps(self, now_unix_ms: int | None) -> Iterator[str]:
        """The waiting rows counted, when `take` at `now_unix_ms` needs them: a metric at a time."""
        if now_unix_ms is None or (
            self._raw_first_ms is not None and self._closed_by(self._raw_first_ms, now_unix_ms)
        ):
            yield from self._fold_steps()

    def _take_folded(self, now_unix_ms: int | None) -> pl.DataFrame:
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
        for _ in self._fold_steps():
            pass

    def _fold_steps(self) -> Iterator[str]:
        """_fold, a yield after each metric's counts of the frames (naming it). The waiting rows
        are taken at the start: rows added in between wait for the next fold."""
        raw, self._raw, self._raw_rows, self._raw_first_ms = self._raw, [], 0, None
        arrays, self._raw_arrays = self._raw_arrays, []
        for table in _COUNTED:
            frames = [df for t, df in raw if t == table]
            for rows in ArrayRows.concat([p for t, p in arrays if t == table]):
                if table == "tokens" and _countable(rows):
                    self._pending.extend(p for p in self._token_array_counts(rows) if p.height)
                elif table == "steps":
                    self._pending.append(self._step_array_counts(rows))
                else:  # per-row lists among them: counted as their frame
                    frames.append(rows.frame(table).select(c for c in _COUNTED[table]))
            if not frames:
                continue
            df = pl.concat(frames) if len(frames) > 1 else frames[0]
            named = self._token_counts(df) if table == "tokens" else self._step_parts(df)
            for metric, part in named:
                if part.height:
                    self._pending.append(part)
                yield f"aggregates {metric}"
        if len(self._pending) > 64:  # keep the pending list short: fold it now and then
            self._pending = [combine(pl.concat(self._pending))]

    # ---------------------------------------------------------------- per metric
    def _token_counts(self, df: pl.DataFrame) -> Iterator[tuple[str, pl.DataFrame]]:
        """Each metric's counts of token rows, with its name, one at a time."""
        ts = df["ts_unix_ms"]
        keep = valid(ts)
        if not keep.all():
            df = df.filter(pl.Series(keep))
        bucket = self._bucket_index(df["ts_unix_ms"].to_numpy())
        yield "tokens", self._counts("tokens", bucket, np.zeros(len(bucket), dtype=np.int64))
        if "log_prob" not in self.leave_out:
            lp = df["log_prob"]
            ok = valid(lp)
            yield "log_prob", self._counts("log_prob", bucket[ok], _bins("log_prob", lp.to_numpy()[ok]))
        if "expert_load" not in self.leave_out:
            yield "expert_load", self._expert_load(df, bucket)
        for ratio in ("act_zero_ratio", "act_below_ratio"):
            if ratio not in self.leave_out:
                yield ratio, self._per_layer_histogram(df, bucket, ratio)

    def _step_parts(self, df: pl.DataFrame) -> Iterator[tuple[str, pl.DataFrame]]:
        yield "step_ms", self._step_counts(df)

    def _token_array_counts(self, rows: ArrayRows) -> list[pl.DataFrame]:
        """_token_counts of token rows whose per-layer columns are arrays (_countable)."""
        ts = _floats(rows.arrays["ts_unix_ms"], rows.n)
        sel = np.flatnonzero(~np.isnan(ts))
        bucket = self._bucket_index(ts[sel].astype(np.int64))
        parts = [self._counts("tokens", bucket, np.zeros(len(bucket), dtype=np.int64))]
        if "log_prob" not in self.leave_out:
            lp = rows.arrays["log_prob"]
            if lp is not None:
                assert isinstance(lp, list)  # (_countable)
                given = np.fromiter((v is not None for v in lp), dtype=bool, count=rows.n)[sel]
                values = np.array([np.nan if v is None else v for v in lp], dtype=np.float64)[sel]
                parts.append(self._counts("log_prob", bucket[given], _bins("log_prob", values[given])))
        if "expert_load" not in self.leave_out:
            got = _per_layer(rows, "expert_ids", sel)
            if got is not None:
                row, index, ids = got
                e = ids.astype(np.int64)
                ok = e >= 0
                layer = layer_of(index[ok], self._layers.get("moe"))
                parts.append(self._counts("expert_load", bucket[row[ok]], e[ok], layer))
        for ratio in ("act_zero_ratio", "act_below_ratio"):
            if ratio in self.leave_out:
                continue
            got = _per_layer(rows, ratio, sel)
            if got is not None:
                row, index, values = got
                layer = layer_of(index, self._layers.get(schema.TOKEN_LIST_LAYERS[ratio]))
                parts.append(self._counts(ratio, bucket[row], _bins(ratio, values), layer))
        return parts

    def _step_array_counts(self, rows: ArrayRows) -> pl.DataFrame:
        """_step_counts of steps rows held as ArrayRows."""
        (ts, t0, t1), ok = _ints(rows, ("ts_unix_ms", "t_start_ns", "t_end_ns"))
        ms = (t1[ok] - t0[ok]) / 1e6
        return self._counts("step_ms", self._bucket_index(ts[ok]), _bins("step_ms", ms))

    def _step_counts(self, df: pl.DataFrame) -> pl.DataFrame:
        ts, t0, t1 = df["ts_unix_ms"], df["t_start_ns"], df["t_end_ns"]
        ok = valid(ts) & valid(t0) & valid(t1)
        ms = (t1.to_numpy()[ok].astype(np.int64) - t0.to_numpy()[ok].astype(np.int64)) / 1e6
        return self._counts("step_ms", self._bucket_index(ts.to_numpy()[ok]), _bins("step_ms", ms))

    def _bucket_index(self, ts_unix_ms: np.ndarray) -> np.ndarray:
        """Each time's bucket, as its start // the bucket's length: a small range of keys for
        aggregate_counts.count_keys (`_counts` makes them the buckets' starts)."""
        return ts_unix_ms.astype(np.int64) // (self.bucket_s * 1000)

    def _expert_load(self, df: pl.DataFrame, bucket: np.ndarray) -> pl.DataFrame:
        """Each selection of an expert (a non-negative id) in a layer's list of a token row."""
        token, index, per_layer = flat_list(df["expert_ids"])
        at, _, ids = flat_list(per_layer)
        e = ids.fill_null(-1).to_numpy().astype(np.int64)
        ok = e >= 0
        layer = layer_of(index[at[ok]], self._layers.get("moe"))
        return self._counts("expert_load", bucket[token[at[ok]]], e[ok], layer)

    def _per_layer_histogram(self, df: pl.DataFrame, bucket: np.ndarray, metric: str) -> pl.DataFrame:
        token, index, values = flat_list(df[metric])
        ok = valid(values)
        layer = layer_of(index[ok], self._layers.get(schema.TOKEN_LIST_LAYERS[metric]))
        return self._counts(metric, bucket[token[ok]], _bins(metric, values.to_numpy()[ok]), layer)

    def _counts(
        self, metric: str, bucket: np.ndarray, bin_: np.ndarray, layer: np.ndarray | None = None
    ) -> pl.DataFrame:
        """schema.AGGREGATES rows: how many values fall in each (bucket, layer, bin); `bucket` holds
        bucket indices (_bucket_index)."""
        keys, counts = count_keys(bucket, bin_) if layer is None else count_keys(bucket, layer, bin_)
        n = len(counts)
        if layer is None:
            layer_col = schema.null_series("layer", pl.Int32(), n)
        else:
            layer_col = pl.Series("layer", keys[1], dtype=pl.Int64()).cast(pl.Int32())
            missing = keys[1] == NO_LAYER
            if missing.any():
                layer_col = pl.select(
                    pl.when(pl.Series(missing)).then(None).otherwise(layer_col).alias("layer")
                ).to_series()
        return pl.DataFrame(
            [
                pl.Series("bucket_unix_ms", keys[0] * (self.bucket_s * 1000), dtype=pl.Int64()),
                schema.repeated_series("bucket_s", self.bucket_s, pl.Int32(), n),
                schema.repeated_series("metric", metric, pl.String(), n),
                layer_col,
                pl.Series("bin", keys[-1], dtype=pl.Int64()).cast(pl.Int32()),
                pl.Series("count", counts, dtype=pl.Int64()),
            ]
        )


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


#: the tokens table's per-layer columns the aggregates count
_PER_LAYER = ("expert_ids", "act_zero_ratio", "act_below_ratio")


def _countable(rows: ArrayRows) -> bool:
    """Whether add_rows counts these token rows from their arrays: the per-layer columns arrays
    (or all null), the others Python values."""
    for name in _PER_LAYER:
        a = rows.arrays.get(name)
        if a is not None and not isinstance(a, np.ndarray):
            return False
    return all(not isinstance(rows.arrays.get(c), np.ndarray) for c in ("ts_unix_ms", "log_prob"))


def _ints(rows: ArrayRows, names: tuple[str, ...]) -> tuple[list[np.ndarray], np.ndarray]:
    """Integer columns as int64 arrays, and which rows have every one of them."""
    ok = np.ones(rows.n, dtype=bool)
    out = []
    for name in names:
        values = rows.arrays.get(name)
        if values is None:
            return [np.zeros(rows.n, dtype=np.int64) for _ in names], np.zeros(rows.n, dtype=bool)
        if isinstance(values, np.ndarray):
            null = rows.nulls.get(name)
            if null is not None:
                ok &= ~null
            out.append(values.astype(np.int64))
            continue
        ok &= np.fromiter((v is not None for v in values), dtype=bool, count=rows.n)
        out.append(np.array([0 if v is None else v for v in values], dtype=np.int64))
    return out, ok


def _floats(values: object, n: int) -> np.ndarray:
    """A column of Python numbers (None: NaN) or an array, as float64 (a millisecond time since
    the epoch is exact there)."""
    if values is None:
        return np.full(n, np.nan)
    if isinstance(values, np.ndarray):
        return values.astype(np.float64)
    return np.array([np.nan if v is None else v for v in values], dtype=np.float64)  # type: ignore[attr-defined]


def _per_layer(
    rows: ArrayRows, name: str, sel: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """The elements of per-layer column `name` in rows `sel` (flat_list's row, in positions of
    `sel`, list index and value), leaving out null rows and rows whose list is all null; None
    when the column is all null. A 3-D column (a list of lists per row) counts each inner
    element at its outer list's index."""
    a = rows.arrays.get(name)
    if a is None:
        return None
    assert isinstance(a, np.ndarray)
    ok = np.ones(rows.n, dtype=bool)
    for marks in (rows.nulls.get(name), rows.null_items.get(name)):
        if marks is not None:
            ok &= ~marks
    ok = ok[sel]
    values = a[sel][ok]
    at = np.flatnonzero(ok)
    width = values.shape[1]
    inner = int(np.prod(values.shape[2:], dtype=np.int64))  # 1 for a list of values per row
    row = np.repeat(at, width * inner)
    index = np.tile(np.repeat(np.arange(width, dtype=np.int64), inner), len(at))
    return row, index, values.reshape(-1)
