"""`export DIR --format perfetto|jsonl -o FILE`, `export DIR --pprof FILE` or `export DIR --otlp
URL`: a recording for other tools."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sparseety_prof.commands.exit_codes import SPANS_NOT_SENT
from sparseety_prof.commands.help_text import command_epilog

FORMATS = ("perfetto", "jsonl")

EXAMPLES = """\
  sparseety-prof export rec --format perfetto -o rec.trace.json   # open in ui.perfetto.dev
  sparseety-prof export rec --format jsonl -o rec.jsonl           # one JSON object per token
  sparseety-prof export rec --otlp http://localhost:4318          # each request as a span
  sparseety-prof export rec --pprof rec.pb.gz                     # CPU profile: go tool pprof, Parca
"""

DESCRIPTION = """\
Write the recording DIR to FILE for other tools:
  perfetto  Chrome trace-event JSON, opened by ui.perfetto.dev (Open trace file) and
            chrome://tracing: a track per engine thread with its steps, a track per request
            with its tokens (experts, sparsity, attention and log-prob as each slice's args),
            a track per GPU stream with its kernels, and flow arrows token -> step -> kernels.
  jsonl     one JSON object per token, in the product brief's event shape.
Times are the recording's CLOCK_MONOTONIC; token text stays null where the recording was made
with --redact-text. FILE is created owner-only (0600); an existing FILE is refused unless --force.
The export holds what the recording holds (token text, routing): see docs: privacy.

With --pprof FILE instead, the CPU sampler's stacks (the cpu_stacks table) are written as a
gzipped pprof profile (go tool pprof, Parca, Pyroscope, speedscope), labelled by step kind,
phase and thread (pprof -tagfocus=phase=decode keeps the decode steps' CPU).

With --otlp URL instead, each request is sent as an OpenTelemetry span to that OTLP/HTTP
collector, the spans `record --otlp` sends live (docs: fleet outputs).
"""


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    e = sub.add_parser(
        "export",
        help="write a recording as a Perfetto/Chrome trace or as JSON lines (one per token)",
        description=DESCRIPTION,
        epilog=command_epilog("export", EXAMPLES),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    e.add_argument("recording", type=Path, metavar="DIR", help="the recording to export")
    e.add_argument("--format", choices=FORMATS, help="perfetto or jsonl")
    e.add_argument("-o", "--output", type=Path, metavar="FILE", help="the file to write")
    e.add_argument("--force", action="store_true", help="replace FILE if it exists")
    e.add_argument(
        "--otlp", default=None, metavar="URL", help="send the requests as spans to this OTLP/HTTP collector"
    )
    e.add_argument(
        "--otlp-token-events",
        type=float,
        default=0.0,
        metavar="RATE",
        help="with --otlp: this share (0..1) of each request's tokens as span events (default 0)",
    )
    e.add_argument("--otlp-steps", action="store_true", help="with --otlp: one span per step too")
    e.add_argument(
        "--pprof",
        type=Path,
        default=None,
        metavar="FILE",
        help="write the CPU sampler's stacks as a pprof profile",
    )
    e.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from sparseety_prof.errors import UsageError

    if args.pprof is not None:
        if args.format is not None or args.output is not None or args.otlp is not None:
            raise UsageError(
                "export: --pprof FILE writes the CPU profile; it takes no --format, -o or --otlp"
            )
        return _write_pprof(args)
    if args.otlp is not None:
        if args.format is not None or args.output is not None:
            raise UsageError("export: --otlp sends spans; it takes no --format or -o")
        return _send_otlp(args)
    if args.otlp_token_events or args.otlp_steps:
        raise UsageError("--otlp-token-events and --otlp-steps need --otlp URL")
    if args.format is None or args.output is None:
        raise UsageError("export: --format and -o FILE are needed (or --otlp URL)")
    from sparseety_prof.store import recording
    from sparseety_prof.store.output_dir import sudo_owner
    from sparseety_prof.store.output_file import check_new_file, new_file
    from sparseety_prof.terminal_text import line
    from sparseety_prof.views.export.perfetto import write_perfetto
    from sparseety_prof.views.export.token_events import write_jsonl

    check_new_file(args.output, force=args.force)
    rec = recording.open(args.recording)
    for table in ("tokens", "steps", "requests", "kernels"):
        rec.table(table)  # read (and checked) before the output is created
    with new_file(args.output, force=args.force, owner=sudo_owner()) as out:
        if args.format == "perfetto":
            counts = write_perfetto(rec, out)
            what = (
                f"{counts.steps} steps, {counts.tokens} tokens, {counts.kernels} kernels, "
                f"{counts.flows} flows"
            )
        else:
            what = f"{write_jsonl(rec, out)} tokens"
    print(line(f"sparseety-prof: wrote {args.output} ({args.format}: {what})"), file=sys.stderr)
    return 0


def _write_pprof(args: argparse.Namespace) -> int:
    from sparseety_prof.errors import UsageError
    from sparseety_prof.store import recording
    from sparseety_prof.store.output_dir import sudo_owner
    from sparseety_prof.store.output_file import check_new_file, new_file
    from sparseety_prof.terminal_text import line
    from sparseety_prof.views.export.pprof import write_pprof

    check_new_file(args.pprof, force=args.force)
    rec = recording.open(args.recording)
    if "cpu_sampler" not in rec.meta:
        raise UsageError(
            f"{args.recording} holds no CPU samples (recorded with --cpu-sample-hz 0, or before it)"
        )
    rec.cpu_stacks()  # read (and checked) before the output is created
    with new_file(args.pprof, force=args.force, owner=sudo_owner()) as out:
        got = write_pprof(rec, out)
    msg = f"sparseety-prof: wrote {args.pprof} (pprof: {got['samples']} samples, {got['stacks']} stack rows)"
    print(line(msg), file=sys.stderr)
    return 0


def _send_otlp(args: argparse.Namespace) -> int:
    from sparseety_prof.errors import UsageError
    from sparseety_prof.store import recording
    from sparseety_prof.terminal_text import line

    try:
        from sparseety_prof.session.otlp_sink import traces_url
        from sparseety_prof.views.export.otlp import send_recording
    except ImportError as e:
        raise UsageError(
            f"--otlp needs the OpenTelemetry SDK ({e}): pip install 'sparseety-prof[otlp]'"
        ) from None

    if not 0.0 <= args.otlp_token_events <= 1.0:
        raise UsageError(f"--otlp-token-events must be within 0..1, got {args.otlp_token_events}")
    try:
        traces_url(args.otlp)
    except ValueError as e:
        raise UsageError(f"--otlp: {e}") from None
    rec = recording.open(args.recording)
    acc = send_recording(rec, args.otlp, token_event_rate=args.otlp_token_events, steps=args.otlp_steps)
    spans = sum(acc["spans"].values())
    msg = f"sparseety-prof: sent {acc['sent']} of {spans} spans to {acc['endpoint']}"
    if acc["sent"] < spans:
        print(
            line(f"{msg}; not sent: {acc.get('last_problem') or 'the collector did not take them'}"),
            file=sys.stderr,
        )
        return SPANS_NOT_SENT
    print(line(msg), file=sys.stderr)
    return 0
