"""`record --pid N -o DIR`: attach and write a recording until stopped."""

from __future__ import annotations

import argparse
import sys

from sparseety_prof.commands.attach_flags import add_attach_flags, metrics_sink_from, options_from
from sparseety_prof.commands.exit_codes import EXIT_CODES_HELP


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    r = sub.add_parser(
        "record",
        help="attach to an engine and record every sampled token",
        epilog=EXIT_CODES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_attach_flags(r, output_help="recording directory (created; must be empty)", output_required=True)
    r.add_argument("--skip-probe", action="append", help=argparse.SUPPRESS)
    r.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from sparseety_prof.session.metadata import summary_line
    from sparseety_prof.session.recorder import Recorder, install_signal_handlers
    from sparseety_prof.terminal_text import line

    opts = options_from(args)
    metrics = metrics_sink_from(args, opts)
    rec = Recorder(opts, sinks=[metrics] if metrics else [])
    install_signal_handlers(rec)
    try:
        meta = rec.run()
    finally:
        if metrics is not None:
            metrics.stop()  # a failed attach never reached the sinks' close
    print(line(summary_line(meta)), file=sys.stderr)
    return 0
