"""Command line: `sparseety-prof <command> ...`. `main(argv) -> int` so tests call it directly;
ProfError subclasses become a message and their exit code here, in one place."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from sparseety_prof import __version__
from sparseety_prof.correlate.serving import DEFAULT_HEADER
from sparseety_prof.errors import ProfError

if TYPE_CHECKING:
    from sparseety_prof.session.recorder import Options

EXIT_CODES_HELP = """exit codes:
  0  success              3  no such process        6  unsupported engine build
  1  other failure        4  not a supported engine 7  corrupt recording
  2  usage error          5  missing privileges     8  BPF unavailable (BCC, headers, kernel)
  9  check: a capture layer lost the request id
"""


CHECK_FAILED = 9


def _options(args: argparse.Namespace) -> Options:
    """Options of `record` and `attach`, from the flags they share (see _attach_flags)."""
    from sparseety_prof.capture.options import TOKENS_ONLY, Capture
    from sparseety_prof.errors import UsageError
    from sparseety_prof.session.recorder import Options

    if args.mode == "tokens":
        if args.capture_router_probs or args.capture_masks:
            raise UsageError("--capture-router-probs and --capture-masks need --mode full")
        capture = TOKENS_ONLY
    else:
        try:
            capture = Capture(
                router_probs=args.capture_router_probs,
                masks=args.capture_masks,
                act_threshold=args.act_threshold,
            )
        except ValueError as e:
            raise UsageError(str(e)) from None
    return Options(
        pid=args.pid,
        out=args.output,
        duration=args.duration,
        redact_text=args.redact_text,
        model=args.model,
        nice=args.nice,
        skip_probes=frozenset(getattr(args, "skip_probe", None) or ()),
        request_header=args.request_header,
        sched=args.sched,
        capture=capture,
        moe_read=getattr(args, "moe_read", "auto"),
        discover_layout=getattr(args, "discover_layout", False),
        discover_timeout=getattr(args, "discover_timeout", 120.0),
    )


def _cmd_record(args: argparse.Namespace) -> int:
    from sparseety_prof.session.recorder import Recorder, install_signal_handlers, summary_line

    rec = Recorder(_options(args))
    install_signal_handlers(rec)
    meta = rec.run()
    print(summary_line(meta), file=sys.stderr)
    return 0


def _cmd_attach(args: argparse.Namespace) -> int:
    import time

    from rich.console import Console
    from rich.live import Live

    from sparseety_prof.session.recorder import Progress, Recorder, install_signal_handlers, summary_line
    from sparseety_prof.views.live import LiveState, render

    opts = _options(args)
    console = Console(stderr=True)
    live = Live(console=console, refresh_per_second=4, auto_refresh=False, transient=False)
    state: list[LiveState] = []
    t0 = time.monotonic()

    def on_update(tok: dict, steps: dict, p: Progress) -> None:
        if not state:
            eng, model = rec.meta.get("engine", {}), rec.meta.get("model", {})
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

    rec = Recorder(opts, on_update=on_update, log=lambda s: console.print(s, markup=False, highlight=False))
    install_signal_handlers(rec)
    with live:
        meta = rec.run()
    console.print(summary_line(meta), markup=False, highlight=False)
    return 0


def _cmd_doctor(args: argparse.Namespace) -> int:
    from sparseety_prof.commands.doctor import print_checks, run_checks

    checks = run_checks(args.pid, gpu=args.gpu)
    print_checks(checks)
    failed = [c.name for c in checks if not c.ok]
    if failed:
        print(f"sparseety-prof doctor: {len(failed)} check(s) failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def _cmd_check(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from sparseety_prof.commands.check import first_missing, run_check

    console = Console()
    rid, results = run_check(
        args.pid,
        url=args.url,
        header=args.request_header,
        timeout=args.timeout,
        skip_probes=frozenset(args.skip_probe or ()),
        log=lambda s: print(s, file=sys.stderr, flush=True),
    )
    table = Table(title=f"request {rid} through the capture layers")
    table.add_column("layer")
    table.add_column("result")
    table.add_column("detail")
    for r in results:
        table.add_row(r.layer, "[green]ok[/]" if r.ok else "[red]LOST[/]", r.detail)
    console.print(table)
    missing = first_missing(results)
    if missing is not None:
        print(f"sparseety-prof check: the request id was lost at the {missing.layer} layer", file=sys.stderr)
        return CHECK_FAILED
    print("sparseety-prof check: the request id reached every layer", file=sys.stderr)
    return 0


def _cmd_launch(args: argparse.Namespace) -> int:
    from sparseety_prof.gpu.launch import run

    return run(args)


def _cmd_report(args: argparse.Namespace) -> int:
    from sparseety_prof.views.report import print_report

    print_report(args.recording)
    return 0


def _cmd_diff(args: argparse.Namespace) -> int:
    from sparseety_prof.views.diff import Tolerances, run

    return run(
        args.a,
        args.b,
        tolerances=Tolerances(logprob=args.logprob_tol, weight=args.weight_tol, ratio=args.ratio_tol),
        all_positions=args.all,
        context=args.context,
        as_json=args.json,
    )


def _non_negative(kind: type[int] | type[float]) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not value >= 0:  # also rejects NaN
            raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
        return value

    return parse


DIFF_DESCRIPTION = """\
Compare two recordings of the same prompts (dense vs sparse configuration, two engine builds,
with and without a change), request by request and token by token, and say where the runs first
diverge and how.

