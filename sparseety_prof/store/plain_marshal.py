"""Python's marshal format (version 4) read back without `marshal.loads`, for plain values only.

`marshal.dumps` writes lists, dicts and numbers in C, far faster than anything that converts
them, which makes it the journal's cheapest record (store/gathered_codec.py). Its reader is not
made for data from elsewhere (the documentation says so: it builds code objects, among others),
and a journal may come from a recording made elsewhere. This reader understands only what plain
values need: None, booleans, ints, floats, str, bytes, lists, tuples, dicts and the references
marshal writes for values met twice; anything else, a length past the end of the data, more than
`max_items` values or nesting deeper than `max_depth`, is MarshalError (one line). It never
recurses on the data's say: containers are built with an explicit stack.

The type codes and layouts are marshal.c's (CPython Python/marshal.c, w_object and r_object).
"""

from __future__ import annotations

import struct
from typing import Any

__all__ = ["MarshalError", "loads"]

_FLAG_REF = 0x80
_I32, _F64 = struct.Struct("<i"), struct.Struct("<d")


class MarshalError(ValueError):
    """The bytes are not plain values in marshal's format (one line saying why)."""


class _Open:
    """A container being filled: its items so far and how many it holds in all."""

    __slots__ = ("items", "kind", "left", "ref")

    def __init__(self, kind: str, left: int, ref: int | None) -> None:
        self.kind = kind  # "[", "(", "{"
        self.items: list[Any] = []
        self.left = left  # items still to read (-1: a dict, until its end mark)
        self.ref = ref  # its place among the references, when it was flagged


def loads(data: bytes, *, max_items: int = 1 << 24, max_depth: int = 8) -> Any:
    """The one value `data` holds (MarshalError unless it is all of `data`)."""
    view = memoryview(data)
    pos = 0
    refs: list[Any] = []
    stack: list[_Open] = []
    items = 0
    result: Any = None
    done = False

    def take(n: int) -> memoryview:
        nonlocal pos
        if n < 0 or n > len(view) - pos:
            raise MarshalError(f"cut short at byte {pos} ({n} bytes wanted)")
        out = view[pos : pos + n]
        pos += n
        return out

    def i32() -> int:
        return int(_I32.unpack(take(4))[0])

    while not done:
        code = take(1)[0]
        flag, code = code & _FLAG_REF, code & ~_FLAG_REF
        ch = chr(code)
        items += 1
        if items > max_items:
            raise MarshalError(f"more than {max_items} values")
        value: Any
        if ch == "0":  # the end of a dict
            if not stack or stack[-1].kind != "{" or len(stack[-1].items) % 2:
                raise MarshalError(f"a dict's end mark out of place at byte {pos - 1}")
            stack[-1].left = 0
            value, ch = _close(stack.pop(), refs), "done"
        elif ch in "[({":
            n = -1 if ch == "{" else i32() if ch in "[(" else 0
            if ch in "[(" and not 0 <= n <= len(view) - pos:
                raise MarshalError(f"a container of {n} items in {len(view) - pos} bytes")
            ref = None
            if flag:
                ref = len(refs)
                refs.append(None)  # filled once the container is complete
            if len(stack) >= max_depth:
                raise MarshalError(f"nested deeper than {max_depth}")
            stack.append(_Open(ch, n, ref))
            if n == 0:
                value, ch = _close(stack.pop(), refs), "done"
            else:
                continue
        elif ch == ")":  # a small tuple
            n = take(1)[0]
            ref = None
            if flag:
                ref = len(refs)
                refs.append(None)
            if len(stack) >= max_depth:
                raise MarshalError(f"nested deeper than {max_depth}")
            stack.append(_Open("(", n, ref))
            if n == 0:
                value, ch = _close(stack.pop(), refs), "done"
            else:
                continue
        elif ch == "r":
            i = i32()
            if not 0 <= i < len(refs) or (refs[i] is None and _refers_to_open(stack, i)):
                raise MarshalError(f"a reference to value {i}, which is not there")
            value = refs[i]
            flag = 0
        else:
            value = _scalar(ch, take, i32, pos)
        if flag and ch != "done":
            refs.append(value)
        # the value goes into the container being filled, or is the result
        while True:
            if not stack:
                result, done = value, True
                break
            top = stack[-1]
            top.items.append(value)
            if top.kind == "{":
                if len(top.items) % 2 == 1 and not _hashable(value):
                    raise MarshalError("a dict key that is not a plain value")
                break
            top.left -= 1
            if top.left:
                break
            value = _close(stack.pop(), refs)
    if pos != len(view):
        raise MarshalError(f"{len(view) - pos} bytes after the value")
    return result


def _refers_to_open(stack: list[_Open], i: int) -> bool:
    """Whether reference `i` is a container still being read (a cycle: marshal writes none)."""
    return any(o.ref == i for o in stack)


def _hashable(v: Any) -> bool:
    return (
        v is None
        or isinstance(v, bool | int | float | str | bytes)
        or (isinstance(v, tuple) and all(_hashable(x) for x in v))
    )


def _close(o: _Open, refs: list[Any]) -> Any:
    if o.kind == "[":
        value: Any = o.items
    elif o.kind == "(":
        value = tuple(o.items)
    else:
        value = dict(zip(o.items[::2], o.items[1::2], strict=True))
    if o.ref is not None:
        refs[o.ref] = value
    return value


def _scalar(ch: str, take: Any, i32: Any, pos: int) -> Any:
    if ch == "N":
        return None
    if ch == "T":
        return True
    if ch == "F":
        return False
    if ch == "i":
        return i32()
    if ch == "g":
        return float(_F64.unpack(take(8))[0])
    if ch == "l":
        n = i32()
        if abs(n) > 1 << 16:
            raise MarshalError(f"an integer of {abs(n)} digits")
        digits = struct.unpack(f"<{abs(n)}H", take(2 * abs(n)))
        if any(d >= 1 << 15 for d in digits):
            raise MarshalError("an integer digit out of range")
        v = sum(d << (15 * k) for k, d in enumerate(digits))
        return -v if n < 0 else v
    if ch in "ut":
        return _text(take(i32()), "utf-8", pos)
    if ch in "aA":
        return _text(take(i32()), "ascii", pos)
    if ch in "zZ":
        return _text(take(take(1)[0]), "ascii", pos)
    if ch == "s":
        return bytes(take(i32()))
    raise MarshalError(f"a value of type {ch!r} at byte {pos - 1}, which plain values do not have")


def _text(raw: memoryview, encoding: str, pos: int) -> str:
    try:
        return bytes(raw).decode(encoding, "surrogatepass")
    except UnicodeDecodeError:
        raise MarshalError(f"text that is not {encoding} near byte {pos}") from None
