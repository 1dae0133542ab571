"""The flags `record` and `attach` share, in the groups their --help shows, and the session Options
made from them. Their defaults are the Options' own (session/options.py), read from there."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import MISSING, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sparseety_prof.commands.dataset_flag import add_dataset_flag
from sparseety_prof.commands.flag_combinations import refuse_unworkable_combinations
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
    from sparseety_prof.session.duty_cycle import DutySpec
    from sparseety_prof.session.follow_target import FollowTarget
    from sparseety_prof.session.metrics_sink import PrometheusSink
    from sparseety_prof.session.options import Options
    from sparseety_prof.session.sinks import FrameSink


#: the record/attach flags left out of --help: tuning and benchmark knobs, each documented in
#: docs/tuning.md (tests/test_cli_help.py checks that every one is, with its default)
TUNING_FLAGS = (
    "--correlate-every",
    "--drain-interval",
    "--ring-mb",
    "--max-drain-gap",
    "--slice-us",
    "--bpf-stats",
    "--ablate-consumer",
    "--moe-read",
    "--discover-layout",
    "--discover-timeout",
    "--recorder-cpus",
)
#: the policies that decide at a request's end: its rows wait in --policy-window until then
UNDECIDED_POLICIES = ("tail", "anomaly")
#: --metrics-bind's default: loopback (expert load over time is routing, as sensitive as prompts)
METRICS_BIND = "127.0.0.1"
#: --metrics-experts' choices (session/metrics_sink.py EXPERT_MODES: not imported for --help, it
#: needs prometheus_client); not given, the endpoint's own default decides (auto)
METRICS_EXPERT_MODES = ("auto", "per-expert", "aggregate")


def option_default(name: str) -> Any:
    """The default of Options field `name` (session/options.py): the one place a default is set."""
    from sparseety_prof.session.options import Options

    return _field_default(Options, name)


def capture_default(name: str) -> Any:
    """The default of Capture field `name` (capture/options.py)."""
    from sparseety_prof.capture.options import Capture

    return _field_default(Capture, name)


def _field_default(cls: type, name: str) -> Any:
    for f in fields(cls):
        if f.name == name:
            if f.default is not MISSING:
                return f.default
            if f.default_factory is not MISSING:
                return f.default_factory()
    raise KeyError(f"{cls.__name__} has no field {name!r} with a default")


def size_text(n: int) -> str:
    """A byte count as the size flags take it (256M, 2G)."""
    for shift, unit in ((30, "G"), (20, "M"), (10, "K")):
        if n and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


def add_attach_flags(p: argparse.ArgumentParser, *, output_help: str, output_required: bool) -> None:
    """The flags `record` and `attach` share, in the groups --help shows them in; the tuning
    flags (TUNING_FLAGS) are accepted but left out of --help."""
    _add_target(p.add_argument_group("target"))
    _add_capture(p.add_argument_group("what to capture"))
    _add_output(p.add_argument_group("output"), output_help=output_help, output_required=output_required)
    _add_policy(p.add_argument_group("sampling and policy"))
    _add_footprint(p.add_argument_group("the recorder's footprint"))
    _add_fleet(p.add_argument_group("fleet outputs"))
    add_late_attach_flags(p.add_argument_group("GPU (CUDA engines)"))
    _add_tuning(p)


def _add_target(g: argparse._ArgumentGroup) -> None:
    which = g.add_mutually_exclusive_group(required=True)
    which.add_argument("-p", "--pid", type=int, help="process id of the running engine")
    which.add_argument(
        "--follow",
        metavar="NAME",
        default=None,
        help="wait for a process whose name (/proc/PID/comm, as `pgrep -x` matches it) is NAME, record "
        "it, and when it exits wait for the next one (a restart): one recording per process under -o "
        "DIR, listed in DIR/follow.json (docs: following a restarting engine)",
    )
    which.add_argument(
        "--follow-unit",
        metavar="UNIT",
        default=None,
        help="as --follow, for the main process of a systemd unit (its MainPID, polled)",
    )
    g.add_argument(
        "--follow-user",
        metavar="USER",
        default=None,
        help="with --follow or --follow-unit: follow processes of this user (name or id) instead of "
        "your own (--follow) or whoever the unit runs as (--follow-unit); a process name proves "
        "nothing: any user can start a program with that name",
    )
    g.add_argument(
        "--model", type=Path, default=None, metavar="FILE", help="model file, when the engine has none mapped"
    )


def _add_capture(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--mode",
        choices=("full", "tokens"),
        default="full",
        help="full (default): tokens plus MoE routing, activation sparsity and attention coverage; "
        "tokens: token boundaries, ids and log-probs only (fewer probes)",
    )
    g.add_argument(
        "--capture-router-probs",
        action="store_true",
        help="also record the router probability of every expert per MoE layer",
    )
    g.add_argument(
        "--capture-masks",
        action="store_true",
        help="also record the activation zero masks, bit-packed, in the masks table",
    )
    g.add_argument(
        "--act-threshold",
        type=float,
        default=None,
        metavar="X",
        help="activations with |x| below this count in act_below_ratio (default "
        f"{capture_default('act_threshold'):g}; recorded in metadata)",
    )
    g.add_argument(
        "--act-every",
        type=int,
        default=capture_default("act_every"),
        metavar="N",
        help=f"count the activations of one decode step in N (default {capture_default('act_every')}: "
        "every step). The counting is the probes' largest cost in the engine's threads; the other "
        "steps keep their routing and get null activation ratios, and the aggregates' sparsity "
        "histograms become a sample of them",
    )
    g.add_argument(
        "--request-header",
        default=option_default("request_header"),
        metavar="NAME",
        help="HTTP servers: header whose value becomes request_id (default "
        f"{option_default('request_header')}); requests without it get generated ids",
    )


def _add_output(g: argparse._ArgumentGroup, *, output_help: str, output_required: bool) -> None:
    g.add_argument(
        "-o", "--output", type=Path, required=output_required, default=None, metavar="DIR", help=output_help
    )
    g.add_argument(
        "-d", "--duration", type=float, default=None, metavar="SECONDS", help="detach after this many seconds"
    )
    g.add_argument(
        "--status-interval",
        type=float,
        default=None,
        metavar="SECONDS",
        help="one status line on stderr this often (tokens, requests, losses, the recorder's CPU and "
        "memory, the ring's fill; with --follow the runs); default 30 when stderr is not a terminal "
        "(a service's log), off on a terminal; 0: off",
    )
    g.add_argument(
        "--redact-text",
        action="store_true",
        help="keep token ids but store no token text, and no prompt or other "
        "text from the engine's command line, environment or server settings (docs: privacy)",
    )
    g.add_argument(
        "--redact",
        action="append",
        default=[],
        metavar="LEVEL[,LEVEL]",
        help="also leave out what recovers tokens: ids (token ids and text), routing (per-token "
        "experts and gate weights; the expert load per layer stays), sparsity (ratios rounded to 0.1), "
        "masks (activation masks); `sparseety-prof audit` measures what each leaves (docs: privacy)",
    )
    g.add_argument(
        "--redact-layers",
        default=None,
        metavar="LAYERS",
        help="apply the routing, sparsity and masks levels of --redact to these model layers only "
        "(e.g. 0-3 or 0,5: the layers `audit` finds leaking most); default every layer",
    )
    g.add_argument(
        "--max-disk",
        default=None,
        metavar="SIZE",
        help="keep the recording within SIZE on disk (e.g. 500M, 2G): beyond it the oldest segments "
        "are removed, so that it holds the latest stretch of the run; the rows removed are counted "
        "in meta.json (rotation), apart from losses (default: no limit)",
    )
    g.add_argument(
        "--flush-interval",
        type=float,
        default=FLUSH_INTERVAL_S,
        metavar="SECONDS",
        help="write the rows gathered as Parquet segments at least this often (default "
        f"{FLUSH_INTERVAL_S:g}); in between, each drain's rows go to the recording's journal, so "
        "that a recorder killed outright (SIGKILL, the OOM killer) loses about the last drain; "
        "metrics and OTLP exporters get rows at least this often",
    )
    g.add_argument(
        "--fsync-interval",
        type=float,
        default=FSYNC_INTERVAL_S,
        metavar="SECONDS",
        help="fsync the recording's journal this often, so that a power cut loses at most about "
        f"this much (default {FSYNC_INTERVAL_S:g}; 0: after each drain)",
    )
    g.add_argument(
        "--no-journal",
        dest="journal",
        action="store_false",
        help="no journal: rows reach the disk at flushes only, so a recorder killed outright loses "
        "up to a flush interval of them, for less of the recorder's CPU (docs/durability.md)",
    )


def _add_policy(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--policy",
        action="append",
        default=None,
        metavar="POLICY",
        help="what the recording keeps, repeatable (a request is kept when any policy keeps it): full "
        "(default) every row; aggregate only the always-on aggregates and the requests table; head:RATE "
        "a share RATE of the requests, decided at their start (alone: drawn at random in the probes, "
        "which then copy nothing of a dropped request; with tail or anomaly: by a hash of the request "
        "id, the same ids in every run); "
        "tail:Q the requests whose time per output token is above the running Q quantile; "
        "anomaly[:KIND,...] the requests in which an anomaly detector fires, and the steps around it. "
        "The aggregates and the requests table are kept whatever the policy; what it drops is counted "
        "in meta.json policy, apart from losses; metrics and exporters (--metrics-port, --otlp) see every "
        "row whatever the policy",
    )
    g.add_argument(
        "--policy-window",
        default=None,
        metavar="SIZE",
        help="with --policy tail or anomaly: memory the rows of undecided requests may hold (default "
        f"{size_text(option_default('policy_window'))}); beyond it the oldest undecided requests are "
        "kept early, counted in meta.json policy.window",
    )
    g.add_argument(
        "--aggregate-interval",
        type=int,
        default=option_default("aggregate_s"),
        metavar="SECONDS",
        help="length of the buckets of the always-on aggregates table (expert load, sparsity, "
        f"log-prob and step-latency histograms; default {option_default('aggregate_s')})",
    )


def _add_footprint(g: argparse._ArgumentGroup) -> None:
    from sparseety_prof.session.memory_budget import DEFAULT_MAX_MEMORY

    g.add_argument(
        "--max-memory",
        default=None,
        metavar="SIZE",
        help=f"anonymous memory the recorder may hold (default {size_text(DEFAULT_MAX_MEMORY)}, at least "
        "64M; 'none': no limit): above it, the rows gathered since the last flush are written out at "
        "once; counted in meta.json profiler_memory.budget",
    )
    g.add_argument(
        "--sched",
        choices=["idle", "nice"],
        default=option_default("sched"),
        help="consumer CPU policy once attached: nice (default) = run at --nice; idle = SCHED_IDLE (only "
        "CPU the engine leaves idle). Either way it takes nice 0 once it falls behind (over a third of "
        "the ring filled, or records waiting too long) until it has caught up. idle suits sampling "
        "policies in production (docs/overhead.md), but the consumer then drains seldom while the "
        "engine is busy: rows reach the recording, live view and sinks later",
    )
    g.add_argument(
        "--nice",
        type=int,
        metavar="N",
        default=option_default("nice"),
        help="niceness the consumer takes once attached, so the engine wins CPU contention (default "
        f"{option_default('nice')})",
    )
    g.add_argument(
        "--duty-cycle",
        default=None,
        metavar="ON/PERIOD",
        help="full detail for a window of ON seconds every PERIOD (e.g. 2s/20s): the per-layer "
        "MoE/FFN probes are detached in between (no trap in the engine), every token is still "
        "recorded; routes rows exist only for tokens in windows, and meta.json duty_cycle states "
        "the windows and their coverage. The share of time in windows is lowered when windows slow "
        "the engine or the recorder lags (default: always in; docs: tuning)",
    )


def _add_fleet(g: argparse._ArgumentGroup) -> None:
    add_dataset_flag(g)
    g.add_argument(
        "--otlp",
        default=None,
        metavar="URL",
        help="also send each request as an OpenTelemetry span (GenAI conventions) to this OTLP/HTTP "
        "collector, e.g. http://localhost:4318 (/v1/traces is added to a URL with no path); a "
        "collector that is slow or down costs dropped spans, counted in meta.json (docs: fleet outputs)",
    )
    g.add_argument(
        "--otlp-token-events",
        type=float,
        default=0.0,
        metavar="RATE",
        help="with --otlp: also attach this share (0..1) of each request's tokens as span events "
        "(default 0; at most 128 per span)",
    )
    g.add_argument(
        "--otlp-steps",
        action="store_true",
        help="with --otlp: also send one span per micro-batch (step)",
    )
    add_metrics_flags(g)


def _add_tuning(p: argparse.ArgumentParser) -> None:
    """Tuning and benchmark knobs: accepted, left out of --help, documented in docs/tuning.md."""
    hidden = argparse.SUPPRESS
    p.add_argument("--correlate-every", type=float, default=option_default("correlate_every"), help=hidden)
    p.add_argument("--drain-interval", type=float, default=DRAIN_INTERVAL_S, help=hidden)
    p.add_argument("--ring-mb", type=int, default=RING_MB, help=hidden)
    p.add_argument("--max-drain-gap", type=float, default=option_default("max_drain_gap"), help=hidden)
    p.add_argument("--slice-us", type=int, default=SLICE_US, help=hidden)
    p.add_argument("--bpf-stats", action="store_true", help=hidden)
    p.add_argument(
        "--ablate-consumer", nargs="?", const="drain", default="", choices=ABLATION_KINDS, help=hidden
    )
    p.add_argument("--moe-read", choices=("auto", "ops"), default=None, help=hidden)
    p.add_argument("--discover-layout", action="store_true", help=hidden)
    p.add_argument("--discover-timeout", type=float, default=option_default("discover_timeout"), help=hidden)
    p.add_argument("--recorder-cpus", default=option_default("recorder_cpus"), metavar="CPUS", help=hidden)


def sinks_from(args: argparse.Namespace, log: Callable[[str], None]) -> list[FrameSink]:
    """The sinks the flags ask for (--otlp); UsageError for a bad URL or rate."""
    from sparseety_prof.errors import UsageError

    if args.otlp is None:
        return []  # options_from refused --otlp-token-events and --otlp-steps without it
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


def add_late_attach_flags(p: argparse._ActionsContainer) -> None:
    from sparseety_prof.gpu.launch import add_preset_flag

    p.add_argument(
        "--late-attach",
        action="store_true",
        help="GPU: if the process is a running CUDA process started without `sparseety-prof launch`, "
        "load the CUPTI injection library into it now (ptrace + dlopen, x86_64; docs: GPU path)",
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
        return  # options_from refused --watch and --preset without it
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


def add_metrics_flags(p: argparse._ActionsContainer) -> None:
    """--metrics-port and what goes with it (docs: fleet outputs)."""
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="N",
        help="serve Prometheus metrics on this port (expert load, sparsity, log-prob and step latency "
        "histograms, tokens, requests, losses, the recorder's CPU and memory; docs: fleet outputs)",
    )
    p.add_argument(
        "--metrics-bind",
        default=None,
        metavar="ADDR",
        help=f"with --metrics-port: the address it listens on (default {METRICS_BIND}: expert load over "
        "time is routing, which recovers tokens, so it is as sensitive as the prompts; widen it on purpose)",
    )
    p.add_argument(
        "--metrics-experts",
        choices=METRICS_EXPERT_MODES,
        default=None,
        help="with --metrics-port: auto (default): a selection counter per MoE layer and expert while "
        "those series stay within a bound, only per-layer imbalance gauges beyond (docs: fleet "
        "outputs); per-expert: always per expert; aggregate: always per layer, no expert label",
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

    refuse_unworkable_combinations(args)
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
    max_memory = option_default("max_memory") if args.max_memory is None else None
    if args.max_memory is not None and args.max_memory.lower() != "none":
        try:
            max_memory = parse_size(args.max_memory)
        except ValueError as e:
            raise UsageError(f"--max-memory: {e}") from None
        if max_memory < MIN_MAX_MEMORY:
            raise UsageError(
                f"--max-memory must be at least {MIN_MAX_MEMORY >> 20} MiB, got {args.max_memory}"
            )
    policy_window = option_default("policy_window")
    if args.policy_window is not None:
        try:
            policy_window = parse_size(args.policy_window)
        except ValueError as e:
            raise UsageError(f"--policy-window: {e}") from None
        if not any(spec.split(":", 1)[0] in UNDECIDED_POLICIES for spec in policy):
            raise UsageError(
                "--policy-window bounds the rows of requests not yet decided: it goes with --policy tail:Q "
                "or --policy anomaly (head, full and aggregate decide at once)"
            )
    if args.aggregate_interval < 1:
        raise UsageError(f"--aggregate-interval must be at least 1 second, got {args.aggregate_interval}")
    if args.ablate_consumer:
        from sparseety_prof.session.ablation import ConsumerAblation

        why = ConsumerAblation.check(args.ablate_consumer)
        if why is not None:
            raise UsageError(why)
    if args.output is not None and _follows(args):
        from sparseety_prof.session.follow_dir import check_follow_output

        # a new or empty directory, or one this follower made (a service manager restarted it)
        check_follow_output(args.output, follow_rule_from(args).to_meta(), sudo_owner())  # type: ignore[union-attr]
    elif args.output is not None:
        check_output_path(args.output, META_FILE, sudo_owner())  # refused before anything is attached
    if args.mode == "tokens":
        given = [
            flag
            for flag, on in (
                ("--capture-router-probs", args.capture_router_probs),
                ("--capture-masks", args.capture_masks),
                ("--act-every", args.act_every != capture_default("act_every")),
                ("--act-threshold", args.act_threshold is not None),
                ("--moe-read", getattr(args, "moe_read", None) is not None),
            )
            if on
        ]
        if given:
            raise UsageError(
                f"{', '.join(given)}: --mode tokens captures no sparse decisions; these need --mode full"
            )
        capture = TOKENS_ONLY
    else:
        try:
            capture = Capture(
                router_probs=args.capture_router_probs,
                masks=args.capture_masks,
                act_threshold=capture_default("act_threshold")
                if args.act_threshold is None
                else args.act_threshold,
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
        journal=args.journal,
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
        moe_read=getattr(args, "moe_read", None) or option_default("moe_read"),
        discover_layout=args.discover_layout,
        discover_timeout=args.discover_timeout,
        policy=policy,
        policy_window=policy_window,
        ring_mb=args.ring_mb,
        aggregate_s=args.aggregate_interval,
        bpf_stats=args.bpf_stats,
        ablate_consumer=args.ablate_consumer,
        recorder_cpus=_recorder_cpus(args.recorder_cpus),
        duty_cycle=_duty_cycle(args.duty_cycle),
    )


def _recorder_cpus(text: str) -> str:
    """--recorder-cpus checked (session/placement.py); UsageError otherwise."""
    from sparseety_prof.session.placement import parse_recorder_cpus

    return parse_recorder_cpus(text)


def _duty_cycle(text: str | None) -> DutySpec | None:
    """--duty-cycle ON/PERIOD parsed (session/duty_cycle.py); UsageError when malformed."""
    from sparseety_prof.errors import UsageError
    from sparseety_prof.session.duty_cycle import parse_duty_cycle

    if text is None:
        return None
    try:
        return parse_duty_cycle(text)
    except ValueError as e:
        raise UsageError(f"--duty-cycle: {e}") from None


def metrics_sink_from(
    args: argparse.Namespace, opts: Options, *, sink_class: type[PrometheusSink] | None = None
) -> PrometheusSink | None:
    """The metrics endpoint asked for with --metrics-port, already listening (so that a port in
    use is refused before attaching), or None. `sink_class`: --follow's, which outlives a run."""
    from sparseety_prof.errors import UsageError
    from sparseety_prof.session.metrics_sink import PrometheusSink

    if args.metrics_port is None:
        return None  # options_from refused --metrics-bind and --metrics-experts without it
    if not 0 < args.metrics_port < 65536:
        raise UsageError(f"--metrics-port must be a port number (1-65535), got {args.metrics_port}")
    chosen = {"experts": args.metrics_experts} if args.metrics_experts is not None else {}
    return (sink_class or PrometheusSink)(
        args.metrics_bind or METRICS_BIND,
        args.metrics_port,
        redact=opts.redact,
        redact_layers=opts.redact_layers,
        **chosen,
    )


