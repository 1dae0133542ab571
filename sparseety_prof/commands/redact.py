"""`redact SRC -o DST --redact LEVEL`: write a redacted copy of a recording."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sparseety_prof.commands.help_text import command_epilog

EXAMPLES = """\
  sparseety-prof redact rec -o rec-shared --redact routing,sparsity --redact-text
  sparseety-prof redact rec -o rec-shared --redact routing --redact-layers 0-3   # the leakiest layers
  sparseety-prof audit rec-shared                                               # what it still gives away
"""

DESCRIPTION = """\
Write a copy of the recording SRC to DST with redaction levels applied, as if it had been recorded
with them: ids (token ids and text), routing (per-token experts, gate weights and router
probabilities; the expert load per layer stays in meta.json), sparsity (activation ratios rounded
to 0.1), masks (activation masks); --redact-layers limits routing, sparsity and masks to some
model layers. Levels the source already has are kept (both sets of levels then apply to both sets
of layers). `sparseety-prof audit` measures how much each level leaves (docs: privacy). DST must
be new or empty.
"""


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    r = sub.add_parser(
        "redact",
        help="write a redacted copy of a recording (token ids, routing, sparsity, masks, text)",
        description=DESCRIPTION,
        epilog=command_epilog("redact", EXAMPLES),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    r.add_argument("source", type=Path, metavar="SRC", help="the recording to copy")
    r.add_argument("-o", "--output", type=Path, required=True, help="the copy (created; must be empty)")
    r.add_argument(
        "--redact",
        action="append",
        default=[],
        metavar="LEVEL[,LEVEL]",
        help="levels to apply: ids, routing, sparsity, masks (repeat or comma-separate)",
    )
    r.add_argument(
        "--redact-layers",
        default=None,
        metavar="LAYERS",
        help="apply the routing, sparsity and masks levels to these model layers only (e.g. 0-3)",
    )
    r.add_argument("--redact-text", action="store_true", help="also drop token text and text in meta.json")
    r.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from sparseety_prof.errors import UsageError
    from sparseety_prof.session.export import export_redacted
    from sparseety_prof.store.output_dir import check_output_path, sudo_owner
    from sparseety_prof.store.recording import META_FILE
    from sparseety_prof.store.redaction_levels import redaction_from_flags
    from sparseety_prof.terminal_text import line

    levels, layers = redaction_from_flags(args.redact, args.redact_layers)
    if not levels and not args.redact_text:
        raise UsageError("nothing to redact: give --redact LEVEL and/or --redact-text")
    check_output_path(args.output, META_FILE, sudo_owner())
    meta = export_redacted(
        args.source, args.output, levels=levels, layers=layers, redact_text=args.redact_text
    )
    rows = sum(t["rows"] for t in meta["tables"].values())
    done = ", ".join(meta["redaction"]["levels"] + (["text"] if meta["redacted"] else []))
    if meta["redaction"]["layers"] is not None:
        done += f" (per-layer levels on layers {meta['redaction']['layers']})"
    print(line(f"sparseety-prof: wrote {args.output} ({rows} rows; redacted: {done})"), file=sys.stderr)
    return 0
