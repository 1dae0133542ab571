"""`--metrics-port`: the recording's rows as a Prometheus endpoint (docs/fleet.md, "Prometheus").

A FrameSink (session/sinks.py) that keeps running totals (session/metrics_tally.py) and serves
them from prometheus_client's HTTP server thread, on a registry of its own (the library's
global default registry would add its process and GC collectors, and anything else imported in
this process). The families are built at scrape time from a copy of the totals, by a custom
collector: a frame then costs the consumer a few numpy additions, whatever the scrape rate.

The series are fixed at attach by the model (see series_count): every MoE layer and expert and
every FFN layer is exposed from the first scrape, at zero until counted, so dashboards and
rate() see no series appear or vanish, and the count can be planned for. Whether the expert
selections are counted per expert or only summarised per layer is decided then too, from the
model's shape (expert_series_plan): per expert while layers x experts x label sets stays within
EXPERT_SERIES_BOUND, per layer beyond it, unless asked otherwise. The request latencies an SRE
pages on (session/request_latency.py) are histograms labelled with the model and the engine.
docs/fleet-metrics.md lists every metric."""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import polars as pl
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from sparseety_prof.errors import MetricsEndpointError
from sparseety_prof.session.metrics_tally import (
    LOSS_KINDS,
    NLL_BUCKETS,
    PHASES,
    SPARSITY_BUCKETS,
    STEP_BUCKETS,
    TALLY_COLUMNS,
    Histograms,
    MetricsTally,
    Snapshot,
)
from sparseety_prof.session.options import Progress
from sparseety_prof.session.request_latency import BUCKETS as LATENCY_BUCKETS

PER_EXPERT = "per-expert"
AGGREGATE = "aggregate"  # per layer: rows, largest share and imbalance of the experts' load
AUTO = "auto"  # PER_EXPERT within EXPERT_SERIES_BOUND, AGGREGATE beyond (expert_series_plan)
EXPERT_MODES: tuple[str, ...] = (AUTO, PER_EXPERT, AGGREGATE)
#: the most per-expert selection series AUTO exposes (MoE layers x experts x label sets): the
#: tests' model and Mixtral (32 x 8) stay per expert, 128- and 256-expert models (gpt-oss,
#: Qwen3 MoE, DeepSeek-V3) get the per-layer summary
EXPERT_SERIES_BOUND = 2000
DEFAULT_BIND = "127.0.0.1"
PREFIX = "sparseety"
#: The label sets come from the engine's model file, which the target controls (docs/threat-model.md:
#: model): an expert count or layer list no model has would make the endpoint (and the totals
#: behind it) as large as the file says. The largest public MoE models have 512 experts and
#: ~100 layers; beyond these bounds the endpoint refuses rather than grows.
MAX_EXPERTS = 4096
MAX_SERIES = 200_000

#: series of the families whose size does not depend on the model: token NLL and step latency
#: histograms (buckets, +Inf, sum and count), the request latency histograms (one label set:
#: model and engine), the expert series decision (info), tokens, requests, losses, CPU, memory
#: and lag
FIXED_SERIES = (
    (len(NLL_BUCKETS) + 3)
    + len(PHASES) * (len(STEP_BUCKETS) + 3)
    + sum(len(b) + 3 for b in LATENCY_BUCKETS.values())
    + 1
    + 2
    + len(LOSS_KINDS)
    + 3
)


@dataclass(frozen=True)
class ExpertSeriesPlan:
    """How the endpoint shows a model's expert selections, decided once when it opens."""

    requested: str  # one of EXPERT_MODES (--metrics-experts)
    experts: str  # PER_EXPERT or AGGREGATE: what is exposed
    n_moe_layers: int
    n_expert: int
    label_sets: int  # label sets each (layer, expert) counter is exposed under
    bound: int

    @property
    def per_expert_series(self) -> int:
        """Series the per-expert selection counter takes (or would take) for this model."""
        return self.n_moe_layers * self.n_expert * self.label_sets

    def line(self) -> str:
        """One sentence for `doctor` and the logs."""
        shape = (
            f"{self.n_moe_layers} MoE layers x {self.n_expert} experts x {self.label_sets} label "
            f"set{'s' if self.label_sets != 1 else ''} = {self.per_expert_series} per-expert series"
        )
        if self.requested != AUTO:
            how = "per expert" if self.experts == PER_EXPERT else "per layer"
            return f"expert selections {how}, as --metrics-experts {self.requested} asks ({shape})"
        if self.experts == PER_EXPERT:
            return f"expert selections per expert: {shape}, within the bound of {self.bound}"
        return (
            f"expert selections per layer (largest share, imbalance): {shape} would pass the bound "
            f"of {self.bound}; --metrics-experts per-expert exposes them all"
        )

    def to_meta(self) -> dict[str, Any]:
        return {
            "requested": self.requested,
            "experts": self.experts,
            "per_expert_series": self.per_expert_series,
            "bound": self.bound,
        }


