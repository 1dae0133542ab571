"""The CPU sampler's samples joined to the steps they fell in: the cpu_stacks table.

A sample (capture/cpu_sampler.py) carries its time, CLOCK_MONOTONIC like the steps' windows
(steps.t_start_ns..t_end_ns, process_ubatch's entry and return): the step whose window holds that
time is the one the sample's CPU went to, whichever engine thread took it (the worker threads of
a CPU backend compute the step the calling thread runs). A step's row comes when it ends, so a
sample newer than the latest step end seen waits: the step it fell in may still be running. It is
counted between steps once a step ending after it arrives without holding it, at the end, or when
it is older than HOLD_S (a step longer than that: its samples count as between steps).

Steps whose rows the policy did not keep (head sampling in the probes sets their rows apart) still
give their windows: their samples are "unrecorded_step", not between steps.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from sparseety_prof.capture.cpu_sampler import CpuSampler, Sample
from sparseety_prof.capture.stack_symbols import Symboliser
from sparseety_prof.errors import ProfError
from sparseety_prof.store import schema
from sparseety_prof.store.array_rows import ArrayRows

HOLD_S = 30.0
OVERLAP_LOOKBACK = 4  # windows looked at before a sample: contexts whose steps overlap
BETWEEN_STEPS = "between_steps"
UNRECORDED_STEP = "unrecorded_step"
STEP_KINDS = ("prompt", "decode", "mixed", BETWEEN_STEPS, UNRECORDED_STEP)
_COLUMNS = schema.columns(
    "cpu_stacks",
    "step_id",
    "step_kind",
    "phase",
    "ctx_id",
    "pid",
    "tid",
    "in_kernel",
    "stack",
    "samples",
    "t_first_ns",
)
schema.check_columns("cpu_stacks", _COLUMNS)


def step_kind(prompt_rows: int | None, decode_rows: int | None) -> str:
    """What a step computed: prompt rows only, decode rows only, or both."""
    p, d = prompt_rows or 0, decode_rows or 0
    if p and d:
        return "mixed"
    return "decode" if d else "prompt"


@dataclass(frozen=True)
class StepWindow:
    t_start: int
    t_end: int
    step_id: int | None
    kind: str
    phase: str | None
    ctx_id: int | None


class CpuProfile:
    """Samples taken from `sampler`, named by `symbols`, joined to the step windows given."""

    def __init__(
        self,
        sampler: CpuSampler,
        symbols: Symboliser,
        *,
        hold_s: float = HOLD_S,
        clock: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        """`clock`: CLOCK_MONOTONIC in ns, the samples' clock (what `hold_s` is counted on)."""
        self.sampler = sampler
        self._clock = clock
        self.symbols = symbols
        self.pid = sampler.pid
        self._hold_ns = int(hold_s * 1e9)
        self._starts: list[int] = []
        self._windows: list[StepWindow] = []
        self._latest_end = 0
        self._pending: list[Sample] = []
        self._folded: dict[tuple[tuple[int, ...], bool], str] = {}
        self._stopped_meta: dict[str, Any] | None = None
        self.joined = {kind: 0 for kind in STEP_KINDS}

    # ------------------------------------------------------------------ windows
    def _add_window(self, w: StepWindow) -> None:
        i = bisect.bisect_right(self._starts, w.t_start)
        self._starts.insert(i, w.t_start)
        self._windows.insert(i, w)
        self._latest_end = max(self._latest_end, w.t_end)

    def add_steps(self, steps: Mapping[str, list[Any]]) -> None:
        """Recorded steps, from the recorder's steps columns (schema.STEPS names)."""
        ids = steps.get("step_id") or []
        if not ids:
            return
        cols = zip(
            ids,
            steps["t_start_ns"],
            steps["t_end_ns"],
            steps["phase"],
            steps["ctx_id"],
            steps["prompt_rows"],
            steps["decode_rows"],
            strict=True,
        )
        for sid, t0, t1, phase, ctx, p, d in cols:
            if t0 is not None and t1 is not None:
                self._add_window(StepWindow(int(t0), int(t1), int(sid), step_kind(p, d), phase, ctx))

    def add_unrecorded(self, steps: Mapping[str, list[Any]]) -> None:
        """Windows of steps whose rows were set apart (Correlator.take_apart's steps parts)."""
        try:
            t0s, t1s = steps["t_start_ns"], steps["t_end_ns"]
        except KeyError:
            return
        for t0, t1 in zip(t0s, t1s, strict=True):
            if t0 is not None and t1 is not None:
                self._add_window(StepWindow(int(t0), int(t1), None, UNRECORDED_STEP, None, None))

    def _window_of(self, ts: int) -> StepWindow | None:
        i = bisect.bisect_right(self._starts, ts) - 1
        # windows of one context do not overlap: the latest started before ts, or for several
        # contexts running at once, one of the few before it
        for j in range(i, max(i - OVERLAP_LOOKBACK, -1), -1):
            if self._windows[j].t_end >= ts:
                return self._windows[j]
        return None

    # ------------------------------------------------------------------ rows
    def poll(self, *, final: bool = False) -> schema.Tables:
        """The rows of the samples that can be joined now (every one with `final`)."""
        if self._stopped_meta is None:
            self._take()
        now = self._clock()
        ready: list[tuple[Sample, StepWindow | None]] = []
        held: list[Sample] = []
        for s in self._pending:
            w = self._window_of(s.ts)
            if w is not None or final or s.ts <= self._latest_end or now - s.ts > self._hold_ns:
                ready.append((s, w))
            else:
                held.append(s)
        self._pending = held
        self._prune(min((s.ts for s in held), default=self._latest_end))
        return {"cpu_stacks": self._rows(ready)} if ready else {}

    def _prune(self, before: int) -> None:
        """Windows that no held or future sample can fall in (they ended before it) are let go;
        the latest is kept (a sample equal to its end)."""
        keep = [i for i, w in enumerate(self._windows) if w.t_end >= before]
        if len(keep) == len(self._windows):
            return
        self._windows = [self._windows[i] for i in keep]
        self._starts = [w.t_start for w in self._windows]

    def _take(self) -> None:
        """The sampler's new samples, held until joined; named at once, while the process and its
        mappings are there to name them (an engine that exits takes its /proc files along): the
        stacks not seen before together, so that their new names are demangled in one run."""
        new = self.sampler.take()
        unseen = list(
            dict.fromkeys((s.stack, s.kernel) for s in new if (s.stack, s.kernel) not in self._folded)
        )
        for key, frames in zip(unseen, self.symbols.frames_many(unseen), strict=True):
            self._folded[key] = ";".join(frames)
        self._pending.extend(new)

    def _fold(self, s: Sample) -> str:
        """The folded stack of a sample `_take` held (it folded every stack it took)."""
        return self._folded[(s.stack, s.kernel)]

    def _rows(self, ready: list[tuple[Sample, StepWindow | None]]) -> schema.Columns:
        groups: dict[tuple[Any, ...], list[int]] = {}  # key -> [samples, first ts]
        for s, w in ready:
            kind = w.kind if w is not None else BETWEEN_STEPS
            self.joined[kind] += 1
            key = (
                w.step_id if w is not None else None,
                kind,
                w.phase if w is not None else None,
                w.ctx_id if w is not None else None,
                s.tid,
                s.kernel,
                self._fold(s),
            )
            g = groups.get(key)
            if g is None:
                groups[key] = [1, s.ts]
            else:
                g[0] += 1
                g[1] = min(g[1], s.ts)
        cols: schema.Columns = {c: [] for c in _COLUMNS}
        for (sid, kind, phase, ctx, tid, kernel, stack), (n, t0) in groups.items():
            for c, v in zip(
                _COLUMNS, (sid, kind, phase, ctx, self.pid, tid, kernel, stack, n, t0), strict=True
            ):
                cols[c].append(v)
        return cols

    # ------------------------------------------------------------------ end
    def stop(self) -> None:
        """Sampling stops (with the probes): the last samples taken, the counts read, the perf
        events closed. poll() then joins what is held."""
        if self._stopped_meta is not None:
            return
        self.sampler.pause()  # first: a sample between the last take and the counts would differ
        self._take()
        self._stopped_meta = self.sampler.meta()
        self.sampler.close()

    def meta(self) -> dict[str, Any]:
        """meta.json's cpu_sampler: the rate, the kernel's counts, the joins, the files named."""
        counted = self._stopped_meta if self._stopped_meta is not None else self.sampler.meta()
        return {
            **counted,
            "period_ns": round(1e9 / self.sampler.rate_hz),
            "joined": dict(self.joined),
            "files": self.symbols.files_meta(),
            "python_frames": "not symbolised: Python code shows as the interpreter's own C functions",
        }

    def close(self) -> None:
        self.sampler.close()

    def rows(
        self, steps: Mapping[str, list[Any]], apart_steps: Iterable[ArrayRows], *, final: bool = False
    ) -> schema.Tables:
        """One drain's steps (recorded, and those set apart) in, the samples joinable now out."""
        self.add_steps(steps)
        for part in apart_steps:
            if "t_start_ns" in part.arrays and "t_end_ns" in part.arrays:
                self.add_unrecorded(
                    {"t_start_ns": part.column("t_start_ns"), "t_end_ns": part.column("t_end_ns")}
                )
        return self.poll(final=final)


def open_cpu_profile(pid: int, rate_hz: int) -> CpuProfile | ProfError | None:
    """The sampler of `pid` at `rate_hz`, loaded but not started (`start_cpu_profile`); None when
    off (0); the error when it cannot load here, said by `start_cpu_profile` once the probes are
    in: an attach that fails for the same cause (no bcc, no privileges) says it once, itself."""
    if rate_hz <= 0:
        return None
    try:
        sampler = CpuSampler.load(pid, rate_hz)
    except ProfError as e:
        return e
    return CpuProfile(sampler, Symboliser(pid))


def start_cpu_profile(
    profile: CpuProfile | ProfError | None, log: Callable[[str], None]
) -> CpuProfile | None:
    """The loaded sampler started (the probes are in), or None when it was off or cannot load or
    start (said in the log: the recording goes on without the cpu_stacks rows)."""
    if profile is None:
        return None
    if isinstance(profile, ProfError):
        log(f"sparseety-prof: CPU sampler not loaded: {profile}")
        return None
    try:
        profile.sampler.start()
    except ProfError as e:
        log(f"sparseety-prof: CPU sampler not started: {e}")
        return None
    return profile
