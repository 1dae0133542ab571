"""`diff A B`: compare two recordings of the same prompts; exit 1 when they differ."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from sparseety_prof.commands.exit_codes import DIFFERENT, SUCCESS
from sparseety_prof.commands.help_text import command_epilog

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

EXAMPLES = """\
  sparseety-prof diff dense-rec sparse-rec             # where the runs first diverge, and how
  sparseety-prof diff a b --all --logprob-tol 1e-2     # compare every position, looser log-probs
  sparseety-prof diff a b --json | jq '.pairs[0]'
"""


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


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    df = sub.add_parser(
        "diff",
        help="compare two recordings of the same prompts token by token; exit 1 when they differ",
        description=DIFF_DESCRIPTION,
        epilog=command_epilog("diff", EXAMPLES),
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
    df.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from sparseety_prof.views.diff import Tolerances, run

    equal = run(
        args.a,
        args.b,
        tolerances=Tolerances(logprob=args.logprob_tol, weight=args.weight_tol, ratio=args.ratio_tol),
        all_positions=args.all,
        context=args.context,
        as_json=args.json,
    )
    return SUCCESS if equal else DIFFERENT
