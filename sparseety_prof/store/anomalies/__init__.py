"""Anomaly detectors: pure functions over a recording's tables, each returning rows of
schema.ANOMALIES (kind, score, where, and a reason a person can read). Thresholds are module
constants with the statistic they bound; docs/usage.md's "Anomalies" section lists them.

Every baseline is robust (median and median absolute deviation), so the anomaly itself does not
move the line it is measured against. Detectors see only what the recording holds: a redacted
column (token ids, routing) makes the detectors that need it find nothing."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import polars as pl

from sparseety_prof.store.anomalies import common
from sparseety_prof.store.anomalies.layers import attention_collapse, sparsity_spikes
from sparseety_prof.store.anomalies.routing import load_imbalance, routing_collapse, routing_jumps
from sparseety_prof.store.anomalies.steps import slow_steps
from sparseety_prof.store.anomalies.text import logprob_collapse, repetition_loops

__all__ = [
    "attention_collapse",
    "detect",
    "load_imbalance",
    "logprob_collapse",
    "repetition_loops",
    "routing_collapse",
    "routing_jumps",
    "slow_steps",
    "sparsity_spikes",
]


def detect(
    tokens: pl.DataFrame,
    steps: pl.DataFrame,
    meta: Mapping[str, Any] | None = None,
    waits: pl.DataFrame | None = None,
    layer_times: pl.DataFrame | None = None,
) -> pl.DataFrame:
    """Every detector with its default thresholds, in schema.ANOMALY_KINDS order, each kind's rows
    by request and decode order; `waits` (the thread_waits table) and `layer_times` name slow
    steps' causes."""
    found = [
        repetition_loops(tokens),
        logprob_collapse(tokens),
        routing_collapse(tokens, meta),
        routing_jumps(tokens, meta),
        sparsity_spikes(tokens, meta),
        attention_collapse(tokens, meta),
        slow_steps(steps, tokens, waits=waits, layer_times=layer_times),
        load_imbalance(tokens, meta),
    ]
    return pl.concat([common.empty(), *found], how="vertical")
