"""Where the consumer's CPU goes, by stage, on the consumer thread's own CPU clock.

A sampling profiler of the recorder (scripts/profile_consumer.py, py-spy) samples wall time: a
consumer at nice 10 that the engine's threads preempt is sampled wherever it was preempted, most
often just after a system call (the statistics of /proc, getrusage), so the stages that make
system calls look costlier than they are. CLOCK_THREAD_CPUTIME_ID counts only the time the
thread ran. A lap costs one clock read (well under a microsecond); the consumer laps a handful of
times per drain, not per token.

meta.json `consumer.cpu_s_by_stage` holds the totals from the first drain to the last flush
(the writer's close, which writes meta.json, is the only work after it): the stages below,
`model_hash` (the thread that hashes the model file and scans its weights, once per attach),
and `other_threads`, the rest of the process's CPU time over the same span (the ring watch,
Polars' thread pool when it writes Parquet, the OTLP and metrics sinks' threads)."""

from __future__ import annotations

import time

#: the consumer's stages, in the order of a drain
STAGES: tuple[str, ...] = (
    "ring_walk",  # records copied out of the ring (RingReader.take)
    "decode",  # record groups decoded, sequence numbers checked
    "correlate",  # records to steps, tokens and requests (Correlator.feed)
    "logits",  # the log-prob, top-k and entropy of each logits row (C)
    "rows",  # the drain's token, step, request and routes columns (Correlator.take_tables)
    "cpu_stacks",  # the CPU sampler's samples taken, named and joined to steps (--cpu-sample-hz)
    "thread_waits",  # the scheduler program's waits taken and joined to steps (--no-sched-waits)
    "op_times",  # the operator probes' records joined to steps (--trace-ops)
    "frames_sinks",  # frames from those columns; aggregates, policy, sinks, the writer's buffers
    "journal",  # the drain's rows encoded and appended to the recording's journal (--no-journal)
    "flush",  # Parquet segments, aggregates, meta.json (a due flush, or --max-memory's)
    "loop",  # the rest: the pace, the liveness check, the progress counters
    "detach",  # the probes detached and the BPF programs unloaded at the end
)


class StageCpu:
    """CPU seconds of the calling thread, by stage. `lap(stage)` charges the time since the
    previous lap to `stage`; every call must come from the same thread."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(STAGES, 0.0)
        self._last = time.thread_time()

    def restart(self) -> None:
        """Zero every stage and start counting from now, on the calling thread."""
        self.seconds = dict.fromkeys(STAGES, 0.0)
        self._last = time.thread_time()

    def lap(self, stage: str) -> None:
        now = time.thread_time()
        self.seconds[stage] += now - self._last
        self._last = now

    def move(self, seconds: float, src: str, dst: str) -> None:
        """Charge `seconds` already counted in `src` to `dst` (a stage measured inside another)."""
        self.seconds[src] -= seconds
        self.seconds[dst] += seconds

    def meta(self, process_cpu_s: float, apart: dict[str, float] | None = None) -> dict[str, float]:
        """The totals, then `apart` (other threads' CPU seconds over the same span, by name: the
        model file's hash), and the rest of the process CPU time not spent on this thread
        (`process_cpu_s`: the process's user + system time over the span)."""
        out = {k: round(v, 4) for k, v in self.seconds.items()}
        apart = apart or {}
        out.update({k: round(v, 4) for k, v in apart.items()})
        rest = process_cpu_s - sum(self.seconds.values()) - sum(apart.values())
        out["other_threads"] = round(max(0.0, rest), 4)
        return out
