"""`attach --pid N [-o DIR]`: attach and show the tokens live (rich), optionally recording."""

from __future__ import annotations

import argparse

from sparseety_prof.commands.attach_flags import add_attach_flags, metrics_sink_from, options_from
from sparseety_prof.commands.exit_codes import EXIT_CODES_HELP


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    at = sub.add_parser(
        "attach",
        help="attach to an engine and show its tokens live (optionally recording)",
        epilog=EXIT_CODES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_attach_flags(
        at, output_help="also record to this directory (created; must be empty)", output_required=False
    )
    at.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import time

    from rich.console import Console
    from rich.live import Live

    from sparseety_prof.session.metadata import summary_line
    from sparseety_prof.session.options import Progress
    from sparseety_prof.session.recorder import Recorder, install_signal_handlers
    from sparseety_prof.terminal_text import line
    from sparseety_prof.views.live import LiveState, render

    opts = options_from(args)
    metrics = metrics_sink_from(args, opts)
    console = Console(stderr=True)
    live = Live(console=console, refresh_per_second=4, auto_refresh=False, transient=False)
    state: list[LiveState] = []
    t0 = time.monotonic()

    def on_update(tok: dict, steps: dict, p: Progress) -> None:
        if not state:
            eng, model = rec.meta.get("engine") or {}, rec.meta.get("model") or {}
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

    rec = Recorder(
        opts,
        on_update=on_update,
        log=lambda s: console.print(s, markup=False, highlight=False),
        sinks=[metrics] if metrics else [],
    )
    install_signal_handlers(rec)
    try:
        with live:
            meta = rec.run()
    finally:
        if metrics is not None:
            metrics.stop()  # a failed attach never reached the sinks' close
    console.print(line(summary_line(meta)), markup=False, highlight=False)
    return 0
