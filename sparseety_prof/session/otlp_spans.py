"""What a request (and, when asked, a step) becomes as an OpenTelemetry span: pure functions from
the recording's rows to span descriptions, shared by the live sink (session/otlp_sink.py) and
`export --otlp` (views/export/otlp.py), so both send the same spans. No SDK here.

A request's span follows the GenAI semantic conventions' inference span (name
"{gen_ai.operation.name} {gen_ai.request.model}", the gen_ai.* attributes below); what the
conventions have no name for lives under sparseety.* (TTFT, inter-token latency, routing and
activation sparsity over the request's tokens). The conventions define no gen_ai.request.id:
the id a client sent (or the one the recorder generated) is sparseety.request_id, and also
gen_ai.response.id, the id of the completion in the recording's tables.

Span times are Unix ns: the recording's CLOCK_MONOTONIC times plus the wall clock offset."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import polars as pl

OPERATION = "text_completion"  # the profiler sees tokens generated for a prompt, not the API route
REQUEST_KIND = "client"  # the conventions' recommended kind for an inference span
STEP_SPAN = "sparseety.step"
TOKEN_EVENT = "sparseety.token"
MAX_TEXT = 256  # model names and ids from a recording (hostile input) are cut to this many characters
MAX_OPEN_REQUESTS = 4096  # per-request summaries held at once; the oldest is dropped (and counted) beyond
MAX_EVENTS_PER_SPAN = 128  # the SDK's default span event limit: token events beyond it are counted, not kept

# end_reason (requests table) -> gen_ai.response.finish_reasons; reasons without a convention stay out
FINISH_REASONS = {"eos": "stop"}

Attrs = dict[str, str | bool | int | float | list[int] | list[str]]


#: the token columns TokenSummaries.add reads, token events aside (what a sink reads of rows that
#: may come set apart: sinks.py)
SUMMARY_COLUMNS = frozenset({"request_id", "ctx_id", "seq_id", "log_prob", "act_zero_ratio", "expert_ids"})
#: what a sampled token event takes of its row, as is (token_event_attributes names them)
_EVENT_FIELDS = (
    "t_end_ns",
    "token_id",
    "token_text",
    "log_prob",
    "entropy",
    "phase",
    "decode_order",
    "pos",
    "step_id",
    "batch_size",
)
TOKEN_EVENT_COLUMNS = frozenset({*_EVENT_FIELDS, "act_zero_ratio"})
#: what a step span takes of its steps row, as is
_STEP_FIELDS = (
    "step_id",
    "ctx_id",
    "decode_id",
    "n_tokens",
    "n_outputs",
    "phase",
    "prompt_rows",
    "decode_rows",
    "tid",
)
STEP_SPAN_COLUMNS = frozenset({*_STEP_FIELDS, "t_start_ns", "t_end_ns", "seq_ids"})


@dataclass
class SpanSpec:
    """One span to send: everything the SDK needs, times as Unix ns."""

    name: str
    kind: str  # "client" or "internal"
    start_ns: int
    end_ns: int
    attributes: Attrs
    events: list[tuple[str, int, Attrs]] = field(default_factory=list)


@dataclass
class RequestSummary:
    """What the span of one request keeps of its token rows: sums, not rows."""

    tokens: int = 0
    log_prob_sum: float = 0.0
    log_prob_n: int = 0
    log_prob_min: float = float("inf")
    act_zero_sum: float = 0.0  # of each token's mean over its FFN layers
    act_zero_n: int = 0
    experts: list[int] = field(default_factory=list)  # per MoE layer: a bitset of the experts used
    events: list[tuple[str, int, Attrs]] = field(default_factory=list)
    events_dropped: int = 0


class TokenSummaries:
    """Per request (request_id, ctx_id, seq_id), the summary of its token rows so far, until its
    requests row arrives. Bounded: at most MAX_OPEN_REQUESTS at once (the oldest is dropped and
    counted beyond that) and MAX_EVENTS_PER_SPAN token events each. Token events are sampled at
    `event_rate` (0..1) evenly over each request's tokens: every 1/rate-th of them."""

    def __init__(self, event_rate: float = 0.0, max_open: int = MAX_OPEN_REQUESTS) -> None:
        if not 0.0 <= event_rate <= 1.0:
            raise ValueError(f"the token event rate must be within 0..1, got {event_rate}")
        self.event_rate = event_rate
        self.max_open = max_open
        self._open: OrderedDict[tuple[str, int, int], RequestSummary] = OrderedDict()
        self.evicted = 0  # summaries dropped for want of room (their spans go out without them)

    def __len__(self) -> int:
        return len(self._open)

    def add(self, tokens: pl.DataFrame, wall_offset_ns: int) -> None:
        """Fold a frame of token rows into their requests' summaries (vectorised per frame)."""
        if tokens.height == 0:
            return
        keyed = tokens.with_columns(pl.col("request_id").fill_null(""))
        per = keyed.group_by("request_id", "ctx_id", "seq_id", maintain_order=True).agg(
            pl.len().alias("n"),
            pl.col("log_prob").sum().alias("lp_sum"),
            pl.col("log_prob").count().alias("lp_n"),
            pl.col("log_prob").min().alias("lp_min"),
            pl.col("act_zero_ratio").list.mean().sum().alias("az_sum"),
            pl.col("act_zero_ratio").list.mean().count().alias("az_n"),
        )
        self._add_events(keyed, wall_offset_ns)  # first: it reads the token counts before this frame
        for r in per.iter_rows(named=True):
            s = self._summary((r["request_id"], r["ctx_id"], r["seq_id"]))
            s.tokens += r["n"]
            if r["lp_n"]:
                s.log_prob_sum += r["lp_sum"]
                s.log_prob_n += r["lp_n"]
                s.log_prob_min = min(s.log_prob_min, r["lp_min"])
            if r["az_n"]:
                s.act_zero_sum += r["az_sum"]
                s.act_zero_n += r["az_n"]
        self._add_experts(keyed)

    def pop(self, request_id: str | None, ctx_id: int | None, seq_id: int | None) -> RequestSummary | None:
        return self._open.pop((request_id or "", ctx_id, seq_id), None)  # type: ignore[arg-type]

    def drop_all(self) -> int:
        """Forget every summary still open (tokens whose request row never came); how many."""
        n = len(self._open)
        self._open.clear()
        return n

    def _summary(self, key: tuple[str, int, int]) -> RequestSummary:
        s = self._open.get(key)
        if s is None:
            if len(self._open) >= self.max_open:
                self._open.popitem(last=False)
                self.evicted += 1
            s = self._open[key] = RequestSummary()
        return s

    def _add_experts(self, tokens: pl.DataFrame) -> None:
        """Each request's distinct experts per MoE layer, as bitsets (a layer's set, however many
        tokens, is at most the model's expert count)."""
        if tokens["expert_ids"].null_count() == tokens.height:
            return
        used = (
            tokens.select("request_id", "ctx_id", "seq_id", "expert_ids")
            .with_row_index("row")
            .explode("expert_ids")
            .with_columns(pl.int_range(pl.len()).over("row").alias("layer"))
            .explode("expert_ids")
            .drop_nulls("expert_ids")
            .group_by("request_id", "ctx_id", "seq_id", "layer")
            .agg(pl.col("expert_ids").unique())
        )
        for rid, ctx, seq, layer, ids in used.iter_rows():
            s = self._open.get((rid, ctx, seq))
            if s is None:
                continue
            if len(s.experts) <= layer:
                s.experts.extend([0] * (layer + 1 - len(s.experts)))
            bits = s.experts[layer]
            for e in ids:
                if 0 <= e < 1 << 16:  # an expert index from a hostile recording stays a small bitset
                    bits |= 1 << e
            s.experts[layer] = bits

    def _add_events(self, tokens: pl.DataFrame, wall_offset_ns: int) -> None:
        rate = self.event_rate
        if rate <= 0.0:
            return
        keys = ("request_id", "ctx_id", "seq_id")
        # a token's index within its request: the summary's count so far plus its rank in this frame
        # (the same tokens are sampled however the rows are cut into frames: live or export)
        first = tokens.select(keys).unique(maintain_order=True)
        counts = [s.tokens if (s := self._open.get(k)) is not None else 0 for k in first.iter_rows()]
        i = (
            tokens.select(keys)
            .join(
                first.with_columns(pl.Series("base", counts, dtype=pl.Int64)),
                on=keys,
                how="left",
                nulls_equal=True,
                maintain_order="left",
            )
            .select(pl.col("base") + pl.int_range(pl.len()).over(keys))
            .to_series()
            .to_numpy()
            .astype(np.float64)
        )
        # sampled when the running count of rate crosses an integer: exactly rate * n of n tokens
        picked = np.flatnonzero(np.floor((i + 1) * rate) > np.floor(i * rate))
        if not len(picked):
            return
        rows = tokens[picked].select(
            *keys,
            *_EVENT_FIELDS,
            pl.col("act_zero_ratio").list.mean().alias("act_zero_ratio_mean"),
        )
        for r in rows.iter_rows(named=True):
            if r["t_end_ns"] is None:
                continue
            s = self._summary((r["request_id"], r["ctx_id"], r["seq_id"]))
            if len(s.events) >= MAX_EVENTS_PER_SPAN:
                s.events_dropped += 1
                continue
            s.events.append((TOKEN_EVENT, r["t_end_ns"] + wall_offset_ns, token_event_attributes(r)))


