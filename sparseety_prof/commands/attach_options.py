"""The session Options of `record` and `attach`, made once from their parsed flags
(commands/attach_flags.py: the parser reads each value, sizes and specs included) and checked: a
combination or a value that cannot work is a UsageError here, before anything is attached. The
parser writes no defaults: a flag not given leaves the Options' own (session/options.py), the one
place a default is set. One function per flag group."""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import TYPE_CHECKING, Any

from sparseety_prof.commands.attach_flags import NO_MEMORY_LIMIT
from sparseety_prof.commands.flag_combinations import refuse_unworkable_combinations
from sparseety_prof.errors import UsageError
from sparseety_prof.session.options import (
    DRAIN_INTERVAL_MAX_S,
    DRAIN_INTERVAL_MIN_S,
    Options,
    Outputs,
)

if TYPE_CHECKING:
    from sparseety_prof.capture.options import Capture
    from sparseety_prof.session.follow_target import FollowTarget

#: the policies that decide at a request's end: its rows wait in --policy-window until then
UNDECIDED_POLICIES = ("tail", "anomaly")


def options_from(args: argparse.Namespace) -> Options:
    """Options of `record` and `attach`, from the flags they share (see add_attach_flags)."""
    refuse_unworkable_combinations(args)
    opts = _build(
        {
            **_target(args),
            **_capture(args),
            **_output(args),
            **_policy(args),
            **_footprint(args),
            **_tuning(args),
        },
        outputs=_fleet(args),
    )
    # the checks of the Options made, their values together (where the run writes is checked as
    # it starts: session/output_checks.py)
    _check_run(opts)
    _check_tuning(opts)
    return opts


def _build(given: dict[str, Any], outputs: Outputs) -> Options:
    """Options from the values given: a field not among them keeps its default."""
    try:
        return Options(**given, outputs=outputs)
    except ValueError as e:  # Options parse their policy as they are made
        raise UsageError(f"--policy: {e}") from None


def _given(**values: Any) -> dict[str, Any]:
    """The values of the flags given: None (a flag not given) leaves the default."""
    return {k: v for k, v in values.items() if v is not None}


# ---------------------------------------------------------------- target


def _target(args: argparse.Namespace) -> dict[str, Any]:
    return _given(
        pid=args.pid if args.pid is not None else 0,  # --follow: each attach sets the PID it found
        model=args.model,
        follow=follow_rule_from(args),
        **_late_attach(args),
    )


def _late_attach(args: argparse.Namespace) -> dict[str, Any]:
    """--late-attach and the kernels it watches (--watch, --preset: made into one spec where the
    late attach uses them, session/run_outputs.py)."""
    if not args.late_attach:
        return {}  # refuse_unworkable_combinations refused --watch and --preset without it
    presets = tuple(args.preset) if args.preset else None
    return _given(late_attach=True, late_attach_watch=args.watch or None, late_attach_presets=presets)


def _follows(args: argparse.Namespace) -> bool:
    return args.follow is not None or getattr(args, "follow_unit", None) is not None


def follow_rule_from(args: argparse.Namespace) -> FollowTarget | None:
    """The processes --follow NAME (capture/process_match.py) or --follow-unit UNIT mean
    (session/follow_target.py), or None for --pid; UsageError for a name no process can have,
    or a flag that needs one fixed PID."""
    from sparseety_prof.session.follow_target import UnitMainProcess

    if not _follows(args):
        if args.follow_user is not None:
            raise UsageError("--follow-user needs --follow NAME or --follow-unit UNIT")
        return None
    if args.late_attach:
        raise UsageError("--late-attach is not available with --follow (it serves one process): use --pid")
    unit = getattr(args, "follow_unit", None)
    if unit is None:
        return _named_processes(args.follow, args.follow_user)
    if not unit or unit != unit.strip() or "/" in unit or unit.startswith("-") or not unit.isprintable():
        raise UsageError(f"--follow-unit needs a systemd unit name (e.g. llama.service), got {unit!r}")
    return UnitMainProcess(unit, _user_id(args.follow_user) if args.follow_user is not None else None)


def _named_processes(name: str, user: str | None) -> FollowTarget:
    from sparseety_prof.capture.process_match import COMM_MAX, ProcessRule
    from sparseety_prof.session.follow_target import NamedProcesses
    from sparseety_prof.store.output_dir import sudo_owner

    if not name or name != name.strip() or "\n" in name:
        raise UsageError(f"--follow needs a process name (as /proc/PID/comm shows it), got {name!r}")
    if len(name.encode()) > COMM_MAX:
        raise UsageError(
            f"--follow {name!r}: the kernel keeps at most {COMM_MAX} bytes of a process name, so no "
            f"process is named that; give the first {COMM_MAX} (what `ps -o comm` shows)"
        )
    owner = sudo_owner()
    uid = _user_id(user) if user is not None else owner[0] if owner else os.getuid()
    return NamedProcesses(ProcessRule(name=name, uid=uid))


