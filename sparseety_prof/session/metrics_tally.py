"""Running totals of a recording's rows for a metrics endpoint: expert selections per MoE layer
and expert, activation-sparsity, log-prob (negated) and step-latency histograms, the requests'
latency histograms (session/request_latency.py), token and request counts, and the session's own
counters (losses, CPU, memory).

The consumer thread adds frames (`add`), the endpoint's thread reads a copy (`snapshot`). Every
update is a handful of numpy operations on a frame's columns, never a Python loop over its rows:
the consumer must keep up with the engine. The label sets are fixed at construction, from the
recording's meta (its MoE and FFN layers, the model's expert count): a row naming a layer or an
expert outside them is not counted, so what the endpoint exposes cannot grow with the data."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import polars as pl

from sparseety_prof.session.options import Progress
from sparseety_prof.session.otlp_spans import SpanContext
from sparseety_prof.session.request_latency import BUCKETS as LATENCY_BUCKETS
from sparseety_prof.session.request_latency import request_latencies
from sparseety_prof.store import schema

#: upper bounds of the activation sparsity buckets: the 0.1 grid `--redact sparsity` rounds to
SPARSITY_BUCKETS: tuple[float, ...] = tuple(round(0.1 * i, 1) for i in range(1, 11))
#: upper bounds of the buckets of a token's log-prob negated (nats): Prometheus gives a histogram
#: with negative buckets no _sum or _count, and with them rate(sum) / rate(count) is the mean
#: negative log-likelihood, whose exp() is the perplexity
NLL_BUCKETS: tuple[float, ...] = (0.01, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0)
#: upper bounds of the step latency buckets (seconds): a decode step of a small model on a CPU
#: is a few milliseconds, a long prompt step on a big one seconds
STEP_BUCKETS: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
#: the step phases a latency is kept for (schema PHASE_*): the only values the correlator writes
PHASES: tuple[str, ...] = (schema.PHASE_PREFILL, schema.PHASE_DECODE)
#: the session counters exposed as losses (Progress fields; README "Losses" says what each means)
LOSS_KINDS: tuple[str, ...] = ("kernel_drops", "seq_gaps", "logits_incomplete")


@dataclass
class Histograms:
    """Per-label bucket counts (the last column is the +Inf bucket, not cumulative) and sums."""

    bounds: tuple[float, ...]
    counts: np.ndarray  # int64 [labels, len(bounds) + 1]
    sums: np.ndarray  # float64 [labels]

    @classmethod
    def empty(cls, bounds: Sequence[float], n_labels: int) -> Histograms:
        return cls(tuple(bounds), np.zeros((n_labels, len(bounds) + 1), np.int64), np.zeros(n_labels))

    def add(self, label: np.ndarray, value: np.ndarray) -> None:
        """Observe `value[i]` under label index `label[i]` (-1 and NaN values are skipped)."""
        ok = (label >= 0) & ~np.isnan(value)
        label, value = label[ok], value[ok]
        if not label.size:
            return
        n_labels, width = self.counts.shape
        # the first bound >= the value: Prometheus buckets count values "le" their bound. The
        # bounds take the values' precision: a ratio stored as float32 0.3 (a --redact sparsity
        # grid point) is above the float64 0.3, and belongs in the 0.3 bucket all the same
        bucket = np.searchsorted(np.asarray(self.bounds, dtype=value.dtype), value, side="left")
        self.counts += np.bincount(label * width + bucket, minlength=n_labels * width).reshape(
            n_labels, width
        )
        self.sums += np.bincount(label, weights=value, minlength=n_labels)

    def copy(self) -> Histograms:
        return Histograms(self.bounds, self.counts.copy(), self.sums.copy())


@dataclass
class Snapshot:
    """What the endpoint shows at one scrape (copies: the consumer goes on adding)."""

    moe_layers: tuple[int, ...]  # layers whose expert selections are counted
    n_expert: int
    selections: np.ndarray  # int64 [moe layer, expert]
    moe_rows: np.ndarray  # int64 [moe layer]: rows routed
    ffn_layers: tuple[int, ...]  # layers whose activation sparsity is counted
    zero_ratio: Histograms
    below_ratio: Histograms
    nll: Histograms  # of the sampled tokens' log-probs, negated
    step_seconds: Histograms  # one label per PHASES
    tokens: int
    requests: int
    #: the label values of the request latencies: the model and the engine (one label set)
    model: str = "unknown"
    engine: str = "unknown"
    #: request_latency.BUCKETS name -> its histogram (one label: model and engine)
    latencies: dict[str, Histograms] = field(default_factory=dict)
    progress: dict[str, float] = field(default_factory=dict)


def _ints(values: np.ndarray, null: int) -> np.ndarray:
    """Integers from a polars column as numpy gives it (float with NaN where it had nulls)."""
    if values.dtype.kind == "f":
        values = np.nan_to_num(values, nan=null)
    return values.astype(np.int64)


class LayerIndex:
    """model layer -> its row in the per-layer arrays, for a column of layers at once (-1: a
    layer not counted). A sorted search rather than a table indexed by layer: the layer numbers
    come from the target's model file, and a table would be as large as the largest of them."""

    def __init__(self, layers: Sequence[int]) -> None:
        self._sorted = np.asarray(sorted(layers), np.int64)
        self._row = np.argsort(np.asarray(layers, np.int64), kind="stable")  # sorted position -> row

    def rows(self, layer: np.ndarray) -> np.ndarray:
        if not self._sorted.size:
            return np.full(layer.shape, -1, np.int64)
        pos = np.minimum(np.searchsorted(self._sorted, layer), self._sorted.size - 1)
        return np.where(self._sorted[pos] == layer, self._row[pos], -1)