def token_event_attributes(r: Mapping[str, Any]) -> Attrs:
    """One sampled token as a span event's attributes (no text when the recording has none:
    --redact-text)."""
    out: Attrs = {}
    for col, name in (
        ("token_id", "sparseety.token.id"),
        ("token_text", "sparseety.token.text"),
        ("log_prob", "sparseety.token.log_prob"),
        ("entropy", "sparseety.token.entropy"),
        ("phase", "sparseety.token.phase"),
        ("decode_order", "sparseety.token.decode_order"),
        ("pos", "sparseety.token.pos"),
        ("step_id", "sparseety.step_id"),
        ("batch_size", "sparseety.step.batch_size"),
        ("act_zero_ratio_mean", "sparseety.token.act_zero_ratio_mean"),
    ):
        v = r.get(col)
        if v is not None:
            out[name] = v[:MAX_TEXT] if isinstance(v, str) else v
    return out


@dataclass(frozen=True)
class SpanContext:
    """What every span of a recording shares: the model and engine, and the wall clock offset."""

    model: str
    provider: str
    wall_offset_ns: int

    @staticmethod
    def from_meta(meta: Mapping[str, Any], wall_offset_ns: int) -> SpanContext:
        model = meta_section(meta, "model")
        name = model.get("name") if isinstance(model.get("name"), str) and model.get("name") else None
        if name is None:
            path = model.get("path")
            name = path.rsplit("/", 1)[-1] if isinstance(path, str) and path else "unknown"
        engine = meta_section(meta, "engine")
        provider = engine.get("name") if isinstance(engine.get("name"), str) else "llama.cpp"
        return SpanContext(name[:MAX_TEXT], (provider or "llama.cpp")[:MAX_TEXT], wall_offset_ns)


