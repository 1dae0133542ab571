"""The live terminal view of `attach`: an update side that folds the consumer's new rows into a
small state, an immutable Snapshot of it, and `render(snapshot, settings, width)`, a pure function
tested at fixed widths. The view settings (paused, which request, which panels) change by key
(sparseety_prof/views/live_keys.py) and are applied by `apply_key`, pure too."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import polars as pl
from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from sparseety_prof.store import anomalies, schema
from sparseety_prof.terminal_text import text as safe_text

RATE_WINDOW_NS = 5_000_000_000  # tokens/s and steps/s over the last 5 s
MAX_REQUESTS = 6  # requests shown, newest last
MAX_TOKENS_PER_REQUEST = 48  # tail of each request's token stream: also the heat map's window
STEPS_KEPT = 4096  # recent steps whose batch context a request's worst gap can name
SLOWEST_KEPT = 256  # recent steps whose slowest layer the stats panel sums up
#: heat map shades by a cell's selections / the busiest cell's; "·" is an expert never chosen
HEAT_SHADES = "░▒▓█"
JUMP_MARK, SPIKE_MARK = "↯", "◆"
#: the token columns the anomaly detectors read to mark tokens
_MARK_COLUMNS = ("request_id", "seq_id", "decode_order", "step_id", "expert_ids", "act_zero_ratio")


@dataclass(frozen=True)
class TokenView:
    text: str
    log_prob: float | None
    experts: tuple[tuple[int, ...], ...] | None = None  # per MoE layer
    zero: tuple[float | None, ...] | None = None  # act_zero_ratio per FFN layer
    below: tuple[float | None, ...] | None = None  # act_below_ratio per FFN layer
    jump: bool = False  # the routing_jump detector flags it
    spike: bool = False  # the sparsity_spike detector flags it (any layer)


@dataclass(frozen=True)
class StepContext:
    """The batch a token's step ran: sequences in it, its rows, and how many were prompt rows
    (a prompt sharing the step slows the decode tokens in it). None where not captured."""

    seqs: int | None
    rows: int | None
    prompt_rows: int | None


@dataclass(frozen=True)
class RequestView:
    request_id: str
    n_tokens: int
    partial: bool
    tokens: tuple[TokenView, ...]  # the tail of the stream
    # where its time goes, from its tokens seen (views/request_timing.py defines the same for
    # `report`): tokens after the first per second since the first, and its longest wait for a
    # token (the gap since its previous token) with that token's step context
    tokens_per_s: float | None = None
    worst_gap_ms: float | None = None
    worst_gap_step: StepContext | None = None


@dataclass
class _RequestTiming:
    first_ns: int | None = None
    last_ns: int | None = None
    timed: int = 0  # tokens with a time
    worst_gap_ms: float | None = None
    worst_gap_step: int | None = None  # the step_id of that token


@dataclass(frozen=True)
class Snapshot:
    pid: int
    engine: str
    model: str
    recording: str | None
    elapsed_s: float
    tokens: int
    steps: int
    tokens_per_s: float
    steps_per_s: float
    step_p50_ms: float | None
    step_p99_ms: float | None
    cpu_s: float
    lag_ms: float
    rss_bytes: int
    kernel_drops: int
    seq_gaps: int
    logits_incomplete: int
    requests: tuple[RequestView, ...]
    moe_layers: tuple[int, ...] | None = None  # model layer of each element of expert_ids
    ffn_layers: tuple[int, ...] | None = None  # ... of act_zero_ratio / act_below_ratio
    n_experts: int | None = None  # the model's expert count, when known
    # the layer most often slowest in the recent steps with layer times (tokens' slowest_layer),
    # its median time there, and in how many of those steps it was the slowest
    slowest_layer: int | None = None
    slowest_layer_ms: float | None = None
    slowest_layer_steps: tuple[int, int] | None = None  # (steps it was slowest in, steps)


@dataclass(frozen=True)
class ViewSettings:
    """What the operator chose with keys: frozen display, the request in focus (None: the newest)
    and which panels show."""

    paused: bool = False
    selected: str | None = None
    heat: bool = True
    sparsity: bool = True
    tokens: bool = True


#: key -> action; Tab and space are the other spellings of n and p
KEYS = {"p": "pause", " ": "pause", "n": "next", "\t": "next", "h": "heat", "s": "sparsity", "t": "tokens"}
QUIT_KEY = "q"


def apply_key(v: ViewSettings, key: str, request_ids: Sequence[str]) -> ViewSettings:
    """The settings after `key` (unknown keys change nothing); `n` cycles through `request_ids`
    (the requests shown, oldest first) starting from the one in focus."""
    action = KEYS.get(key)
    if action == "pause":
        return replace(v, paused=not v.paused)
    if action == "heat":
        return replace(v, heat=not v.heat)
    if action == "sparsity":
        return replace(v, sparsity=not v.sparsity)
    if action == "tokens":
        return replace(v, tokens=not v.tokens)
    if action == "next" and request_ids:
        current = focused(v, request_ids)
        i = request_ids.index(current) if current in request_ids else -1
        return replace(v, selected=request_ids[(i + 1) % len(request_ids)])
    return v


def focused(v: ViewSettings, request_ids: Sequence[str]) -> str | None:
    """The request in focus: the chosen one while it is shown, else the newest."""
    if v.selected in request_ids:
        return v.selected
    return request_ids[-1] if request_ids else None


def _tuple_or_none(value: Any, cast: type) -> tuple[Any, ...] | None:
    return None if value is None else tuple(None if x is None else cast(x) for x in value)


def _column(name: str, values: list[Any]) -> pl.Series:
    """A detector input column. Nested lists of one shape (every token the same layers and top-k)
    go through numpy: polars builds nested lists from Python objects element by element, many
    times slower for a few requests of a 48-layer top-8 model."""
    dtype = schema.TOKENS[name]
    if isinstance(dtype, pl.List) and values and all(v is not None for v in values):
        try:
            arr = np.array(values, dtype=np.float32 if dtype.inner == pl.Float32 else np.int32)
        except (ValueError, TypeError):  # ragged, or nulls inside
            arr = None
        depth = 2 if isinstance(dtype.inner, pl.List) else 1
        if arr is not None and arr.ndim == depth + 1 and arr.size:
            return pl.Series(name, arr).cast(dtype)
    return pl.Series(name, values, dtype=dtype, strict=False)


def _detect_marks(
    rows: list[dict[str, Any]], layers: Mapping[str, Any]
) -> tuple[set[tuple[str, int]], set[tuple[str, int]]]:
    """The routing_jump and sparsity_spike detectors with their default thresholds over `rows`
    (token columns of _MARK_COLUMNS): the (request, decode order) of each token they flag."""
    jumps: set[tuple[str, int]] = set()
    spikes: set[tuple[str, int]] = set()
    if not rows:
        return jumps, spikes
    df = pl.DataFrame([_column(c, [r[c] for r in rows]) for c in _MARK_COLUMNS])
    meta = {"layers": dict(layers)}
    for found, into in (
        (anomalies.routing_jumps(df, meta), jumps),
        (anomalies.sparsity_spikes(df, meta), spikes),
    ):
        for rid, first, last in found.select("request_id", "decode_order", "decode_order_end").iter_rows():
            into.update((rid, d) for d in range(first, last + 1))
    return jumps, spikes


class LiveState:
    """Folded state the snapshots are made from; fed by the consumer thread only."""

    def __init__(
        self,
        *,
        pid: int,
        engine: str,
        model: str,
        recording: str | None,
        layers: Mapping[str, Any] | None = None,
        n_experts: int | None = None,
    ) -> None:
        self.pid, self.engine, self.model, self.recording = pid, engine, model, recording
        self.layers = layers if isinstance(layers, Mapping) else {}
        self.n_experts = n_experts if n_experts else None
        self.tokens = 0
        self.steps = 0
        self._token_times: deque[int] = deque()
        self._step_times: deque[int] = deque()
        self._step_ms: deque[float] = deque(maxlen=2000)
        # id -> [n, partial, deque[(TokenView, {column: value} for the detectors)]]
        self._requests: dict[str, list[Any]] = {}
        # id -> (tokens seen when computed, jumps, spikes): the detectors' marks per request
        self._marks: dict[str, tuple[int, set[tuple[str, int]], set[tuple[str, int]]]] = {}
        self._timing: dict[str, _RequestTiming] = {}
        self._step_context: dict[int, StepContext] = {}  # step_id -> context, the newest STEPS_KEPT
        # step_id -> (its slowest layer, ms), the newest SLOWEST_KEPT steps with layer times
        self._slowest: dict[int, tuple[int, float]] = {}
        self.counters: dict[str, float] = {}

    def update(
        self, tokens: Mapping[str, list[Any]], steps: Mapping[str, list[Any]], counters: dict[str, float]
    ) -> None:
        """Fold one batch of the consumer's new rows (column -> values) and its latest counters."""
        self.counters = dict(counters)
        for t0, t1 in zip(steps.get("t_start_ns", []), steps.get("t_end_ns", []), strict=True):
            self.steps += 1
            if t1 is not None:
                self._step_times.append(int(t1))
                self._step_ms.append((int(t1) - int(t0)) / 1e6)
        self._keep_step_context(steps)
        n = len(tokens.get("token_id", []))

        def col(name: str) -> list[Any]:
            return tokens.get(name) or [None] * n

        self._keep_slowest(col("step_id"), col("slowest_layer"), col("slowest_layer_ms"))
        for i in range(n):
            self.tokens += 1
            t_end = tokens["t_end_ns"][i]
            if t_end is not None:
                self._token_times.append(int(t_end))
            rid = str(tokens["request_id"][i])
            req = self._requests.get(rid)
            if req is None:
                req = self._requests[rid] = [
                    0,
                    bool(tokens["partial"][i]),
                    deque(maxlen=MAX_TOKENS_PER_REQUEST),
                ]
                while len(self._requests) > MAX_REQUESTS:  # dicts keep insertion order: oldest first
                    gone = next(iter(self._requests))
                    del self._requests[gone]
                    self._timing.pop(gone, None)
            req[0] += 1
            self._time(rid, t_end, col("step_id")[i])
            text = col("token_text")[i]
            experts = col("expert_ids")[i]
            view = TokenView(
                text=text if text is not None else f"<{tokens['token_id'][i]}>",
                log_prob=tokens["log_prob"][i],
                experts=None
                if experts is None
                else tuple(tuple(int(e) for e in (() if x is None else x)) for x in experts),
                zero=_tuple_or_none(col("act_zero_ratio")[i], float),
                below=_tuple_or_none(col("act_below_ratio")[i], float),
            )
            req[2].append((view, {c: col(c)[i] for c in _MARK_COLUMNS}))

    def _keep_step_context(self, steps: Mapping[str, list[Any]]) -> None:
        ids = steps.get("step_id") or []
        n = len(ids)

        def col(name: str) -> list[Any]:
            return steps.get(name) or [None] * n

        for step_id, seq_ids, rows, prompt in zip(
            ids, col("seq_ids"), col("n_tokens"), col("prompt_rows"), strict=True
        ):
            if step_id is not None:
                self._step_context[int(step_id)] = StepContext(
                    len(seq_ids) if seq_ids is not None else None, rows, prompt
                )
        while len(self._step_context) > STEPS_KEPT:  # insertion order: the oldest step first
            del self._step_context[next(iter(self._step_context))]

    def _keep_slowest(self, step_ids: list[Any], layers: list[Any], ms: list[Any]) -> None:
        """Each token's step's slowest layer (one per step: a step's tokens share it)."""
        for step_id, layer, t in zip(step_ids, layers, ms, strict=True):
            if step_id is not None and layer is not None and t is not None:
                self._slowest[int(step_id)] = (int(layer), float(t))
        while len(self._slowest) > SLOWEST_KEPT:  # insertion order: the oldest step first
            del self._slowest[next(iter(self._slowest))]

    def _slowest_summary(self) -> tuple[int | None, float | None, tuple[int, int] | None]:
        """The layer most often slowest in the kept steps, its median ms when slowest, and
        (steps it was slowest in, steps kept)."""
        if not self._slowest:
            return None, None, None
        by_layer: dict[int, list[float]] = {}
        for layer, t in self._slowest.values():
            by_layer.setdefault(layer, []).append(t)
        layer, times = max(by_layer.items(), key=lambda kv: (len(kv[1]), -kv[0]))
        return layer, float(np.median(times)), (len(times), len(self._slowest))

    def _time(self, rid: str, t_end: int | None, step_id: int | None) -> None:
        """Fold a token's time into its request's timing (gap since its previous token)."""
        if t_end is None:
            return
        t = self._timing.setdefault(rid, _RequestTiming())
        if t.last_ns is not None:
            gap = (int(t_end) - t.last_ns) / 1e6
            if t.worst_gap_ms is None or gap > t.worst_gap_ms:
                t.worst_gap_ms, t.worst_gap_step = gap, step_id
        if t.first_ns is None:
            t.first_ns = int(t_end)
        t.last_ns = int(t_end)
        t.timed += 1

    def _request_view(self, rid: str, n: int, partial: bool, toks: tuple[TokenView, ...]) -> RequestView:
        t = self._timing.get(rid)
        if t is None:
            return RequestView(rid, n, partial, toks)
        span_s = (t.last_ns - t.first_ns) / 1e9 if t.first_ns is not None and t.last_ns is not None else 0.0
        step = self._step_context.get(t.worst_gap_step) if t.worst_gap_step is not None else None
        return RequestView(
            rid,
            n,
            partial,
            toks,
            tokens_per_s=(t.timed - 1) / span_s if span_s > 0 else None,
            worst_gap_ms=t.worst_gap_ms,
            worst_gap_step=step,
        )

    def _flagged(self) -> tuple[set[tuple[str, int]], set[tuple[str, int]]]:
        """(request, decode order) of the tokens shown that the routing_jump and sparsity_spike
        detectors flag, each request's run over its own tokens on screen (so their baselines are
        those tokens); recomputed only for the requests that got tokens since the last call."""
        jumps: set[tuple[str, int]] = set()
        spikes: set[tuple[str, int]] = set()
        marks = {}
        for rid, (n, _, toks) in self._requests.items():
            got = self._marks.get(rid)
            if got is None or got[0] != n:
                got = (n, *_detect_marks([r for _, r in toks], self.layers))
            marks[rid] = got
            jumps |= got[1]
            spikes |= got[2]
        self._marks = marks  # requests no longer shown drop out
        return jumps, spikes

    def snapshot(self, now_ns: int, elapsed_s: float) -> Snapshot:
        """The state at `now_ns`; rates over the last RATE_WINDOW_NS, or since the start if shorter."""
        for q in (self._token_times, self._step_times):
            while q and q[0] < now_ns - RATE_WINDOW_NS:
                q.popleft()
        window = min(RATE_WINDOW_NS / 1e9, max(elapsed_s, 1e-9))
        ms = np.array(self._step_ms) if self._step_ms else None
        c = self.counters
        jumps, spikes = self._flagged()

        def marked(view: TokenView, row: dict[str, Any]) -> TokenView:
            key = (str(row["request_id"]), row["decode_order"])
            return replace(view, jump=key in jumps, spike=key in spikes)

        moe, ffn = self.layers.get("moe"), self.layers.get("ffn")
        slow_layer, slow_ms, slow_steps = self._slowest_summary()
        return Snapshot(
            pid=self.pid,
            engine=self.engine,
            model=self.model,
            recording=self.recording,
            elapsed_s=elapsed_s,
            tokens=self.tokens,
            steps=self.steps,
            tokens_per_s=len(self._token_times) / window,
            steps_per_s=len(self._step_times) / window,
            step_p50_ms=float(np.percentile(ms, 50)) if ms is not None else None,
            step_p99_ms=float(np.percentile(ms, 99)) if ms is not None else None,
            cpu_s=float(c.get("cpu_s", 0.0)),
            lag_ms=float(c.get("lag_ms", 0.0)),
            rss_bytes=int(c.get("rss_bytes", 0)),
            kernel_drops=int(c.get("kernel_drops", 0)),
            seq_gaps=int(c.get("seq_gaps", 0)),
            logits_incomplete=int(c.get("logits_incomplete", 0)),
            requests=tuple(
                self._request_view(rid, n, partial, tuple(marked(v, r) for v, r in toks))
                for rid, (n, partial, toks) in self._requests.items()
            ),
            moe_layers=tuple(int(x) for x in moe) if isinstance(moe, list) else None,
            ffn_layers=tuple(int(x) for x in ffn) if isinstance(ffn, list) else None,
            n_experts=self.n_experts,
            slowest_layer=slow_layer,
            slowest_layer_ms=slow_ms,
            slowest_layer_steps=slow_steps,
        )


