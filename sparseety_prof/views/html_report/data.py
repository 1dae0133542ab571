"""What the HTML report shows, gathered from a recording with polars: each panel's numbers, or the
sentence that says why the recording has none (a dense model, `--mode tokens`, a redaction)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import polars as pl

from sparseety_prof.errors import UsageError
from sparseety_prof.store.recording import Recording, section
from sparseety_prof.terminal_text import visible
from sparseety_prof.views.html_report.cpu_data import CpuFlames, cpu_flames

#: the chosen request's first TOKEN_CAP tokens make its charts and its per-token table, so that the
#: page stays bounded (a few MB) however long the request or the recording is
TOKEN_CAP = 512
#: anomalies listed, highest score first
ANOMALY_CAP = 200
#: the step-latency chart draws at most this many points: above it, steps are binned and each bin
#: shows its slowest step (a spike never disappears into an average)
STEP_POINTS = 2000
#: expert ids at or above this (or the model's expert count, when meta.json has it) are not drawn:
#: a damaged or hostile recording must not make the heat map a gigabyte wide
MAX_EXPERTS = 1024


@dataclass(frozen=True)
class ExpertLoad:
    """Selections per (MoE layer, expert), and where they were counted."""

    layers: list[int]
    counts: np.ndarray  # layers x experts
    source: str

    def imbalance(self) -> np.ndarray:
        """Per layer: the busiest expert's selections / the mean per expert (1.0 = balanced)."""
        mean = self.counts.mean(axis=1)
        return np.divide(self.counts.max(axis=1), mean, out=np.zeros(len(self.layers)), where=mean > 0)


@dataclass(frozen=True)
class LayerSparsity:
    """Mean activation sparsity per FFN layer."""

    layers: list[int]
    zero: list[float | None]  # act_zero_ratio
    below: list[float | None]  # act_below_ratio
    source: str


@dataclass(frozen=True)
class StepLatency:
    x: list[int]  # step id (the bin's slowest step when binned)
    ms: list[float]
    phase: list[str]
    binned: int  # steps per point (1: every step)
    total: int


@dataclass
class ReportData:
    title: str  # the recording's folder name
    facts: list[tuple[str, str]]  # header rows (label, value)
    request_ids: list[str]  # every request with tokens, longest first
    request: str | None  # the chosen one
    request_tokens: int  # its tokens (the page shows up to TOKEN_CAP)
    tokens: pl.DataFrame  # its first TOKEN_CAP tokens, decode order
    moe_layers: list[int]  # which model layer each element of expert_ids is
    ffn_layers: list[int]  # ... of act_zero_ratio / act_below_ratio
    load: ExpertLoad | None
    sparsity: LayerSparsity | None
    steps: StepLatency | None
    anomalies: pl.DataFrame
    anomaly_total: int
    notes: dict[str, str] = field(default_factory=dict)  # panel -> why it shows nothing
    cpu: CpuFlames | None = None  # the CPU sampler's flame graphs (cpu_data.py)


def _layers(rec: Recording, kind: str) -> list[int] | None:
    got = section(rec, "layers").get(kind)
    if isinstance(got, list) and all(type(x) is int for x in got):
        return list(got)
    return None


def _n_experts(rec: Recording) -> int:
    hp = section(rec, "model").get("hyperparameters")
    n = hp.get("expert_count") if isinstance(hp, dict) else None
    return n if type(n) is int and 0 < n <= MAX_EXPERTS else 0


def _redacted(rec: Recording, level: str) -> bool:
    return level in rec.redaction_levels


def _counts(long: pl.DataFrame, layers: list[int], n_experts: int, source: str) -> ExpertLoad:
    """(layer, expert) rows -> selections per layer and expert; ids outside the model's experts
    (0 .. MAX_EXPERTS-1 when meta.json does not say how many) are left out, and counted in `source`."""
    limit = n_experts or MAX_EXPERTS
    inside = long.filter(pl.col("expert").is_between(0, limit - 1) & pl.col("layer").is_in(layers))
    top = inside["expert"].max() if inside.height else None
    width = n_experts or (top + 1 if isinstance(top, int) else 0)
    out = np.zeros((len(layers), width), dtype=np.int64)
    index = {layer: i for i, layer in enumerate(layers)}
    for layer, expert, n in inside.group_by("layer", "expert").len().iter_rows():
        out[index[layer], expert] += n
    left_out = long.height - inside.height
    if left_out:
        source += (
            f" ({left_out} selections of an expert id outside 0-{limit - 1} or of no MoE layer left out)"
        )
    return ExpertLoad(layers, out, source)


