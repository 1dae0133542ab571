"""Serving context: which client request each engine sequence is serving, and per-request rows.

llama-server hands a request through three hops, each seen by a probe on the thread doing it
(probes/server_probes.bpf.c):

1. an HTTP worker thread reads the request line and headers from its socket (EV_HTTP_READ):
   the request id is the value of the configured header (default ``X-Request-Id``), or a
   generated ``gen-<pid>-<n>`` when the client sent none;
2. the same thread posts the request's task(s) to the server queue (EV_TASK_POST): the thread's
   pending request is bound to those task ids;
3. the main loop launches a task on a slot (EV_SLOT_LAUNCH): from then on, until the slot is
   launched again, the slot's sequence (llama-server: seq id = slot id) serves that request. A
   slot reused by a later request gets the later request's id at its launch, never the earlier
   one's.

Limits, documented in the README: the header must be in the first 4 KiB read of the request
(cpp-httplib reads 4 KiB at a time; headers are rarely longer); TLS traffic is encrypted on the
socket, so behind TLS only generated ids are available (terminate TLS in a proxy in front of
the server, which is how llama-server is usually deployed); a keep-alive connection is fine
(each request line starts a new request on the thread); pipelined requests in one read are
bound in order of their request lines, which cpp-httplib also processes in order.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

DEFAULT_HEADER = "X-Request-Id"
MAX_ID_LEN = 256  # longer header values are cut (a request id, not a payload)
MAX_PENDING_TASKS = 1 << 16  # task ids awaiting their slot launch; the oldest beyond are dropped
MAX_TRACED = 1024  # client ids whose hops are remembered for `sparseety-prof check`

ID_HEADER = "header"
ID_GENERATED = "generated"
ID_SEGMENTED = "segmented"


@dataclass
class HttpRequest:
    request_id: str
    id_source: str
    t_received_ns: int
    method: str
    path: str


@dataclass
class Launch:
    """A task launched on a slot: the request a sequence serves from `t_ns` on."""

    serial: int  # increases with every launch (contexts compare it with what they last bound)
    request_id: str
    id_source: str
    slot: int
    task_id: int
    t_ns: int
    t_received_ns: int | None
    parent_seq_id: int | None = None


@dataclass
class ServingCounters:
    http_requests: int = 0  # request lines read
    http_with_header: int = 0
    tasks_unbound: int = 0  # tasks launched whose request was never read (sent before attach)
    task_bindings_dropped: int = 0
    slot_token_mismatch: int = 0  # process_token's token differs from the sampler's


def parse_request_head(data: bytes, header: str) -> tuple[str, str, str | None] | None:
    """(method, path, value of `header` or None) of a request head, or None if `data` does not
    start with an HTTP/1.x request line. Header names compare case-insensitively (RFC 9110)."""
    head, end, _ = data.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    if not end:  # the head goes on past the bytes copied: its last line may be cut short
        lines = lines[:-1] if len(lines) > 1 else lines
    parts = lines[0].split(b" ")
    if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
        return None
    want = header.lower().encode()
    value: str | None = None
    for line in lines[1:]:
        name, sep, rest = line.partition(b":")
        if sep and name.strip().lower() == want:
            value = rest.strip()[:MAX_ID_LEN].decode("utf-8", "replace")
            break
    return parts[0].decode("ascii", "replace"), parts[1].decode("ascii", "replace"), value or None


class ServingTracker:
    """Joins the three hops. Fed in record order by the correlator."""

    def __init__(self, pid: int, header: str = DEFAULT_HEADER) -> None:
        self.pid = pid
        self.header = header
        self.counters = ServingCounters()
        self._pending_http: dict[int, list[HttpRequest]] = {}  # by HTTP thread
        self._task_request: dict[int, HttpRequest] = {}  # task id -> request
        self._task_size = 0  # bytes of one server_task, learned from vector posts (smallest span)
        self._generated = itertools.count(1)
        self._serial = itertools.count(1)
        self.slots: dict[int, Launch] = {}  # slot (sequence) -> its current launch
        self._child_parent: dict[int, tuple[int, int]] = {}  # child slot -> (parent slot, parent task)
        # client-given ids -> the hops they were seen at (entry_ns, task ids, (slot, launch ns))
        self.trace: dict[str, dict[str, list[int]]] = {}

    # ---- hop 1
    def on_http(self, tid: int, t_ns: int, data: bytes) -> None:
        # pipelined requests: several request heads in one read
        heads = [data]
        if data.count(b"HTTP/1.") > 1:
            heads = _split_heads(data)
        for h in heads:
            parsed = parse_request_head(h, self.header)
            if parsed is None:
                continue
            method, path, value = parsed
            self.counters.http_requests += 1
            if value is not None:
                self.counters.http_with_header += 1
                req = HttpRequest(value, ID_HEADER, t_ns, method, path)
                self._traced(value)["entry_ns"].append(t_ns)
            else:
                req = HttpRequest(f"gen-{self.pid}-{next(self._generated)}", ID_GENERATED, t_ns, method, path)
            # a new request line on a keep-alive connection replaces one that posted no task
            # (GET /health, /props, ...); pipelined ones queue up
            q = self._pending_http.setdefault(tid, [])
            if len(heads) == 1:
                q.clear()
            q.append(req)

    # ---- hop 2
    def on_task_post(self, tid: int, first_task: int, single: bool, span_bytes: int) -> None:
        if not single and span_bytes > 0 and (self._task_size == 0 or span_bytes < self._task_size):
            self._task_size = span_bytes  # most posts hold one task: the smallest span is one
        q = self._pending_http.get(tid)
        if not q or first_task < 0:
            return  # the main loop's own tasks, or a request read before attach
        req = q.pop(0)
        n = max(1, span_bytes // self._task_size) if not single and span_bytes > 0 else 1
        for t in range(first_task, first_task + n):
            self._task_request[t] = req
        if req.id_source == ID_HEADER:
            self._traced(req.request_id)["tasks"].extend(range(first_task, first_task + n))
        while len(self._task_request) > MAX_PENDING_TASKS:
            del self._task_request[next(iter(self._task_request))]
            self.counters.task_bindings_dropped += 1

    # ---- hop 3
    def on_slot_launch(self, t_ns: int, slot: int, task: int) -> Launch:
        # bindings stay (bounded, oldest dropped first): a task relaunched on another slot, or a
        # child of a parent task (n > 1), still finds its request
        req = self._task_request.get(task)
        parent = self._child_parent.pop(slot, None)
        if req is None and parent is not None:
            req = self._task_request.get(parent[1])
        if req is None:
            self.counters.tasks_unbound += 1
            rid, src, t_recv = f"task-{self.pid}-{task}", ID_GENERATED, None
        else:
            rid, src, t_recv = req.request_id, req.id_source, req.t_received_ns
        launch = Launch(next(self._serial), rid, src, slot, task, t_ns, t_recv, parent[0] if parent else None)
        if src == ID_HEADER:
            self._traced(rid)["slots"] += [slot, t_ns]
        self.slots[slot] = launch
        return launch

    def _traced(self, rid: str) -> dict[str, list[int]]:
        t = self.trace.get(rid)
        if t is None:
            if len(self.trace) >= MAX_TRACED:
                del self.trace[next(iter(self.trace))]
            t = self.trace[rid] = {"entry_ns": [], "tasks": [], "slots": []}
        return t

    def on_slot_child(self, child: int, parent: int, task: int) -> None:
        """A child slot of a parent task (n > 1 completions): its sequence is a fork of the
        parent's. Reported before the child's own launch."""
        if child != parent and child >= 0 and parent >= 0:
            self._child_parent[child] = (parent, task)


def _split_heads(data: bytes) -> list[bytes]:
    out = []
    rest = data
    while rest:
        head, sep, rest = rest.partition(b"\r\n\r\n")
        if head:
            out.append(head + sep)
        if not sep:
            break
    return out


def percentile(ordered: list[float], q: float) -> float:
    """numpy.percentile's default ("linear") of sorted values: the same answer (to the last bit
    but for rounding of the interpolation point), without numpy's fixed cost of tens of
    microseconds a call, paid per request."""
    at = (len(ordered) - 1) * q / 100
    lo = int(at)
    hi = min(lo + 1, len(ordered) - 1)
    a, b, frac = ordered[lo], ordered[hi], at - lo
    # numpy's lerp: from the nearer end, so that frac 0 and 1 give the values exactly
    return a + (b - a) * frac if frac < 0.5 else b - (b - a) * (1 - frac)


@dataclass
class RequestAgg:
    """What the requests table needs about one request, accumulated as its tokens are emitted."""

    request_id: str
    id_source: str
    ctx_id: int
    seq_id: int
    pid: int
    partial: bool
    t_started_ns: int | None
    slot_id: int | None = None
    task_id: int | None = None
    parent_seq_id: int | None = None
    t_received_ns: int | None = None
    prompt_tokens: int | None = None
    t_token_ns: list[int] = field(default_factory=list)  # end of the step of each token, in order
    last_token: int | None = None
    end_reason: str | None = None

    inherited: int = 0  # a fork's first tokens, generated by its parent sequence

    def add_token(self, logits_pos: int, t_end_ns: int | None, token: int) -> None:
        if not self.t_token_ns and not self.partial and self.prompt_tokens is None:
            self.prompt_tokens = logits_pos + 1
        if t_end_ns is not None:
            self.t_token_ns.append(t_end_ns)
        self.last_token = token

    def row(self) -> dict[str, object]:
        """The requests table's row: every column, in schema order (checked where it is buffered,
        request_tokens.py; this module stays free of the schema's polars import for the CLI)."""
        t = self.t_token_ns
        first = int(t[0]) if t else None
        t0 = self.t_received_ns if self.t_received_ns is not None else self.t_started_ns
        itl = sorted((b - a) / 1e6 for a, b in itertools.pairwise(t))
        p50, p99 = (percentile(itl, 50), percentile(itl, 99)) if itl else (None, None)
        return {
            "request_id": self.request_id,
            "id_source": self.id_source,
            "ctx_id": self.ctx_id,
            "seq_id": self.seq_id,
            "slot_id": self.slot_id,
            "task_id": self.task_id,
            "parent_seq_id": self.parent_seq_id,
            "t_received_ns": self.t_received_ns,
            "t_started_ns": self.t_started_ns,
            "t_first_token_ns": first,
            "t_last_token_ns": int(t[-1]) if t else None,
            "ttft_ms": (first - t0) / 1e6
            if first is not None and t0 is not None and not self.partial
            else None,
            "itl_p50_ms": p50,
            "itl_p99_ms": p99,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.inherited + len(self.t_token_ns),
            "end_reason": self.end_reason,
            "partial": self.partial,
            "pid": self.pid,
        }