def _follows(args: argparse.Namespace) -> bool:
    return args.follow is not None or getattr(args, "follow_unit", None) is not None


def follow_rule_from(args: argparse.Namespace) -> FollowTarget | None:
    """The processes --follow NAME (capture/process_match.py) or --follow-unit UNIT mean
    (session/follow_target.py), or None for --pid; UsageError for a name no process can have,
    or a flag that needs one fixed PID."""
    from sparseety_prof.capture.process_match import COMM_MAX, ProcessRule
    from sparseety_prof.errors import UsageError
    from sparseety_prof.session.follow_target import NamedProcesses, UnitMainProcess
    from sparseety_prof.store.output_dir import sudo_owner

    if not _follows(args):
        if args.follow_user is not None:
            raise UsageError("--follow-user needs --follow NAME or --follow-unit UNIT")
        return None
    if args.late_attach:
        raise UsageError("--late-attach is not available with --follow (it serves one process): use --pid")
    unit = getattr(args, "follow_unit", None)
    if unit is not None:
        if not unit or unit != unit.strip() or "/" in unit or unit.startswith("-") or not unit.isprintable():
            raise UsageError(f"--follow-unit needs a systemd unit name (e.g. llama.service), got {unit!r}")
        return UnitMainProcess(unit, _user_id(args.follow_user) if args.follow_user is not None else None)
    name = args.follow
    if not name or name != name.strip() or "\n" in name:
        raise UsageError(f"--follow needs a process name (as /proc/PID/comm shows it), got {name!r}")
    if len(name.encode()) > COMM_MAX:
        raise UsageError(
            f"--follow {name!r}: the kernel keeps at most {COMM_MAX} bytes of a process name, so no "
            f"process is named that; give the first {COMM_MAX} (what `ps -o comm` shows)"
        )
    owner = sudo_owner()
    uid = _user_id(args.follow_user) if args.follow_user is not None else owner[0] if owner else os.getuid()
    return NamedProcesses(ProcessRule(name=name, uid=uid))


def _user_id(user: str) -> int:
    import pwd

    from sparseety_prof.errors import UsageError

    if user.isdigit():
        return int(user)
    try:
        return pwd.getpwnam(user).pw_uid
    except KeyError:
        raise UsageError(f"--follow-user: no user named {user!r}") from None
