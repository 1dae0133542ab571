"""scripts/preempt_stalls.py, run as a user runs it: two spinning processes made to share one CPU,
one named as the engine and one as the recorder; the tracer must find both and charge the engine's
waits to the recorder, never to the engine itself. How long the engine waited is a measurement
the script prints, not checked here."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest
from conftest import ROOT

SCRIPT = ROOT / "scripts" / "preempt_stalls.py"
SPIN = "import sys, time\nend = time.monotonic() + float(sys.argv[1])\nwhile time.monotonic() < end: pass\n"


def _spinner(seconds: float, marker: str, cpu: int) -> subprocess.Popen[bytes]:
    p = subprocess.Popen([sys.executable, "-c", SPIN, str(seconds), marker])
    os.sched_setaffinity(p.pid, {cpu})
    return p


@pytest.mark.root
def test_waits_of_an_engine_thread_are_charged_to_who_took_its_cpu() -> None:
    tag = uuid.uuid4().hex
    cpu = min(os.sched_getaffinity(0))
    engine = _spinner(60, f"engine-{tag}", cpu)
    recorder = _spinner(60, f"recorder-{tag}", cpu)
    try:
        matches = ["--engine-match", f"engine-{tag}", "--recorder-match", f"recorder-{tag}"]
        r = subprocess.run(
            [sys.executable, str(SCRIPT), "--seconds", "3", *matches],
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        for p in (engine, recorder):
            p.kill()
            p.wait()
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == f"engines [{engine.pid}], recorders [{recorder.pid}], 3 s"
    assert lines[1].startswith("| CPU taken by | waits |")
    rows = {ln.split("|")[1].strip(): ln for ln in lines[3:] if ln.startswith("| ")}
    # two processes that never sleep, on one CPU: the engine runs only when the recorder is switched out
    assert "recorder" in rows
    assert "engine" not in rows  # a process that is only the engine never waits for itself
