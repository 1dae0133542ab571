"""The flags `record` and `attach` share, in the groups their --help shows. The parser only parses:
it writes no default (a flag not given is None), and the session Options made from the flags
(commands/attach_options.py) keep their own defaults (session/options.py), which --help reads."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import MISSING, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sparseety_prof.commands.dataset_flag import add_dataset_flag
from sparseety_prof.errors import UsageError
from sparseety_prof.session.options import (
    ABLATION_KINDS,
    FLUSH_INTERVAL_JOURNALED_S,
    FLUSH_INTERVAL_S,
    METRICS_BIND,
)

if TYPE_CHECKING:
    from sparseety_prof.session.duty_cycle import DutySpec

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


# The values of text flags, parsed as the parser reads them: a value that cannot work is a
# UsageError naming its flag (cli.main says it, exit 2), raised before any Options are made.


def size_flag(flag: str) -> Callable[[str], int]:
    """A size flag's parser (store/rotation.py parse_size: 500M, 2G)."""

    def parse(text: str) -> int:
        from sparseety_prof.store.rotation import parse_size

        try:
            return parse_size(text)
        except ValueError as e:
            raise UsageError(f"{flag}: {e}") from None

    return parse


def _at_least(flag: str, text: str, least: int) -> int:
    n = size_flag(flag)(text)
    if n < least:
        raise UsageError(f"{flag} must be at least {least >> 20} MiB, got {text}")
    return n


def max_disk_flag(text: str) -> int:
    """--max-disk SIZE, at least what a recording needs (store/recording_writer.py)."""
    from sparseety_prof.store.recording_writer import MIN_MAX_DISK

    return _at_least("--max-disk", text, MIN_MAX_DISK)


#: what --max-memory none parses to: no limit (Options.max_memory None)
NO_MEMORY_LIMIT = 0


def max_memory_flag(text: str) -> int:
    """--max-memory SIZE (session/memory_budget.py), or none (NO_MEMORY_LIMIT)."""
    from sparseety_prof.session.memory_budget import MIN_MAX_MEMORY

    return NO_MEMORY_LIMIT if text.lower() == "none" else _at_least("--max-memory", text, MIN_MAX_MEMORY)


def trace_ops_flag(text: str) -> DutySpec:
    """--trace-ops ON/PERIOD (session/op_times.py), parsed as --duty-cycle is."""
    from sparseety_prof.session.duty_cycle import parse_duty_cycle

    try:
        return parse_duty_cycle(text)
    except ValueError as e:
        raise UsageError(f"--trace-ops: {e}") from None


def duty_cycle_flag(text: str) -> DutySpec:
    """--duty-cycle ON/PERIOD (session/duty_cycle.py)."""
    from sparseety_prof.session.duty_cycle import parse_duty_cycle

    try:
        return parse_duty_cycle(text)
    except ValueError as e:
        raise UsageError(f"--duty-cycle: {e}") from None


def redact_flag(text: str) -> frozenset[str]:
    """One --redact value: a level or a comma-separated list (store/redaction_levels.py)."""
    from sparseety_prof.store.redaction_levels import parse_levels

    try:
        return parse_levels([text])
    except ValueError as e:
        raise UsageError(f"--redact: {e}") from None


def redact_layers_flag(text: str) -> frozenset[int]:
    """--redact-layers LAYERS, "0,2,5-7" (store/redaction_levels.py)."""
    from sparseety_prof.store.redaction_levels import parse_layers

    try:
        return parse_layers(text)
    except ValueError as e:
        raise UsageError(f"--redact-layers: {e}") from None


def ablate_consumer_flag(text: str) -> str:
    """--ablate-consumer KIND, refused where this host cannot run it (session/ablation.py)."""
    from sparseety_prof.session.ablation import ConsumerAblation

    why = ConsumerAblation.check(text) if text in ABLATION_KINDS else None
    if why is not None:
        raise UsageError(why)
    return text  # a KIND not among the choices: argparse's usage error


