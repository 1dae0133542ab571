"""`audit DIR [--train DIR...]`: how much of the tokens a recording gives away, per signal, per
layer and after each redaction level."""

from __future__ import annotations

import argparse
from pathlib import Path

from sparseety_prof.commands.help_text import command_epilog

AUDIT_DESCRIPTION = """\
Take the attacker's view of a recording: fit token-recovery models (a per-layer lookup of expert
sets, naive Bayes over layers, nearest centroids over gate weights, router probabilities, sparsity
ratios, activation masks, attention counts and step timing) on training recordings of the same
model, and report on the held-out recording DIR: top-1 and top-5 token recovery, bits of token
information, the layers that leak most, and the same after each redaction level (--redact routing,
sparsity, masks, and all three).

Without --train, each run of DIR (a sequence up to where its position goes back: one per
prompt) is held out in turn and scored by models fitted on the others.
The recordings need token ids (not --redact ids): they are the ground truth.
"""

EXAMPLES = """\
  sparseety-prof audit rec                             # each run held out in turn
  sparseety-prof audit rec --train rec2 --train rec3   # fitted on other recordings of the model
  sparseety-prof audit rec --json | jq .leakiest_layers
"""
USAGE_ERRORS = """\
usage errors (exit 2) include: training recordings of another model (their model sha256 differs),
a recording without token ids or sparse decisions, a single run without --train
"""


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    a = sub.add_parser(
        "audit",
        help="measure how well a recording's routing and sparsity recover its tokens",
        description=AUDIT_DESCRIPTION,
        epilog=command_epilog("audit", EXAMPLES, notes=USAGE_ERRORS),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    a.add_argument("recording", type=Path, metavar="DIR", help="the recording to audit (held out)")
    a.add_argument(
        "--train",
        type=Path,
        action="append",
        default=[],
        metavar="DIR",
        help="a recording of the same model to fit the models on (repeat for several)",
    )
    a.add_argument("--json", action="store_true", help="print the result as JSON instead of the report")
    a.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from sparseety_prof.views.audit.render import run

    return run(args.recording, args.train, as_json=args.json)
