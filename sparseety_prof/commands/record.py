"""`record --pid N -o DIR`: attach and write a recording until stopped."""

from __future__ import annotations

import argparse
import sys

from sparseety_prof.commands.attach_flags import add_attach_flags
from sparseety_prof.commands.attach_options import options_from
from sparseety_prof.commands.collect import collect_into
from sparseety_prof.commands.help_text import command_epilog, description
from sparseety_prof.session.recording_run import Frontend, run_recording

EXAMPLES = """\
  sparseety-prof record -p "$(pgrep -xo llama-server)" -o rec          # until Ctrl-C or the engine exits
  sparseety-prof record -p 12345 -o rec -d 60                           # one minute
  sparseety-prof record -p 12345 -o rec --policy head:0.01 --max-disk 2G  # 1% of requests, bounded
  sparseety-prof record -p 12345 -o rec --redact-text --redact routing  # no text, no per-token experts
  sparseety-prof record --follow llama-server -o recs                   # one recording per restart
  sparseety-prof record --follow-unit llama.service -o recs --max-disk 20G --metrics-port 9464
  sparseety-prof record -p 12345 -o rec --metrics-port 9464 --otlp http://localhost:4318
then: sparseety-prof report rec
"""


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    r = sub.add_parser(
        "record",
        help="attach to an engine and record every sampled token",
        description=description(
            """Attach to a running llama.cpp engine by PID and record each token it samples, with
            its sparse decisions (experts, activation sparsity, attention), its step and its request,
            into a recording directory, until Ctrl-C, SIGTERM, --duration or the engine's exit.

            Needs root, or the capabilities in docs/privileges.md (`doctor` names a missing one).
            Layers an engine offloads to a GPU (-ngl) record no routing or sparsity. Tuning flags
            are accepted but left out of this list: docs/tuning.md."""
        ),
        epilog=command_epilog("record", EXAMPLES),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_attach_flags(r, output_help="recording directory (created; must be empty)", output_required=True)
    r.add_argument("--skip-probe", action="append", help=argparse.SUPPRESS)
    r.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    opts = options_from(args)
    return run_recording(opts, Frontend(_log, collect_into))


def _log(s: str) -> None:
    from sparseety_prof.terminal_text import line

    print(line(s), file=sys.stderr, flush=True)
