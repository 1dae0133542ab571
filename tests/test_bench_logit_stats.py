"""scripts/bench_logit_stats.py: the logits statistics' cost per row, warm and cold."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "bench_logit_stats.py"


def test_prints_a_cost_per_row_for_each_block_size() -> None:
    got = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--vocab",
            "4096",
            "--rows",
            "1",
            "8",
            "--repeat",
            "2",
            "--evict-mb",
            "8",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert got.returncode == 0, got.stderr[-2000:]
    lines = got.stdout.splitlines()
    assert lines[0].startswith("backend ") and "vocabulary 4,096 (16 KiB a row)" in lines[0]
    assert lines[1] == "| rows per call | warm µs per row | cold µs per row |"
    rows = [line.strip("| ").split(" | ") for line in lines[3:]]
    assert [r[0] for r in rows] == ["1", "8"]
    assert all(float(warm) > 0 and float(cold) > 0 for _, warm, cold in rows)


def test_refuses_sizes_that_are_not_positive() -> None:
    got = subprocess.run(
        [sys.executable, str(SCRIPT), "--rows", "0"], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert got.returncode == 2 and "must be positive" in got.stderr