def shade(log_prob: float | None) -> str:
    """Style of a token by how likely the engine found it: the unlikely ones stand out."""
    if log_prob is None:
        return "dim"
    if log_prob >= -0.5:
        return "green"
    if log_prob >= -2.0:
        return "yellow"
    if log_prob >= -5.0:
        return "bold red"
    return "bold white on red"


def _fmt_ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f} ms"


def _fmt_slowest(s: Snapshot) -> str:
    """The layer most often slowest in recent steps (tokens' slowest_layer): "L<layer> <median ms>
    (<steps it was slowest in>/<steps> steps)", "-" without layer times (a capture without the
    aggregate record)."""
    if s.slowest_layer is None or s.slowest_layer_steps is None:
        return "-"
    n, of = s.slowest_layer_steps
    return f"L{s.slowest_layer} {_fmt_ms(s.slowest_layer_ms)} ({n}/{of} steps)"


def _row_groups(layers: tuple[int, ...] | None, n: int, max_rows: int | None) -> list[tuple[str, list[int]]]:
    """Rows of a per-layer panel: (label, list elements) with the model layer of each element as
    label (its index without a layer map); more elements than `max_rows` are merged into runs of
    consecutive layers, labelled first-last."""

    def name(i: int) -> int:
        return layers[i] if layers is not None and i < len(layers) else i

    per = max(1, math.ceil(n / max_rows)) if max_rows else 1
    groups = [list(range(i, min(i + per, n))) for i in range(0, n, per)]
    return [(f"L{name(g[0])}" + (f"-{name(g[-1])}" if len(g) > 1 else ""), g) for g in groups]


