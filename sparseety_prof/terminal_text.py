"""Strings that came from the target, its clients or a recording, made safe to show on a terminal.

Request ids (any client's header), token text (the target's GGUF), kernel names, paths and build
strings are not trusted: shown raw, an escape sequence can clear the screen, set the window title
or write the clipboard (OSC 52), a bidi override can reorder what the operator reads, and Rich
markup inside them would be interpreted (`[link=...]`) or crash the view (`[/x]`). Every place
that prints such a string goes through this module; stored data keeps the exact bytes.
"""

from __future__ import annotations

import json
import unicodedata
from typing import Any

from rich.markup import escape as _escape_markup
from rich.text import Text

# Control (C0, DEL, C1), format (bidi overrides and isolates, zero-width and tag characters),
# surrogates, and the line/paragraph separators. ZWJ/ZWNJ stay: they only join glyphs (emoji,
# Indic scripts) and cannot move or hide text.
_HIDDEN_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})
_HARMLESS = frozenset({"\u200c", "\u200d"})


def _hidden(c: str) -> bool:
    return c not in _HARMLESS and unicodedata.category(c) in _HIDDEN_CATEGORIES


_SHORT = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escaped(c: str) -> str:
    if c in _SHORT:
        return _SHORT[c]
    o = ord(c)
    return f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}" if o < 0x10000 else f"\\U{o:08x}"


def visible(value: object, *, keep_newlines: bool = False) -> str:
    """`value` as text with every hidden character spelled out (ESC -> `\\x1b`, U+202E ->
    `\\u202e`); newlines too unless `keep_newlines` (multi-line messages of our own)."""
    s = str(value)
    return "".join(_escaped(c) if _hidden(c) and not (keep_newlines and c == "\n") else c for c in s)


def line(value: object) -> str:
    """A message for stderr (log line, error) whose parts may come from the target: newlines
    kept, every other hidden character spelled out."""
    return visible(value, keep_newlines=True)


def markup(value: object) -> str:
    """`visible(value)` with Rich markup escaped, for places that interpret markup."""
    return _escape_markup(visible(value))


def text(value: object, style: str = "", *, keep_newlines: bool = False) -> Text:
    """`value` as a Rich Text (never interpreted as markup) with hidden characters spelled out."""
    return Text(visible(value, keep_newlines=keep_newlines), style=style)


def json_dumps(obj: Any, **kw: Any) -> str:
    """json.dumps that also escapes the hidden characters JSON allows raw (C1, bidi, separators)
    as \\uXXXX: the same data, safe to print."""
    raw = json.dumps(obj, **kw)
    return "".join(
        "".join(f"\\u{u:04x}" for u in _utf16(c)) if _hidden(c) and ord(c) >= 0x7F else c for c in raw
    )


def _utf16(c: str) -> list[int]:
    o = ord(c)
    if o < 0x10000:
        return [o]
    o -= 0x10000
    return [0xD800 + (o >> 10), 0xDC00 + (o & 0x3FF)]
