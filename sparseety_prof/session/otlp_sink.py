"""`--otlp URL`: a sink that sends each request as an OpenTelemetry span (OTLP/HTTP protobuf),
through the OpenTelemetry SDK's BatchSpanProcessor.

The consumer never waits on the collector: ending a span appends it to the processor's bounded
queue (a deque; BatchSpanProcessor.on_end takes no lock and does no I/O) and the processor's own
thread sends it. When that queue is full the SDK drops the oldest span silently, so the sink
counts for itself: every span it ends is either sent, refused by the collector (export_failed),
or dropped (queue full, or still queued when close gave up). A collector that is down costs the
export thread its timeouts and the recording nothing but those counts.

A request's span is built when its requests row arrives (the correlator emits it when the
request ends) from a bounded per-request summary of its token rows (otlp_spans.TokenSummaries).
Rows come in frames, one per table per flush, and a flush may hand the requests frame before the
tokens frame of the same requests: so request rows wait for the next drain (or close) to be
turned into spans, by which time every token row of theirs has been taken."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import polars as pl
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import SpanKind

from sparseety_prof import __version__
from sparseety_prof.session.options import Progress
from sparseety_prof.session.otlp_spans import (
    MAX_EVENTS_PER_SPAN,
    STEP_SPAN_COLUMNS,
    SUMMARY_COLUMNS,
    TOKEN_EVENT_COLUMNS,
    SpanContext,
    SpanSpec,
    TokenSummaries,
    meta_section,
    request_span,
    step_span,
)

QUEUE_SPANS = 2048  # spans waiting for the export thread; beyond this the oldest are dropped
BATCH_SPANS = 512  # spans per OTLP request
SCHEDULE_MS = 1000  # the export thread sends at least this often
EXPORT_TIMEOUT_S = 3.0  # one OTLP request, retries included (the exporter retries with backoff)
CLOSE_TIMEOUT_S = 10.0  # close sends what is queued for at most this long
TRACES_PATH = "/v1/traces"
_KINDS = {"client": SpanKind.CLIENT, "internal": SpanKind.INTERNAL}


def traces_url(url: str) -> str:
    """The OTLP/HTTP traces endpoint of `url`: a URL with no path gets the standard /v1/traces
    (as OTEL_EXPORTER_OTLP_ENDPOINT does); one with a path is used as given. ValueError unless
    http(s) with a host."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL with a host: {url!r}")
    if parts.path in ("", "/"):
        parts = parts._replace(path=TRACES_PATH)
    return urlunsplit(parts)


def shown_url(url: str) -> str:
    """`url` without any user:password part, for meta.json and messages."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    netloc = f"[{host}]" if ":" in host else host
    if parts.port is not None:
        netloc += f":{parts.port}"
    return urlunsplit(parts._replace(netloc=netloc))


class _CountingExporter(SpanExporter):
    """The OTLP exporter, counting what it sent and what failed; once the sink closes, a failed
    send (the collector is down) ends the sending, so that close stays bounded."""

    def __init__(self, inner: SpanExporter) -> None:
        self.inner = inner
        self.sent = 0
        self.failed = 0
        self.requests = 0
        self.closing = False
        self.gave_up = False
        self.fail_fast = False  # export --otlp: the first failed send ends the sending
        self.last_failed = False

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self.gave_up or (self.closing and self.last_failed) or (self.fail_fast and self.failed):
            return SpanExportResult.FAILURE  # not attempted: counted as dropped
        self.requests += 1
        result = self.inner.export(spans)
        self.last_failed = result is not SpanExportResult.SUCCESS
        if self.last_failed:
            self.failed += len(spans)
        else:
            self.sent += len(spans)
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


class _LastProblem(logging.Handler):
    """Keeps the SDK's last warning (why an export failed) for the close account, instead of
    letting it reach the terminal once per failed batch or dropped span."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.message: str | None = None
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1
        self.message = record.getMessage()[:300]