def meta_section(meta: Mapping[str, Any], key: str) -> dict[str, Any]:
    """meta[key] when it is an object, else {} (a recording's meta.json is hostile input)."""
    v = meta.get(key)
    return v if isinstance(v, dict) else {}


def request_span(row: Mapping[str, Any], summary: RequestSummary | None, ctx: SpanContext) -> SpanSpec | None:
    """The span of one requests row; None when the row has no time to place it at."""
    t0 = next((row[c] for c in ("t_received_ns", "t_started_ns", "t_first_token_ns") if row.get(c)), None)
    t1 = row.get("t_last_token_ns") or t0
    if t0 is None or t1 is None:
        return None
    rid = str(row.get("request_id") or "")[:MAX_TEXT]
    a: Attrs = {
        "gen_ai.operation.name": OPERATION,
        "gen_ai.provider.name": ctx.provider,
        "gen_ai.request.model": ctx.model,
        "gen_ai.response.model": ctx.model,
        "gen_ai.response.id": rid,
        "sparseety.request_id": rid,
    }
    opt = {
        "gen_ai.usage.input_tokens": row.get("prompt_tokens"),
        "gen_ai.usage.output_tokens": row.get("output_tokens"),
        "sparseety.request_id.source": row.get("id_source"),
        "sparseety.ttft_ms": row.get("ttft_ms"),
        "sparseety.itl_p50_ms": row.get("itl_p50_ms"),
        "sparseety.itl_p99_ms": row.get("itl_p99_ms"),
        "sparseety.end_reason": row.get("end_reason"),
        "sparseety.partial": row.get("partial"),
        "sparseety.ctx_id": row.get("ctx_id"),
        "sparseety.seq_id": row.get("seq_id"),
        "sparseety.slot_id": row.get("slot_id"),
        "sparseety.task_id": row.get("task_id"),
        "sparseety.pid": row.get("pid"),
    }
    a.update({k: (v[:MAX_TEXT] if isinstance(v, str) else v) for k, v in opt.items() if v is not None})
    finish = FINISH_REASONS.get(str(row.get("end_reason")))
    if finish is not None:
        a["gen_ai.response.finish_reasons"] = [finish]
    events: list[tuple[str, int, Attrs]] = []
    if summary is not None:
        a.update(summary_attributes(summary))
        events = summary.events
    off = ctx.wall_offset_ns
    return SpanSpec(f"{OPERATION} {ctx.model}", REQUEST_KIND, int(t0) + off, int(t1) + off, a, events)


