"""Tables that fit the terminal without cutting a header: when the columns do not fit side by side
they are dealt into several tables, each repeating the key column (the request id), and every
column is at least as wide as its header. Cells wrap (fold) instead of being cut."""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Console
from rich.table import Table

from sparseety_prof.terminal_text import text, visible

#: a key column wider than this folds its values (a long HTTP request id) rather than taking a row
KEY_MAX = 24
#: per column: a border and one space of padding each side; plus the table's closing border
_COLUMN_FRAME = 3


def _natural(header: str, cells: Sequence[str]) -> int:
    return max([len(header), *(len(visible(c)) for c in cells)])


def column_groups(headers: Sequence[str], rows: Sequence[Sequence[str]], width: int) -> list[list[int]]:
    """Indices of the columns of each table: column 0 (the key) in every one, the others in order,
    as many per table as fit in `width` (at least one, even when it alone is wider)."""
    widths = [_natural(h, [r[i] for r in rows]) for i, h in enumerate(headers)]
    key = min(widths[0], max(KEY_MAX, len(headers[0]))) + _COLUMN_FRAME
    groups: list[list[int]] = [[0]]
    used = key + 1
    for i in range(1, len(headers)):
        need = widths[i] + _COLUMN_FRAME
        if used + need > width and len(groups[-1]) > 1:
            groups.append([0])
            used = key + 1
        groups[-1].append(i)
        used += need
    return groups


def print_fitted(
    con: Console, title: str, headers: Sequence[str], rows: Sequence[Sequence[str]], *, legend: str = ""
) -> None:
    """`rows` (strings from anywhere: shown through terminal_text) under `headers`, split into as
    many tables as the console's width needs; `legend` explains abbreviated headers."""
    groups = column_groups(headers, rows, con.width)
    for n, cols in enumerate(groups):
        part = f" ({n + 1}/{len(groups)})" if len(groups) > 1 else ""
        t = Table(title=text(title + part))
        for i in cols:
            t.add_column(headers[i], min_width=len(headers[i]), overflow="fold")
        for r in rows:
            t.add_row(*[text(r[i]) for i in cols])
        con.print(t)
    if legend:
        con.print(legend, style="dim", markup=False, highlight=False)
