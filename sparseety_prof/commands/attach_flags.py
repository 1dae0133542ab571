"""The flags `record` and `attach` share, and the session Options made from them."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from sparseety_prof.correlate.serving import DEFAULT_HEADER
from sparseety_prof.session.options import (
    ABLATION_KINDS,
    DRAIN_INTERVAL_MAX_S,
    DRAIN_INTERVAL_MIN_S,
    DRAIN_INTERVAL_S,
    FLUSH_INTERVAL_S,
    FSYNC_INTERVAL_S,
    RING_MB,
    SLICE_US,
)

if TYPE_CHECKING:
    from sparseety_prof.capture.process_match import ProcessRule
    from sparseety_prof.session.metrics_sink import PrometheusSink
    from sparseety_prof.session.options import Options
    from sparseety_prof.session.sinks import FrameSink


def add_attach_flags(p: argparse.ArgumentParser, *, output_help: str, output_required: bool) -> None:
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--pid", type=int, help="process id of the running engine")
    target.add_argument(
        "--follow",
        metavar="NAME",
        default=None,
        help="wait for a process whose name (/proc/PID/comm, as `pgrep -x` matches it) is NAME, record "
        "it, and when it exits wait for the next one (a restart): one recording per process under -o "
        "DIR, listed in DIR/follow.json (README: Following a restarting engine)",
    )
    p.add_argument(
        "--follow-user",
        metavar="USER",
        default=None,
        help="with --follow: follow processes of this user (name or id) instead of your own; a "
        "process name proves nothing: any user can start a program with that name",
    )
    p.add_argument("-o", "--output", type=Path, required=output_required, default=None, help=output_help)
    p.add_argument("--duration", type=float, default=None, help="detach after this many seconds")
    p.add_argument(
        "--redact-text",
        action="store_true",
        help="keep token ids but store no token text, and no prompt or other "
        "text from the engine's command line, environment or server settings (README: Privacy)",
    )
    p.add_argument(
        "--redact",
        action="append",
        default=[],
        metavar="LEVEL[,LEVEL]",
        help="also leave out what recovers tokens: ids (token ids and text), routing (per-token "
        "experts and gate weights; the expert load per layer stays), sparsity (ratios rounded to 0.1), "
        "masks (activation masks); `sparseety-prof audit` measures what each leaves (README: Privacy)",
    )
    p.add_argument(
        "--redact-layers",
        default=None,
        metavar="LAYERS",
        help="apply the routing, sparsity and masks levels of --redact to these model layers only "
        "(e.g. 0-3 or 0,5: the layers `audit` finds leaking most); default every layer",
    )
    p.add_argument(
        "--flush-interval",
        type=float,
        default=FLUSH_INTERVAL_S,
        metavar="SECONDS",
        help="write the rows gathered as Parquet segments at least this often (default "
        f"{FLUSH_INTERVAL_S:g}); in between, each drain's rows go to the recording's journal, so "
        "that a recorder killed outright (SIGKILL, the OOM killer) loses about the last drain; "
        "metrics and OTLP exporters get rows at the flush pace",
    )
    p.add_argument(
        "--fsync-interval",
        type=float,
        default=FSYNC_INTERVAL_S,
        metavar="SECONDS",
        help="fsync the recording's journal this often, so that a power cut loses at most about "
        f"this much (default {FSYNC_INTERVAL_S:g}; 0: after each drain)",
    )
    p.add_argument(
        "--max-disk",
        default=None,
        metavar="SIZE",
        help="keep the recording within SIZE on disk (e.g. 500M, 2G): beyond it the oldest segments "
        "are removed, so that it holds the latest stretch of the run; the rows removed are counted "
        "in meta.json (rotation), apart from losses (default: no limit)",
    )
    p.add_argument(
        "--policy",
        action="append",
        default=None,
        metavar="POLICY",
        help="what the recording keeps, repeatable (a request is kept when any policy keeps it): full "
        "(default) every row; aggregate only the always-on aggregates and the requests table; head:RATE "
        "the requests whose id hashes below RATE (decided at their start, the same ids in every run); "
        "tail:Q the requests whose time per output token is above the running Q quantile; "
        "anomaly[:KIND,...] the requests in which an anomaly detector fires, and the steps around it. "
        "The aggregates and the requests table are kept whatever the policy; what it drops is counted "
        "in meta.json policy, apart from losses; metrics and exporters (--metrics-port, --otlp) see every "
        "row whatever the policy",
    )
    p.add_argument(
        "--max-memory",
        default="256M",
        metavar="SIZE",
        help="anonymous memory the recorder may hold (default 256M, at least 64M; 'none': no limit): above "
        "it, the rows gathered since the last flush are written out at once; counted in meta.json "
        "profiler_memory.budget",
    )
    p.add_argument(
        "--policy-window",
        default="64M",
        metavar="SIZE",
        help="memory the rows of undecided requests may hold under tail and anomaly policies (default "
        "64M); beyond it the oldest undecided requests are kept early, counted in meta.json policy.window",
    )
    p.add_argument(
        "--correlate-every",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="reduce each drain's logits rows to their statistics as it is taken and correlate the "
        "drains of SECONDS together (up to 10): less CPU per token when the consumer has a core of "
        "its own, more when the engine keeps every core busy (README); default 0, each drain as taken",
    )
    p.add_argument(
        "--drain-interval",
        type=float,
        default=DRAIN_INTERVAL_S,
        metavar="SECONDS",
        help=f"the longest pause between two drains of the ring (default {DRAIN_INTERVAL_S:g}; sooner when "
        "the ring fills fast, so that a drain finds at most a quarter of it filled). Each drain has a "
        "fixed cost whatever it holds: fewer drains cost less CPU per token, but rows reach the "
        "recording, live view and sinks later, and a drain holds more records",
    )
    p.add_argument(
        "--ring-mb",
        type=int,
        default=RING_MB,
        metavar="MIB",
        help=f"size of the ring buffer the probes write into, a power of two (default {RING_MB}: a burst of "
        "full capture with a 32k vocabulary fills about 40 MB/s while the consumer waits for CPU); kernel "
        "memory; a drain should find at most a quarter of it filled, so a bigger ring lets drains come "
        "further apart at high token rates; what does not fit is counted as kernel_drops",
    )
    p.add_argument(
        "--aggregate-interval",
        type=int,
        default=10,
        metavar="SECONDS",
        help="length of the buckets of the always-on aggregates table (expert load, sparsity, "
        "log-prob and step-latency histograms; default 10)",
    )
    p.add_argument("--model", type=Path, default=None, help="model file, when the engine has none mapped")
    p.add_argument(
        "--discover-layout",
        action="store_true",
        help="learn the engine's private llama_ubatch layout from its first forward passes even when "
        "the table of verified layouts has its build (those passes are not recorded)",
    )
    p.add_argument(
        "--discover-timeout",
        type=float,
        default=120.0,
        help="seconds to wait for forward passes when the layout must be learned (default 120)",
    )
    p.add_argument(
        "--nice",
        type=int,
        default=10,
        help="niceness the consumer takes once attached, so the engine wins CPU contention (default 10)",
    )
    p.add_argument(
        "--mode",
        choices=("full", "tokens"),
        default="full",
        help="full (default): tokens plus MoE routing, activation sparsity and attention coverage; "
        "tokens: token boundaries, ids and log-probs only (fewer probes)",
    )
    p.add_argument(
        "--act-threshold",
        type=float,
        default=1e-2,
        help="activations with |x| below this count in act_below_ratio (default 0.01; recorded in metadata)",
    )
    p.add_argument(
        "--act-every",
        type=int,
        default=1,
        metavar="N",
        help="count the activations of one decode step in N (default 1: every step). The counting is "
        "the probes' largest cost in the engine's threads; the other steps keep their routing and "
        "get null activation ratios, and the aggregates' sparsity histograms become a sample of them",
    )
    p.add_argument(
        "--capture-router-probs",
        action="store_true",
        help="also record the router probability of every expert per MoE layer",
    )
    p.add_argument(
        "--capture-masks",
        action="store_true",
        help="also record the activation zero masks, bit-packed, in the masks table",
    )
    p.add_argument(
        "--moe-read",
        choices=("auto", "ops"),
        default="auto",
        help="where MoE routing and activations are read: auto (default) = at each MoE layer's weighted "
        "multiply where the graph allows (fewest probe hits); ops = at the router's get_rows and the "
        "GLU op (more probe hits, for engine builds whose MoE graph differs)",
    )
    p.add_argument(
        "--sched",
        choices=["idle", "nice"],
        default="nice",
        help="consumer CPU policy once attached: nice (default) = run at --nice; idle = SCHED_IDLE (only CPU "
        "the engine leaves idle). Either way it takes nice 0 once it falls behind (over a third of the "
        "ring filled, seen by the ring watch's thread as the probes write or by a drain) until it has "
        "caught up. idle suits sampling policies in production (measured with --policy head:0.01 on "
        "saturated cores: no records lost, 37-43 us of CPU per token, the inter-token p99 0.97-1.12 "
        "times the engine's alone), but the consumer then drains seldom while the engine is busy: rows "
        "reach the recording, live view and sinks up to about twice --max-drain-gap late",
    )
    p.add_argument(
        "--max-drain-gap",
        type=float,
        default=5.0,
        metavar="S",
        help="when records have waited this long with no drain (a consumer starved under --sched idle), "
        "the consumer takes nice 0 until it has caught up, as when the ring fills (default 5; 0 = only a "
        "filling ring raises it: under --sched idle with a sampling policy, drains 20 s apart)",
    )
    p.add_argument(
        "--slice-us",
        type=int,
        default=SLICE_US,
        metavar="US",
        help="CPU slice the consumer asks the kernel for while it competes at --nice (Linux 6.12+; "
        "100-100000, default 0 = the kernel's own). Shorter slices spread its CPU over more decode steps "
        "but let it preempt the engine more often: 100 measured worse on a saturated 2-core host",
    )
    p.add_argument(
        "--bpf-stats",
        action="store_true",
        help="count each probe program's runs and the time it ran in the engine's threads (the kernel's "
        "BPF statistics, on while attached; two clock reads per probe hit), in meta.json bpf_programs",
    )
    p.add_argument(
        "--ablate-consumer",
        nargs="?",
        const="drain",
        default="",
        choices=ABLATION_KINDS,
        metavar="KIND",
        help="measure the probes' cost alone: after the start-up work (first tokens recorded, the "
        "attention layer map learned and its graph-op probes detached), drain the ring and discard "
        "the records; the recording keeps only the rows made before (meta.json consumer.ablated). "
        "KIND `logits` reduces each drain's logits rows to their statistics before the discard: the "
        "floor under any full-mode consumer. For benchmarks: scripts/bench_sustained.py --ablate-consumer",
    )
    p.add_argument(
        "--request-header",
        default=DEFAULT_HEADER,
        metavar="NAME",
        help=f"HTTP servers: header whose value becomes request_id (default {DEFAULT_HEADER}); "
        "requests without it get generated ids",
    )
    p.add_argument(
        "--otlp",
        default=None,
        metavar="URL",
        help="also send each request as an OpenTelemetry span (GenAI conventions) to this OTLP/HTTP "
        "collector, e.g. http://localhost:4318 (/v1/traces is added to a URL with no path); a "
        "collector that is slow or down costs dropped spans, counted in meta.json (README: OpenTelemetry)",
    )
    p.add_argument(
        "--otlp-token-events",
        type=float,
        default=0.0,
        metavar="RATE",
        help="with --otlp: also attach this share (0..1) of each request's tokens as span events "
        "(default 0; at most 128 per span)",
    )
    p.add_argument(
        "--otlp-steps",
        action="store_true",
        help="with --otlp: also send one span per micro-batch (step)",
    )
    add_late_attach_flags(p)
    add_metrics_flags(p)


def sinks_from(args: argparse.Namespace, log: Callable[[str], None]) -> list[FrameSink]:
    """The sinks the flags ask for (--otlp); UsageError for a bad URL or rate."""
    from sparseety_prof.errors import UsageError

    if args.otlp is None:
        if args.otlp_token_events or args.otlp_steps:
            raise UsageError("--otlp-token-events and --otlp-steps need --otlp URL")
        return []
    if not 0.0 <= args.otlp_token_events <= 1.0:
        raise UsageError(f"--otlp-token-events must be within 0..1, got {args.otlp_token_events}")
    try:
        from sparseety_prof.session.otlp_sink import OtlpSink, traces_url
    except ImportError as e:
        raise UsageError(
            f"--otlp needs the OpenTelemetry SDK ({e}): pip install 'sparseety-prof[otlp]'"
        ) from None

    try:
        traces_url(args.otlp)
    except ValueError as e:
        raise UsageError(f"--otlp: {e}") from None
    return [OtlpSink(args.otlp, token_event_rate=args.otlp_token_events, steps=args.otlp_steps, log=log)]


def add_late_attach_flags(p: argparse.ArgumentParser) -> None:
    from sparseety_prof.gpu.launch import add_preset_flag

    p.add_argument(
        "--late-attach",
        action="store_true",
        help="GPU: if the process is a running CUDA process started without `sparseety-prof launch`, "
        "load the CUPTI injection library into it now (ptrace + dlopen, x86_64; README: GPU path)",
    )
    p.add_argument(
        "--watch",
        metavar="SPEC",
        default=None,
        help="with --late-attach: watched kernels, as `launch --watch` ('name_substring:arg:dtype:rule;...')",
    )
    add_preset_flag(p)


def late_attach_from(args: argparse.Namespace, log: Callable[[str], None]) -> None:
    """--late-attach: give the target a CUPTI ring before the recorder looks for one."""
    from sparseety_prof.errors import UsageError
    from sparseety_prof.gpu.late_attach import SETTINGS, late_attach
    from sparseety_prof.gpu.launch import library_path
    from sparseety_prof.gpu.presets import watch_spec
    from sparseety_prof.gpu.watch_rules import WatchSpecError

    if not args.late_attach:
        if args.watch is not None or args.preset:
            raise UsageError(
                "--watch and --preset need --late-attach (for a new process: `sparseety-prof launch --watch`)"
            )
        return
    try:
        watch = watch_spec(args.watch, args.preset)
    except WatchSpecError as e:
        raise UsageError(f"--watch/--preset: {e}") from None
    lib = library_path()
    if not lib.is_file():
        raise UsageError(f"the CUPTI injection library {lib} is not built: run `sparseety-prof build-cupti`")
    settings = {k: v for k, v in os.environ.items() if k in SETTINGS}
    if watch:
        settings["SPARSEETY_WATCH"] = watch
    result = late_attach(args.pid, lib, settings, log=log)
    if not result.injected:
        log(f"sparseety-prof: {result.message}")


def add_metrics_flags(p: argparse.ArgumentParser) -> None:
    """--metrics-port and what goes with it (README: Prometheus)."""
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="N",
        help="serve Prometheus metrics on this port (expert load, sparsity, log-prob and step latency "
        "histograms, tokens, requests, losses, the recorder's CPU and memory; README: Prometheus)",
    )
    p.add_argument(
        "--metrics-bind",
        default="127.0.0.1",
        metavar="ADDR",
        help="address the metrics endpoint listens on (default 127.0.0.1: expert load over time is "
        "routing, which recovers tokens, so it is as sensitive as the prompts; widen it on purpose)",
    )
    p.add_argument(
        "--metrics-experts",
        choices=("per-expert", "aggregate"),
        default="per-expert",
        help="per-expert (default): a selection counter per MoE layer and expert (layers x experts "
        "series); aggregate: only per-layer imbalance gauges, no expert label",
    )


def options_from(args: argparse.Namespace) -> Options:
    """Options of `record` and `attach`, from the flags they share (see add_attach_flags)."""
    from sparseety_prof.capture.options import TOKENS_ONLY, Capture
    from sparseety_prof.errors import UsageError
    from sparseety_prof.session.memory_budget import MIN_MAX_MEMORY
    from sparseety_prof.session.options import Options
    from sparseety_prof.session.sched_slice import SLICE_MAX_US, SLICE_MIN_US
    from sparseety_prof.store.output_dir import check_output_path, sudo_owner
    from sparseety_prof.store.recording import META_FILE
    from sparseety_prof.store.recording_writer import MIN_MAX_DISK
    from sparseety_prof.store.redaction_levels import redaction_from_flags
    from sparseety_prof.store.rotation import parse_size

    if not 0 <= args.correlate_every <= 10:
        raise UsageError(f"--correlate-every must be from 0 to 10 seconds, got {args.correlate_every}")
    if not args.flush_interval > 0:
        raise UsageError(f"--flush-interval must be a positive number of seconds, got {args.flush_interval}")
    if not args.fsync_interval >= 0:
        raise UsageError(
            f"--fsync-interval must be 0 or a positive number of seconds, got {args.fsync_interval}"
        )
    redact, redact_layers = redaction_from_flags(args.redact, args.redact_layers)
    max_disk = None
    if args.max_disk is not None:
        try:
            max_disk = parse_size(args.max_disk)
        except ValueError as e:
            raise UsageError(f"--max-disk: {e}") from None
        if max_disk < MIN_MAX_DISK:
            raise UsageError(f"--max-disk must be at least {MIN_MAX_DISK >> 20} MiB, got {args.max_disk}")
        if args.output is None:
            raise UsageError("--max-disk needs -o (it bounds the recording on disk)")
    if not 1 <= args.ring_mb <= 1024 or args.ring_mb & (args.ring_mb - 1):
        raise UsageError(f"--ring-mb must be a power of two from 1 to 1024, got {args.ring_mb}")
    from sparseety_prof.session.policy import check as check_policy

    try:
        policy = check_policy(args.policy or ["full"])
    except ValueError as e:
        raise UsageError(f"--policy: {e}") from None
    if not (args.max_drain_gap == 0 or 0.1 <= args.max_drain_gap <= 3600):
        raise UsageError(f"--max-drain-gap must be 0 (none) or 0.1-3600 s, got {args.max_drain_gap}")
    if not DRAIN_INTERVAL_MIN_S <= args.drain_interval <= DRAIN_INTERVAL_MAX_S:
        raise UsageError(
            f"--drain-interval must be from {DRAIN_INTERVAL_MIN_S:g} to {DRAIN_INTERVAL_MAX_S:g} s, "
            f"got {args.drain_interval}"
        )
    if args.max_drain_gap and args.drain_interval >= args.max_drain_gap:
        # every ordinary pause would count as a starved consumer and raise its priority
        raise UsageError(
            f"--drain-interval ({args.drain_interval:g} s) must be shorter than --max-drain-gap "
            f"({args.max_drain_gap:g} s)"
        )
    if args.slice_us != 0 and not SLICE_MIN_US <= args.slice_us <= SLICE_MAX_US:
        raise UsageError(
            f"--slice-us must be 0 (the kernel's) or {SLICE_MIN_US}-{SLICE_MAX_US}, got {args.slice_us}"
        )
    max_memory = None
    if args.max_memory.lower() != "none":
        try:
            max_memory = parse_size(args.max_memory)
        except ValueError as e:
            raise UsageError(f"--max-memory: {e}") from None
        if max_memory < MIN_MAX_MEMORY:
            raise UsageError(
                f"--max-memory must be at least {MIN_MAX_MEMORY >> 20} MiB, got {args.max_memory}"
            )
    try:
        policy_window = parse_size(args.policy_window)
    except ValueError as e:
        raise UsageError(f"--policy-window: {e}") from None
    if args.aggregate_interval < 1:
        raise UsageError(f"--aggregate-interval must be at least 1 second, got {args.aggregate_interval}")
    if getattr(args, "ablate_consumer", ""):
        from sparseety_prof.session.ablation import ConsumerAblation

        why = ConsumerAblation.check(args.ablate_consumer)
        if why is not None:
            raise UsageError(why)
    if args.output is not None:
        check_output_path(args.output, META_FILE, sudo_owner())  # refused before anything is attached
    if args.mode == "tokens":
        if args.capture_router_probs or args.capture_masks or args.act_every != 1:
            raise UsageError("--capture-router-probs, --capture-masks and --act-every need --mode full")
        capture = TOKENS_ONLY
    else:
        try:
            capture = Capture(
                router_probs=args.capture_router_probs,
                masks=args.capture_masks,
                act_threshold=args.act_threshold,
                act_every=args.act_every,
            )
        except ValueError as e:
            raise UsageError(str(e)) from None
    return Options(
        pid=args.pid if args.pid is not None else 0,  # --follow: each attach sets the PID it found
        out=args.output,
        duration=args.duration,
        flush_interval=args.flush_interval,
        fsync_interval=args.fsync_interval,
        correlate_every=args.correlate_every,
        max_disk=max_disk,
        max_memory=max_memory,
        redact_text=args.redact_text,
        redact=redact,
        redact_layers=redact_layers,
        model=args.model,
        nice=args.nice,
        skip_probes=frozenset(getattr(args, "skip_probe", None) or ()),
        request_header=args.request_header,
        sched=args.sched,
        max_drain_gap=args.max_drain_gap,
        drain_interval=args.drain_interval,
        slice_us=args.slice_us,
        capture=capture,
        moe_read=getattr(args, "moe_read", "auto"),
        discover_layout=getattr(args, "discover_layout", False),
        discover_timeout=getattr(args, "discover_timeout", 120.0),
        policy=policy,
        policy_window=policy_window,
        ring_mb=args.ring_mb,
        aggregate_s=args.aggregate_interval,
        bpf_stats=getattr(args, "bpf_stats", False),
        ablate_consumer=getattr(args, "ablate_consumer", ""),
    )


def metrics_sink_from(args: argparse.Namespace, opts: Options) -> PrometheusSink | None:
    """The metrics endpoint asked for with --metrics-port, already listening (so that a port in
    use is refused before attaching), or None."""
    from sparseety_prof.errors import UsageError
    from sparseety_prof.session.metrics_sink import PrometheusSink

    if args.metrics_port is None:
        return None
    if not 0 < args.metrics_port < 65536:
        raise UsageError(f"--metrics-port must be a port number (1-65535), got {args.metrics_port}")
    return PrometheusSink(
        args.metrics_bind,
        args.metrics_port,
        experts=args.metrics_experts,
        redact=opts.redact,
        redact_layers=opts.redact_layers,
    )


def follow_rule_from(args: argparse.Namespace) -> ProcessRule | None:
    """The processes --follow NAME means (capture/process_match.py), or None for --pid; UsageError
    for a name no process can have, or a flag that needs one fixed PID."""
    from sparseety_prof.capture.process_match import COMM_MAX, ProcessRule
    from sparseety_prof.errors import UsageError
    from sparseety_prof.store.output_dir import sudo_owner

    if args.follow is None:
        if args.follow_user is not None:
            raise UsageError("--follow-user needs --follow NAME")
        return None
    name = args.follow
    if not name or name != name.strip() or "\n" in name:
        raise UsageError(f"--follow needs a process name (as /proc/PID/comm shows it), got {name!r}")
    if len(name.encode()) > COMM_MAX:
        raise UsageError(
            f"--follow {name!r}: the kernel keeps at most {COMM_MAX} bytes of a process name, so no "
            f"process is named that; give the first {COMM_MAX} (what `ps -o comm` shows)"
        )
    for flag, given in (
        ("--late-attach", args.late_attach),
        ("--metrics-port", args.metrics_port is not None),
        ("--otlp", args.otlp is not None),
        ("--dataset", getattr(args, "dataset", None) is not None),
    ):
        if given:
            raise UsageError(f"{flag} is not available with --follow (it serves one process): use --pid")
    owner = sudo_owner()
    uid = _user_id(args.follow_user) if args.follow_user is not None else owner[0] if owner else os.getuid()
    return ProcessRule(name=name, uid=uid)


def _user_id(user: str) -> int:
    import pwd

    from sparseety_prof.errors import UsageError

    if user.isdigit():
        return int(user)
    try:
        return pwd.getpwnam(user).pw_uid
    except KeyError:
        raise UsageError(f"--follow-user: no user named {user!r}") from None
