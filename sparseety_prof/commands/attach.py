"""`attach --pid N [-o DIR]`: attach and show the tokens live (rich), optionally recording."""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, ExitStack
from typing import TYPE_CHECKING, Any

from sparseety_prof.commands.attach_flags import add_attach_flags
from sparseety_prof.commands.attach_options import options_from
from sparseety_prof.commands.collect import collect_into
from sparseety_prof.commands.help_text import command_epilog, description
from sparseety_prof.session.recording_run import Frontend, run_recording

if TYPE_CHECKING:
    from sparseety_prof.session.options import Progress
    from sparseety_prof.session.recorder import Recorder
    from sparseety_prof.views.live import LiveState

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
    opts = options_from(args)
    return run_recording(opts, LiveView().frontend())


class LiveView:
    """attach's view of the run: the requests and tokens drawn live (rich) from the consumer
    thread's snapshots, the keys read on their own thread (views/live_keys.py)."""

    def __init__(self) -> None:
        from rich.console import Console
        from rich.live import Live

        from sparseety_prof.views.live import Snapshot, ViewSettings

        self.console = Console(stderr=True)
        self.live = Live(console=self.console, refresh_per_second=4, auto_refresh=False, transient=False)
        self.state: list[LiveState] = []
        # the consumer thread brings snapshots, the key thread settings: one lock orders the redraws
        self.lock = threading.Lock()
        self.view = ViewSettings()
        self.latest: list[Snapshot] = []  # the newest snapshot
        self.shown: list[Snapshot] = []  # the one on screen (the newest unless paused)
        self.t0 = time.monotonic()
        self.recorders: list[Recorder] = []  # the one attached now (--follow: a new one per process)

    def frontend(self) -> Frontend:
        return Frontend(
            self.log, collect_into, on_update=self.on_update, showing=self.showing, opened=self.opened
        )

    def log(self, s: str) -> None:
        from sparseety_prof.terminal_text import line

        self.console.print(line(s), markup=False, highlight=False)

    def opened(self, rec: Recorder) -> None:
        self.state.clear()  # a new process: its own engine, model and counts on screen
        self.recorders.append(rec)

    def showing(self, stop: Callable[[str], None]) -> AbstractContextManager[Any]:
        """The live view and the key reader, for as long as the run lasts; q stops it."""
        from sparseety_prof.views.live import QUIT_KEY, apply_key
        from sparseety_prof.views.live_keys import KeyReader

        def on_key(key: str) -> None:
            if key == QUIT_KEY:
                stop("q pressed")  # the same clean stop as Ctrl-C: the recording is closed complete
                return
            with self.lock:
                ids = [r.request_id for r in self.shown[0].requests] if self.shown else []
                self.view = apply_key(self.view, key, ids)
                if not self.view.paused and self.latest:
                    self.shown[:] = self.latest
                self._redraw()

        both = ExitStack()
        both.enter_context(self.live)
        both.enter_context(KeyReader(on_key))
        return both

    def _redraw(self) -> None:
        from sparseety_prof.views.live import render

        if self.shown:
            size = self.console.width, self.console.height
            self.live.update(render(self.shown[0], self.view, *size), refresh=True)

    def on_update(self, tok: Mapping[str, list[Any]], steps: Mapping[str, list[Any]], p: Progress) -> None:
        if not self.state:
            self.state.append(_live_state(self.recorders[-1]))
        self.state[0].update(tok, steps, p.counters())
        snap = self.state[0].snapshot(time.monotonic_ns(), time.monotonic() - self.t0)
        with self.lock:
            self.latest[:] = [snap]
            if not self.view.paused:
                self.shown[:] = [snap]
                self._redraw()


def _live_state(rec: Recorder) -> LiveState:
    """What the view shows of the process attached: its engine, model and layers."""
    from sparseety_prof.views.live import LiveState

    eng, model = rec.meta.get("engine") or {}, rec.meta.get("model") or {}
    hp = model.get("hyperparameters") or {}
    return LiveState(
        pid=rec.opts.pid,
        engine=f"{eng.get('name', '?')} {eng.get('version', '')}".strip(),
        model=str(model.get("path", "?")).rsplit("/", 1)[-1],
        recording=str(rec.opts.out) if rec.opts.out else None,
        layers=rec.meta.get("layers"),
        n_experts=hp.get("expert_count") if isinstance(hp.get("expert_count"), int) else None,
    )
