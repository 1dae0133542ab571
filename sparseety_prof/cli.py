"""Command line: `sparseety-prof <command> ...`. `main(argv) -> int` so tests call it directly;
ProfError subclasses become a message and their exit code here, in one place."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from . import __version__
from .errors import ProfError

if TYPE_CHECKING:
    from .record import Options

EXIT_CODES_HELP = """exit codes:
  0  success              3  no such process        6  unsupported engine build
  1  other failure        4  not a supported engine 7  corrupt recording
  2  usage error          5  missing privileges     8  BPF unavailable (BCC, headers, kernel)
"""


def _options(args: argparse.Namespace) -> Options:
    """Options of `record` and `attach`, from the flags they share (see _attach_flags)."""
    from .record import Options

    return Options(
        pid=args.pid,
        out=args.output,
        duration=args.duration,
        redact_text=args.redact_text,
        model=args.model,
        nice=args.nice,
        skip_probes=frozenset(getattr(args, "skip_probe", None) or ()),
    )


def _cmd_record(args: argparse.Namespace) -> int:
    from .record import Recorder, install_signal_handlers, summary_line

    rec = Recorder(_options(args))
    install_signal_handlers(rec)
    meta = rec.run()
    print(summary_line(meta), file=sys.stderr)
    return 0


def _cmd_attach(args: argparse.Namespace) -> int:
    import time

    from rich.console import Console
    from rich.live import Live

    from .live import LiveState, render
    from .record import Progress, Recorder, install_signal_handlers, summary_line

    opts = _options(args)
    console = Console(stderr=True)
    live = Live(console=console, refresh_per_second=4, auto_refresh=False, transient=False)
    state: list[LiveState] = []
    t0 = time.monotonic()

    def on_update(tok: dict, steps: dict, p: Progress) -> None:
        if not state:
            eng, model = rec.meta.get("engine", {}), rec.meta.get("model", {})
            state.append(
                LiveState(
                    pid=args.pid,
                    engine=f"{eng.get('name', '?')} {eng.get('version', '')}".strip(),
                    model=str(model.get("path", "?")).rsplit("/", 1)[-1],
                    recording=str(args.output) if args.output else None,
                )
            )
        state[0].update(tok, steps, p.counters())
        live.update(render(state[0].snapshot(time.monotonic_ns(), time.monotonic() - t0)), refresh=True)

    rec = Recorder(opts, on_update=on_update, log=lambda s: console.print(s, markup=False, highlight=False))
    install_signal_handlers(rec)
    with live:
        meta = rec.run()
    console.print(summary_line(meta), markup=False, highlight=False)
    return 0


def _cmd_doctor(args: argparse.Namespace) -> int:
    from .doctor import print_checks, run_checks

    checks = run_checks(args.pid)
    print_checks(checks)
    failed = [c.name for c in checks if not c.ok]
    if failed:
        print(f"sparseety-prof doctor: {len(failed)} check(s) failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from .report import print_report

    print_report(args.recording)
    return 0


def _attach_flags(p: argparse.ArgumentParser, *, output_help: str, output_required: bool) -> None:
    """The flags `record` and `attach` share, defined once."""
    p.add_argument("--pid", type=int, required=True, help="process id of the running engine")
    p.add_argument("-o", "--output", type=Path, required=output_required, default=None, help=output_help)
    p.add_argument("--duration", type=float, default=None, help="detach after this many seconds")
    p.add_argument("--redact-text", action="store_true", help="keep token ids but store no token text")
    p.add_argument("--model", type=Path, default=None, help="model file, when the engine has none mapped")
    p.add_argument(
        "--nice",
        type=int,
        default=10,
        help="niceness the consumer takes once attached, so the engine wins CPU contention (default 10)",
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="sparseety-prof",
        description="Token-level profiler for sparse LLM inference: "
        "attaches to a running llama.cpp engine by PID.",
        epilog=EXIT_CODES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"sparseety-prof {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser(
        "record",
        help="attach to an engine and record every sampled token",
        epilog=EXIT_CODES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _attach_flags(r, output_help="recording directory (created; must be empty)", output_required=True)
    r.add_argument("--skip-probe", action="append", help=argparse.SUPPRESS)
    r.set_defaults(func=_cmd_record)

    at = sub.add_parser(
        "attach",
        help="attach to an engine and show its tokens live (optionally recording)",
        epilog=EXIT_CODES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _attach_flags(
        at, output_help="also record to this directory (created; must be empty)", output_required=False
    )
    at.set_defaults(func=_cmd_attach)

    dr = sub.add_parser("doctor", help="check privileges, BPF, headers, tracefs and (with --pid) the engine")
    dr.add_argument("--pid", type=int, default=None, help="also check this engine process")
    dr.set_defaults(func=_cmd_doctor)

    rp = sub.add_parser("report", help="summary tables of a recording")
    rp.add_argument("recording", type=Path)
    rp.set_defaults(func=_cmd_report)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except ProfError as e:
        print(f"sparseety-prof: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
