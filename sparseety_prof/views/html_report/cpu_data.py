"""The report's CPU panel data: the CPU sampler's folded stacks (cpu_stacks) of the whole
recording, of each phase, and of the request the page shows; what named the frames."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import polars as pl

from sparseety_prof.store.recording import Recording
from sparseety_prof.views.cpu_stacks import folded, request_steps, self_shares

TOP_FUNCTIONS = 10


@dataclass
class CpuFlames:
    rate_hz: int
    samples: int  # every sample the kernel counted (meta.json cpu_sampler.samples)
    everything: list[tuple[str, int]]  # (folded stack, samples) of the whole recording
    by_phase: dict[str, list[tuple[str, int]]]  # "prefill", "decode", "between steps"
    request: list[tuple[str, int]]  # the page's request's steps
    top: list[tuple[str, float]]  # the functions the CPU was in, and their shares
    files: list[dict[str, str]] = field(default_factory=list)  # which files named the frames, how


def _pairs(df: pl.DataFrame) -> list[tuple[str, int]]:
    return [(str(s), int(n)) for s, n in folded(df).select("stack", "samples").iter_rows()]


def cpu_flames(rec: Recording, request: str | None) -> tuple[CpuFlames | None, str]:
    """The panel's data, or None and why the recording has none."""
    sampler: dict[str, Any] | None = rec.meta.get("cpu_sampler")
    if not sampler:
        return None, "not captured: the recording was made without the CPU sampler (--cpu-sample-hz 0)"
    stacks = rec.cpu_stacks()
    if stacks.height == 0:
        return None, "not captured: no sample (the engine's threads did not run while recorded)"
    by_phase = {
        phase: _pairs(stacks.filter(pl.col("phase") == phase))
        for phase in sorted(set(stacks["phase"].drop_nulls()))
    }
    outside = stacks.filter(pl.col("phase").is_null())
    if outside.height:
        by_phase["between steps"] = _pairs(outside)
    mine: list[tuple[str, int]] = []
    if request is not None:
        steps = request_steps(rec.steps(), rec.requests()).filter(pl.col("request_id") == request)
        mine = _pairs(stacks.join(steps, on="step_id"))
    return (
        CpuFlames(
            rate_hz=int(sampler.get("rate_hz") or 0),
            samples=int(sampler.get("samples") or 0),
            everything=_pairs(stacks),
            by_phase=by_phase,
            request=mine,
            top=self_shares(stacks, TOP_FUNCTIONS),
            files=list(sampler.get("files") or []),
        ),
        "",
    )
