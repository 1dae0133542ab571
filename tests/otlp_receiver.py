"""A real OTLP/HTTP trace receiver for tests: POST /v1/traces, the body decoded as the
opentelemetry-proto ExportTraceServiceRequest, answered with an ExportTraceServiceResponse; the
spans kept as plain dicts (attributes decoded from their AnyValues)."""

from __future__ import annotations

import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span


def any_value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [any_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def attributes(kvs: Any) -> dict[str, Any]:
    return {kv.key: any_value(kv.value) for kv in kvs if isinstance(kv, KeyValue)}


class OtlpReceiver:
    """Listens on 127.0.0.1:<free port>; `spans` holds every span received, `posts` the requests."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.posts = 0
        self.bad: list[str] = []
        self._lock = threading.Lock()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                ok = (
                    self.path == "/v1/traces" and self.headers.get("Content-Type") == "application/x-protobuf"
                )
                if not ok:
                    owner.bad.append(f"{self.path} {self.headers.get('Content-Type')}")
                    self.send_response(400)
                    self.end_headers()
                    return
                owner._take(ExportTraceServiceRequest.FromString(body))
                out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def _take(self, req: ExportTraceServiceRequest) -> None:
        with self._lock:
            self.posts += 1
            for rs in req.resource_spans:
                resource = attributes(rs.resource.attributes)
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        self.spans.append(
                            {
                                "name": s.name,
                                "kind": Span.SpanKind.Name(s.kind),
                                "trace_id": s.trace_id.hex(),
                                "parent": s.parent_span_id.hex(),
                                "start_ns": s.start_time_unix_nano,
                                "end_ns": s.end_time_unix_nano,
                                "attributes": attributes(s.attributes),
                                "events": [
                                    (e.name, e.time_unix_nano, attributes(e.attributes)) for e in s.events
                                ],
                                "dropped_events": s.dropped_events_count,
                                "resource": resource,
                                "scope": ss.scope.name,
                            }
                        )

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Blackhole:
    """A port that takes TCP connections (the kernel's backlog) and never answers: a collector
    that hangs. `url` for the exporter."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(1024)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def close(self) -> None:
        self.sock.close()