class OtlpSink:
    """FrameSink sending request spans (and, with `steps`, step spans) to an OTLP/HTTP collector.

    `blocking` (export --otlp): waits for the collector after every batch instead of dropping,
    and stops trying after the first failed send. `wall_offset_ns`: the recording's Unix -
    CLOCK_MONOTONIC offset; live, measured at open()."""

    name = "otlp"
    tables = frozenset({"tokens", "steps", "requests"})  # what take() reads

    def __init__(
        self,
        url: str,
        *,
        token_event_rate: float = 0.0,
        steps: bool = False,
        blocking: bool = False,
        wall_offset_ns: int | None = None,
        log: Callable[[str], None] | None = None,
        queue_spans: int = QUEUE_SPANS,
    ) -> None:
        self.url = traces_url(url)
        self._summaries = TokenSummaries(token_event_rate)
        self._steps = steps
        # what take() reads of rows that may come set apart (sinks.py): the summaries' columns,
        # the token events' when sampled, the step spans' when asked
        self.columns = {
            "tokens": SUMMARY_COLUMNS | (TOKEN_EVENT_COLUMNS if token_event_rate > 0 else frozenset()),
            "steps": STEP_SPAN_COLUMNS if steps else frozenset(),
        }
        self._blocking = blocking
        self._wall_offset_ns = wall_offset_ns
        self._log = log
        self._queue_spans = queue_spans
        self._pending: list[pl.DataFrame] = []  # requests frames waiting for the next drain
        self._ctx: SpanContext | None = None
        self._provider: TracerProvider | None = None
        self._processor: BatchSpanProcessor | None = None
        self._exporter: _CountingExporter | None = None
        self._problems = _LastProblem()
        self.spans = {"request": 0, "step": 0}
        self.token_events = 0
        self.requests_unplaced = 0  # requests rows with no time (no span possible)
        self.requests_without_tokens = 0
        self._queued_since_flush = 0

    # ------------------------------------------------------------------ FrameSink
    def open(self, meta: Mapping[str, Any]) -> None:
        offset = self._wall_offset_ns
        if offset is None:
            offset = time.time_ns() - time.monotonic_ns()
        self._ctx = SpanContext.from_meta(meta, offset)
        sdk_log = logging.getLogger("opentelemetry")
        sdk_log.addHandler(self._problems)
        sdk_log.propagate = False
        self._exporter = _CountingExporter(OTLPSpanExporter(endpoint=self.url, timeout=EXPORT_TIMEOUT_S))
        self._exporter.fail_fast = self._blocking
        self._processor = BatchSpanProcessor(
            self._exporter,
            max_queue_size=self._queue_spans,
            schedule_delay_millis=SCHEDULE_MS,
            max_export_batch_size=min(BATCH_SPANS, self._queue_spans),
        )
        self._provider = TracerProvider(
            resource=Resource.create(_resource_attributes(meta)),
            span_limits=SpanLimits(max_events=MAX_EVENTS_PER_SPAN),
            shutdown_on_exit=False,  # close() shuts it down, within its bound; never again at exit
        )
        self._provider.add_span_processor(self._processor)

    def take(self, table: str, df: pl.DataFrame) -> None:
        if self._ctx is None:
            return
        if table == "tokens":
            self._summaries.add(df, self._ctx.wall_offset_ns)
        elif table == "requests":
            self._pending.append(df)
        elif table == "steps" and self._steps:
            for row in df.iter_rows(named=True):
                spec = step_span(row, self._ctx)
                if spec is not None:
                    self._end(spec, "step")

    def drained(self, progress: Progress) -> None:
        self._place_requests()

    def close(self, meta: Mapping[str, Any]) -> dict[str, Any]:
        t0 = time.monotonic()
        self._place_requests()
        tokens_unmatched = self._summaries.drop_all()
        exporter, processor = self._exporter, self._processor
        ended = sum(self.spans.values())
        if exporter is not None and processor is not None:
            exporter.closing = True
            done = threading.Thread(target=processor.shutdown, name="otlp-close", daemon=True)
            done.start()
            done.join(CLOSE_TIMEOUT_S)
            exporter.gave_up = True  # whatever is still queued stays there
            if done.is_alive():
                exporter.inner.shutdown()  # wakes a retry's backoff wait
        sdk_log = logging.getLogger("opentelemetry")
        sdk_log.removeHandler(self._problems)
        sdk_log.propagate = True
        sent = exporter.sent if exporter else 0
        failed = exporter.failed if exporter else 0
        account: dict[str, Any] = {
            "endpoint": shown_url(self.url),
            "spans": dict(self.spans),
            "sent": sent,
            "export_failed": failed,
            "dropped": ended - sent - failed,
            "otlp_requests": exporter.requests if exporter else 0,
            "token_events": self.token_events,
            "requests_unplaced": self.requests_unplaced,
            "requests_without_tokens": self.requests_without_tokens,
            "token_summaries_evicted": self._summaries.evicted,
            "tokens_of_no_request": tokens_unmatched,
            "close_s": round(time.monotonic() - t0, 3),
        }
        if self._problems.message is not None:
            account["last_problem"] = self._problems.message
        if self._log is not None:
            self._log(
                f"sparseety-prof: OTLP {account['endpoint']}: {sent} of {ended} spans sent"
                + (f", {failed} refused or unreachable" if failed else "")
                + (f", {account['dropped']} dropped" if account["dropped"] else "")
            )
        return account

    # ------------------------------------------------------------------ spans
    def _place_requests(self) -> None:
        ctx = self._ctx
        pending, self._pending = self._pending, []
        if ctx is None:
            return
        for df in pending:
            for row in df.iter_rows(named=True):
                summary = self._summaries.pop(row["request_id"], row["ctx_id"], row["seq_id"])
                if summary is None:
                    self.requests_without_tokens += 1
                spec = request_span(row, summary, ctx)
                if spec is None:
                    self.requests_unplaced += 1
                    continue
                self.token_events += len(spec.events)
                self._end(spec, "request")

    def _end(self, spec: SpanSpec, kind: str) -> None:
        """Start and end the span at the recording's times: the processor queues it (never waits)."""
        assert self._provider is not None
        tracer = self._provider.get_tracer("sparseety-prof", __version__)
        span = tracer.start_span(
            spec.name, kind=_KINDS[spec.kind], attributes=spec.attributes, start_time=spec.start_ns
        )
        for name, ts, attrs in spec.events:
            span.add_event(name, attrs, timestamp=ts)
        span.end(end_time=max(spec.end_ns, spec.start_ns))
        self.spans[kind] += 1
        if self._blocking:
            self._queued_since_flush += 1
            if self._queued_since_flush >= BATCH_SPANS and self._processor is not None:
                self._processor.force_flush()  # offline: wait for the collector instead of dropping
                self._queued_since_flush = 0


def _resource_attributes(meta: Mapping[str, Any]) -> dict[str, str | int]:
    """Who sent the spans: the profiler, the engine and its host (service.name is the profiler's)."""
    engine = meta_section(meta, "engine")
    target = meta_section(meta, "target")
    host = meta_section(meta, "host")
    out: dict[str, str | int] = {"service.name": "sparseety-prof", "service.version": __version__}
    for key, value in (
        ("host.name", host.get("hostname")),
        ("process.pid", target.get("pid")),
        ("sparseety.engine.name", engine.get("name")),
        ("sparseety.engine.version", engine.get("version")),
    ):
        if isinstance(value, str) and value:
            out[key] = value[:256]
        elif isinstance(value, int) and not isinstance(value, bool):
            out[key] = value
    return out