def recorder_cpus_flag(text: str) -> str:
    """--recorder-cpus auto, none or a CPU list (session/placement.py)."""
    from sparseety_prof.session.placement import parse_recorder_cpus

    return parse_recorder_cpus(text)


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
        default=None,
        help="full (default): tokens plus MoE routing, activation sparsity and attention coverage; "
        "tokens: token boundaries, ids and log-probs only (fewer probes)",
    )
    g.add_argument(
        "--capture-router-probs",
        action="store_true",
        default=None,
        help="also record the router probability of every expert per MoE layer",
    )
    g.add_argument(
        "--capture-masks",
        action="store_true",
        default=None,
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
        default=None,
        metavar="N",
        help=f"count the activations of one decode step in N (default {capture_default('act_every')}: "
        "every step). The counting is the probes' largest cost in the engine's threads; the other "
        "steps keep their routing and get null activation ratios, and the aggregates' sparsity "
        "histograms become a sample of them",
    )
    g.add_argument(
        "--request-header",
        default=None,
        metavar="NAME",
        help="HTTP servers: header whose value becomes request_id (default "
        f"{option_default('request_header')}); requests without it get generated ids",
    )
    g.add_argument(
        "--cpu-sample-hz",
        type=int,
        default=None,
        metavar="HZ",
        help="sample the engine's threads this many times per second of their CPU time, with their "
        "user stacks, each sample joined to the step it fell in: the cpu_stacks table, `export "
        f"--pprof` and the report's flame graph (default {option_default('cpu_sample_hz')}; 0: off)",
    )
    g.add_argument(
        "--trace-ops",
        type=trace_ops_flag,
        default=None,
        metavar="ON/PERIOD",
        help="per-operator tracing for a window of ON seconds every PERIOD (e.g. 1s/60s): every graph "
        "node the CPU backend computes, its entry and exit on each engine thread, in the op_times "
        "table for the steps that ran whole inside a window; its two probes are detached between "
        "windows (default: off; docs: usage, Per-operator tracing)",
    )
    g.add_argument(
        "--no-layer-times",
        dest="layer_times",
        action="store_false",
        default=None,
        help="no layer_times table: by default the sparse probes also time when each engine thread "
        "reached each layer of a one-row step, which says where a slow step's time went",
    )
    g.add_argument(
        "--no-sched-waits",
        dest="sched_waits",
        action="store_false",
        default=None,
        help="no thread_waits table: by default the scheduler's tracepoints say, per step and engine "
        "thread, its time on CPU, runnable (and which process ran instead), sleeping and stopped",
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
        default=None,
        help="keep token ids but store no token text, and no prompt or other "
        "text from the engine's command line, environment or server settings (docs: privacy)",
    )
    g.add_argument(
        "--redact",
        action="append",
        type=redact_flag,
        default=None,
        metavar="LEVEL[,LEVEL]",
        help="also leave out what recovers tokens: ids (token ids and text), routing (per-token "
        "experts and gate weights; the expert load per layer stays), sparsity (ratios rounded to 0.1), "
        "masks (activation masks); `sparseety-prof audit` measures what each leaves (docs: privacy)",
    )
    g.add_argument(
        "--redact-layers",
        type=redact_layers_flag,
        default=None,
        metavar="LAYERS",
        help="apply the routing, sparsity and masks levels of --redact to these model layers only "
        "(e.g. 0-3 or 0,5: the layers `audit` finds leaking most); default every layer",
    )
    g.add_argument(
        "--max-disk",
        type=max_disk_flag,
        default=None,
        metavar="SIZE",
        help="keep the recording within SIZE on disk (e.g. 500M, 2G): beyond it the oldest segments "
        "are removed, so that it holds the latest stretch of the run; the rows removed are counted "
        "in meta.json (rotation), apart from losses (default: no limit)",
    )
    g.add_argument(
        "--flush-interval",
        type=float,
        default=None,
        metavar="SECONDS",
        help="write the rows gathered as Parquet segments at least this often (default "
        f"{FLUSH_INTERVAL_JOURNALED_S:g}, or {FLUSH_INTERVAL_S:g} with --no-journal, --metrics-port or "
        "--otlp); in between, each drain's rows go to the recording's journal, so that a recorder "
        "killed outright (SIGKILL, the OOM killer) loses about the last drain; metrics and OTLP "
        "exporters get rows at least this often",
    )
    g.add_argument(
        "--fsync-interval",
        type=float,
        default=None,
        metavar="SECONDS",
        help="fsync the recording's journal this often, so that a power cut loses at most about "
        f"this much (default {option_default('fsync_interval'):g}; 0: after each drain)",
    )
    g.add_argument(
        "--no-journal",
        dest="journal",
        action="store_false",
        default=None,
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
        type=size_flag("--policy-window"),
        default=None,
        metavar="SIZE",
        help="with --policy tail or anomaly: memory the rows of undecided requests may hold (default "
        f"{size_text(option_default('policy_window'))}); beyond it the oldest undecided requests are "
        "kept early, counted in meta.json policy.window",
    )
    g.add_argument(
        "--aggregate-interval",
        type=int,
        default=None,
        metavar="SECONDS",
        help="length of the buckets of the always-on aggregates table (expert load, sparsity, "
        f"log-prob and step-latency histograms; default {option_default('aggregate_s')})",
    )


