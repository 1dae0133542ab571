"""`record --pid N -o DIR`: attach and write a recording until stopped."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sparseety_prof.commands.attach_flags import (
    add_attach_flags,
    follow_rule_from,
    late_attach_from,
    metrics_sink_from,
    options_from,
    sinks_from,
)
from sparseety_prof.commands.dataset_flag import check_dataset_flag, collect_recording
from sparseety_prof.commands.help_text import command_epilog, description

if TYPE_CHECKING:
    from sparseety_prof.session.follow_target import FollowTarget
    from sparseety_prof.session.options import Options

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
    from sparseety_prof.session.metadata import summary_line
    from sparseety_prof.session.recorder import Recorder, install_signal_handlers
    from sparseety_prof.terminal_text import line

    check_dataset_flag(args)
    rule = follow_rule_from(args)
    opts = options_from(args)

    def log(s: str) -> None:
        print(line(s), file=sys.stderr, flush=True)

    if rule is not None:
        return follow(args, rule, opts, log)

    from sparseety_prof.session.status_line import ProgressTotals, StatusTicker, status_interval

    sinks = sinks_from(args, log)
    metrics = metrics_sink_from(args, opts)  # the port is bound (or refused) before attaching
    ticker: StatusTicker | None = None
    try:
        late_attach_from(args, log)
        rec = Recorder(opts, sinks=[*sinks, metrics] if metrics else sinks)
        install_signal_handlers(rec)
        totals = ProgressTotals()
        ticker = StatusTicker(
            status_interval(args.status_interval, sys.stderr), lambda: totals.reading(rec.progress), log
        ).start()
        meta = rec.run()
    finally:
        if ticker is not None:
            ticker.stop()
        if metrics is not None:
            metrics.stop()  # a failed attach never reached the sinks' close
    print(line(summary_line(meta)), file=sys.stderr)
    return collect_recording(args)


def follow(args: argparse.Namespace, target: FollowTarget, opts: Options, log: Callable[[str], None]) -> int:
    """--follow NAME / --follow-unit UNIT: one recording per process, until stopped
    (session/follow.py), with the output flags living as long as the follower
    (commands/follow_outputs.py)."""
    from sparseety_prof.commands.follow_outputs import FollowOutputs
    from sparseety_prof.session.follow import Follower, install_follow_signal_handlers
    from sparseety_prof.session.metadata import summary_line
    from sparseety_prof.session.recorder import Recorder
    from sparseety_prof.session.status_line import StatusTicker, status_interval

    outputs = FollowOutputs(args, opts, log)  # the port is bound (or refused) before waiting

    def make_recorder(o: Options) -> Recorder:
        return Recorder(o, log=log, sinks=outputs.sinks())

    def log_summary(meta: dict[str, Any]) -> None:
        log(summary_line(meta))

    follower = Follower(
        target, opts, make_recorder, log, on_recorded=log_summary, after_run=outputs.after_run
    )
    install_follow_signal_handlers(follower)
    ticker = StatusTicker(status_interval(args.status_interval, sys.stderr), follower.status, log).start()
    try:
        follower.run()
    finally:
        ticker.stop()
        outputs.close()
    log(follower.summary())
    return 0