def summary_attributes(s: RequestSummary) -> Attrs:
    """The routing and sparsity figures of a request's tokens (only those the recording holds)."""
    a: Attrs = {"sparseety.tokens_recorded": s.tokens}
    if s.log_prob_n:
        a["sparseety.log_prob.mean"] = s.log_prob_sum / s.log_prob_n
        a["sparseety.log_prob.min"] = s.log_prob_min
    if s.act_zero_n:
        a["sparseety.act_zero_ratio.mean"] = s.act_zero_sum / s.act_zero_n
    distinct = [b.bit_count() for b in s.experts]
    if any(distinct):
        a["sparseety.experts.distinct_per_layer"] = distinct
        a["sparseety.experts.distinct.mean"] = sum(distinct) / len(distinct)
        a["sparseety.experts.distinct.max"] = max(distinct)
    if s.events_dropped:
        a["sparseety.token_events_dropped"] = s.events_dropped
    return a


def step_span(row: Mapping[str, Any], ctx: SpanContext) -> SpanSpec | None:
    """One micro-batch (steps row) as an internal span of its own trace."""
    t0, t1 = row.get("t_start_ns"), row.get("t_end_ns")
    if t0 is None or t1 is None:
        return None
    a: Attrs = {}
    for col in _STEP_FIELDS:
        v = row.get(col)
        if v is not None:
            a[f"sparseety.step.{col}"] = v[:MAX_TEXT] if isinstance(v, str) else v
    seqs = row.get("seq_ids")
    if seqs is not None:
        a["sparseety.step.seq_ids"] = [int(x) for x in seqs[:MAX_TEXT] if x is not None]
    off = ctx.wall_offset_ns
    return SpanSpec(STEP_SPAN, "internal", int(t0) + off, int(t1) + off, a)


def wall_offset_from(tokens: pl.DataFrame, steps: pl.DataFrame) -> int | None:
    """The recording's wall clock offset (Unix ns - CLOCK_MONOTONIC ns), from the rows that carry
    both clocks: ts_unix_ms is floor((t + offset) / 1e6), so each row bounds the offset from
    below to within 1 ms; the tightest bound is the largest. None without such rows."""
    bounds = []
    for df, t in ((tokens, "t_end_ns"), (steps, "t_start_ns")):
        if df.height:
            b = df.select((pl.col("ts_unix_ms") * 1_000_000 - pl.col(t)).max()).item()
            if b is not None:
                bounds.append(int(b))
    return max(bounds) if bounds else None
