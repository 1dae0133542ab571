"""The per-request policies of `--policy` (head:RATE, tail:Q, anomaly[:KINDS]): each says of one
request whether to keep its rows. Head decides at the request's start, from its id alone; tail and
anomaly at its end, from its requests row and its tokens (session/request_hold.py holds the rows
until then)."""

from __future__ import annotations

import bisect
import hashlib
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import polars as pl

from sparseety_prof.store import anomalies

#: the detectors the anomaly policy runs on one request's tokens (recording-wide ones, load
#: imbalance and slow steps, need other requests or the steps: the tail policy covers slowness)
REQUEST_DETECTORS: dict[str, Callable[[pl.DataFrame, Mapping[str, Any] | None], pl.DataFrame]] = {
    "repetition_loop": lambda t, _m: anomalies.repetition_loops(t),
    "logprob_collapse": lambda t, _m: anomalies.logprob_collapse(t),
    "routing_collapse": anomalies.routing_collapse,
    "routing_jump": anomalies.routing_jumps,
    "sparsity_spike": anomalies.sparsity_spikes,
    "attention_collapse": anomalies.attention_collapse,
}
#: the tail policy's running quantile is over the latencies of the last TAIL_HISTORY requests
TAIL_HISTORY = 1000
#: below this many requests seen, the quantile means nothing yet: tail keeps the request
TAIL_WARMUP = 10


def head_fraction(request_id: str) -> float:
    """Where a request id falls in [0, 1): the first 8 bytes of its BLAKE2b digest. The same id
    falls at the same place in every run and on every machine (Python's hash() is salted)."""
    digest = hashlib.blake2b(request_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


class Head:
    """Keeps a request when its id falls below RATE: a share RATE of the requests, the same ones
    when the same ids come again.

    With `probe_verdicts` (head sampling in the probes, session/policy.py PolicyChoice.head_in_probes) the
    probes have drawn each request at its start and copied the logits rows of those they kept
    only: the verdict is theirs, which the correlator put there by request id at the request's
    first token (taken once). A request with none is kept (`unjudged`): its rows are stored,
    whatever the probes copied of them."""

    def __init__(self, rate: float, probe_verdicts: dict[str, bool] | None = None) -> None:
        self.check(rate)
        self.name = f"head:{rate:g}"
        self.rate = rate
        self.probe_verdicts = probe_verdicts
        self.unjudged = 0

    @staticmethod
    def check(rate: float) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"head:RATE needs 0 <= RATE <= 1, got {rate}")

    def keeps_at_start(self, request_id: str) -> bool:
        if self.probe_verdicts is None:
            return head_fraction(request_id) < self.rate
        kept = self.probe_verdicts.pop(request_id, None)
        if kept is None:
            self.unjudged += 1
            return True
        return kept


def request_latency_ms(req: Mapping[str, Any]) -> float | None:
    """The tail policy's latency: the request's time from its arrival (t_received_ns; the first
    step without a socket read) to its last token, per output token. Per token, so that a long
    answer is not slow for being long; from arrival, so that queueing and prefill count."""
    t0 = req.get("t_received_ns") or req.get("t_started_ns")
    t1 = req.get("t_last_token_ns")
    n = req.get("output_tokens") or 0
    if t0 is None or t1 is None or n <= 0:
        return None
    return (int(t1) - int(t0)) / 1e6 / int(n)


class Tail:
    """Keeps a request whose latency (request_latency_ms) is above the running quantile Q of the
    requests that ended before it (the last TAIL_HISTORY of them; the first TAIL_WARMUP are kept)."""

    def __init__(self, q: float) -> None:
        self.check(q)
        self.name = f"tail:{q:g}"
        self.q = q
        self._recent: deque[float] = deque()
        self._sorted: list[float] = []

    @staticmethod
    def check(q: float) -> None:
        if not 0.0 < q < 1.0:
            raise ValueError(f"tail:Q needs 0 < Q < 1, got {q}")

    def keeps_at_end(self, req: Mapping[str, Any]) -> bool:
        lat = request_latency_ms(req)
        if lat is None:
            return False  # no token: nothing of it to keep but its requests row, kept anyway
        keep = len(self._sorted) < TAIL_WARMUP or lat > self._quantile()
        self._recent.append(lat)
        bisect.insort(self._sorted, lat)
        if len(self._recent) > TAIL_HISTORY:
            old = self._recent.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, old)]
        return keep

    def _quantile(self) -> float:
        """The Q quantile of the history (nearest rank)."""
        s = self._sorted
        return s[min(len(s) - 1, int(self.q * len(s)))]