def _stats(s: Snapshot, v: ViewSettings) -> RenderableType:
    stats = Table.grid(padding=(0, 2), expand=True)
    for _ in range(4):
        stats.add_column()
    stats.add_row("tokens/s", f"{s.tokens_per_s:.1f}", "steps/s", f"{s.steps_per_s:.1f}")
    stats.add_row("step p50", _fmt_ms(s.step_p50_ms), "step p99", _fmt_ms(s.step_p99_ms))
    stats.add_row("tokens", str(s.tokens), "steps", str(s.steps))
    cpu_pct = 100 * s.cpu_s / s.elapsed_s if s.elapsed_s > 0 else 0.0
    stats.add_row("profiler CPU", f"{s.cpu_s:.2f} s ({cpu_pct:.1f}%)", "lag", f"{s.lag_ms:.0f} ms")
    stats.add_row("profiler mem", f"{s.rss_bytes / 2**20:.0f} MiB resident", "slowest layer", _fmt_slowest(s))
    loss_style = "bold red" if (s.kernel_drops or s.seq_gaps or s.logits_incomplete) else "green"
    stats.add_row(
        "drops",
        Text(str(s.kernel_drops), style=loss_style),
        "gaps",
        Text(f"{s.seq_gaps} (+{s.logits_incomplete} incomplete logits)", style=loss_style),
    )
    # engine, model and path come from the target or the operator: Text, never markup
    title = safe_text(f"sparseety-prof · PID {s.pid} · {s.engine} · {s.model}")
    if v.paused:
        title.append(" · PAUSED", style="bold yellow")
    subtitle = safe_text(f"recording to {s.recording}" if s.recording else "not recording (use -o DIR)")
    return Panel(stats, title=title, subtitle=subtitle, title_align="left")


