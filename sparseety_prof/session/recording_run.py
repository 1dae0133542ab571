"""The run sequence `record` and `attach` share, from their Options to their exit code: check
where the run writes (session/output_checks.py), open the outputs (a port in use or a bad URL is
refused before anything is attached), one Recorder for the process (or, with --follow, one per
process, session/follow.py), the status line, the summary, --dataset. What differs is how a
command shows the run, and how it collects a recording into a dataset: a `Frontend`."""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sparseety_prof.session.output_checks import check_outputs
from sparseety_prof.session.run_outputs import late_attach_from, metrics_sink_from, sinks_from

if TYPE_CHECKING:
    from sparseety_prof.session.follow_target import FollowTarget
    from sparseety_prof.session.options import Options, Progress
    from sparseety_prof.session.recorder import Recorder
    from sparseety_prof.session.sinks import FrameSink

#: a live view's callback: each drain's token and step rows, and the progress so far
OnUpdate = Callable[[Mapping[str, list[Any]], Mapping[str, list[Any]], "Progress"], None]


def _no_view(_stop: Callable[[str], None]) -> AbstractContextManager[Any]:
    return nullcontext()


@dataclass
class Frontend:
    """How a command shows a run. `record`: lines on stderr; `attach`: a live view as well."""

    log: Callable[[str], None]
    # --dataset: collect these closed recordings into DEST, the command's exit code (`collect`'s)
    collect: Callable[[list[Path], Path], int]
    on_update: OnUpdate | None = None  # each drain's rows, for a live view
    # around the run, given the clean stop (a quit key may call it): the live view, say
    showing: Callable[[Callable[[str], None]], AbstractContextManager[Any]] = _no_view
    opened: Callable[[Recorder], None] = lambda _rec: None  # a recorder is made (--follow: per process)


def run_recording(opts: Options, front: Frontend) -> int:
    """Record as `opts` ask, shown by `front`; the command's exit code."""
    check_outputs(opts)
    if opts.follow is not None:
        return _follow(opts, opts.follow, front)
    return _record_one(opts, front)


def _new_recorder(opts: Options, front: Frontend, sinks: list[FrameSink]) -> Recorder:
    from sparseety_prof.session.policy import RecordingPolicy
    from sparseety_prof.session.recorder import Recorder

    policy = RecordingPolicy.for_session(opts.policy_choice, opts.policy_window)
    rec = Recorder(opts, policy=policy, on_update=front.on_update, log=front.log, sinks=sinks)
    front.opened(rec)
    return rec


def _record_one(opts: Options, front: Frontend) -> int:
    """One process (--pid): until Ctrl-C, SIGTERM, --duration or the engine's exit."""
    from sparseety_prof.session.metadata import summary_line
    from sparseety_prof.session.recorder import install_signal_handlers
    from sparseety_prof.session.status_line import ProgressTotals, StatusTicker, status_interval

    sinks = sinks_from(opts, front.log)
    metrics = metrics_sink_from(opts)  # the port is bound (or refused) before attaching
    ticker: StatusTicker | None = None
    try:
        late_attach_from(opts, front.log)
        rec = _new_recorder(opts, front, [*sinks, metrics] if metrics else sinks)
        install_signal_handlers(rec)
        totals = ProgressTotals()
        interval = status_interval(opts.outputs.status_interval, sys.stderr)
        ticker = StatusTicker(interval, lambda: totals.reading(rec.progress), front.log).start()
        with front.showing(rec.stop):
            meta = rec.run()
    finally:
        if ticker is not None:
            ticker.stop()
        if metrics is not None:
            metrics.stop()  # a failed attach never reached the sinks' close
    front.log(summary_line(meta))
    if opts.outputs.dataset is None or opts.out is None:
        return 0
    return front.collect([opts.out], opts.outputs.dataset)


def _follow(opts: Options, target: FollowTarget, front: Frontend) -> int:
    """--follow NAME / --follow-unit UNIT: one recording per process, until stopped
    (session/follow.py), with the output flags living as long as the follower
    (session/follow_outputs.py)."""
    from sparseety_prof.session.follow import Follower, install_follow_signal_handlers
    from sparseety_prof.session.follow_outputs import FollowOutputs
    from sparseety_prof.session.metadata import summary_line
    from sparseety_prof.session.status_line import StatusTicker, status_interval

    outputs = FollowOutputs(opts, front.log, front.collect)  # the port is bound (or refused) before waiting

    def make_recorder(o: Options) -> Recorder:
        return _new_recorder(o, front, outputs.sinks())

    def log_summary(meta: dict[str, Any]) -> None:
        front.log(summary_line(meta))

    follower = Follower(
        target, opts, make_recorder, front.log, on_recorded=log_summary, after_run=outputs.after_run
    )
    install_follow_signal_handlers(follower)
    interval = status_interval(opts.outputs.status_interval, sys.stderr)
    ticker = StatusTicker(interval, follower.status, front.log).start()
    try:
        with front.showing(follower.stop):
            follower.run()
    finally:
        ticker.stop()
        outputs.close()
    front.log(follower.summary())
    return 0
