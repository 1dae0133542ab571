"""Inline SVG charts drawn in Python: no script runs in the page. Every label and tooltip passes
through `esc` (the numbers are ours, but the labels may hold text from the recording).

Charts with many marks (routing per token and layer) draw one <path> per colour instead of one
element per mark, which keeps a long request's chart to a few bytes per mark."""

from __future__ import annotations

import html
from collections.abc import Callable, Sequence

import numpy as np

from sparseety_prof.terminal_text import visible

#: colour ramp from low to high (a perceptually ordered, colour-blind-safe ramp: viridis stops)
RAMP = ("#440154", "#3b528b", "#21918c", "#5ec962", "#fde725")
#: colours of the series of one chart
SERIES = ("#3b6fb6", "#e08a1e", "#2a9d5b", "#b33c3c")
LEVELS = 10  # colour bins of the path-per-colour charts


def esc(value: object) -> str:
    """Text from anywhere, safe in HTML text and in a double- or single-quoted attribute: hidden
    characters (controls, bidi overrides) spelled out, then &, <, >, " and ' escaped."""
    s = str(value)
    if not (s.isascii() and s.isprintable()):  # printable ASCII has nothing to spell out (fast path)
        s = visible(s)
    return html.escape(s, quote=True)


def num(v: float) -> str:
    return f"{v:.4g}"


def ramp(t: float) -> str:
    """The colour of `t` in [0, 1] on RAMP (linear between stops)."""
    t = min(1.0, max(0.0, t)) * (len(RAMP) - 1)
    i = min(int(t), len(RAMP) - 2)
    f = t - i
    a, b = RAMP[i], RAMP[i + 1]
    rgb = [round(int(a[k : k + 2], 16) * (1 - f) + int(b[k : k + 2], 16) * f) for k in (1, 3, 5)]
    return "#" + "".join(f"{c:02x}" for c in rgb)


def _svg(width: float, height: float, body: list[str], label: str) -> str:
    return (
        f'<svg width="{width:.0f}" height="{height:.0f}" '
        f'viewBox="0 0 {width:.0f} {height:.0f}" role="img" aria-label="{esc(label)}">'
        + "".join(body)
        + "</svg>"
    )


def _text(x: float, y: float, s: object, anchor: str = "start", cls: str = "lbl") -> str:
    return f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}" class="{cls}">{esc(s)}</text>'


def legend_ramp(x: float, y: float, low: str, high: str) -> list[str]:
    out = [
        f'<rect x="{x + i * 12:.0f}" y="{y:.0f}" width="12" height="10" fill="{ramp(i / 9)}"/>'
        for i in range(10)
    ]
    return [_text(x - 4, y + 9, low, "end"), *out, _text(x + 124, y + 9, high)]