def expert_load(rec: Recording, moe_layers: list[int]) -> tuple[ExpertLoad | None, str]:
    """Expert load from the routes (every row computed, prompts too), else from the tokens, else
    the aggregate that `--redact routing` keeps in meta.json; or why there is none."""
    n_experts = _n_experts(rec)
    routes = rec.routes().select("layer", pl.col("expert_ids").alias("expert")).drop_nulls()
    if routes.height:
        long = routes.explode("expert").drop_nulls()
        layers = sorted(set(long["layer"].unique().to_list()) | set(moe_layers))
        return _counts(long, layers, n_experts, "routes: every row computed"), ""
    tokens = rec.tokens().select(pl.col("expert_ids")).drop_nulls()
    if tokens.height and moe_layers:
        long = (
            tokens.with_columns(pl.int_ranges(0, pl.col("expert_ids").list.len()).alias("i"))
            .explode("expert_ids", "i")
            .filter(pl.col("i") < len(moe_layers))
            .select(
                pl.col("i").replace_strict(list(range(len(moe_layers))), moe_layers).alias("layer"),
                pl.col("expert_ids").alias("expert"),
            )
            .explode("expert")
            .drop_nulls()
        )
        return _counts(long, moe_layers, n_experts, "sampled tokens"), ""
    kept = section(rec, "redaction").get("expert_load")
    if isinstance(kept, dict) and kept:
        layers, rows = [], []
        for key, entry in kept.items():
            sel = entry.get("selections") if isinstance(entry, dict) else None
            if key.isdigit() and isinstance(sel, list) and all(type(x) is int for x in sel):
                layers.append(int(key))
                rows.append(sel)
        if layers:
            width = n_experts or min(MAX_EXPERTS, max(len(r) for r in rows))
            counts = np.array([r[:width] + [0] * (width - len(r)) for r in rows], dtype=np.int64)
            order = np.argsort(layers)
            return (
                ExpertLoad([layers[i] for i in order], counts[order], "meta.json (kept by --redact routing)"),
                "",
            )
    if _redacted(rec, "routing"):
        return None, "redacted: routing was recorded with --redact routing and no aggregate was kept"
    if not moe_layers:
        return None, "not captured: the model has no MoE layers (a dense model)"
    return None, "not captured: the recording holds no routing (recorded with --mode tokens?)"


def layer_sparsity(rec: Recording, ffn_layers: list[int]) -> tuple[LayerSparsity | None, str]:
    routes = rec.routes().select("layer", "act_zero_ratio", "act_below_ratio")
    routes = routes.filter(pl.col("act_zero_ratio").is_not_null() | pl.col("act_below_ratio").is_not_null())
    source = "routes: every row computed"
    if not routes.height and ffn_layers:
        t = (
            rec.tokens()
            .select("act_zero_ratio", "act_below_ratio")
            .filter(pl.col("act_zero_ratio").is_not_null())
        )
        if t.height:
            routes = (
                t.with_columns(pl.int_ranges(0, pl.col("act_zero_ratio").list.len()).alias("i"))
                .explode("act_zero_ratio", "act_below_ratio", "i")
                .filter(pl.col("i") < len(ffn_layers))
                .select(
                    pl.col("i").replace_strict(list(range(len(ffn_layers))), ffn_layers).alias("layer"),
                    "act_zero_ratio",
                    "act_below_ratio",
                )
            )
            source = "sampled tokens"
    if not routes.height:
        if _redacted(rec, "sparsity"):
            return None, "redacted"
        return None, "not captured: the recording holds no activation sparsity (recorded with --mode tokens?)"
    means = (
        routes.group_by("layer")
        .agg(pl.col("act_zero_ratio").mean(), pl.col("act_below_ratio").mean())
        .sort("layer")
    )
    if _redacted(rec, "sparsity"):
        source += "; coarsened by --redact sparsity"
    return (
        LayerSparsity(
            means["layer"].to_list(),
            means["act_zero_ratio"].to_list(),
            means["act_below_ratio"].to_list(),
            source,
        ),
        "",
    )


