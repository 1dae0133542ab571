"""Command line: `sparseety-prof <command> ...`, one module per command under commands/.
`main(argv) -> int` so tests call it directly; ProfError subclasses become a message and their
exit code here, in one place (the table of every code: commands/exit_codes.py). Commands import
their heavy parts (bcc, polars) only when run, so `--help` works on a machine without them."""

from __future__ import annotations

import argparse
import sys
import traceback
from types import ModuleType

from sparseety_prof import __version__
from sparseety_prof.errors import INTERNAL_ERROR, ProfError
from sparseety_prof.session.thread_pools import limit_thread_pools
from sparseety_prof.terminal_text import line


def command_modules() -> tuple[ModuleType, ...]:
    """One module per command, in the order --help lists them. Imported when the parser is
    built, not with this module: cli.main sizes the thread pools first (session/thread_pools.py),
    and command modules import polars."""
    from sparseety_prof.commands import (
        attach,
        audit,
        build_cupti,
        check,
        collect,
        diff,
        doctor,
        export,
        launch,
        record,
        redact,
        report,
    )

    return (record, attach, launch, build_cupti, check, doctor, report, diff, audit, redact, export, collect)


QUICK_START = """\
examples (as root; each command's --help has more):
  sparseety-prof doctor -p "$(pgrep -xo llama-server)"        # can it attach, and what to fix
  sparseety-prof attach -p "$(pgrep -xo llama-server)"        # watch tokens and experts live
  sparseety-prof record -p "$(pgrep -xo llama-server)" -o rec -d 60
  sparseety-prof report rec                                   # where the time went, per request
"""


def build_parser() -> argparse.ArgumentParser:
    from sparseety_prof.commands.exit_codes import EXIT_CODES_HELP

    p = argparse.ArgumentParser(
        prog="sparseety-prof",
        description="Token-level profiler for sparse LLM inference: "
        "attaches to a running llama.cpp engine by PID.",
        epilog=QUICK_START + "\n" + EXIT_CODES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"sparseety-prof {__version__}")
    sub = p.add_subparsers(dest="command", required=True, title="commands", metavar="COMMAND")
    for command in command_modules():
        command.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    # This process is the recorder (record, attach, check) or reads recordings on the engine's
    # host: one thread per pool, set before a command module imports numpy or polars
    limit_thread_pools()
    from sparseety_prof.commands.exit_codes import INTERRUPTED

    parser = build_parser()
    try:
        args = parser.parse_args(argv)  # a flag's value that cannot work is a UsageError
        return int(args.func(args))
    except ProfError as e:
        print(line(f"sparseety-prof: error: {e}"), file=sys.stderr)  # may name target paths
        return e.exit_code
    except KeyboardInterrupt:
        return INTERRUPTED
    except Exception:  # a bug: its traceback, and an exit code of its own (1 is `diff`'s answer)
        traceback.print_exc()
        print("sparseety-prof: internal error (the traceback above): please report it", file=sys.stderr)
        return INTERNAL_ERROR


if __name__ == "__main__":
    sys.exit(main())