def _panel_title(what: str, r: RequestView) -> Text:
    t = Text(f"{what} · ")
    t.append(safe_text(r.request_id, "bold cyan"))
    t.append(f" · last {len(r.tokens)} tokens")
    return t


def _layer_expert_pairs(routed: list[tuple[tuple[int, ...], ...]]) -> np.ndarray:
    """(layer index, expert id) of every selection in `routed` (per token, per layer, the experts),
    as an (n, 2) array; negative ids (never an expert) left out."""
    try:  # every token the same layers and top-k: one array, no Python loop over the selections
        arr = np.array(routed, dtype=np.int64)
    except ValueError:
        arr = None
    if arr is not None and arr.ndim == 3:
        layer = np.broadcast_to(np.arange(arr.shape[1])[None, :, None], arr.shape)
        pairs = np.stack([layer.ravel(), arr.ravel()], axis=1)
    else:
        flat = [(li, x) for e in routed for li, chosen in enumerate(e) for x in chosen]
        pairs = np.array(flat, dtype=np.int64).reshape(-1, 2)
    return pairs[pairs[:, 1] >= 0]


def heat_map(
    r: RequestView,
    n_experts: int | None,
    moe_layers: tuple[int, ...] | None,
    width: int,
    max_rows: int | None = None,
) -> Panel:
    """Rows: MoE layers (several per row beyond `max_rows`); columns: experts (several per column
    when they do not fit `width`); each cell shaded by how often the request's last tokens selected
    it."""
    routed = [t.experts for t in r.tokens if t.experts]
    title = _panel_title("expert load", r)
    if not routed:
        return Panel(
            Text("no routing in these tokens (dense model, --mode tokens or redacted)", style="dim"),
            title=title,
            title_align="left",
        )
    n_layers = max(len(e) for e in routed)
    pairs = _layer_expert_pairs(routed)
    total = max(n_experts or 0, int(pairs[:, 1].max()) + 1 if len(pairs) else 0, 1)
    rows = _row_groups(moe_layers, n_layers, max_rows)
    label_w = max(len(label) for label, _ in rows) + 1
    room = max(width - 4 - label_w, 8)  # 4: the panel's borders and padding
    per_col = max(1, math.ceil(total / room))
    n_cols = math.ceil(total / per_col)
    cell_w = 1 if per_col > 1 else max(1, min(3, room // n_cols))
    by_layer = np.zeros((n_layers, n_cols), dtype=np.int64)
    np.add.at(by_layer, (pairs[:, 0], pairs[:, 1] // per_col), 1)
    counts = np.stack([by_layer[g].sum(axis=0) for _, g in rows])
    top = int(counts.max()) or 1
    body = Text(no_wrap=True, overflow="crop")
    if cell_w >= 2:  # expert ids over the columns, right-aligned in each cell
        body.append(" " * label_w + "".join(f"{c:>{cell_w - 1}} " for c in range(n_cols)), "dim")
        body.append("\n")
    # with room, a space between cells keeps neighbouring experts apart
    fill, gap = (cell_w - 1, " ") if cell_w >= 2 else (1, "")
    for li, (label, _) in enumerate(rows):
        body.append(f"{label:<{label_w}}", "bold")
        # the row as one span (shade by character): a span per cell makes a 48x128 map slow to draw
        cells = [
            "·".ljust(fill) + gap
            if c == 0
            else HEAT_SHADES[min(len(HEAT_SHADES) - 1, int(c * len(HEAT_SHADES) / (top + 1)))] * fill + gap
            for c in counts[li]
        ]
        body.append("".join(cells), "cyan")
        body.append("\n")
    columns = f"experts 0-{total - 1}" + (f", {per_col} per column" if per_col > 1 else ", one per column")
    if len(rows) < n_layers:
        columns += f", {len(rows[0][1])} layers per row"
    body.rstrip()
    # the legend wraps where the map crops: it must be read whole
    legend = Text(f"{columns}; · none, {HEAT_SHADES} up to {top} selections", "dim")
    return Panel(Group(body, legend), title=title, title_align="left")


def _bar(value: float | None, w: int) -> Text:
    if value is None or value != value:  # null or NaN
        return Text("-".ljust(w + 5), "dim")
    filled = round(max(0.0, min(1.0, value)) * w)
    return Text("█" * filled, "magenta") + Text("░" * (w - filled), "dim") + Text(f" {value:>4.0%}")


def _mean(rows: list[tuple[float | None, ...]], elements: list[int]) -> float | None:
    """Mean over the tokens and the given list elements (layers), nulls and NaNs left out."""
    vals = [v for x in rows for i in elements if i < len(x) and (v := x[i]) is not None and v == v]
    return sum(vals) / len(vals) if vals else None


def sparsity(
    r: RequestView, ffn_layers: tuple[int, ...] | None, width: int, max_rows: int | None = None
) -> Panel:
    """Per FFN layer (several per row beyond `max_rows`), the mean act_zero_ratio and
    act_below_ratio of the request's last tokens."""
    zero = [t.zero for t in r.tokens if t.zero is not None]
    below = [t.below for t in r.tokens if t.below is not None]
    title = _panel_title("sparsity", r)
    if not zero and not below:
        return Panel(
            Text("no activation sparsity in these tokens", style="dim"), title=title, title_align="left"
        )
    n_layers = max(len(x) for x in zero + below)
    rows = _row_groups(ffn_layers, n_layers, max_rows)
    label_w = max(len(label) for label, _ in rows) + 1
    bar_w = max(4, min(24, (width - 4 - label_w - len("zero  below ") - 10) // 2))
    body = Text(no_wrap=True, overflow="crop")
    for label, elements in rows:
        body.append(f"{label:<{label_w}}", "bold")
        body.append("zero ")
        body.append(_bar(_mean(zero, elements), bar_w))
        body.append("  below ")
        body.append(_bar(_mean(below, elements), bar_w))
        body.append("\n")
    body.append("zero: activations exactly 0; below: |x| < meta act_threshold", "dim")
    return Panel(body, title=title, title_align="left")


def _timing_text(r: RequestView) -> str:
    """· 38.2 tok/s · worst gap 41 ms (4 seqs, 9 rows, 8 prompt): what is known of it."""
    out = ""
    if r.tokens_per_s is not None:
        out += f" · {r.tokens_per_s:.1f} tok/s"
    if r.worst_gap_ms is not None:
        out += f" · worst gap {r.worst_gap_ms:.0f} ms"
        c = r.worst_gap_step
        if c is not None:
            parts = [
                f"{v} {what}"
                for v, what in ((c.seqs, "seqs"), (c.rows, "rows"), (c.prompt_rows, "prompt"))
                if v is not None
            ]
            out += f" ({', '.join(parts)})" if parts else ""
    return out


def _token_lines(s: Snapshot, current: str | None) -> list[RenderableType]:
    lines: list[RenderableType] = []
    for r in s.requests:
        line = Text("▶ " if r.request_id == current else "  ", style="bold")
        line.append(safe_text(r.request_id, "bold cyan"))
        line.append(f" {r.n_tokens} tok{' (partial)' if r.partial else ''}", style="cyan")
        line.append(_timing_text(r), style="dim")
        line.append(": ", style="cyan")
        for t in r.tokens:
            if t.jump:
                line.append(JUMP_MARK, "bold magenta")
            if t.spike:
                line.append(SPIKE_MARK, "bold magenta")
            line.append(safe_text(t.text.replace("\n", "⏎"), shade(t.log_prob)))
        lines.append(line)
    lines.append(
        Text("log-prob: ", style="dim")
        + Text("≥-0.5 ", style="green")
        + Text("≥-2 ", style="yellow")
        + Text("≥-5 ", style="bold red")
        + Text("<-5", style="bold white on red")
        + Text(f"   {JUMP_MARK} routing jump  {SPIKE_MARK} sparsity spike", style="bold magenta")
    )
    return lines


def _rows_left(s: Snapshot, v: ViewSettings, width: int, height: int | None) -> int | None:
    """How many layer rows each shown per-layer panel may take for the whole view to fit `height`
    lines (None: no limit): what the stats panel, the token streams, the footer and the panels'
    frames leave, shared by the panels shown."""
    panels = int(v.heat) + int(v.sparsity)
    if height is None or not panels:
        return None
    used = 7 + 1 + 1  # stats panel, keys, the line the terminal keeps for the cursor
    if v.tokens:
        for r in s.requests:  # each stream wraps: its length in cells over the width
            n = 2 + len(r.request_id) + 20 + len(_timing_text(r))
            n += sum(len(t.text) + t.jump + t.spike for t in r.tokens)
            used += math.ceil(n / max(width, 1))
        used += 1  # their legend
    used += 4 * int(v.heat) + 3 * int(v.sparsity)  # frames, column ids and legends
    return max(2, (height - used) // panels)


def render(
    s: Snapshot, v: ViewSettings | None = None, width: int = 80, height: int | None = None
) -> RenderableType:
    """Stats panel; for the request in focus the expert-load heat map and sparsity per layer; the
    newest requests' token tails shaded by log-prob with the detectors' marks; the keys. With a
    `height`, the per-layer panels merge consecutive layers into rows so that the view fits it."""
    v = v or ViewSettings()
    current = focused(v, [r.request_id for r in s.requests])
    req = next((r for r in s.requests if r.request_id == current), None)
    parts: list[RenderableType] = [_stats(s, v)]
    if req is None:
        parts.append(Text("waiting for tokens ...", style="dim"))
    else:
        max_rows = _rows_left(s, v, width, height)
        if v.heat:
            parts.append(heat_map(req, s.n_experts, s.moe_layers, width, max_rows))
        if v.sparsity:
            parts.append(sparsity(req, s.ffn_layers, width, max_rows))
        if v.tokens:
            parts.extend(_token_lines(s, current))

    def key(k: str, what: str, on: bool = True) -> Text:
        return Text(k, style="bold") + Text(f" {what}  ", style="" if on else "dim")

    parts.append(
        key("p", "resume" if v.paused else "pause")
        + key("n", "next request")
        + key("h", "heat map", v.heat)
        + key("s", "sparsity", v.sparsity)
        + key("t", "tokens", v.tokens)
        + key("q", "quit")
    )
    return Group(*parts)