def step_latency(rec: Recording) -> tuple[StepLatency | None, str]:
    steps = rec.steps().filter(pl.col("t_end_ns").is_not_null() & pl.col("t_start_ns").is_not_null())
    if not steps.height:
        return None, "not captured: the recording holds no steps"
    steps = steps.select(
        "step_id",
        ((pl.col("t_end_ns") - pl.col("t_start_ns")) / 1e6).alias("ms"),
        pl.col("phase").fill_null("?"),
    )
    per = max(1, -(-steps.height // STEP_POINTS))
    if per > 1:  # the slowest step of each bin of `per` steps
        steps = (
            steps.with_row_index("i")
            .with_columns((pl.col("i") // per).alias("bin"))
            .sort("ms", descending=True)
            .unique("bin", keep="first")
            .sort("bin")
        )
    return (
        StepLatency(
            steps["step_id"].to_list(),
            steps["ms"].to_list(),
            steps["phase"].to_list(),
            per,
            rec.steps().height,
        ),
        "",
    )


def requests_by_length(tokens: pl.DataFrame) -> list[str]:
    if not tokens.height:
        return []
    lengths = (
        tokens.filter(pl.col("request_id").is_not_null())
        .group_by("request_id", maintain_order=True)
        .len()
        .sort("len", descending=True, maintain_order=True)
    )
    return lengths["request_id"].to_list()


def choose_request(ids: list[str], wanted: str | None) -> str | None:
    if wanted is None:
        return ids[0] if ids else None
    if wanted not in ids:
        shown = ", ".join(f"'{visible(i)}'" for i in ids[:5]) + (" ..." if len(ids) > 5 else "")
        raise UsageError(
            f"no request '{visible(wanted)}' in the recording"
            + (f"; its requests (longest first): {shown}" if ids else " (it holds no tokens)")
        )
    return wanted


def request_tokens(tokens: pl.DataFrame, request: str | None) -> tuple[pl.DataFrame, int]:
    """The request's tokens in decode order (tokens of a request joined mid-way, without a decode
    order, by time), the first TOKEN_CAP of them, and how many it has."""
    if request is None:
        return tokens.clear(), 0
    mine = tokens.filter(pl.col("request_id") == request).sort(
        "decode_order", "t_end_ns", nulls_last=True, maintain_order=True
    )
    return mine.head(TOKEN_CAP), mine.height


def _facts(rec: Recording, tokens: pl.DataFrame) -> list[tuple[str, str]]:
    engine = section(rec, "engine")
    model = section(rec, "model")
    out = [
        ("engine", f"{engine.get('name', '?')} {engine.get('version', '?')}"),
        ("model", f"{model.get('name') or model.get('path') or '?'} ({model.get('architecture', '?')})"),
        ("tokens / steps", f"{tokens.height} / {rec.steps().height}"),
        ("complete", "yes" if rec.complete else "no (interrupted: the last segment may be lost)"),
    ]
    levels = rec.redaction_levels
    if levels or rec.redacted:
        out.append(("redacted", ", ".join(levels + (["text"] if rec.redacted else [])) or "yes"))
    return out


def gather(rec: Recording, *, request: str | None = None) -> ReportData:
    """Everything the page shows; UsageError when `request` is not one of the recording's."""
    tokens = rec.tokens()
    ids = requests_by_length(tokens)
    chosen = choose_request(ids, request)
    mine, n_mine = request_tokens(tokens, chosen)
    moe = _layers(rec, "moe")
    ffn = _layers(rec, "ffn")
    notes: dict[str, str] = {}
    load, notes["load"] = expert_load(rec, moe or [])
    sparsity, notes["sparsity"] = layer_sparsity(rec, ffn or [])
    steps, notes["steps"] = step_latency(rec)
    found = rec.anomalies()
    cpu, notes["cpu"] = cpu_flames(rec, chosen)
    data = ReportData(
        title=rec.path.name,
        facts=_facts(rec, tokens),
        request_ids=ids,
        request=chosen,
        request_tokens=n_mine,
        tokens=mine,
        moe_layers=moe if moe is not None else _list_width(mine, "expert_ids"),
        ffn_layers=ffn if ffn is not None else _list_width(mine, "act_zero_ratio"),
        load=load,
        sparsity=sparsity,
        steps=steps,
        anomalies=found.sort("score", descending=True, nulls_last=True).head(ANOMALY_CAP),
        anomaly_total=found.height,
        cpu=cpu,
    )
    data.notes = {k: v for k, v in notes.items() if v}
    if chosen is None:
        data.notes["request"] = "not captured: the recording holds no tokens"
    return data


def _list_width(df: pl.DataFrame, column: str) -> list[int]:
    """Without meta.json's layer map, list elements are numbered by position."""
    n: Any = df[column].list.len().max() if df.height else None
    return list(range(int(n))) if isinstance(n, int) else []
