"""`doctor [--pid N] [--gpu]`: runs every check attaching needs (capture/preflight.py, and the
GPU path's in gpu/diagnose.py) and prints how to fix each missing piece."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import asdict
from typing import Any

from sparseety_prof.capture import capabilities as caps
from sparseety_prof.capture.preflight import SYSTEM_CHECKS, check_capabilities, check_engine
from sparseety_prof.checks import Check
from sparseety_prof.commands.exit_codes import DOCTOR_FAILED
from sparseety_prof.commands.help_text import command_epilog, description
from sparseety_prof.session.placement import placement_check


def run_checks(pid: int | None, *, gpu: bool = False) -> list[Check]:
    checks = [c() for c in SYSTEM_CHECKS]
    checks += check_capabilities(pid)
    if pid is not None:
        checks += check_engine(pid)
        checks.append(placement_check(pid))  # where `record` would run the recorder (issue 61)
    if gpu:
        from sparseety_prof.gpu.diagnose import gpu_checks

        checks += gpu_checks(pid)
    return checks


def print_checks(checks: list[Check]) -> None:
    from rich.console import Console
    from rich.table import Table

    from sparseety_prof.terminal_text import text

    t = Table(title="sparseety-prof doctor", show_lines=False)
    for col in ("check", "", "detail", "how to fix"):
        t.add_column(col, overflow="fold")
    for c in checks:
        # details name the target's files and build strings: Text, never markup
        t.add_row(
            text(c.name),
            "[green]ok[/]" if c.ok else "[red]FAIL[/]",
            text(c.detail, keep_newlines=True),
            text(c.fix, keep_newlines=True),
        )
    Console().print(t)


EXAMPLES = """\
  sparseety-prof doctor                                  # this host: privileges, BCC, headers, tracefs
  sparseety-prof doctor -p "$(pgrep -xo llama-server)"   # and that engine: build, model, capture layers
  sparseety-prof doctor --gpu                            # and the GPU path (CUPTI library, driver)
  sparseety-prof doctor --json | jq '.checks[] | select(.ok | not)'
"""


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    dr = sub.add_parser(
        "doctor",
        help="check privileges, BPF, headers, tracefs and (with --pid) the engine",
        description=description(
            """Run every check attaching needs (privileges, BCC, kernel headers, tracefs, a BPF
            load; with --pid the engine's build, model and capture layers; with --gpu the GPU
            path) and say how to fix each one that fails."""
        ),
        epilog=command_epilog("doctor", EXAMPLES),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    dr.add_argument("-p", "--pid", type=int, default=None, help="also check this engine process")
    dr.add_argument(
        "--gpu",
        action="store_true",
        help="also check the GPU path: injection library, libcupti, cupti-python, CUDA driver "
        "(and with --pid the engine's CUPTI ring)",
    )
    dr.add_argument(
        "--json", action="store_true", help="print the checks as JSON (stdout) instead of the table"
    )
    dr.set_defaults(func=run)


def checks_json(checks: list[Check]) -> dict[str, Any]:
    """The JSON `doctor --json` prints: every check, and how many passed and failed."""
    failed = [c for c in checks if not c.ok]
    return {
        "command": "doctor",
        "ok": not failed,
        "passed": len(checks) - len(failed),
        "failed": len(failed),
        "checks": [asdict(c) for c in checks],
        "capabilities": capabilities_json(),
    }


def capabilities_json() -> dict[str, Any]:
    """This process's effective capabilities, and which of those the recorder needs it lacks."""
    mask = caps.effective_capabilities()
    return {
        "effective": caps.capability_names(mask),
        "uid": os.getuid(),
        "missing": [c.name for c in caps.CAPABILITIES if c.required and not caps.has_capability(mask, c)],
        "optional_missing": [
            c.name for c in caps.CAPABILITIES if not c.required and not caps.has_capability(mask, c)
        ],
    }


def run(args: argparse.Namespace) -> int:
    checks = run_checks(args.pid, gpu=args.gpu)
    if args.json:
        from sparseety_prof.terminal_text import json_dumps

        print(json_dumps(checks_json(checks), indent=2))
    else:
        print_checks(checks)
    failed = [c.name for c in checks if not c.ok]
    if failed:
        print(f"sparseety-prof doctor: {len(failed)} check(s) failed: {', '.join(failed)}", file=sys.stderr)
        return DOCTOR_FAILED
    return 0
