"""`--metrics-port` with `--follow`: one endpoint for the follower's whole life.

The endpoint (session/metrics_sink.py) is bound once, before the first attach, and serves until
the follower ends; each run feeds it through the Recorder's sinks like any --metrics-port. Its
counters are cumulative over the runs and never go back: a run of the same model and engine
(a restart) goes on adding to the same totals; the session counters each run starts from zero
(CPU, losses) are added to what the runs before it counted. A run of another model starts new
per-layer series (their label sets are that model's) while the model-independent counters
(tokens, requests, log-prob and step histograms) go on from their totals. Between runs the
endpoint answers with the totals so far. `<prefix>_engine_restarts_total` counts the attaches
after the first, `<prefix>_follow_runs_total` every attach, `<prefix>_follow_attached` is 1
while a run records."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from dataclasses import replace
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from sparseety_prof.session.metrics_sink import PREFIX, PrometheusSink
from sparseety_prof.session.metrics_tally import LOSS_KINDS, MetricsTally, Snapshot
from sparseety_prof.session.options import Progress

__all__ = ["FollowPrometheusSink"]

#: the Progress counters a run starts from zero, summed over the runs
_RUN_COUNTERS = ("cpu_s", *LOSS_KINDS)


class FollowPrometheusSink(PrometheusSink):
    """A PrometheusSink opened and closed once per run, serving until `shutdown()`."""

    def __init__(self, host: str, port: int, **kwargs: Any) -> None:
        super().__init__(host, port, **kwargs)
        self.runs = 0
        self.attached = False
        self._lock = threading.Lock()
        self._done: dict[str, float] = dict.fromkeys(_RUN_COUNTERS, 0.0)  # of the closed runs
        self._last: Progress | None = None
        self._carry: Snapshot | None = None  # the totals of the models before this one
        self.registry.register(_FollowCollector(self))

    def open(self, meta: Mapping[str, Any]) -> None:
        before = self._tally
        super().open(meta)
        now = self._tally
        if before is not None and now is not None:
            if _same_labels(before, now):
                self._tally = before  # the same engine restarted: go on adding to its totals
            else:
                self._carry = _sum_fixed(self._carry, before.snapshot())
        with self._lock:
            self.runs += 1
            self.attached = True
            self._last = None

    def drained(self, progress: Progress) -> None:
        with self._lock:
            self._last = progress
            summed = replace(
                progress,
                **{
                    k: type(getattr(progress, k))(self._done[k] + getattr(progress, k)) for k in _RUN_COUNTERS
                },
            )
        super().drained(summed)

    def close(self, meta: Mapping[str, Any]) -> dict[str, Any]:
        with self._lock:
            if self._last is not None:
                for k in _RUN_COUNTERS:
                    self._done[k] += getattr(self._last, k)
            self._last = None
            self.attached = False
        account = {
            "address": f"{self.host}:{self.port}",
            "experts": self.experts,
            "expert_series": self.plan.to_meta() if self.plan else None,
            "scrapes": self.scrapes,
            "follow_runs": self.runs,
        }
        return account

    def shutdown(self) -> None:
        """Stop serving: the follower ends."""
        super().stop()

    def snapshot(self) -> Snapshot | None:
        snap = super().snapshot()
        if snap is None or self._carry is None:
            return snap
        return _sum_fixed(self._carry, snap, into=snap)


def _same_labels(a: MetricsTally, b: MetricsTally) -> bool:
    return (a.moe_layers, a.n_expert, a.ffn_layers, a.model, a.engine) == (
        b.moe_layers,
        b.n_expert,
        b.ffn_layers,
        b.model,
        b.engine,
    )


def _sum_fixed(carry: Snapshot | None, snap: Snapshot, *, into: Snapshot | None = None) -> Snapshot:
    """`snap` (or `into`) with the model-independent totals of `carry` added (tokens, requests,
    log-prob and step histograms)."""
    base = into if into is not None else snap
    if carry is None:
        return base
    nll, steps = base.nll.copy(), base.step_seconds.copy()
    nll.counts += carry.nll.counts
    nll.sums += carry.nll.sums
    steps.counts += carry.step_seconds.counts
    steps.sums += carry.step_seconds.sums
    return replace(
        base,
        tokens=base.tokens + carry.tokens,
        requests=base.requests + carry.requests,
        nll=nll,
        step_seconds=steps,
    )


class _FollowCollector(Collector):
    def __init__(self, sink: FollowPrometheusSink) -> None:
        self._sink = sink

    def collect(self) -> Iterator[Any]:
        runs, attached = self._sink.runs, self._sink.attached
        yield CounterMetricFamily(
            f"{PREFIX}_engine_restarts",
            "Engine processes the follower attached to after the first (restarts of the engine)",
            value=max(0, runs - 1),
        )
        yield CounterMetricFamily(
            f"{PREFIX}_follow_runs", "Engine processes the follower attached to", value=runs
        )
        yield GaugeMetricFamily(
            f"{PREFIX}_follow_attached",
            "1 while the follower records an engine, 0 while it waits",
            value=int(attached),
        )