def expert_series_plan(
    n_moe_layers: int,
    n_expert: int,
    *,
    requested: str = AUTO,
    label_sets: int = 1,
    bound: int = EXPERT_SERIES_BOUND,
) -> ExpertSeriesPlan:
    """Per expert or per layer for a model of this shape: AUTO gives PER_EXPERT while
    n_moe_layers x n_expert x label_sets <= bound, AGGREGATE beyond; PER_EXPERT and AGGREGATE
    stand as asked. The endpoint decides with it when it opens; `doctor` can ask it ahead."""
    if requested not in EXPERT_MODES:
        raise ValueError(f"experts must be one of {EXPERT_MODES}, got {requested!r}")
    plan = ExpertSeriesPlan(requested, requested, n_moe_layers, n_expert, label_sets, bound)
    if requested == AUTO:
        plan = replace(plan, experts=PER_EXPERT if plan.per_expert_series <= bound else AGGREGATE)
    return plan


def model_shape(meta: Mapping[str, Any]) -> tuple[int, int, int]:
    """(MoE layers, experts, FFN layers) of a recording's meta, as the endpoint counts them."""
    layers = meta.get("layers") or {}
    hp = (meta.get("model") or {}).get("hyperparameters") or {}
    return len(layers.get("moe") or ()), int(hp.get("expert_count") or 0), len(layers.get("ffn") or ())


def series_count(n_moe_layers: int, n_expert: int, n_ffn_layers: int, experts: str) -> int:
    """Series the endpoint exposes for a model: per MoE layer a rows counter and two imbalance
    gauges (plus one counter per expert when `experts` is PER_EXPERT, or AUTO resolves to it),
    per FFN layer two sparsity histograms, and FIXED_SERIES."""
    experts = expert_series_plan(n_moe_layers, n_expert, requested=experts).experts
    per_moe_layer = 3 + (n_expert if experts == PER_EXPERT else 0)
    per_ffn_layer = 2 * (len(SPARSITY_BUCKETS) + 3)
    return n_moe_layers * per_moe_layer + n_ffn_layers * per_ffn_layer + FIXED_SERIES


class PrometheusSink:
    """Binds its port when made (so that a port in use is refused before attaching); serves
    until close()."""

    name = "prometheus"
    tables = frozenset({"tokens", "steps", "routes", "requests"})  # what take() reads (MetricsTally.add)
    columns = TALLY_COLUMNS  # of rows that may come set apart (sinks.py)

    def __init__(
        self,
        host: str,
        port: int,
        *,
        experts: str = AUTO,
        expert_series_bound: int = EXPERT_SERIES_BOUND,
        redact: frozenset[str] = frozenset(),
        redact_layers: frozenset[int] | None = None,
    ) -> None:
        if experts not in EXPERT_MODES:
            raise ValueError(f"experts must be one of {EXPERT_MODES}, got {experts!r}")
        self.requested = experts
        self.experts = experts  # AUTO until open() decides from the model's shape
        self.expert_series_bound = expert_series_bound
        self.plan: ExpertSeriesPlan | None = None
        self._routing_redacted = "routing" in redact
        self._redact_layers = redact_layers
        self._tally: MetricsTally | None = None
        self.scrapes = 0  # answered, counted under _scrape_lock (the server answers in threads)
        self._scrape_lock = threading.Lock()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(self))
        try:
            self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as e:  # in use, an address not on this host, a name that does not resolve
            raise MetricsEndpointError(
                f"cannot serve metrics on {host}:{port}: {e.strerror or e} "
                "(choose another --metrics-port or --metrics-bind)"
            ) from None
        self.host = host
        self.port = int(self._server.server_port)

    # ---------------------------------------------------------------- FrameSink
    def open(self, meta: Mapping[str, Any]) -> None:
        redacted: frozenset[int] | None = None
        if self._routing_redacted:  # its rows carry no experts: count none rather than zeros
            moe = (meta.get("layers") or {}).get("moe") or ()
            redacted = frozenset(int(x) for x in moe) if self._redact_layers is None else self._redact_layers
        n_moe, n_expert, n_ffn = model_shape(meta)
        plan = expert_series_plan(n_moe, n_expert, requested=self.requested, bound=self.expert_series_bound)
        series = series_count(n_moe, n_expert, n_ffn, plan.experts)
        if n_expert > MAX_EXPERTS or series > MAX_SERIES:
            self.stop()  # switched off by the fan-out: serve nothing rather than an empty endpoint
            fits = plan.experts == PER_EXPERT and n_expert <= MAX_EXPERTS
            hint = ": try --metrics-experts aggregate" if fits else ""
            raise ValueError(
                f"the model's {n_moe} MoE layers x {n_expert} experts and {n_ffn} FFN layers would be "
                f"{series} series (at most {MAX_SERIES}, and {MAX_EXPERTS} experts){hint}"
            )
        self.plan, self.experts = plan, plan.experts
        self._tally = MetricsTally.from_meta(meta, routing_redacted=redacted)

    def take(self, table: str, df: pl.DataFrame) -> None:
        if self._tally is not None:
            self._tally.add(table, df)

    def drained(self, progress: Progress) -> None:
        if self._tally is not None:
            self._tally.drained(progress)

    def close(self, meta: Mapping[str, Any]) -> dict[str, Any]:
        self.stop()
        t = self._tally
        return {
            "address": f"{self.host}:{self.port}",
            "experts": self.experts,
            "expert_series": self.plan.to_meta() if self.plan else None,
            "series": series_count(len(t.moe_layers), t.n_expert, len(t.ffn_layers), self.experts)
            if t
            else 0,
            "expert_layers": list(t.moe_layers) if t else [],
            "scrapes": self.scrapes,
        }

    def stop(self) -> None:
        """Stop serving (idempotent): the port is free when this returns."""
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join(timeout=5)
        self._server.server_close()

    def count_scrape(self) -> None:
        with self._scrape_lock:
            self.scrapes += 1

    def snapshot(self) -> Snapshot | None:
        return None if self._tally is None else self._tally.snapshot()


