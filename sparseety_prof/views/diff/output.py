"""The `diff` command: compare two recordings, print the result as a report or as JSON, and exit
0 when the runs are equal within tolerances, 1 when they differ.

``--json`` prints `result_json`: the `DiffResult` fields as nested objects
(``"format": "sparseety-prof-diff"``, ``"version": 1``, ``equal``, ``a``/``b`` summaries,
``pairs`` with each pair's statistics and context, overall ``log_prob``/``routing``/
``act_zero_ratio``/``attn``, ``not_comparable``, ``notes``); a position is
``{"pair", "decode_order", "layer": {"index", "layer"} | null}``."""

from __future__ import annotations

import math
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.console import Console

from sparseety_prof.terminal_text import json_dumps
from sparseety_prof.views.diff.compare import diff_recordings
from sparseety_prof.views.diff.render import render
from sparseety_prof.views.diff.result import DiffResult, Tolerances

JSON_FORMAT = "sparseety-prof-diff"
JSON_VERSION = 1


def result_json(result: DiffResult) -> dict[str, Any]:
    """The result as JSON-ready data (non-finite floats become strings "inf"/"nan")."""

    def clean(v: Any) -> Any:
        if isinstance(v, float) and not math.isfinite(v):
            return str(v)
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        if isinstance(v, list | tuple):
            return [clean(x) for x in v]
        return v

    return {"format": JSON_FORMAT, "version": JSON_VERSION, **clean(asdict(result))}


def run(
    path_a: Path,
    path_b: Path,
    *,
    tolerances: Tolerances | None = None,
    all_positions: bool = False,
    context: int = 3,
    as_json: bool = False,
    console: Console | None = None,
) -> bool:
    """The `diff` command's output: whether the runs are equal within tolerances (its exit code is
    commands/diff.py's)."""
    result = diff_recordings(
        path_a, path_b, tolerances=tolerances, all_positions=all_positions, context=context
    )
    if as_json:
        out = console.file if console is not None else sys.stdout
        # the same JSON, with C1 and bidi characters of ids and token text as \\uXXXX escapes
        out.write(json_dumps(result_json(result), indent=2, ensure_ascii=False) + "\n")
    else:
        render(result, console or Console(), name_a=str(path_a), name_b=str(path_b))
    return result.equal
