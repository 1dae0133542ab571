"""Whether a drain may hold the ring's space while it is handled: read its logits records where
they lie (by reference) instead of copying them out first.

Reading them in place saves copying a logits row a token (large with a 32k vocabulary) out of the
ring, but the space they take goes back to the producers only once the drain has been handled
(RingReader.release). Meanwhile the producers write on into what is left. A fixed limit on the
share pending when the drain starts (what this was: a quarter, the share paced drains aim for)
copied at every drain a little over it: at four llama-server clients, most of them, and the ring
walk then cost several times the recorder's CPU per token of reading the rows in place
(docs/overhead.md). What can fill the ring is the share pending at the start plus what the
producers add while the drain is handled: their rate since the last drain times the handling time,
taken here as the longest of the last few drains' (a consumer at a low priority is preempted now
and then). A drain holds the ring when that sum, the added part counted twice, stays under half of
it. A small model at thousands of tokens a second fills the ring in about a second and is handled
for a good part of one: it copies (the stress run of scripts/stress_aggregate.py lost records
holding the ring whenever under a third was pending at the start). Until a drain has been handled,
the fixed limit stands.
"""

from __future__ import annotations

from collections import deque


class RingHold:
    """Handling times of the last drains and the producers' rate: whether the next may hold."""

    MAX_HELD = 0.5  # pending at the start plus twice what the handling adds: at most this share
    MARGIN = 2.0
    KEEP = 8  # handling times remembered; the longest is the estimate

    def __init__(self, unmeasured_max: float) -> None:
        # before any drain was handled: the share pending under which a drain may hold the ring
        self.unmeasured_max = unmeasured_max
        self._handled: deque[float] = deque(maxlen=self.KEEP)
        self._taken_at: float | None = None
        self._drained_at: float | None = None

    def allows(self, pending: float, now: float) -> bool:
        """Whether a drain starting at `now` (time.monotonic) with `pending` of the ring to read
        may hold the ring until it has been handled."""
        since = None if self._drained_at is None else now - self._drained_at
        if not self._handled or since is None or since <= 0:
            return pending < self.unmeasured_max
        rate = pending / since  # ring per second, produced since the last drain
        return pending + self.MARGIN * rate * max(self._handled) < self.MAX_HELD

    def taken(self, now: float) -> None:
        """A drain read records and its handling starts (at `now`)."""
        self._taken_at = self._drained_at = now

    def released(self, now: float) -> None:
        """The drain taken last was handled (its held space, if any, given back) at `now`."""
        if self._taken_at is not None:
            self._handled.append(now - self._taken_at)
            self._taken_at = None