class _Collector(Collector):
    def __init__(self, sink: PrometheusSink) -> None:
        self._sink = sink

    def collect(self) -> Iterator[Any]:
        snap, plan = self._sink.snapshot(), self._sink.plan
        self._sink.count_scrape()
        if snap is None or plan is None:  # not attached yet: nothing is known
            return
        yield from families(snap, plan)


def _name(base: str) -> str:
    return f"{PREFIX}_{base}"


def families(snap: Snapshot, plan: ExpertSeriesPlan) -> list[Any]:
    """The metric families of one snapshot (exposition order)."""
    return [
        *_expert_families(snap, plan),
        *_sparsity_families(snap),
        *_latency_histograms(snap),
        _counter("tokens", "Tokens sampled (rate() gives tokens per second)", snap.tokens),
        _counter("requests", "Requests seen to their end (or to detach)", snap.requests),
        *_recorder_families(snap.progress),
    ]


def _expert_families(snap: Snapshot, plan: ExpertSeriesPlan) -> list[Any]:
    """How expert series are exposed, the selections per expert (within the plan's bound), and
    per MoE layer its rows, its largest share and its imbalance."""
    layers = [str(x) for x in snap.moe_layers]
    out: list[Any] = [
        InfoMetricFamily(
            _name("metrics_experts"),
            "How expert selections are exposed, decided at attach from the model's shape: experts "
            "per-expert (a counter per layer and expert) or aggregate (per layer only), as requested "
            "(auto: per expert while layers x experts x label sets is within the bound)",
            value={
                "experts": plan.experts,
                "requested": plan.requested,
                "per_expert_series": str(plan.per_expert_series),
                "bound": str(plan.bound),
            },
        )
    ]
    if plan.experts == PER_EXPERT:
        sel = CounterMetricFamily(
            _name("expert_selections"),
            "Times the router selected the expert, per MoE layer, over every row the engine computed "
            "(prompt rows included)",
            labels=["layer", "expert"],
        )
        expert_names = [str(e) for e in range(snap.n_expert)]
        for i, layer in enumerate(layers):
            for e, name in enumerate(expert_names):
                sel.add_metric([layer, name], float(snap.selections[i, e]))
        out.append(sel)
    rows = CounterMetricFamily(
        _name("moe_rows"),
        "Rows routed on the MoE layer (selections / rows = experts per row)",
        labels=["layer"],
    )
    top = GaugeMetricFamily(
        _name("expert_load_max_share"),
        "Largest share of the layer's selections one expert took since attach (NaN before any)",
        labels=["layer"],
    )
    imbalance = GaugeMetricFamily(
        _name("expert_load_imbalance"),
        "Most selected expert's count over the mean count of the model's experts since attach "
        "(1 = balanced; NaN before any)",
        labels=["layer"],
    )
    for i, layer in enumerate(layers):
        counts = snap.selections[i]
        total = int(counts.sum())
        rows.add_metric([layer], float(snap.moe_rows[i]))
        top.add_metric([layer], float(counts.max()) / total if total else math.nan)
        imbalance.add_metric([layer], float(counts.max()) / (total / counts.size) if total else math.nan)
    return [*out, rows, top, imbalance]


