"""Names of the graph nodes the sparse probes read, e.g. b"ffn_moe_weights-3": the node's kind
and its model layer."""

from __future__ import annotations

import re

# (a layer of at most five digits: the name comes from the target's memory, and a longer number,
# past any model's layers, would overflow the int64 arrays the layers are gathered into)
_NAME_RE = re.compile(rb"^(ffn_moe_weights|ffn_moe_weighted|ffn_[a-z0-9_]+|kq_soft_max|__fattn__)-(\d{1,5})$")
_PARSED: dict[bytes, tuple[str, int] | None] = {}


def parse_name(raw: bytes) -> tuple[str, int] | None:
    """(node kind, layer) of a probed tensor name, e.g. b"ffn_moe_weights-3" -> ("ffn_moe_weights", 3).
    Cached: a model has a few names per layer, seen on every forward pass."""
    got = _PARSED.get(raw, False)
    if got is not False:
        return got  # type: ignore[return-value]
    m = _NAME_RE.match(raw.split(b"\0", 1)[0])
    parsed = (m.group(1).decode(), int(m.group(2))) if m else None
    if len(_PARSED) < 65536:
        _PARSED[raw] = parsed
    return parsed
