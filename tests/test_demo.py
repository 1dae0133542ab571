"""The demo's last screen (scripts/demo.py final_screen) on a real recording: one request's tokens
with the experts and sparsity of every layer as recorded, at 80 columns, and where to look next
(whose commands and Polars lines run)."""

from __future__ import annotations

import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest
from conftest import ROOT, Engine, Recorder, run_cli
from rich.console import Console

import sparseety_prof

sys.path.insert(0, str(ROOT / "scripts"))
import demo

pytestmark = [pytest.mark.root, pytest.mark.engine]


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("│").split("│")]


def test_last_screen_shows_the_recorded_decisions(llama_engine: Engine, tmp_path: Path) -> None:
    out = tmp_path / "rec"
    rec = Recorder(llama_engine.pid, out)
    llama_engine.generate(["hello the expert router", "one two three"], max_tokens=20)
    assert rec.stop()[0] == 0
    buf = io.StringIO()
    rows = demo.final_screen(out, Console(file=buf, width=80, color_system=None))
    screen = buf.getvalue()
    assert all(len(line) <= 80 for line in screen.splitlines()), screen

    r = sparseety_prof.open(out)
    tokens = r.tokens()
    first = tokens.sort("t_end_ns")["request_id"][0]
    want = tokens.filter(pl.col("request_id") == first).sort("decode_order")
    assert f"request {first} (first 20 of 20 tokens)" in screen
    # the table as printed: decode order, experts per MoE layer, zero % and below % per FFN layer
    shown = [_cells(ln) for ln in screen.splitlines() if re.match(r"│ \d+ +│", ln)]
    assert len(shown) == len(rows) == want.height == 20
    for cells, tok in zip(shown, want.iter_rows(named=True), strict=True):
        assert int(cells[0]) == tok["decode_order"]
        experts = [[int(e) for e in layer.split(",")] for layer in cells[2].split("|")]
        assert experts == tok["expert_ids"] and len(experts) == len(r.meta["layers"]["moe"])
        for col, name in ((3, "act_zero_ratio"), (4, "act_below_ratio")):
            assert [int(x) for x in cells[col].split()] == [round(100 * v) for v in tok[name]]
    assert "layers L0 L1 L2 L3 separated by |" in " ".join(screen.split())

    unwrapped = screen.replace("\n", "")  # a long path folds at 80 columns
    assert f"REC={out}" in unwrapped and f"r = sparseety_prof.open('{out}')" in unwrapped
    assert 'report "$REC" --anomalies' in screen and 'export "$REC" --format perfetto' in screen
    # the commands shown run on the recording, as pasted from the repository root
    commands = [ln.strip() for ln in screen.splitlines() if ln.strip().startswith(".venv/bin/sparseety-prof")]
    assert len(commands) >= 2
    for cmd in commands:
        args = shlex.split(cmd.replace('"$REC"', shlex.quote(str(out))))[1:]
        args = [str(tmp_path / a) if a.endswith((".json", ".html")) else a for a in args]
        done = run_cli(*args)
        assert done.returncode == 0, (cmd, done.stderr)
    env = {"sparseety_prof": sparseety_prof, "pl": pl, "r": r}
    for _, code in demo.POLARS_LINES:
        line = code.format(request=first)
        assert line in screen
        got = eval(line, env)  # the lines as a user would paste them
        assert isinstance(got, pl.DataFrame)
    load = eval(demo.POLARS_LINES[1][1], env)
    routed = r.routes().filter(pl.col("expert_ids").is_not_null())
    assert load["len"].sum() == routed["expert_ids"].list.len().sum()
    assert eval(demo.POLARS_LINES[0][1].format(request=first), env).height == 20


def test_demo_runs_on_the_installed_engine_and_shows_what_it_recorded(tmp_path: Path) -> None:
    """scripts/demo.py as scripts/demo.sh runs it, on its defaults (xllamacpp's llama-server, the
    smallthinker model): the engine recorded is xllamacpp, and the screen shows the first request's
    tokens with the experts and sparsity the recording holds."""
    out = tmp_path / "rec"
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "demo.py"), "--out", str(out), "--tokens", "12"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env={**os.environ, "COLUMNS": "80"},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    screen = done.stdout

    r = sparseety_prof.open(out)
    assert r.meta["engine"]["name"] == "xllamacpp" and r.meta["complete"] is True
    tokens = r.tokens()
    first = tokens.filter(pl.col("decode_order").is_not_null()).sort("t_end_ns")["request_id"][0]
    want = tokens.filter(pl.col("request_id") == first).sort("decode_order")
    assert want.height == 12
    # the recording has decisions to show: every token routed in every MoE layer, and ReGLU
    # experts leave part of each FFN layer's activations exactly zero
    assert all(len(e) == len(r.meta["layers"]["moe"]) for e in want["expert_ids"])
    zero = [v for row in want["act_zero_ratio"] for v in row]
    assert zero and all(0.0 < v < 1.0 for v in zero)

    assert f"request {first} (first 12 of 12" in " ".join(screen.split())
    shown = [_cells(ln) for ln in screen.splitlines() if re.match(r"│ \d+ +│", ln)]
    assert len(shown) == want.height
    for cells, tok in zip(shown, want.iter_rows(named=True), strict=True):
        assert int(cells[0]) == tok["decode_order"]
        assert [[int(e) for e in layer.split(",")] for layer in cells[2].split("|")] == tok["expert_ids"]
        for col, name in ((3, "act_zero_ratio"), (4, "act_below_ratio")):
            assert [int(x) for x in cells[col].split()] == [round(100 * v) for v in tok[name]]
