"""The live terminal view of `attach`: an update side that folds the consumer's new rows into a
small state, an immutable Snapshot of it, and `render(snapshot)`, a pure function tested at
fixed widths."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np
from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from sparseety_prof.terminal_text import text as safe_text

RATE_WINDOW_NS = 5_000_000_000  # tokens/s and steps/s over the last 5 s
MAX_REQUESTS = 6  # requests shown, newest last
MAX_TOKENS_PER_REQUEST = 48  # tail of each request's token stream


@dataclass(frozen=True)
class RequestView:
    request_id: str
    n_tokens: int
    partial: bool
    tokens: tuple[tuple[str, float | None], ...]  # (text, log_prob), the tail of the stream


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
    kernel_drops: int
    seq_gaps: int
    logits_incomplete: int
    requests: tuple[RequestView, ...]


class LiveState:
    """Folded state the snapshots are made from; fed by the consumer thread only."""

    def __init__(self, *, pid: int, engine: str, model: str, recording: str | None) -> None:
        self.pid, self.engine, self.model, self.recording = pid, engine, model, recording
        self.tokens = 0
        self.steps = 0
        self._token_times: deque[int] = deque()
        self._step_times: deque[int] = deque()
        self._step_ms: deque[float] = deque(maxlen=2000)
        self._requests: dict[str, list[Any]] = {}  # id -> [n, partial, deque[(text, lp)]]
        self.counters: dict[str, float] = {}

    def update(
        self, tokens: dict[str, list[Any]], steps: dict[str, list[Any]], counters: dict[str, float]
    ) -> None:
        """Fold one batch of the consumer's new rows (column -> values) and its latest counters."""
        self.counters = dict(counters)
        for t0, t1 in zip(steps.get("t_start_ns", []), steps.get("t_end_ns", []), strict=True):
            self.steps += 1
            if t1 is not None:
                self._step_times.append(int(t1))
                self._step_ms.append((int(t1) - int(t0)) / 1e6)
        n = len(tokens.get("token_id", []))
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
                    del self._requests[next(iter(self._requests))]
            req[0] += 1
            text = tokens.get("token_text", [None] * n)[i]
            req[2].append((text if text is not None else f"<{tokens['token_id'][i]}>", tokens["log_prob"][i]))

    def snapshot(self, now_ns: int, elapsed_s: float) -> Snapshot:
        """The state at `now_ns`; rates over the last RATE_WINDOW_NS, or since the start if shorter."""
        for q in (self._token_times, self._step_times):
            while q and q[0] < now_ns - RATE_WINDOW_NS:
                q.popleft()
        window = min(RATE_WINDOW_NS / 1e9, max(elapsed_s, 1e-9))
        ms = np.array(self._step_ms) if self._step_ms else None
        c = self.counters
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
            kernel_drops=int(c.get("kernel_drops", 0)),
            seq_gaps=int(c.get("seq_gaps", 0)),
            logits_incomplete=int(c.get("logits_incomplete", 0)),
            requests=tuple(
                RequestView(rid, n, partial, tuple(toks))
                for rid, (n, partial, toks) in self._requests.items()
            ),
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


def render(s: Snapshot) -> RenderableType:
    """Stats panel, the newest requests' token tails shaded by log-prob, and the legend."""
    stats = Table.grid(padding=(0, 2), expand=True)
    for _ in range(4):
        stats.add_column()
    stats.add_row("tokens/s", f"{s.tokens_per_s:.1f}", "steps/s", f"{s.steps_per_s:.1f}")
    stats.add_row("step p50", _fmt_ms(s.step_p50_ms), "step p99", _fmt_ms(s.step_p99_ms))
    stats.add_row("tokens", str(s.tokens), "steps", str(s.steps))
    cpu_pct = 100 * s.cpu_s / s.elapsed_s if s.elapsed_s > 0 else 0.0
    stats.add_row("profiler CPU", f"{s.cpu_s:.2f} s ({cpu_pct:.1f}%)", "lag", f"{s.lag_ms:.0f} ms")
    loss_style = "bold red" if (s.kernel_drops or s.seq_gaps or s.logits_incomplete) else "green"
    stats.add_row(
        "drops",
        Text(str(s.kernel_drops), style=loss_style),
        "gaps",
        Text(f"{s.seq_gaps} (+{s.logits_incomplete} incomplete logits)", style=loss_style),
    )
    # engine, model and path come from the target or the operator: Text, never markup
    title = safe_text(f"sparseety-prof · PID {s.pid} · {s.engine} · {s.model}")
    subtitle = safe_text(f"recording to {s.recording}" if s.recording else "not recording (use -o DIR)")
    parts: list[RenderableType] = [Panel(stats, title=title, subtitle=subtitle, title_align="left")]
    if not s.requests:
        parts.append(Text("waiting for tokens ...", style="dim"))
    for r in s.requests:
        line = Text()
        line.append(safe_text(r.request_id, "bold cyan"))
        line.append(f" {r.n_tokens} tok{' (partial)' if r.partial else ''}: ", style="cyan")
        for text, lp in r.tokens:
            line.append(safe_text(text.replace("\n", "⏎"), shade(lp)))
        parts.append(line)
    parts.append(
        Text("log-prob: ", style="dim")
        + Text("≥-0.5 ", style="green")
        + Text("≥-2 ", style="yellow")
        + Text("≥-5 ", style="bold red")
        + Text("<-5", style="bold white on red")
        + Text("   Ctrl-C to detach", style="dim")
    )
    return Group(*parts)
