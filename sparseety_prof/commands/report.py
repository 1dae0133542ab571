"""`report DIR`: summary tables of a recording."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sparseety_prof.commands.help_text import command_epilog, description
from sparseety_prof.errors import UsageError

EXAMPLES = """\
  sparseety-prof report rec                      # header, requests, where the time went, slowest tokens
  sparseety-prof report rec --anomalies          # and what the anomaly detectors find
  sparseety-prof report rec --html rec.html      # one self-contained page with charts
  sparseety-prof report rec --json | jq '.slowest_tokens[0]'
  sparseety-prof report rec --explain r0-0-1      # the request's slowest token on one screen
  sparseety-prof report rec --explain r0-0-1:12   # its token of decode order 12
"""


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    rp = sub.add_parser(
        "report",
        help="summary of a recording: requests, where their time went, slowest tokens",
        description=description(
            """Summary of a recording: what was recorded and lost, each request's tokens and
            log-probs, where each request's time went (queued, prompt, decode, time to first
            token, tokens per second), the slowest requests and tokens with their step's batch
            context, GPU kernels and step latency."""
        ),
        epilog=command_epilog("report", EXAMPLES),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    rp.add_argument("recording", type=Path, metavar="DIR", help="the recording")
    rp.add_argument(
        "--anomalies",
        action="store_true",
        help="also list what the anomaly detectors find (repetition loops, log-prob collapse, routing "
        "collapse and jumps, sparsity spikes, attention-coverage collapse, slow steps, load imbalance)",
    )
    rp.add_argument(
        "--html",
        type=Path,
        metavar="FILE",
        help="write one self-contained HTML page instead (charts, anomalies, the per-token table; opens "
        "without network); FILE is created owner-only and an existing FILE is refused unless --force",
    )
    rp.add_argument(
        "--request",
        metavar="ID",
        help="with --html: the request whose tokens the page shows (default: the longest)",
    )
    rp.add_argument("--force", action="store_true", help="with --html: replace FILE if it exists")
    rp.add_argument(
        "--explain",
        metavar="REQUEST[:DECODE_ORDER]",
        help="one token on one screen: its decisions per layer, log-prob and alternatives, its step's "
        "time by layer and thread, the hottest functions of its step kind, the waits and the operators "
        "where recorded (each part says when its table is absent); without DECODE_ORDER the "
        "request's slowest token; with --json as JSON",
    )
    rp.add_argument(
        "--json",
        action="store_true",
        help="print the report as JSON (stdout): counts, per-request table, slowest requests and tokens",
    )
    rp.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.explain is not None:
        return _explain(args)
    if args.html is not None:
        if args.json:
            raise UsageError("--json and --html FILE are two outputs: give one")
        return _html(args)
    if args.request is not None or args.force:
        raise UsageError("--request and --force go with --html FILE")
    if args.json:
        from sparseety_prof.terminal_text import json_dumps
        from sparseety_prof.views.report_json import report_json

        print(json_dumps(report_json(args.recording, anomalies=args.anomalies), indent=2))
        return 0
    from sparseety_prof.views.report import print_report

    print_report(args.recording, anomalies=args.anomalies)
    return 0


def _explain(args: argparse.Namespace) -> int:
    if args.html is not None or args.anomalies or args.request is not None or args.force:
        raise UsageError("--explain goes alone, or with --json")
    from sparseety_prof.store import recording
    from sparseety_prof.views.explain import explain, parse_token_ref

    rec = recording.open(args.recording)
    ids = set(rec.tokens()["request_id"].drop_nulls().to_list())
    found = explain(rec, parse_token_ref(args.explain, ids))
    if args.json:
        from sparseety_prof.terminal_text import json_dumps

        print(json_dumps(found, indent=2))
        return 0
    from sparseety_prof.views.explain_print import print_explain

    print_explain(found)
    return 0


def _html(args: argparse.Namespace) -> int:
    from sparseety_prof.store import recording
    from sparseety_prof.store.output_dir import sudo_owner
    from sparseety_prof.store.output_file import check_new_file, new_file
    from sparseety_prof.terminal_text import line
    from sparseety_prof.views.html_report import write_html

    check_new_file(args.html, force=args.force)
    rec = recording.open(args.recording)
    for table in ("tokens", "steps", "routes"):
        rec.table(table)  # read (and checked) before the output is created
    with new_file(args.html, force=args.force, owner=sudo_owner()) as out:
        shown = write_html(rec, out, request=args.request)
    what = f"request {shown}" if shown is not None else "no tokens"
    print(line(f"sparseety-prof: wrote {args.html} (HTML report, {what})"), file=sys.stderr)
    return 0
