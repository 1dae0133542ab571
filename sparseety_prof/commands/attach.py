"""`attach --pid N [-o DIR]`: attach and show the tokens live (rich), optionally recording."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Mapping
from typing import Any

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

EXAMPLES = """\
  sparseety-prof attach -p "$(pgrep -xo llama-server)"     # watch its tokens live; q quits
  sparseety-prof attach -p 12345 -o rec                    # and record them
  sparseety-prof attach -p 12345 --mode tokens             # tokens and log-probs only (fewer probes)
"""

KEYS = """\
keys in the live view:
  q  quit (a recording is closed complete)    p or space  pause the view
  n or tab  the next request                  h  expert heat map    s  sparsity    t  the token stream
"""


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    at = sub.add_parser(
        "attach",
        help="attach to an engine and show its tokens live (optionally recording)",
        description=description(
            """Attach to a running llama.cpp engine by PID and show its requests and tokens live:
            where each request's time went, its experts, sparsity and log-probs; with -o, also
            record them (as `record` does).

            Needs root, or the capabilities in docs/privileges.md (`doctor` names a missing one).
            Layers an engine offloads to a GPU (-ngl) record no routing or sparsity. Tuning flags
            are accepted but left out of this list: docs/tuning.md."""
        ),
        epilog=command_epilog("attach", EXAMPLES, notes=KEYS),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_attach_flags(
        at, output_help="also record to this directory (created; must be empty)", output_required=False
    )
    at.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import threading
    import time

    from rich.console import Console
    from rich.live import Live

    from sparseety_prof.session.follow import Follower, install_follow_signal_handlers
    from sparseety_prof.session.metadata import summary_line
    from sparseety_prof.session.options import Options, Progress
    from sparseety_prof.session.recorder import Recorder, install_signal_handlers
    from sparseety_prof.terminal_text import line
    from sparseety_prof.views.live import QUIT_KEY, LiveState, Snapshot, ViewSettings, apply_key, render
    from sparseety_prof.views.live_keys import KeyReader

    check_dataset_flag(args)
    rule = follow_rule_from(args)
    opts = options_from(args)
    console = Console(stderr=True)

    def log(s: str) -> None:
        console.print(line(s), markup=False, highlight=False)

    from sparseety_prof.commands.follow_outputs import FollowOutputs
    from sparseety_prof.session.status_line import ProgressTotals, StatusTicker, status_interval

    # the port is bound (or refused) before attaching; --follow: one endpoint for every run
    outputs = FollowOutputs(args, opts, log) if rule is not None else None
    sinks = sinks_from(args, log) if outputs is None else []
    metrics = metrics_sink_from(args, opts) if outputs is None else None
    live = Live(console=console, refresh_per_second=4, auto_refresh=False, transient=False)
    state: list[LiveState] = []
    # the consumer thread brings snapshots, the key thread settings: one lock orders the redraws
    lock = threading.Lock()
    view = [ViewSettings()]
    latest: list[Snapshot] = []  # the newest snapshot
    shown: list[Snapshot] = []  # the one on screen (the newest unless paused)
    t0 = time.monotonic()

    def redraw() -> None:
        if shown:
            live.update(render(shown[0], view[0], console.width, console.height), refresh=True)

    recorders: list[Recorder] = []  # the one attached now (--follow: a new one per process)

    def on_update(tok: Mapping[str, list[Any]], steps: Mapping[str, list[Any]], p: Progress) -> None:
        rec = recorders[-1]
        if not state:
            eng, model = rec.meta.get("engine") or {}, rec.meta.get("model") or {}
            hp = model.get("hyperparameters") or {}
            state.append(
                LiveState(
                    pid=rec.opts.pid,
                    engine=f"{eng.get('name', '?')} {eng.get('version', '')}".strip(),
                    model=str(model.get("path", "?")).rsplit("/", 1)[-1],
                    recording=str(rec.opts.out) if rec.opts.out else None,
                    layers=rec.meta.get("layers"),
                    n_experts=hp.get("expert_count") if isinstance(hp.get("expert_count"), int) else None,
                )
            )
        state[0].update(tok, steps, p.counters())
        snap = state[0].snapshot(time.monotonic_ns(), time.monotonic() - t0)
        with lock:
            latest[:] = [snap]
            if not view[0].paused:
                shown[:] = [snap]
                redraw()

    def make_recorder(o: Options) -> Recorder:
        state.clear()  # a new process: its own engine, model and counts on screen
        run_sinks = outputs.sinks() if outputs is not None else [*sinks, metrics] if metrics else sinks
        recorders.append(Recorder(o, on_update=on_update, log=log, sinks=run_sinks))
        return recorders[-1]

    stopper: list[Callable[[str], None]] = []

    def on_key(key: str) -> None:
        if key == QUIT_KEY:
            stopper[0]("q pressed")  # the same clean stop as Ctrl-C: the recording is closed complete
            return
        with lock:
            ids = [r.request_id for r in shown[0].requests] if shown else []
            view[0] = apply_key(view[0], key, ids)
            if not view[0].paused and latest:
                shown[:] = latest
            redraw()

    interval = status_interval(args.status_interval, sys.stderr)
    if rule is not None and outputs is not None:
        follower = Follower(
            rule,
            opts,
            make_recorder,
            log,
            on_recorded=lambda m: log(summary_line(m)),
            after_run=outputs.after_run,
        )
        stopper.append(follower.stop)
        install_follow_signal_handlers(follower)
        ticker = StatusTicker(interval, follower.status, log).start()
        try:
            with live, KeyReader(on_key):
                follower.run()
        finally:
            ticker.stop()
            outputs.close()
        log(follower.summary())
        return 0
    one_ticker: StatusTicker | None = None
    try:
        late_attach_from(args, log)
        rec = make_recorder(opts)
        stopper.append(rec.stop)
        install_signal_handlers(rec)
        totals = ProgressTotals()
        one_ticker = StatusTicker(interval, lambda: totals.reading(rec.progress), log).start()
        with live, KeyReader(on_key):
            meta = rec.run()
    finally:
        if one_ticker is not None:
            one_ticker.stop()
        if metrics is not None:
            metrics.stop()  # a failed attach never reached the sinks' close
    console.print(line(summary_line(meta)), markup=False, highlight=False)
    return collect_recording(args)