#: what MetricsTally.add reads of the token and step rows (the rows that may come set apart:
#: sinks.py); of the routes and requests rows it reads every one whole
TALLY_COLUMNS = {"tokens": frozenset({"log_prob"}), "steps": frozenset({"t_start_ns", "t_end_ns", "phase"})}


class MetricsTally:
    def __init__(
        self,
        moe_layers: Sequence[int],
        n_expert: int,
        ffn_layers: Sequence[int],
        *,
        model: str = "unknown",
        engine: str = "unknown",
    ) -> None:
        self.model, self.engine = model, engine
        self.moe_layers = tuple(moe_layers) if n_expert > 0 else ()
        self.n_expert = n_expert if self.moe_layers else 0
        self.ffn_layers = tuple(ffn_layers)
        self._moe_index = LayerIndex(self.moe_layers)
        self._ffn_index = LayerIndex(self.ffn_layers)
        self._lock = threading.Lock()
        self._selections = np.zeros((len(self.moe_layers), self.n_expert), np.int64)
        self._moe_rows = np.zeros(len(self.moe_layers), np.int64)
        self._zero = Histograms.empty(SPARSITY_BUCKETS, len(self.ffn_layers))
        self._below = Histograms.empty(SPARSITY_BUCKETS, len(self.ffn_layers))
        self._nll = Histograms.empty(NLL_BUCKETS, 1)
        self._steps = Histograms.empty(STEP_BUCKETS, len(PHASES))
        self._latencies = {name: Histograms.empty(b, 1) for name, b in LATENCY_BUCKETS.items()}
        self._tokens = 0
        self._requests = 0
        self._progress: dict[str, float] = {}

    @classmethod
    def from_meta(
        cls, meta: Mapping[str, Any], *, routing_redacted: frozenset[int] | None = None
    ) -> MetricsTally:
        """The label sets of a recording's meta: MoE layers (less those whose routing is
        redacted: their rows carry no experts; None = none redacted) and FFN layers, each only
        when the capture reads them (--mode tokens reads neither); the model and engine names
        the request latencies are labelled with, as the OTLP spans name them."""
        layers = meta.get("layers") or {}
        capture = meta.get("capture") or {}
        hp = (meta.get("model") or {}).get("hyperparameters") or {}
        moe = [int(x) for x in layers.get("moe") or ()] if capture.get("routes") else []
        if routing_redacted is not None:
            moe = [x for x in moe if x not in routing_redacted]
        ffn = [int(x) for x in layers.get("ffn") or ()] if capture.get("activations") else []
        names = SpanContext.from_meta(meta, 0)
        return cls(moe, int(hp.get("expert_count") or 0), ffn, model=names.model, engine=names.provider)

    def add(self, table: str, df: pl.DataFrame) -> None:
        """Count the rows of one frame of `table` (schema.TABLES[table] columns)."""
        if df.height == 0:
            return
        if table == "routes":
            self._add_routes(df)
        elif table == "tokens":
            nll = -df["log_prob"].to_numpy().astype(np.float64, copy=False)
            with self._lock:
                self._tokens += df.height
                self._nll.add(np.zeros(df.height, np.int64), nll)
        elif table == "steps":
            seconds = (df["t_end_ns"].to_numpy() - df["t_start_ns"].to_numpy()) / 1e9  # NaN when null
            names = df["phase"].to_numpy()  # str or None
            phase = np.full(df.height, -1, np.int64)
            for i, name in enumerate(PHASES):
                phase[names == name] = i
            with self._lock:
                self._steps.add(phase, seconds.astype(np.float64, copy=False))
        elif table == "requests":  # a request's row comes once, when it ends (or at detach)
            latencies = request_latencies(df)
            label = np.zeros(df.height, np.int64)
            with self._lock:
                self._requests += df.height
                for name, values in latencies.items():
                    self._latencies[name].add(label, values)

    def _add_routes(self, df: pl.DataFrame) -> None:
        layer = df["layer"].to_numpy().astype(np.int64)
        ffn = self._ffn_index.rows(layer)
        zero = df["act_zero_ratio"].to_numpy()  # float32 as stored, NaN where null
        below = df["act_below_ratio"].to_numpy()
        flat_pos = flat_ids = routed = None
        if self.moe_layers:
            ids = df["expert_ids"]
            # (polars' fill_null is slow for a call this small: nulls are handled in numpy instead)
            lens = _ints(ids.list.len().to_numpy(), 0)
            moe = self._moe_index.rows(layer)
            routed = moe[(moe >= 0) & (lens > 0)]
            # exactly `lens` values per row: a null list gives none, a null id inside one is -1
            flat_ids = _ints(ids.explode(empty_as_null=False, keep_nulls=False).to_numpy(), -1)
            flat_pos = np.repeat(moe, lens)
            ok = (flat_pos >= 0) & (flat_ids >= 0) & (flat_ids < self.n_expert)
            flat_pos, flat_ids = flat_pos[ok], flat_ids[ok]
        with self._lock:
            self._zero.add(ffn, zero)
            self._below.add(ffn, below)
            if flat_pos is not None and flat_ids is not None and routed is not None:
                n_moe, n_expert = self._selections.shape
                self._selections += np.bincount(
                    flat_pos * n_expert + flat_ids, minlength=n_moe * n_expert
                ).reshape(n_moe, n_expert)
                self._moe_rows += np.bincount(routed, minlength=n_moe)

    def drained(self, progress: Progress) -> None:
        got = {
            "cpu_s": progress.cpu_s,
            "rss_bytes": float(progress.rss_bytes),
            "lag_ms": progress.lag_ms,
            **{k: float(getattr(progress, k)) for k in LOSS_KINDS},
        }
        if progress.sparse_coverage is not None:
            got["sparse_coverage"] = progress.sparse_coverage
        with self._lock:
            self._progress = got

    def snapshot(self) -> Snapshot:
        with self._lock:
            return Snapshot(
                moe_layers=self.moe_layers,
                n_expert=self.n_expert,
                selections=self._selections.copy(),
                moe_rows=self._moe_rows.copy(),
                ffn_layers=self.ffn_layers,
                zero_ratio=self._zero.copy(),
                below_ratio=self._below.copy(),
                nll=self._nll.copy(),
                step_seconds=self._steps.copy(),
                tokens=self._tokens,
                requests=self._requests,
                model=self.model,
                engine=self.engine,
                latencies={name: h.copy() for name, h in self._latencies.items()},
                progress=dict(self._progress),
            )