def _sparsity_families(snap: Snapshot) -> list[Any]:
    """The activation sparsity histograms per FFN layer, the tokens' NLL and the steps' durations."""
    ffn = [str(x) for x in snap.ffn_layers]
    out = [
        _histogram(
            _name(base),
            f"Share of {what} in a row's FFN activation, per FFN layer (per expert run for MoE layers)",
            ["layer"],
            [[x] for x in ffn],
            hist,
        )
        for base, hist, what in (
            ("activation_zero_ratio", snap.zero_ratio, "exact zeros"),
            (
                "activation_below_ratio",
                snap.below_ratio,
                "values with |x| below the recording's act_threshold",
            ),
        )
    ]
    out.append(
        _histogram(
            _name("token_nll"),
            "Negative log-prob (nats) of each sampled token under the raw logits; "
            "exp(rate(_sum) / rate(_count)) is the perplexity",
            [],
            [],
            snap.nll,
        )
    )
    out.append(
        _histogram(
            _name("step_seconds"),
            "Duration of a forward pass (micro-batch)",
            ["phase"],
            [[p] for p in PHASES],
            snap.step_seconds,
        )
    )
    return out


def _recorder_families(p: Mapping[str, Any] | None) -> list[Any]:
    """The recorder's own: its losses, CPU, memory and lag (none before its first drain), and under
    --duty-cycle the share of the time in full detail."""
    if not p:
        return []
    coverage = (
        [
            GaugeMetricFamily(
                _name("sparse_coverage_ratio"),
                "Share of the time since attach with the per-layer probes in (--duty-cycle): "
                "the sparse series count the steps of that share only",
                value=p["sparse_coverage"],
            )
        ]
        if "sparse_coverage" in p
        else []
    )
    losses = CounterMetricFamily(
        _name("losses"), "What the recording missed so far, by kind", labels=["kind"]
    )
    for kind in LOSS_KINDS:
        losses.add_metric([kind], p[kind])
    return [
        losses,
        _counter("profiler_cpu_seconds", "CPU time of the recorder since attach", p["cpu_s"]),
        GaugeMetricFamily(
            _name("profiler_resident_memory_bytes"), "Resident memory of the recorder", value=p["rss_bytes"]
        ),
        GaugeMetricFamily(
            _name("profiler_lag_seconds"),
            "How far behind the engine the recorder's last drain was",
            value=p["lag_ms"] / 1e3,
        ),
        *coverage,
    ]


#: the request latencies' help texts (session/request_latency.py defines each)
_LATENCY_DOCS = {
    "time_to_first_token": "Time to first token of each request (gen_ai.server.time_to_first_token): "
    "first token - arrival (received, else started); partial requests excluded",
    "time_per_output_token": "Time per output token after the first (gen_ai.server.time_per_output_token): "
    "(last token - first token) / (output tokens - 1), requests of 2 tokens or more",
    "request_duration": "Request duration to its last output token (gen_ai.server.request.duration): "
    "last token - arrival, requests whose end the recorder saw",
    "request_queue_time": "Time from the server reading a request to launching it on a slot, where "
    "the server reports both",
}


def _latency_histograms(snap: Snapshot) -> list[HistogramMetricFamily]:
    """The request latency histograms, labelled with the model and the engine."""
    labels = ["model", "engine"], [[snap.model, snap.engine]]
    return [
        _histogram(_name(f"{name}_seconds"), _LATENCY_DOCS[name], *labels, hist)
        for name, hist in snap.latencies.items()
    ]


def _counter(base: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(_name(base), doc, value=float(value))


def _histogram(
    name: str, doc: str, label_names: list[str], label_sets: list[list[str]], hist: Histograms
) -> HistogramMetricFamily:
    """One histogram family: label_sets[i] (values of label_names) is row i of `hist`."""
    fam = HistogramMetricFamily(name, doc, labels=label_names or None)
    bounds = [floatToGoString(b) for b in hist.bounds] + ["+Inf"]
    cumulative = np.cumsum(hist.counts, axis=1)
    for i, labels in enumerate(label_sets or [[]]):
        fam.add_metric(
            labels, list(zip(bounds, (float(c) for c in cumulative[i]), strict=True)), float(hist.sums[i])
        )
    return fam
