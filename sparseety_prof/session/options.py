"""What a recording session is asked to do (Options, from the command line) and what it has done
so far (Progress, read by the live view and the summary line)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from sparseety_prof.capture.cpu_sampler import DEFAULT_RATE_HZ
from sparseety_prof.capture.options import Capture
from sparseety_prof.correlate.serving import DEFAULT_HEADER
from sparseety_prof.session.duty_cycle import DutySpec
from sparseety_prof.session.memory_budget import DEFAULT_MAX_MEMORY
from sparseety_prof.session.policy import PolicyChoice
from sparseety_prof.session.request_hold import DEFAULT_WINDOW_BYTES

if TYPE_CHECKING:
    from sparseety_prof.session.follow_target import FollowTarget

#: default --flush-interval, seconds, without a journal or with a sink. Each flush writes a segment
#: per table (Parquet, two fsyncs) and rewrites meta.json, a fixed cost that shorter intervals pay
#: more often (measured in docs/overhead.md, "Overhead, change by change"). Between flushes each
#: drain's rows go to the recording's journal (store/journal.py) in the page cache, so a recorder
#: killed outright (SIGKILL, the OOM killer) loses about the last drain; Ctrl-C, SIGTERM and SIGHUP
#: lose nothing. The sinks (metrics, OTLP) get rows at flushes: their freshness.
FLUSH_INTERVAL_S = 10.0
#: default --flush-interval, seconds, when the journal holds the rows between flushes and no sink
#: waits for them: a kill loses no more than with shorter flushes, and the segments' fixed cost is
#: paid a third as often (Options.flush_s; docs/durability.md, "Cost")
FLUSH_INTERVAL_JOURNALED_S = 30.0
#: default --fsync-interval, seconds: how often the journal is fsynced, what a power cut loses
#: at most (the segments are fsynced as written). The flush interval's old guarantee, kept.
FSYNC_INTERVAL_S = 10.0
#: default --drain-interval, seconds: the longest pause between two drains (a ring that fills fast
#: is drained sooner: session/sched.py). A drain has a fixed cost whatever it holds (the
#: correlation's set-up, the row passes), so fewer drains cost less per token and preempt the
#: engine less often (measured in docs/overhead.md, "Drains a second apart").
DRAIN_INTERVAL_S = 1.0
DRAIN_INTERVAL_MIN_S = 0.05  # below it the ring watch and the pace do the job; each drain has a cost
DRAIN_INTERVAL_MAX_S = 10.0  # the live view, the sinks and the policies wait that long for rows
#: default --ring-mb. Full capture of a large vocabulary fills it fast (the logits rows), so the pace
#: drains it sooner than --drain-interval; a bigger ring lets drains come further apart and costs
#: resident memory (its pages are mapped twice; measured in docs/overhead.md)
RING_MB = 64
#: what `--ablate-consumer KIND` still does with each drain (session/ablation.py)
ABLATION_KINDS = ("drain", "logits")
#: default --slice-us: 0, the kernel's own slice. A short one measured worse (docs/overhead.md):
#: EEVDF runs a short-slice thread sooner, so it preempts the engine more often
SLICE_US = 0
#: default --metrics-bind: loopback (expert load over time is routing, as sensitive as prompts)
METRICS_BIND = "127.0.0.1"


@dataclass(frozen=True)
class Outputs:
    """Where rows go besides the recording, and what is said while recording (the fleet and
    output flags of `record`/`attach`)."""

    otlp: str | None = None  # an OTLP/HTTP collector: a span per request (session/otlp_sink.py)
    otlp_token_events: float = 0.0  # the share of each request's tokens attached as span events
    otlp_steps: bool = False  # also a span per micro-batch
    metrics_port: int | None = None  # serve Prometheus metrics on this port (session/metrics_sink.py)
    metrics_bind: str = METRICS_BIND  # the address the metrics endpoint listens on
    metrics_experts: str | None = None  # the endpoint's expert series (None: its own default, auto)
    dataset: Path | None = None  # collect each closed recording into this dataset
    status_interval: float | None = None  # seconds between status lines; None: on when not a terminal


@dataclass
class Options:
    pid: int
    out: Path | None
    duration: float | None = None
    # rows older than this are in Parquet segments; None: chosen by the run (flush_s)
    flush_interval: float | None = None
    fsync_interval: float = FSYNC_INTERVAL_S  # the journal's rows older than this survive a power cut
    journal: bool = True  # each drain's rows to the recording's journal (False: at flushes only)
    max_disk: int | None = None  # bytes the recording may hold; the oldest segments make room
    redact_text: bool = False
    redact: frozenset[str] = frozenset()  # redaction levels applied to every row (store/redaction_levels.py)
    redact_layers: frozenset[int] | None = None  # the layers the per-layer levels apply to (None: all)
    model: Path | None = None  # override when the process has no GGUF file mapped or open
    skip_probes: frozenset[str] = frozenset()  # for tests: disable a probe point on purpose
    nice: int = 10  # consumer priority once attached: the engine's threads win any contention
    sched: str = "nice"  # "nice": compete at `nice`; "idle": SCHED_IDLE, escalating when the ring fills
    # the longest records wait in the ring for a consumer that does not drain (starved under
    # --sched idle) before it takes the engine's priority; 0: only a filling ring raises it
    max_drain_gap: float = 5.0
    drain_interval: float = DRAIN_INTERVAL_S  # the longest pause between two drains
    slice_us: int = SLICE_US  # the consumer's CPU slice at SCHED_OTHER (session/sched_slice.py); 0: kernel's
    request_header: str = DEFAULT_HEADER  # HTTP header carrying the client's request id
    capture: Capture = field(default_factory=Capture)  # sparse decisions to capture
    # where MoE values are read: "auto" = at the weighted multiply where the graph allows; "ops" =
    # at get_rows and the GLU op (capture.plans.MoePlan)
    moe_read: str = "auto"
    discover_layout: bool = False  # learn the llama_ubatch layout on live data even if the table has it
    discover_timeout: float = 120.0  # seconds to wait for forward passes to learn a layout from
    ring_mb: int = RING_MB  # the ring buffer the probes write to (a power of two; kernel memory, locked)
    # seconds of drains correlated together, their logits rows reduced as drained
    # (session/drain_batches.py); 0: each drain correlated as it is taken
    correlate_every: float = 0.0
    policy: tuple[str, ...] = ("full",)  # what the recording keeps (session/policy.py), any of them
    policy_window: int = DEFAULT_WINDOW_BYTES  # bytes of rows the per-request policies hold until decided
    max_memory: int | None = DEFAULT_MAX_MEMORY  # the consumer's anonymous memory (session/memory_budget.py)
    aggregate_s: int = 10  # bucket of the always-on aggregates table
    # samples per second of CPU time of each engine thread (capture/cpu_sampler.py, the cpu_stacks
    # table); 0: no sampling
    cpu_sample_hz: int = DEFAULT_RATE_HZ
    # who took the CPU: per step and engine thread, time on CPU, runnable (and who ran instead),
    # sleeping, stopped (capture/sched_waits.py, the thread_waits table)
    sched_waits: bool = True
    # per-operator tracing (session/op_times.py, the op_times table): its probes in for ON seconds
    # every PERIOD; None: off
    trace_ops: DutySpec | None = None
    bpf_stats: bool = False  # count each probe program's runs and run time (capture/bpf_stats.py)
    # after the start-up work, drain the ring and discard the records: the probes' cost alone
    # ("drain"), or with each drain's logits rows reduced first ("logits"); "": not ablated
    # (session/ablation.py)
    ablate_consumer: str = ""
    # where the recorder's threads run: "auto" (a core no engine thread may use, if any), "none",
    # or a CPU list (session/placement.py)
    recorder_cpus: str = "auto"
    # the expensive probes in for ON seconds every PERIOD, out between (session/duty_cycle.py);
    # None: always in
    duty_cycle: DutySpec | None = None
    # --follow NAME / --follow-unit UNIT: the processes recorded one after another
    # (session/follow.py); None: the one process `pid`
    follow: FollowTarget | None = None
    late_attach: bool = False  # load the CUPTI injection library into the running process first
    # with late_attach: the watched kernels, --watch's entries and --preset's engines (made into
    # the library's spec by gpu/presets.py watch_spec where the late attach uses them)
    late_attach_watch: str | None = None
    late_attach_presets: tuple[str, ...] = ()
    outputs: Outputs = field(default_factory=Outputs)
    # `policy` parsed, once per Options: what each recording's RecordingPolicy is made from
    policy_choice: PolicyChoice = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        """ValueError for `policy` values that cannot work (session/policy.py)."""
        self.policy_choice = PolicyChoice.parse(self.policy)
        self.policy = self.policy_choice.specs

    @property
    def flush_s(self) -> float:
        """Seconds between flushes: `--flush-interval`, or by default FLUSH_INTERVAL_JOURNALED_S
        when the journal keeps every drain's rows and no sink (metrics, OTLP) waits for them, else
        FLUSH_INTERVAL_S."""
        if self.flush_interval is not None:
            return self.flush_interval
        sinks = self.outputs.metrics_port is not None or self.outputs.otlp is not None
        journaled = self.journal and self.out is not None
        return FLUSH_INTERVAL_JOURNALED_S if journaled and not sinks else FLUSH_INTERVAL_S


@dataclass
class Progress:
    """What the live view and the summary line show; updated by the consumer loop."""

    tokens: int = 0
    steps: int = 0
    requests: int = 0  # requests ended (their rows made), for the status line
    records: int = 0
    kernel_drops: int = 0
    seq_gaps: int = 0
    cpu_s: float = 0.0
    lag_ms: float = 0.0
    logits_incomplete: int = 0
    ring_fill_peak: float = 0.0  # largest share of the ring one drain found filled
    drain_gap_max_ms: float = 0.0  # longest time between two drains (the consumer waited for CPU)
    drain_gap_max_at_s: float = 0.0  # when it ended, in seconds after the consumer's start
    flush_wall_max_ms: float = 0.0  # longest piece of a flush between two drains, wall (waits for CPU too)
    flush_cpu_ms: float = 0.0  # the consumer thread's CPU in that piece
    flush_piece_max: str = ""  # what that piece was ("rows tokens", "segment routes", "aggregates", ...)
    escalations: int = 0  # times the consumer left SCHED_IDLE because the ring was filling
    rss_bytes: int = 0  # the recorder's resident memory at the last drain
    anon_bytes: int = 0  # and its anonymous part (what --max-memory bounds)
    # --duty-cycle: the share of the time so far in full detail (the sparse probes in); None: no
    # duty cycle (every step in full detail)
    sparse_coverage: float | None = None

    def counters(self) -> dict[str, float]:
        return {
            "cpu_s": self.cpu_s,
            "lag_ms": self.lag_ms,
            "rss_bytes": self.rss_bytes,
            "kernel_drops": self.kernel_drops,
            "seq_gaps": self.seq_gaps,
            "logits_incomplete": self.logits_incomplete,
        }
