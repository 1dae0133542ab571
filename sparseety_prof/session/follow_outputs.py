"""The output flags of `record/attach --follow`, made to outlive each run: one metrics endpoint
for the follower's whole life (session/follow_metrics.py), an OTLP exporter per run (each run's
spans carry that engine process's resource: its PID and model), and --dataset collecting each
run once it closed (by the command's `collect`: it shows its progress)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sparseety_prof.session.run_outputs import metrics_sink_from, sinks_from

if TYPE_CHECKING:
    from sparseety_prof.session.follow_metrics import FollowPrometheusSink
    from sparseety_prof.session.options import Options
    from sparseety_prof.session.sinks import FrameSink


class FollowOutputs:
    """Made before the first attach (a port in use, a bad URL: refused then); `close()` once."""

    def __init__(
        self, opts: Options, log: Callable[[str], None], collect: Callable[[list[Path], Path], int]
    ) -> None:
        from sparseety_prof.session.follow_metrics import FollowPrometheusSink

        self._opts = opts
        self._log = log
        self._collect = collect
        sinks_from(opts, log)  # refuses a bad --otlp before anything is attached
        metrics = metrics_sink_from(opts, sink_class=FollowPrometheusSink)
        self.metrics: FollowPrometheusSink | None = metrics  # type: ignore[assignment]
        self.collected = 0

    def sinks(self) -> list[FrameSink]:
        """The sinks of one run: a new OTLP exporter, the one metrics endpoint."""
        run: list[FrameSink] = list(sinks_from(self._opts, self._log))
        if self.metrics is not None:
            run.append(self.metrics)
        return run

    def after_run(self, entry: dict[str, Any]) -> None:
        """--dataset: collect the run just closed (a refused one is said, and the follow goes on)."""
        dataset, out = self._opts.outputs.dataset, self._opts.out
        if dataset is None or out is None or not entry.get("dir"):
            return
        rc = self._collect([out / entry["dir"]], dataset)
        if rc == 0:
            self.collected += 1
        else:
            self._log(f"sparseety-prof: --dataset: run {entry['dir']} was not collected (exit {rc})")

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.shutdown()
