"""One line of a health check: what was checked, whether it holds, what was seen, and the command
that fixes it. Shared by `doctor` (host and engine checks) and the GPU diagnosis."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""