def _user_id(user: str) -> int:
    import pwd

    if user.isdigit():
        return int(user)
    try:
        return pwd.getpwnam(user).pw_uid
    except KeyError:
        raise UsageError(f"--follow-user: no user named {user!r}") from None


# ---------------------------------------------------------------- what to capture


def _capture(args: argparse.Namespace) -> dict[str, Any]:
    from sparseety_prof.capture.cpu_sampler import MAX_RATE_HZ

    if args.cpu_sample_hz is not None and not 0 <= args.cpu_sample_hz <= MAX_RATE_HZ:
        raise UsageError(
            f"--cpu-sample-hz must be within 0..{MAX_RATE_HZ} (0: off), got {args.cpu_sample_hz}"
        )
    return _given(
        capture=_tokens_only(args) if args.mode == "tokens" else _sparse_capture(args),
        request_header=args.request_header,
        moe_read=args.moe_read,
        cpu_sample_hz=args.cpu_sample_hz,
        trace_ops=args.trace_ops,
        sched_waits=args.sched_waits,
    )


def _tokens_only(args: argparse.Namespace) -> Capture:
    from sparseety_prof.capture.options import TOKENS_ONLY, Capture

    default_every = Capture().act_every
    given = [
        flag
        for flag, on in (
            ("--capture-router-probs", args.capture_router_probs),
            ("--capture-masks", args.capture_masks),
            ("--act-every", args.act_every not in (None, default_every)),
            ("--act-threshold", args.act_threshold is not None),
            ("--moe-read", args.moe_read is not None),
            ("--duty-cycle", args.duty_cycle is not None),  # (it switches the sparse probes only)
            ("--no-layer-times", args.layer_times is False),  # (the sparse probes time the layers)
        )
        if on
    ]
    if given:
        raise UsageError(
            f"{', '.join(given)}: --mode tokens captures no sparse decisions; these need --mode full"
        )
    return TOKENS_ONLY


def _sparse_capture(args: argparse.Namespace) -> Capture:
    from sparseety_prof.capture.options import Capture

    given = _given(
        router_probs=args.capture_router_probs,
        masks=args.capture_masks,
        act_threshold=args.act_threshold,
        act_every=args.act_every,
        layer_times=args.layer_times,
    )
    try:
        return Capture(**given)
    except ValueError as e:
        raise UsageError(str(e)) from None


# ---------------------------------------------------------------- output


def _output(args: argparse.Namespace) -> dict[str, Any]:
    from sparseety_prof.store.schema import REDACT_PER_LAYER

    redact = frozenset[str]().union(*args.redact) if args.redact else None  # each value parsed as given
    if args.redact_layers is not None and not (redact or frozenset()) & set(REDACT_PER_LAYER):
        raise UsageError(f"--redact-layers needs --redact with one of {', '.join(REDACT_PER_LAYER)}")
    if args.max_disk is not None and args.output is None:
        raise UsageError("--max-disk needs -o (it bounds the recording on disk)")
    return {"out": args.output} | _given(
        duration=args.duration,
        flush_interval=args.flush_interval,
        fsync_interval=args.fsync_interval,
        journal=args.journal,
        max_disk=args.max_disk,
        redact_text=args.redact_text,
        redact=redact,
        redact_layers=args.redact_layers,
    )


# ---------------------------------------------------------------- sampling and policy


def _policy(args: argparse.Namespace) -> dict[str, Any]:
    undecided = any(spec.split(":", 1)[0] in UNDECIDED_POLICIES for spec in args.policy or ())
    if args.policy_window is not None and not undecided:
        raise UsageError(
            "--policy-window bounds the rows of requests not yet decided: it goes with --policy tail:Q "
            "or --policy anomaly (head, full and aggregate decide at once)"
        )
    if args.aggregate_interval is not None and args.aggregate_interval < 1:
        raise UsageError(f"--aggregate-interval must be at least 1 second, got {args.aggregate_interval}")
    return _given(
        policy=tuple(args.policy) if args.policy else None,
        policy_window=args.policy_window,
        aggregate_s=args.aggregate_interval,
    )


# ---------------------------------------------------------------- the recorder's footprint


