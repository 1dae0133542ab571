"""scripts/replay_drains.py: a real run's drains kept, then replayed through the correlator,
which must make the rows the recorder made of them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "replay_drains.py"


def test_the_replay_flushes_at_the_captured_runs_drain_pace() -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    from replay_drains import LEGACY_DRAIN_S, captured_drain_s

    assert captured_drain_s({"meta": {"consumer": {"drain_interval_s": 0.1}}}) == 0.1
    # a capture from before --drain-interval (meta.json without it): the fixed pause of then
    assert captured_drain_s({"meta": {"consumer": {"drains": 9}}}) == LEGACY_DRAIN_S == 0.5
    assert captured_drain_s({"meta": {}}) == captured_drain_s({}) == LEGACY_DRAIN_S
    assert captured_drain_s({"meta": {"consumer": {"drain_interval_s": "x"}}}) == LEGACY_DRAIN_S


@pytest.mark.root
@pytest.mark.engine
def test_replayed_drains_make_the_recorders_rows(tmp_path: Path) -> None:
    drains = tmp_path / "drains.pkl"
    cap = subprocess.run(
        [sys.executable, str(SCRIPT), "capture", "-o", str(drains), "--seconds", "3", "--tokens", "16"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert cap.returncode == 0, cap.stderr[-2000:]
    assert drains.stat().st_mode & 0o777 == 0o600  # tokens and logits of the run: owner only
    rep = _replay(drains)
    # the package's correlator, compiled by scripts/setup.sh (which the test command runs first)
    which, head = rep.splitlines()[:2]
    assert which == "correlator: compiled"
    # "... the recorder made N token rows and M step rows of them, this replay N and M"
    made = head.split("the recorder made ")[1]
    recorded, replayed = made.split(" of them, this replay ")
    n_tok, n_steps = int(recorded.split()[0]), int(recorded.split(" and ")[1].split()[0])
    assert n_tok > 16 and n_steps >= n_tok  # several requests: a step per token, prompts too
    assert replayed == f"{n_tok} and {n_steps}"
    header, stages = rep.splitlines()[-3], rep.splitlines()[-1]
    assert header == "| decode | correlate | rows | logits | frames | write | sum |"  # the flush's writes too
    assert stages.startswith("| ") and stages.endswith(" µs |")
    assert os.path.getsize(drains) > 0
    # what the probes sent per token by kind: the logits rows (32,000 floats a token here) first
    (sent,) = [line for line in rep.splitlines() if line.startswith("record bytes per token: ")]
    kinds = dict(part.rsplit(" ", 1) for part in sent.removeprefix("record bytes per token: ").split(", "))
    assert next(iter(kinds)) == "logits" and 128_000 <= float(kinds["logits"].replace(",", "")) < 140_000
    assert {"small", "ubatch_s", "step_agg"} <= set(kinds)  # a decode step's own records
    # --profile: the Python calls per token (the count a change to the correlator is judged by
    # where the VM's speed drifts), then the costliest functions; of the correlator's source
    # (cProfile sees no call inside compiled modules)
    out = _replay(drains, "--profile", "3", "--profile-sort", "cumulative", pure=True)
    calls = [line for line in out.splitlines() if line.endswith(" Python function calls per token")]
    assert len(calls) == 1 and float(calls[0].split()[0]) > 10  # a token's records take more than that
    assert "Correlator.feed under cProfile (with what it calls" in out
    # --profile-stage: the rows', the frames' and the writes' Python instead of the correlation's
    for stage, heading, called in (
        ("rows", "take_tables and take_apart under cProfile", "take_tables"),
        ("frames", "the frames under cProfile", "_frame"),
        ("write", "the writes under cProfile", "write_parquet"),
    ):
        out = _replay(
            drains, "--profile", "40", "--profile-sort", "cumulative", "--profile-stage", stage, pure=True
        )
        assert heading in out and f"({called})" in out, out[-3000:]
        assert "(feed)" not in out  # the correlation is left out of that profile


def _replay(drains: Path, *args: str, pure: bool = False) -> str:
    """`replay_drains.py replay DRAINS --repeat 1 ARGS...`'s output, checked to have succeeded;
    `pure`: with the correlator's source (SPARSEETY_PROF_PURE_PYTHON=1)."""
    env = {k: v for k, v in os.environ.items() if k != "SPARSEETY_PROF_PURE_PYTHON"}
    got = subprocess.run(
        [sys.executable, str(SCRIPT), "replay", str(drains), "--repeat", "1", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**env, "SPARSEETY_PROF_PURE_PYTHON": "1"} if pure else env,
    )
    assert got.returncode == 0, got.stdout + got.stderr[-2000:]
    if pure:
        assert got.stdout.startswith("correlator: source: SPARSEETY_PROF_PURE_PYTHON is set\n")
    return got.stdout
