"""The `record`/`attach` flag combinations that cannot work, refused as usage errors (exit 2)
before anything is attached, each with what to do instead. A flag that only modifies another one
("with --otlp: ...") is refused without it, rather than silently ignored."""

from __future__ import annotations

import argparse

from sparseety_prof.errors import UsageError

#: flags that only modify another one: (the flag they need, its attribute, {modifier: attribute})
_MODIFIERS = (
    ("--otlp URL", "otlp", {"--otlp-token-events": "otlp_token_events", "--otlp-steps": "otlp_steps"}),
    (
        "--metrics-port N",
        "metrics_port",
        {"--metrics-bind": "metrics_bind", "--metrics-experts": "metrics_experts"},
    ),
    ("--late-attach", "late_attach", {"--watch": "watch", "--preset": "preset"}),
)


def refuse_unworkable_combinations(args: argparse.Namespace) -> None:
    """UsageError for the first combination of `record`/`attach` flags that cannot work (a
    value out of its range is refused as the Options are made: commands/attach_options.py)."""
    for needs, needed_attr, modifiers in _MODIFIERS:
        if getattr(args, needed_attr) in (None, False) and any(getattr(args, a) for a in modifiers.values()):
            hint = " (for a new process: `sparseety-prof launch --watch`)" if needs == "--late-attach" else ""
            raise UsageError(f"{' and '.join(modifiers)} need {needs}{hint}")
    if args.output is None and args.policy and args.policy != ["full"]:
        raise UsageError(
            "--policy decides what the recording keeps: give -o DIR (the live view, metrics and "
            "exporters see every row whatever the policy)"
        )
