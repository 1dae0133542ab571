"""`check --pid N`: follow one tagged request through every capture layer of a live HTTP engine."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from sparseety_prof.commands.exit_codes import CHECK_FAILED
from sparseety_prof.commands.help_text import command_epilog, description
from sparseety_prof.correlate.serving import DEFAULT_HEADER
from sparseety_prof.errors import UsageError

if TYPE_CHECKING:
    from sparseety_prof.session.request_check import LayerResult

EXAMPLES = """\
  sparseety-prof check -p "$(pgrep -xo llama-server)"      # one tagged request, through every layer
  sparseety-prof check -p 12345 --url http://127.0.0.1:8080
  sparseety-prof check -p 12345 --json | jq .lost_at
"""


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    ck = sub.add_parser(
        "check",
        help="send one tagged request to an HTTP engine and verify its id reaches every capture layer",
        description=description(
            """Send one request with a known id to a running HTTP engine (llama-server) and verify
            that the id reaches every capture layer, from the server's request to the tokens."""
        ),
        epilog=command_epilog("check", EXAMPLES),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ck.add_argument("-p", "--pid", type=int, required=True, help="process id of the running HTTP engine")
    ck.add_argument("--url", default=None, help="engine endpoint (default: the port the process listens on)")
    ck.add_argument("--request-header", default=DEFAULT_HEADER, metavar="NAME", help="request id header name")
    ck.add_argument(
        "--timeout", type=float, default=120.0, help="seconds for attaching and for the request (default 120)"
    )
    ck.add_argument(
        "--json", action="store_true", help="print the result as JSON (stdout) instead of the table"
    )
    ck.add_argument("--skip-probe", action="append", help=argparse.SUPPRESS)
    ck.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from sparseety_prof.session.request_check import first_missing, run_check
    from sparseety_prof.terminal_text import line

    if not args.timeout > 0:
        raise UsageError(f"--timeout must be a positive number of seconds, got {args.timeout}")
    rid, results = run_check(
        args.pid,
        url=args.url,
        header=args.request_header,
        timeout=args.timeout,
        skip_probes=frozenset(args.skip_probe or ()),
        log=lambda s: print(line(s), file=sys.stderr, flush=True),
    )
    missing = first_missing(results)
    if args.json:
        from sparseety_prof.terminal_text import json_dumps

        print(json_dumps(check_json(args.pid, rid, results), indent=2))
    else:
        _print_table(rid, results)
    if missing is not None:
        print(
            line(f"sparseety-prof check: the request id was lost at the {missing.layer} layer"),
            file=sys.stderr,
        )
        return CHECK_FAILED
    print("sparseety-prof check: the request id reached every layer", file=sys.stderr)
    return 0


def check_json(pid: int, request_id: str, results: list[LayerResult]) -> dict[str, Any]:
    """The JSON `check --json` prints: the shape of `doctor --json` (ok, passed, failed, checks with
    name, ok and detail), plus the request's id and the first layer that lost it."""
    from sparseety_prof.session.request_check import first_missing

    missing = first_missing(results)
    failed = sum(not r.ok for r in results)
    return {
        "command": "check",
        "ok": missing is None,
        "pid": pid,
        "request_id": request_id,
        "lost_at": missing.layer if missing is not None else None,
        "passed": len(results) - failed,
        "failed": failed,
        "checks": [{"name": r.layer, "ok": r.ok, "detail": r.detail} for r in results],
    }


def _print_table(rid: str, results: list[LayerResult]) -> None:
    from rich.console import Console
    from rich.table import Table

    from sparseety_prof.terminal_text import text

    table = Table(title=text(f"request {rid} through the capture layers"))
    table.add_column("layer")
    table.add_column("result")
    table.add_column("detail")
    for r in results:
        # details quote what the engine and its memory gave back: Text, never markup
        table.add_row(text(r.layer), "[green]ok[/]" if r.ok else "[red]LOST[/]", text(r.detail))
    Console().print(table)