class Anomaly:
    """Keeps a request in which one of `kinds` of detectors fires on its tokens; the steps where
    they fired are handed to the hold, which keeps the steps rows around them. The detectors run
    once over the tokens of every request that ended since the last flush (one polars pass each,
    not one per request); their baselines are per request (log-prob, routing jumps), or per layer
    over those requests together (sparsity spikes), as over a recording."""

    def __init__(self, kinds: tuple[str, ...], meta: Mapping[str, Any] | None = None) -> None:
        self.check(kinds)
        self.name = "anomaly" if kinds == tuple(REQUEST_DETECTORS) else "anomaly:" + ",".join(kinds)
        self.kinds = kinds
        # the recording's metadata (its layer map, which some detectors read), known once
        # attached: RecordingPolicy.read_layout sets it
        self.meta = meta
        self.fired: dict[str, int] = {}  # detector -> requests it fired in

    @staticmethod
    def check(kinds: tuple[str, ...]) -> None:
        unknown = [k for k in kinds if k not in REQUEST_DETECTORS]
        if unknown:
            raise ValueError(
                f"anomaly: unknown detector {', '.join(unknown)}; per-request detectors are "
                + ", ".join(REQUEST_DETECTORS)
            )

    def fire(self, tokens: pl.DataFrame) -> dict[str, list[int]]:
        """Request id -> the steps where a detector fired in it, for the requests where one did."""
        out: dict[str, list[int]] = {}
        if tokens.is_empty():
            return out
        for kind in self.kinds:
            found = REQUEST_DETECTORS[kind](tokens, self.meta).filter(pl.col("request_id").is_not_null())
            for rid, steps in found.group_by("request_id").agg(pl.col("step_id").drop_nulls()).iter_rows():
                self.fired[kind] = self.fired.get(kind, 0) + 1
                out.setdefault(rid, []).extend(int(x) for x in steps)
        return out


Verdict = Head | Tail | Anomaly


@dataclass(frozen=True)
class VerdictSpec:
    """One per-request `--policy` value, parsed: `name` (head, tail or anomaly) and its argument
    (the rate, the quantile, or the detectors). Parsed once; each recording makes its own
    verdicts from it (`make`), since a verdict keeps state (the tail's history, the counts)."""

    name: str
    number: float = 0.0  # head's RATE, tail's Q
    kinds: tuple[str, ...] = ()  # anomaly's detectors

    def make(self, probe_verdicts: dict[str, bool] | None = None) -> Verdict:
        """A fresh verdict; `probe_verdicts`: the head policy's verdicts, drawn in the probes (Head)."""
        if self.name == "head":
            return Head(self.number, probe_verdicts)
        if self.name == "tail":
            return Tail(self.number)
        return Anomaly(self.kinds)


def parse_specs(specs: list[str] | tuple[str, ...]) -> tuple[VerdictSpec, ...]:
    """The per-request policies of `--policy` values (full and aggregate are not per request),
    checked: ValueError with what is wrong."""
    out: list[VerdictSpec] = []
    for spec in specs:
        name, _, arg = spec.partition(":")
        try:
            if name == "head":
                out.append(VerdictSpec(name, float(arg)))
                Head.check(out[-1].number)
            elif name == "tail":
                out.append(VerdictSpec(name, float(arg)))
                Tail.check(out[-1].number)
            elif name == "anomaly":
                kinds = tuple(k for k in arg.split(",") if k) if arg else tuple(REQUEST_DETECTORS)
                Anomaly.check(kinds)
                out.append(VerdictSpec(name, kinds=kinds))
            else:
                raise ValueError(f"unknown policy {spec!r}")
        except ValueError as e:
            if "could not convert" in str(e):
                raise ValueError(f"{spec!r}: {name} needs a number after the colon") from None
            raise
    return tuple(out)
