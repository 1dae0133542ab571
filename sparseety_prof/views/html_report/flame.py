"""Flame graphs of the CPU sampler's folded stacks (cpu_stacks), drawn as inline SVG: no script,
each frame's name and share in its <title> (the browser's own tooltip).

A flame graph: the root at the bottom, each frame a box as wide as the samples under it, its
callees stacked on it, siblings sorted by name (x is not time). Frames narrower than MIN_SHARE of
the whole are left out (with the boxes above them), which bounds the page whatever the profile.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field

from sparseety_prof.views.html_report.svg import _svg, esc

WIDTH = 1000.0
ROW = 16.0
MIN_SHARE = 0.002  # a frame below 0.2% of the samples is not drawn
MAX_DEPTH = 128
CHAR_PX = 6.6  # the width of a character of the labels' font, for fitting names into boxes


@dataclass
class Frame:
    name: str
    samples: int = 0
    children: dict[str, Frame] = field(default_factory=dict)


def tree(folded: Iterable[tuple[str, int]]) -> Frame:
    """The call tree of (folded stack, samples) pairs, under a root named "all"."""
    root = Frame("all")
    for stack, n in folded:
        root.samples += n
        node = root
        for name in stack.split(";")[:MAX_DEPTH]:
            node = node.children.setdefault(name, Frame(name))
            node.samples += n
    return root


def colour(name: str) -> str:
    """A warm colour fixed by the name (the same function is the same colour in every graph);
    the kernel's frames blue, unnamed ones grey."""
    if name == "[kernel]":
        return "#7aa6d8"
    if name.startswith("[") or "+0x" in name:
        return "#b8b8b8"
    h = zlib.crc32(name.encode())
    return f"rgb({205 + h % 50},{(h >> 8) % 150 + 60},{(h >> 16) % 50})"


def flame_svg(folded: Iterable[tuple[str, int]], label: str) -> str:
    """The flame graph of (folded stack, samples) pairs; "" when there is no sample."""
    root = tree(folded)
    if root.samples == 0:
        return ""
    boxes: list[tuple[float, int, float, Frame]] = []  # x, depth, width, frame
    min_n = root.samples * MIN_SHARE

    def place(node: Frame, x: float, depth: int) -> None:
        boxes.append((x, depth, WIDTH * node.samples / root.samples, node))
        for child in sorted(node.children.values(), key=lambda c: c.name):
            if child.samples >= min_n:
                place(child, x, depth + 1)
            x += WIDTH * child.samples / root.samples

    place(root, 0.0, 0)
    depth = max(d for _, d, _, _ in boxes) + 1
    height = depth * ROW
    body = []
    for x, d, w, node in boxes:
        y = height - (d + 1) * ROW
        share = 100.0 * node.samples / root.samples
        tip = f"{node.name} ({node.samples} samples, {share:.2f}%)"
        fits = int((w - 4) / CHAR_PX)
        text = node.name if len(node.name) <= fits else node.name[: fits - 2] + ".." if fits > 3 else ""
        body.append(
            f'<g><title>{esc(tip)}</title><rect x="{x:.2f}" y="{y:.0f}" width="{max(w - 0.5, 0.5):.2f}" '
            f'height="{ROW - 1:.0f}" fill="{colour(node.name)}"/>'
            + (f'<text x="{x + 2:.2f}" y="{y + ROW - 4:.0f}" class="fl">{esc(text)}</text>' if text else "")
            + "</g>"
        )
    return _svg(WIDTH, height, body, label)
