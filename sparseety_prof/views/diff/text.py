"""Short text forms of numbers and tokens, shared by the first-difference details and the report."""

from __future__ import annotations

from sparseety_prof.terminal_text import visible
from sparseety_prof.views.diff.result import TokenRef


def num(v: float | None, spec: str = ".3g") -> str:
    if v is None:
        return "—"
    return "0" if v == 0 else format(v, spec)


def pct(v: float | None) -> str:
    if v is None:
        return "—"
    return "100%" if v == 1 else f"{min(100 * v, 99.99):.2f}%"  # never rounds up to a false 100%


def describe_token(t: TokenRef | None) -> str:
    """A token as id and text, for a line of prose."""
    if t is None:
        return "(none)"
    return f"{t.token_id} '{visible(t.text)}'" if t.text is not None else f"{t.token_id}"
