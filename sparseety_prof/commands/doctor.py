"""`doctor [--pid N] [--gpu]`: runs every check attaching needs (capture/preflight.py, and the
GPU path's in gpu/diagnose.py) and prints how to fix each missing piece."""

from __future__ import annotations

import argparse
import sys

from sparseety_prof.capture.preflight import SYSTEM_CHECKS, check_engine
from sparseety_prof.checks import Check


def run_checks(pid: int | None, *, gpu: bool = False) -> list[Check]:
    checks = [c() for c in SYSTEM_CHECKS]
    if pid is not None:
        checks += check_engine(pid)
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


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    dr = sub.add_parser("doctor", help="check privileges, BPF, headers, tracefs and (with --pid) the engine")
    dr.add_argument("--pid", type=int, default=None, help="also check this engine process")
    dr.add_argument(
        "--gpu",
        action="store_true",
        help="also check the GPU path: injection library, libcupti, cupti-python, CUDA driver "
        "(and with --pid the engine's CUPTI ring)",
    )
    dr.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    checks = run_checks(args.pid, gpu=args.gpu)
    print_checks(checks)
    failed = [c.name for c in checks if not c.ok]
    if failed:
        print(f"sparseety-prof doctor: {len(failed)} check(s) failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0
