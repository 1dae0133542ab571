"""What a `record`/`attach` run opens beside the Recorder, from its Options: the OTLP exporter,
the metrics endpoint (listening before anything is attached, so that a port in use is refused
then), and the CUPTI ring of --late-attach (its watched kernels made from --watch and --preset
here, where they are used)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sparseety_prof.errors import UsageError

if TYPE_CHECKING:
    from sparseety_prof.session.metrics_sink import PrometheusSink
    from sparseety_prof.session.options import Options
    from sparseety_prof.session.sinks import FrameSink


def sinks_from(opts: Options, log: Callable[[str], None]) -> list[FrameSink]:
    """The sinks the Options ask for (--otlp); UsageError for a bad URL."""
    out = opts.outputs
    if out.otlp is None:
        return []
    try:
        from sparseety_prof.session.otlp_sink import OtlpSink, traces_url
    except ImportError as e:
        raise UsageError(
            f"--otlp needs the OpenTelemetry SDK ({e}): pip install 'sparseety-prof[otlp]'"
        ) from None
    try:
        traces_url(out.otlp)
    except ValueError as e:
        raise UsageError(f"--otlp: {e}") from None
    return [OtlpSink(out.otlp, token_event_rate=out.otlp_token_events, steps=out.otlp_steps, log=log)]


def metrics_sink_from(
    opts: Options, *, sink_class: type[PrometheusSink] | None = None
) -> PrometheusSink | None:
    """The metrics endpoint asked for with --metrics-port, already listening, or None.
    `sink_class`: --follow's, which outlives a run."""
    from sparseety_prof.session.metrics_sink import PrometheusSink

    out = opts.outputs
    if out.metrics_port is None:
        return None
    chosen: dict[str, Any] = {"experts": out.metrics_experts} if out.metrics_experts is not None else {}
    return (sink_class or PrometheusSink)(
        out.metrics_bind, out.metrics_port, redact=opts.redact, redact_layers=opts.redact_layers, **chosen
    )


def late_attach_from(opts: Options, log: Callable[[str], None]) -> None:
    """--late-attach: give the target a CUPTI ring before the recorder looks for one."""
    from sparseety_prof.gpu.late_attach import SETTINGS, late_attach
    from sparseety_prof.gpu.launch import library_path
    from sparseety_prof.gpu.presets import watch_spec
    from sparseety_prof.gpu.watch_rules import WatchSpecError

    if not opts.late_attach:
        return
    try:  # --watch's entries and the presets', parsed together once
        watch = watch_spec(opts.late_attach_watch, list(opts.late_attach_presets))
    except WatchSpecError as e:
        raise UsageError(f"--watch/--preset: {e}") from None
    lib = library_path()
    if not lib.is_file():
        raise UsageError(f"the CUPTI injection library {lib} is not built: run `sparseety-prof build-cupti`")
    settings = {k: v for k, v in os.environ.items() if k in SETTINGS}
    if watch:
        settings["SPARSEETY_WATCH"] = watch
    result = late_attach(opts.pid, lib, settings, log=log)
    if not result.injected:
        log(f"sparseety-prof: {result.message}")
