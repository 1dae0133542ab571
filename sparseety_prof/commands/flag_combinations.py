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
#: the capture flags a redaction level (applied to every layer) would store nothing of
_REDACTED_CAPTURE = (
    ("--capture-router-probs", "capture_router_probs", "routing"),
    ("--capture-masks", "capture_masks", "masks"),
)


def refuse_unworkable_combinations(args: argparse.Namespace) -> None:
    """UsageError for the first combination of `record`/`attach` flags that cannot work."""
    for needs, needed_attr, modifiers in _MODIFIERS:
        if getattr(args, needed_attr) in (None, False) and any(getattr(args, a) for a in modifiers.values()):
            hint = " (for a new process: `sparseety-prof launch --watch`)" if needs == "--late-attach" else ""
            raise UsageError(f"{' and '.join(modifiers)} need {needs}{hint}")
    if args.duration is not None and not args.duration > 0:
        raise UsageError(f"--duration must be a positive number of seconds, got {args.duration}")
    if not args.discover_timeout > 0:
        raise UsageError(
            f"--discover-timeout must be a positive number of seconds, got {args.discover_timeout}"
        )
    if not -20 <= args.nice <= 19:
        raise UsageError(f"--nice must be from -20 to 19, got {args.nice}")
    if args.output is None and args.policy and args.policy != ["full"]:
        raise UsageError(
            "--policy decides what the recording keeps: give -o DIR (the live view, metrics and "
            "exporters see every row whatever the policy)"
        )
    levels = {level.strip() for value in args.redact for level in value.split(",")}
    for flag, attr, level in _REDACTED_CAPTURE:
        if getattr(args, attr) and level in levels and args.redact_layers is None:
            raise UsageError(
                f"{flag} records what --redact {level} leaves out of every layer: drop one of them, "
                "or limit the redaction with --redact-layers"
            )
