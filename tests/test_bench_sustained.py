"""scripts/bench_sustained.py --bare-traps: a calibration recording finds the probe points, then
B runs scripts/bare_traps.py (no-op programs there) instead of the recorder. The figures are the
benchmark's to print; here only that the run goes through and counts what it says it counts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.root, pytest.mark.engine]


def test_bare_traps_pairs_count_each_points_traps(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_sustained.py"), "--engine", "llama-cpp-python"]
    p = subprocess.run(
        [*cmd, "--pairs", "1", "--seconds", "4", "--bare-traps", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert "calibration: the recorder keeps" in p.stderr
    (r,) = json.loads(out.read_text())
    assert r["bare_traps"] and "bare traps" in r["mode"]
    assert r["losses"] == 0 and r["records"] == 0  # nothing recorded on the B side
    (per_token,) = r["traps_per_token"]
    by_point = r["traps_per_token_by_point"]
    assert per_token == pytest.approx(sum(by_point.values()), rel=1e-9)
    # every multiply of the graph traps on both engine threads (the norms' too): the most frequent
    top = next(iter(by_point))
    assert top.startswith("entry ggml_compute_forward_mul ") and by_point[top] >= 2 * 8, by_point
    # one sampler call per generated token
    (logits,) = [v for k, v in by_point.items() if k.startswith("entry llama_get_logits_ith ")]
    assert 0.9 <= logits <= 1.1, by_point
    assert "traps per generated token by probe point" in p.stdout
