"""JSON text of exported values: every string escaped to ASCII, so control characters, bidi
overrides and U+2028 in token text or request ids stay data in any reader (and on a terminal
that shows the file), and exactly what the recording holds after parsing back."""

from __future__ import annotations

import json
import math
from typing import Any

_ENCODER = json.JSONEncoder(ensure_ascii=True, allow_nan=False, separators=(",", ":"))


def dumps(obj: Any) -> str:
    """Compact JSON of `obj`. JSON has no NaN or infinity: such a float is written as null."""
    try:
        return _ENCODER.encode(obj)
    except ValueError:
        return _ENCODER.encode(_finite(obj))


def _finite(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj
