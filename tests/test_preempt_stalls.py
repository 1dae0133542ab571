"""scripts/preempt_stalls.py, performed: two spinning processes made to share one CPU, one named
as the engine and one as the recorder; the tracer must count the engine's waits while the other
held the CPU, and only those, as the recorder's."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import pytest

from scripts.preempt_stalls import StallTracer, table, trace

SPIN = "import sys, time\nend = time.monotonic() + float(sys.argv[1])\nwhile time.monotonic() < end: pass\n"


def _spinner(seconds: float, marker: str, cpu: int) -> subprocess.Popen[bytes]:
    p = subprocess.Popen([sys.executable, "-c", SPIN, str(seconds), marker])
    os.sched_setaffinity(p.pid, {cpu})
    return p


@pytest.mark.root
def test_waits_of_an_engine_thread_are_counted_by_who_took_its_cpu() -> None:
    tag = uuid.uuid4().hex
    cpu = min(os.sched_getaffinity(0))
    engine = _spinner(6, f"engine-{tag}", cpu)
    recorder = _spinner(6, f"recorder-{tag}", cpu)
    try:
        st = trace(3.0, f"engine-{tag}", f"recorder-{tag}")
    finally:
        for p in (engine, recorder):
            p.kill()
            p.wait()
    assert st.engines == {engine.pid} and st.recorders == {recorder.pid}
    # two spinners on one CPU share it: over ~2 s traced after the first second's discovery,
    # the engine waited about half the time, each wait the recorder's slice
    waited_s = st.total_ns["recorder"] / 1e9
    assert 0.3 < waited_s < 3.0
    assert sum(st.hist["recorder"].values()) >= 10
    assert 0 <= st.long_ns.get("recorder", 0) <= st.total_ns["recorder"]
    # the engine never waits for itself (a process that is only the engine)
    assert "engine" not in st.hist
    rows = table(st)
    assert rows[2].startswith("| recorder | ")


@pytest.mark.root
def test_a_take_starts_the_counts_again() -> None:
    tag = uuid.uuid4().hex
    cpu = min(os.sched_getaffinity(0))
    tracer = StallTracer()
    try:
        engine = _spinner(30, f"engine-{tag}", cpu)
        recorder = _spinner(1.5, f"recorder-{tag}", cpu)
        tracer.add_engine(engine.pid)
        recorder.wait()
        # a wait is counted when the engine runs again, and charged to whoever first took its
        # CPU: let a wait the recorder began end before the take
        time.sleep(0.2)
        first = tracer.take({recorder.pid})
        time.sleep(1.0)  # the engine spins alone: nothing of the recorder's is left to count
        second = tracer.take({recorder.pid})
    finally:
        tracer.close()
        engine.kill()
        engine.wait()
    assert first.total_ns["recorder"] > 0.1e9
    assert "recorder" not in second.total_ns and "recorder" not in second.hist
