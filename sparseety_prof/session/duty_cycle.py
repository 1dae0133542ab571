"""`--duty-cycle ON/PERIOD`: the expensive probes in for a window of ON seconds every PERIOD.

Pure: no thread, no system call (session/duty_driver.py runs it against the probes). Three parts:
- DutySpec: the flag's value ("2s/20s").
- DutyController: lowers the share of time in windows when the windows cost the engine more
  than TARGET_COST of its tokens/s on average (tokens/s in windows against tokens/s outside), or
  when the consumer lags (the ring filling, records lost); raises it back towards the share asked
  for while neither happens. It lengthens the period and keeps the window's length, so that each
  window still holds as many whole steps as asked.
- DutyCycle: the schedule (when to arm, when to disarm), the windows as they happened, and the
  tokens the drains counted, split between windows and the time outside them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

#: the shortest window: arming takes milliseconds and detaching about a tenth of a second of the
#: recorder's wall time (docs/tuning.md, --duty-cycle); a shorter window would be mostly edges
MIN_ON_S = 0.5
MAX_PERIOD_S = 3600.0
#: windows listed in meta.json (the most recent); older ones are counted, not listed
MAX_WINDOWS_LISTED = 10_000

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m)?\s*$")


def _seconds(text: str) -> float:
    m = _DURATION.match(text)
    if m is None:
        raise ValueError(f"not a duration: {text!r} (e.g. 2s, 500ms, 1m)")
    value = float(m.group(1))
    return value / 1e3 if m.group(2) == "ms" else value * 60 if m.group(2) == "m" else value


@dataclass(frozen=True)
class DutySpec:
    on_s: float
    period_s: float
    # --duty-logits: the logits rows out between windows too (log-probs in windows only)
    logits: bool = False

    @property
    def share(self) -> float:
        return self.on_s / self.period_s

    @property
    def text(self) -> str:
        return f"{self.on_s:g}s/{self.period_s:g}s"


def parse_duty_cycle(text: str) -> DutySpec:
    """ "ON/PERIOD" ("2s/20s", "500ms/10s", "2/20": seconds); ValueError when malformed, when the
    window is not shorter than the period, shorter than MIN_ON_S or the period over MAX_PERIOD_S."""
    on_text, sep, period_text = text.partition("/")
    if not sep:
        raise ValueError(f"expected ON/PERIOD such as 2s/20s, got {text!r}")
    on_s, period_s = _seconds(on_text), _seconds(period_text)
    if on_s < MIN_ON_S:
        raise ValueError(f"the window ({on_s:g} s) must be at least {MIN_ON_S:g} s")
    if not on_s < period_s <= MAX_PERIOD_S:
        raise ValueError(f"the period must be longer than the window and at most {MAX_PERIOD_S:g} s")
    return DutySpec(on_s, period_s)


@dataclass
class WindowRates:
    """The tokens the drains counted while a window was open and in the time before it."""

    tokens_in: float = 0.0
    seconds_in: float = 0.0
    tokens_out: float = 0.0
    seconds_out: float = 0.0

    def rates(self, min_tokens: float) -> tuple[float, float] | None:
        """(tokens/s in the window, outside it), or None when either side saw too few tokens
        for a rate (an idle engine costs nothing to watch: no decision is made then)."""
        if self.tokens_in < min_tokens or self.tokens_out < min_tokens:
            return None
        if self.seconds_in <= 0 or self.seconds_out <= 0:
            return None
        return self.tokens_in / self.seconds_in, self.tokens_out / self.seconds_out


class DutyController:
    """The share of time in windows, decided after each window."""

    #: the engine's tokens/s the windows may cost, averaged over the cycle
    TARGET_COST = 0.01
    #: the lowest share it goes down to (a window of ON every ON/MIN_SHARE seconds)
    MIN_SHARE = 0.01
    #: a window whose drains found more of the ring filled than this: the consumer lags
    LAG_FILL = 0.25
    #: each window without a reason to lower it raises the share by this factor, up to the asked
    RECOVER = 1.25
    #: the in-window slowdown is smoothed over windows (one window's tokens/s is noisy)
    SMOOTHING = 0.3
    #: tokens a side of the comparison needs before it is trusted
    MIN_TOKENS = 8.0

    def __init__(self, spec: DutySpec) -> None:
        self.asked = spec
        self.share = spec.share
        self.slowdown: float | None = None  # smoothed 1 - tokens/s in windows / outside
        self.lowered = 0  # times the share went down
        self.last_reason = ""

    @property
    def period_s(self) -> float:
        return self.asked.on_s / self.share

    def after_window(self, rates: tuple[float, float] | None, lagging: bool) -> float:
        """The share for the next cycle, given the window's and the outside's tokens/s (None:
        not enough tokens to compare) and whether the consumer lagged during the window."""
        if rates is not None:
            rate_in, rate_out = rates
            drop = max(0.0, 1.0 - rate_in / rate_out) if rate_out > 0 else 0.0
            s = self.slowdown
            self.slowdown = drop if s is None else s + self.SMOOTHING * (drop - s)
        cost = self.share * (self.slowdown or 0.0)
        if lagging:
            self._lower(self.share / 2, "the consumer lagged (ring filling or records lost)")
        elif rates is not None and cost > self.TARGET_COST:
            self._lower(
                self.share * self.TARGET_COST / cost,
                f"tokens/s {self.slowdown:.1%} lower in windows than outside",
            )
        elif self.share < self.asked.share and (rates is None or cost < self.TARGET_COST / 2):
            self.share = min(self.asked.share, self.share * self.RECOVER)
            self.last_reason = "raised back towards the share asked"
        return self.share

    def _lower(self, share: float, reason: str) -> None:
        share = max(self.MIN_SHARE, min(self.asked.share, share))
        if share < self.share:
            self.lowered += 1
        self.share = share
        self.last_reason = reason

    def meta(self) -> dict[str, Any]:
        return {
            "share_asked": round(self.asked.share, 4),
            "share_now": round(self.share, 4),
            "period_s_now": round(self.period_s, 3),
            "slowdown_in_windows": None if self.slowdown is None else round(self.slowdown, 4),
            "lowered": self.lowered,
            "last_reason": self.last_reason,
        }


@dataclass
class _Window:
    arm_began: float
    armed_at: float
    disarm_began: float | None = None
    disarmed_at: float | None = None


@dataclass
class DutyCycle:
    """The schedule, on time.monotonic() seconds. The probes are armed when it starts (attach
    put them in): the first window runs from `start`, its probes going in from `since` (when
    the attach began; `start` when not given)."""

    spec: DutySpec
    start: float
    since: float | None = None
    controller: DutyController = field(init=False)
    armed: bool = True
    windows: list[_Window] = field(default_factory=list)
    windows_dropped: int = 0  # windows no longer listed (MAX_WINDOWS_LISTED)
    covered_s: float = 0.0  # full detail: from armed to the start of the detach, summed
    _phase_start: float = field(init=False)
    _rates: WindowRates = field(default_factory=WindowRates)
    _lagging: bool = False
    _obs_at: float | None = None
    _obs_tokens: int = 0
    _obs_losses: int | None = None

    def __post_init__(self) -> None:
        self.controller = DutyController(self.spec)
        self._phase_start = self.start
        self.windows.append(_Window(self.start if self.since is None else self.since, self.start))

    def next_change(self) -> float:
        """When the probes next go in or out."""
        on = self.spec.on_s
        return self._phase_start + (on if self.armed else self.controller.period_s - on)

    def tick(self, now: float) -> str | None:
        """ "disarm" or "arm" when it is time to, else None."""
        if now < self.next_change():
            return None
        return "disarm" if self.armed else "arm"

    def disarmed(self, began: float, done: float) -> None:
        """The probes went out: detaching began at `began` and returned at `done`. The window
        closes; the controller decides the next period from it."""
        w = self.windows[-1]
        w.disarm_began, w.disarmed_at = began, done
        self.covered_s += max(0.0, began - w.armed_at)
        self.armed = False
        self._phase_start = began
        self.controller.after_window(self._rates.rates(DutyController.MIN_TOKENS), self._lagging)
        self._lagging = False
        # the next comparison: the next window against the time outside before it
        self._rates = WindowRates()

    def armed_again(self, began: float, done: float) -> None:
        """The probes went in: attaching began at `began` and returned at `done`."""
        self.armed = True
        self._phase_start = done
        self.windows.append(_Window(began, done))
        if len(self.windows) > MAX_WINDOWS_LISTED:
            del self.windows[0]
            self.windows_dropped += 1

    def observe(self, now: float, tokens: int, fill: float, losses: int) -> None:
        """A drain at `now`: `tokens` counted so far, the share of the ring it found `fill`ed,
        `losses` so far. The tokens since the last drain count for the phase the probes were in
        at its end (drains come at most --drain-interval apart: a phase boundary between two
        drains misattributes at most one drain's tokens)."""
        if self._obs_at is not None:
            dt, dn = now - self._obs_at, tokens - self._obs_tokens
            r = self._rates
            if self.armed:
                r.tokens_in += dn
                r.seconds_in += dt
            else:
                r.tokens_out += dn
                r.seconds_out += dt
        # (the first drain takes what piled up while attaching: no sign of lag)
        if (
            self.armed
            and self._obs_at is not None
            and (
                fill > DutyController.LAG_FILL or (self._obs_losses is not None and losses > self._obs_losses)
            )
        ):
            self._lagging = True
        self._obs_at, self._obs_tokens, self._obs_losses = now, tokens, losses

    def close(self, now: float) -> None:
        """The recording ends: a window still open ends now."""
        w = self.windows[-1]
        if self.armed and w.disarm_began is None:
            w.disarm_began = w.disarmed_at = now
            self.covered_s += max(0.0, now - w.armed_at)

    def coverage(self, now: float) -> float:
        """The share of the time since the start in full detail, a window still open counted to
        `now`."""
        elapsed = now - self.start
        if elapsed <= 0:
            return 1.0 if self.armed else 0.0
        w = self.windows[-1]
        open_s = max(0.0, now - w.armed_at) if self.armed and w.disarm_began is None else 0.0
        return min(1.0, (self.covered_s + open_s) / elapsed)

    def meta(self, now: float) -> dict[str, Any]:
        """meta.json `duty_cycle`. Times are time.monotonic(), CLOCK_MONOTONIC as the rows'
        t_*_ns: a token is in full detail when its step lies in a window's [armed, detach
        began]; sparse rows may come from [attach began, detached]."""
        elapsed = max(1e-9, now - self.start)

        def ns(t: float | None) -> int | None:
            return None if t is None else int(t * 1e9)

        return {
            "asked": self.spec.text,
            "windows": len(self.windows) + self.windows_dropped,
            "covered_s": round(self.covered_s, 3),
            "elapsed_s": round(elapsed, 3),
            "coverage": round(min(1.0, self.covered_s / elapsed), 4),
            # [attach began, armed, detach began, detached], CLOCK_MONOTONIC ns
            "windows_ns": [
                [ns(w.arm_began), ns(w.armed_at), ns(w.disarm_began), ns(w.disarmed_at)] for w in self.windows
            ],
            "windows_not_listed": self.windows_dropped,
            "controller": self.controller.meta(),
        }