def _footprint(args: argparse.Namespace) -> dict[str, Any]:
    if args.nice is not None and not -20 <= args.nice <= 19:
        raise UsageError(f"--nice must be from -20 to 19, got {args.nice}")
    duty = args.duty_cycle
    if args.duty_logits:
        if duty is None:
            raise UsageError(
                "--duty-logits switches the logits probes with --duty-cycle's windows: give --duty-cycle"
            )
        duty = dataclasses.replace(duty, logits=True)
    footprint = _given(sched=args.sched, nice=args.nice, duty_cycle=duty, max_memory=args.max_memory)
    if args.max_memory == NO_MEMORY_LIMIT:
        footprint["max_memory"] = None  # --max-memory none
    return footprint


# ---------------------------------------------------------------- fleet outputs


def _fleet(args: argparse.Namespace) -> Outputs:
    if args.otlp_token_events is not None and not 0.0 <= args.otlp_token_events <= 1.0:
        raise UsageError(f"--otlp-token-events must be within 0..1, got {args.otlp_token_events}")
    if args.metrics_port is not None and not 0 < args.metrics_port < 65536:
        raise UsageError(f"--metrics-port must be a port number (1-65535), got {args.metrics_port}")
    given = _given(
        otlp=args.otlp,
        otlp_token_events=args.otlp_token_events,
        otlp_steps=args.otlp_steps,
        metrics_port=args.metrics_port,
        metrics_bind=args.metrics_bind,
        metrics_experts=args.metrics_experts,
        dataset=args.dataset,
        status_interval=args.status_interval,
    )
    return Outputs(**given)


# ---------------------------------------------------------------- tuning


def _tuning(args: argparse.Namespace) -> dict[str, Any]:
    return _given(
        correlate_every=args.correlate_every,
        drain_interval=args.drain_interval,
        ring_mb=args.ring_mb,
        max_drain_gap=args.max_drain_gap,
        slice_us=args.slice_us,
        bpf_stats=args.bpf_stats,
        ablate_consumer=args.ablate_consumer,
        discover_layout=args.discover_layout,
        discover_timeout=args.discover_timeout,
        skip_probes=frozenset(getattr(args, "skip_probe", None) or ()) or None,
        recorder_cpus=args.recorder_cpus,
    )


def _check_run(opts: Options) -> None:
    if opts.duration is not None and not opts.duration > 0:
        raise UsageError(f"--duration must be a positive number of seconds, got {opts.duration}")
    if opts.flush_interval is not None and not opts.flush_interval > 0:
        raise UsageError(f"--flush-interval must be a positive number of seconds, got {opts.flush_interval}")
    if not opts.fsync_interval >= 0:
        raise UsageError(
            f"--fsync-interval must be 0 or a positive number of seconds, got {opts.fsync_interval}"
        )
    interval = opts.outputs.status_interval
    if interval is not None and not 0 <= interval < float("inf"):
        raise UsageError(f"--status-interval must be 0 (off) or a number of seconds, got {interval}")


def _check_tuning(opts: Options) -> None:
    from sparseety_prof.session.sched_slice import SLICE_MAX_US, SLICE_MIN_US

    if not 0 <= opts.correlate_every <= 10:
        raise UsageError(f"--correlate-every must be from 0 to 10 seconds, got {opts.correlate_every}")
    if not 1 <= opts.ring_mb <= 1024 or opts.ring_mb & (opts.ring_mb - 1):
        raise UsageError(f"--ring-mb must be a power of two from 1 to 1024, got {opts.ring_mb}")
    if not (opts.max_drain_gap == 0 or 0.1 <= opts.max_drain_gap <= 3600):
        raise UsageError(f"--max-drain-gap must be 0 (none) or 0.1-3600 s, got {opts.max_drain_gap}")
    if not DRAIN_INTERVAL_MIN_S <= opts.drain_interval <= DRAIN_INTERVAL_MAX_S:
        raise UsageError(
            f"--drain-interval must be from {DRAIN_INTERVAL_MIN_S:g} to {DRAIN_INTERVAL_MAX_S:g} s, "
            f"got {opts.drain_interval}"
        )
    if opts.max_drain_gap and opts.drain_interval >= opts.max_drain_gap:
        # every ordinary pause would count as a starved consumer and raise its priority
        raise UsageError(
            f"--drain-interval ({opts.drain_interval:g} s) must be shorter than --max-drain-gap "
            f"({opts.max_drain_gap:g} s)"
        )
    if opts.slice_us != 0 and not SLICE_MIN_US <= opts.slice_us <= SLICE_MAX_US:
        raise UsageError(
            f"--slice-us must be 0 (the kernel's) or {SLICE_MIN_US}-{SLICE_MAX_US}, got {opts.slice_us}"
        )
    if not opts.discover_timeout > 0:
        raise UsageError(
            f"--discover-timeout must be a positive number of seconds, got {opts.discover_timeout}"
        )
