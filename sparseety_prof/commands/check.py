"""`check --pid N`: follow one tagged request through every capture layer of a live HTTP engine."""

from __future__ import annotations

import argparse
import sys

from sparseety_prof.commands.exit_codes import CHECK_FAILED, EXIT_CODES_HELP
from sparseety_prof.correlate.serving import DEFAULT_HEADER


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    ck = sub.add_parser(
        "check",
        help="send one tagged request to an HTTP engine and verify its id reaches every capture layer",
        epilog=EXIT_CODES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ck.add_argument("--pid", type=int, required=True, help="process id of the running HTTP engine")
    ck.add_argument("--url", default=None, help="engine endpoint (default: the port the process listens on)")
    ck.add_argument("--request-header", default=DEFAULT_HEADER, metavar="NAME", help="request id header name")
    ck.add_argument("--timeout", type=float, default=120.0, help="seconds for attaching and for the request")
    ck.add_argument("--skip-probe", action="append", help=argparse.SUPPRESS)
    ck.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from sparseety_prof.session.request_check import first_missing, run_check
    from sparseety_prof.terminal_text import line, text

    console = Console()
    rid, results = run_check(
        args.pid,
        url=args.url,
        header=args.request_header,
        timeout=args.timeout,
        skip_probes=frozenset(args.skip_probe or ()),
        log=lambda s: print(line(s), file=sys.stderr, flush=True),
    )
    table = Table(title=text(f"request {rid} through the capture layers"))
    table.add_column("layer")
    table.add_column("result")
    table.add_column("detail")
    for r in results:
        # details quote what the engine and its memory gave back: Text, never markup
        table.add_row(text(r.layer), "[green]ok[/]" if r.ok else "[red]LOST[/]", text(r.detail))
    console.print(table)
    missing = first_missing(results)
    if missing is not None:
        print(f"sparseety-prof check: the request id was lost at the {missing.layer} layer", file=sys.stderr)
        return CHECK_FAILED
    print("sparseety-prof check: the request id reached every layer", file=sys.stderr)
    return 0