Requests are paired by order of their first token within each recording (request ids differ
between runs); requests already running when a recording began (partial) are left out of both,
and different request counts are reported. Within a pair tokens are aligned by decode order.
The divergence point is the first token whose id differs: later tokens condition on different
histories, so by default nothing after it is compared (--all compares every aligned position).
Per pair: tokens compared, the divergence with the surrounding tokens of both runs, the largest
|Δ log-prob| (same token only), MoE routing agreement (identical expert lists, and as sets) with
the first token and layer whose expert set differs, gate weights, |Δ act_zero_ratio| per FFN
layer, and attended cells per attention layer. Columns one recording did not capture (e.g.
expert ids of a dense model) are "not comparable", never differences.
"""

DIFF_EPILOG = """\
exit status:
  0  the runs are equal within the tolerances
  1  the runs differ (tokens, log-probs, routing, sparsity, attention, or request counts)
  2  usage error (e.g. a path that does not exist)
  7  not a recording, or a corrupt one
"""


def _attach_flags(p: argparse.ArgumentParser, *, output_help: str, output_required: bool) -> None:
    """The flags `record` and `attach` share, defined once."""
    p.add_argument("--pid", type=int, required=True, help="process id of the running engine")
    p.add_argument("-o", "--output", type=Path, required=output_required, default=None, help=output_help)
    p.add_argument("--duration", type=float, default=None, help="detach after this many seconds")
    p.add_argument("--redact-text", action="store_true", help="keep token ids but store no token text")
    p.add_argument("--model", type=Path, default=None, help="model file, when the engine has none mapped")
    p.add_argument(
        "--discover-layout",
        action="store_true",
        help="learn the engine's private llama_ubatch layout from its first forward passes even when "
        "the table of verified layouts has its build (those passes are not recorded)",
    )
    p.add_argument(
        "--discover-timeout",
        type=float,
        default=120.0,
        help="seconds to wait for forward passes when the layout must be learned (default 120)",
    )
    p.add_argument(
        "--nice",
        type=int,
        default=10,
        help="niceness the consumer takes once attached, so the engine wins CPU contention (default 10)",
    )
    p.add_argument(
        "--mode",
        choices=("full", "tokens"),
        default="full",
        help="full (default): tokens plus MoE routing, activation sparsity and attention coverage; "
        "tokens: token boundaries, ids and log-probs only (fewer probes)",
    )
    p.add_argument(
        "--act-threshold",
        type=float,
        default=1e-2,
        help="activations with |x| below this count in act_below_ratio (default 0.01; recorded in metadata)",
    )
    p.add_argument(
        "--capture-router-probs",
        action="store_true",
        help="also record the router probability of every expert per MoE layer",
    )
    p.add_argument(
        "--capture-masks",
        action="store_true",
        help="also record the activation zero masks, bit-packed, in the masks table",
    )
    p.add_argument(
        "--moe-read",
        choices=("auto", "ops"),
        default="auto",
        help="where MoE routing and activations are read: auto (default) = at each MoE layer's weighted "
        "multiply where the graph allows (fewest probe hits); ops = at the router's get_rows and the "
        "GLU op (more probe hits, for engine builds whose MoE graph differs)",
    )
    p.add_argument(
        "--sched",
        choices=["idle", "nice"],
        default="nice",
        help="consumer CPU policy once attached: nice (default) = run at --nice; idle = SCHED_IDLE (only CPU "
        "the engine leaves idle). Either way it takes nice 0 while more than half the ring is pending",
    )
    p.add_argument(
        "--request-header",
        default=DEFAULT_HEADER,
        metavar="NAME",
        help=f"HTTP servers: header whose value becomes request_id (default {DEFAULT_HEADER}); "
        "requests without it get generated ids",
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="sparseety-prof",
        description="Token-level profiler for sparse LLM inference: "
        "attaches to a running llama.cpp engine by PID.",
        epilog=EXIT_CODES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"sparseety-prof {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser(
        "record",
        help="attach to an engine and record every sampled token",
        epilog=EXIT_CODES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _attach_flags(r, output_help="recording directory (created; must be empty)", output_required=True)
    r.add_argument("--skip-probe", action="append", help=argparse.SUPPRESS)
    r.set_defaults(func=_cmd_record)

    at = sub.add_parser(
        "attach",
        help="attach to an engine and show its tokens live (optionally recording)",
        epilog=EXIT_CODES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _attach_flags(
        at, output_help="also record to this directory (created; must be empty)", output_required=False
    )
    at.set_defaults(func=_cmd_attach)

    la = sub.add_parser(
        "launch",
        help="start a CUDA engine with the CUPTI injection library (GPU path), to attach to later",
        description="Start `COMMAND` with CUDA_INJECTION64_PATH set to cupti_ext's library: CUPTI cannot "
        "attach to a running process, so GPU kernels are only visible for engines started this way. "
        "Then: sudo sparseety-prof record --pid N -o DIR (the kernels table).",
    )
    from sparseety_prof.gpu.launch import add_arguments as add_launch_arguments

    add_launch_arguments(la)
    la.set_defaults(func=_cmd_launch)

    ck = sub.add_parser(
        "check",
        help="send one tagged request to an HTTP engine and verify its id reaches every capture layer",
        epilog=EXIT_CODES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ck.add_argument("--pid", type=int, required=True, help="process id of the running HTTP engine")
    ck.add_argument("--url", default=None, help="engine endpoint (default: the port the process listens on)")
    ck.add_argument("--request-header", default=DEFAULT_HEADER, metavar="NAME", help="request id header name")
    ck.add_argument("--timeout", type=float, default=120.0, help="seconds for attaching and for the request")
    ck.add_argument("--skip-probe", action="append", help=argparse.SUPPRESS)
    ck.set_defaults(func=_cmd_check)

    dr = sub.add_parser("doctor", help="check privileges, BPF, headers, tracefs and (with --pid) the engine")
    dr.add_argument("--pid", type=int, default=None, help="also check this engine process")
    dr.add_argument(
        "--gpu",
        action="store_true",
        help="also check the GPU path: injection library, libcupti, cupti-python, CUDA driver "
        "(and with --pid the engine's CUPTI ring)",
    )
    dr.set_defaults(func=_cmd_doctor)

    rp = sub.add_parser("report", help="summary tables of a recording")
    rp.add_argument("recording", type=Path)
    rp.set_defaults(func=_cmd_report)

    df = sub.add_parser(
        "diff",
        help="compare two recordings of the same prompts token by token; exit 1 when they differ",
        description=DIFF_DESCRIPTION,
        epilog=DIFF_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    df.add_argument("a", type=Path, metavar="A", help="first recording (e.g. the dense run)")
    df.add_argument("b", type=Path, metavar="B", help="second recording (e.g. the sparse run)")
    df.add_argument(
        "--all",
        action="store_true",
        help="keep comparing aligned positions after the token ids diverge",
    )
    df.add_argument(
        "--logprob-tol",
        type=_non_negative(float),
        default=1e-3,
        metavar="X",
        help="|Δ log-prob| allowed for the same token (default 1e-3)",
    )
    df.add_argument(
        "--weight-tol",
        type=_non_negative(float),
        default=1e-5,
        metavar="X",
        help="|Δ gate weight| allowed for an expert both runs selected (default 1e-5)",
    )
    df.add_argument(
        "--ratio-tol",
        type=_non_negative(float),
        default=0.0,
        metavar="X",
        help="|Δ act_zero_ratio| allowed per layer (default 0: any change is a difference)",
    )
    df.add_argument(
        "--context",
        type=_non_negative(int),
        default=3,
        metavar="N",
        help="tokens shown before and after the divergence (default 3)",
    )
    df.add_argument("--json", action="store_true", help="print the result as JSON instead of the report")
    df.set_defaults(func=_cmd_diff)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except ProfError as e:
        print(f"sparseety-prof: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