def heatmap(
    values: np.ndarray,
    rows: Sequence[object],
    cols: Sequence[object],
    *,
    row_title: str,
    col_title: str,
    tip: Callable[[int, int], str],
    label: str,
) -> str:
    """A rows x cols grid coloured by value / the largest value, each cell with a tooltip."""
    n_rows, n_cols = values.shape
    cell = max(6.0, min(28.0, 900.0 / max(n_cols, 1)))
    left, top = 70.0, 30.0
    top_value = float(values.max()) if values.size else 0.0
    body = [_text(left, 12, f"{col_title} →"), _text(4, top - 6, f"{row_title} ↓")]
    body += legend_ramp(left + 260, 2, "0", num(top_value))
    for j, c in enumerate(cols):
        if n_cols <= 32 or j % max(1, n_cols // 16) == 0:
            body.append(_text(left + (j + 0.5) * cell, top - 4, c, "middle", "tick"))
    for i, r in enumerate(rows):
        y = top + i * cell
        body.append(_text(left - 6, y + cell * 0.7, r, "end", "tick"))
        for j in range(n_cols):
            v = float(values[i, j])
            body.append(
                f'<rect x="{left + j * cell:.1f}" y="{y:.1f}" width="{cell:.1f}" height="{cell:.1f}" '
                f'fill="{ramp(v / top_value if top_value else 0)}"><title>{esc(tip(i, j))}</title></rect>'
            )
    return _svg(left + n_cols * cell + 10, top + n_rows * cell + 10, body, label)


def binned_grid(
    values: np.ndarray,
    rows: Sequence[object],
    *,
    row_title: str,
    col_title: str,
    low: str,
    high: str,
    label: str,
) -> str:
    """A rows x cols grid of values in [0, 1] (NaN: nothing), one <path> per colour bin."""
    n_rows, n_cols = values.shape
    cw = max(1.0, min(12.0, 1100.0 / max(n_cols, 1)))
    ch = max(8.0, min(16.0, 400.0 / max(n_rows, 1)))
    left, top = 70.0, 30.0
    body = [_text(left, 12, f"{col_title} →"), _text(4, top - 6, f"{row_title} ↓")]
    body += legend_ramp(left + 300, 2, low, high)
    bins: dict[int, list[str]] = {}
    for i in range(n_rows):
        for j in range(n_cols):
            v = values[i, j]
            if not np.isnan(v):
                b = min(LEVELS - 1, int(v * LEVELS))
                bins.setdefault(b, []).append(
                    f"M{left + j * cw:.1f} {top + i * ch:.1f}h{cw:.1f}v{ch:.1f}h-{cw:.1f}z"
                )
    for b, parts in sorted(bins.items()):
        body.append(f'<path fill="{ramp((b + 0.5) / LEVELS)}" d="{"".join(parts)}"/>')
    for i, r in enumerate(rows):
        body.append(_text(left - 6, top + i * ch + ch * 0.75, r, "end", "tick"))
    for j in range(0, n_cols, max(1, n_cols // 10)):
        body.append(_text(left + (j + 0.5) * cw, top + n_rows * ch + 12, j, "middle", "tick"))
    return _svg(left + n_cols * cw + 10, top + n_rows * ch + 20, body, label)


def dots(
    marks: Sequence[tuple[int, int]], n_cols: int, n_rows: int, *, col_title: str, row_title: str, label: str
) -> str:
    """(column, row) marks on a grid, one path: which expert each token chose in one layer."""
    cw = max(1.0, min(8.0, 1100.0 / max(n_cols, 1)))
    ch = max(3.0, min(8.0, 240.0 / max(n_rows, 1)))
    left, top = 70.0, 20.0
    d = "".join(f"M{left + c * cw:.1f} {top + r * ch:.1f}h{cw:.1f}v{ch:.1f}h-{cw:.1f}z" for c, r in marks)
    body = [
        _text(left, 12, f"{col_title} →"),
        _text(4, 12, f"{row_title} ↓"),
        f'<rect x="{left}" y="{top}" width="{n_cols * cw:.1f}" height="{n_rows * ch:.1f}" class="frame"/>',
        f'<path fill="{SERIES[0]}" d="{d}"/>',
    ]
    for r in range(0, n_rows, max(1, n_rows // 8)):
        body.append(_text(left - 6, top + r * ch + ch, r, "end", "tick"))
    return _svg(left + n_cols * cw + 10, top + n_rows * ch + 10, body, label)


def bars(
    cats: Sequence[object],
    series: Sequence[tuple[str, Sequence[float | None]]],
    *,
    cat_title: str,
    y_title: str,
    label: str,
    y_max: float | None = None,
) -> str:
    """Grouped bars: one group per category (layer), one bar per series; a missing value draws none."""
    vals = [v for _, s in series for v in s if v is not None]
    top_v = y_max if y_max is not None else max(vals, default=0.0) or 1.0
    gw = max(8.0, min(60.0, 1000.0 / max(len(cats), 1)))
    bw = gw * 0.8 / max(len(series), 1)
    left, top, h = 60.0, 40.0, 180.0
    body = [
        _text(4, 14, y_title),
        f'<line x1="{left}" y1="{top + h}" x2="{left + gw * len(cats)}" y2="{top + h}" class="axis"/>',
        _text(left - 4, top + 8, num(top_v), "end", "tick"),
        _text(left - 4, top + h, "0", "end", "tick"),
    ]
    for k, (name, _) in enumerate(series):
        x = left + k * 150
        body += [
            f'<rect x="{x}" y="20" width="10" height="10" fill="{SERIES[k % len(SERIES)]}"/>',
            _text(x + 14, 29, name),
        ]
    for i, c in enumerate(cats):
        for k, (name, s) in enumerate(series):
            v = s[i]
            if v is None:
                continue
            bh = h * min(v / top_v, 1.0) if top_v else 0.0
            x = left + i * gw + gw * 0.1 + k * bw
            tip = esc(f"{cat_title} {c}: {name} {num(v)}")
            body.append(
                f'<rect x="{x:.1f}" y="{top + h - bh:.1f}" width="{bw:.1f}" height="{bh:.1f}" '
                f'fill="{SERIES[k % len(SERIES)]}"><title>{tip}</title></rect>'
            )
        if len(cats) <= 40 or i % max(1, len(cats) // 20) == 0:
            body.append(_text(left + (i + 0.5) * gw, top + h + 14, c, "middle", "tick"))
    body.append(_text(left + gw * len(cats) / 2, top + h + 30, cat_title, "middle"))
    return _svg(left + gw * len(cats) + 10, top + h + 36, body, label)


def scatter(
    series: Sequence[tuple[str, Sequence[float], Sequence[float]]],
    *,
    x_title: str,
    y_title: str,
    label: str,
    join: bool = False,
) -> str:
    """Points (x, y) per series, joined by a line with `join`; axes scaled to the data."""
    xs = [x for _, sx, _ in series for x in sx]
    ys = [y for _, _, sy in series for y in sy]
    if not xs:
        return ""
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(min(ys), 0.0), max(max(ys), 0.0)
    x1, y1 = (x1 if x1 > x0 else x0 + 1), (y1 if y1 > y0 else y0 + 1)
    left, top, w, h = 60.0, 40.0, 1000.0, 200.0

    def px(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * w

    def py(y: float) -> float:
        return top + (y1 - y) / (y1 - y0) * h

    body = [
        _text(4, 14, y_title),
        f'<rect x="{left}" y="{top}" width="{w}" height="{h}" class="frame"/>',
        f'<line x1="{left}" y1="{py(0):.1f}" x2="{left + w}" y2="{py(0):.1f}" class="axis"/>',
        _text(left - 4, top + 8, num(y1), "end", "tick"),
        _text(left - 4, top + h, num(y0), "end", "tick"),
        _text(left, top + h + 14, num(x0), "start", "tick"),
        _text(left + w, top + h + 14, num(x1), "end", "tick"),
        _text(left + w / 2, top + h + 28, x_title, "middle"),
    ]
    for k, (name, sx, sy) in enumerate(series):
        colour = SERIES[k % len(SERIES)]
        pts = [(px(x), py(y)) for x, y in zip(sx, sy, strict=True)]
        if join and len(pts) > 1:
            d = "M" + "L".join(f"{x:.1f} {y:.1f}" for x, y in pts)
            body.append(f'<path d="{d}" fill="none" stroke="{colour}" stroke-width="1"/>')
        d = "".join(f"M{x - 1.5:.1f} {y - 1.5:.1f}h3v3h-3z" for x, y in pts)
        body.append(f'<path d="{d}" fill="{colour}"/>')
        if len(series) > 1:
            lx = left + k * 150
            body += [
                f'<rect x="{lx}" y="20" width="10" height="10" fill="{colour}"/>',
                _text(lx + 14, 29, name),
            ]
    return _svg(left + w + 10, top + h + 34, body, label)