def _add_footprint(g: argparse._ArgumentGroup) -> None:
    from sparseety_prof.session.memory_budget import DEFAULT_MAX_MEMORY

    g.add_argument(
        "--max-memory",
        type=max_memory_flag,
        default=None,
        metavar="SIZE",
        help=f"anonymous memory the recorder may hold (default {size_text(DEFAULT_MAX_MEMORY)}, at least "
        "64M; 'none': no limit): above it, the rows gathered since the last flush are written out at "
        "once; counted in meta.json profiler_memory.budget",
    )
    g.add_argument(
        "--sched",
        choices=["idle", "nice"],
        default=None,
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
        default=None,
        help="niceness the consumer takes once attached, so the engine wins CPU contention (default "
        f"{option_default('nice')})",
    )
    g.add_argument(
        "--duty-cycle",
        type=duty_cycle_flag,
        default=None,
        metavar="ON/PERIOD",
        help="full detail for a window of ON seconds every PERIOD (e.g. 2s/20s): the per-layer "
        "MoE/FFN probes are detached in between (no trap in the engine), every token is still "
        "recorded; routes rows exist only for tokens in windows, and meta.json duty_cycle states "
        "the windows and their coverage. The share of time in windows is lowered when windows slow "
        "the engine or the recorder lags (default: always in; docs: tuning)",
    )
    g.add_argument(
        "--duty-logits",
        action="store_true",
        default=None,
        help="with --duty-cycle: the logits probes out between windows too, so that a token's "
        "logits row is copied only in windows (tokens outside them have no log-prob, top-k or "
        "entropy; default: every token's)",
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
        default=None,
        metavar="RATE",
        help="with --otlp: also attach this share (0..1) of each request's tokens as span events "
        "(default 0; at most 128 per span)",
    )
    g.add_argument(
        "--otlp-steps",
        action="store_true",
        default=None,
        help="with --otlp: also send one span per micro-batch (step)",
    )
    add_metrics_flags(g)


def _add_tuning(p: argparse.ArgumentParser) -> None:
    """Tuning and benchmark knobs: accepted, left out of --help, documented in docs/tuning.md."""
    hidden = argparse.SUPPRESS
    p.add_argument("--correlate-every", type=float, default=None, help=hidden)
    p.add_argument("--drain-interval", type=float, default=None, help=hidden)
    p.add_argument("--ring-mb", type=int, default=None, help=hidden)
    p.add_argument("--max-drain-gap", type=float, default=None, help=hidden)
    p.add_argument("--slice-us", type=int, default=None, help=hidden)
    p.add_argument("--bpf-stats", action="store_true", default=None, help=hidden)
    p.add_argument(
        "--ablate-consumer",
        nargs="?",
        const="drain",
        type=ablate_consumer_flag,
        default=None,
        choices=ABLATION_KINDS,
        help=hidden,
    )
    p.add_argument("--moe-read", choices=("auto", "ops"), default=None, help=hidden)
    p.add_argument("--discover-layout", action="store_true", default=None, help=hidden)
    p.add_argument("--discover-timeout", type=float, default=None, help=hidden)
    p.add_argument("--recorder-cpus", type=recorder_cpus_flag, default=None, metavar="CPUS", help=hidden)


def add_late_attach_flags(p: argparse._ActionsContainer) -> None:
    from sparseety_prof.gpu.launch import add_preset_flag

    p.add_argument(
        "--late-attach",
        action="store_true",
        default=None,
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
