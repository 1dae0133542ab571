"""The consumer's CPU by stage (session/stage_cpu.py): counted on the thread's own CPU clock, so
waiting costs nothing; in meta.json of a real recording, every stage is there and the work a
full-mode recording does shows where it is done."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import pytest
from conftest import Engine, Recorder

from sparseety_prof.session.stage_cpu import STAGES, StageCpu
from sparseety_prof.store import recording


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_a_lap_charges_the_threads_cpu_since_the_last_one() -> None:
    st = StageCpu()
    _spin(0.05)
    st.lap("correlate")
    time.sleep(0.2)  # waiting is not CPU
    st.lap("loop")
    _spin(0.03)
    st.lap("rows")
    st.move(0.01, "rows", "logits")
    s = st.seconds
    assert 0.05 <= s["correlate"] < 0.1
    assert s["loop"] < 0.02
    assert 0.02 - 1e-9 <= s["rows"] < 0.07 and s["logits"] == pytest.approx(0.01)
    meta = st.meta(process_cpu_s=sum(s.values()) + 0.5)
    assert list(meta) == [*STAGES, "other_threads"]
    assert meta["other_threads"] == pytest.approx(0.5, abs=1e-3)
    assert st.meta(process_cpu_s=0.0)["other_threads"] == 0.0  # never negative
    apart = st.meta(sum(s.values()) + 0.5, {"model_hash": 0.2})
    assert apart["model_hash"] == 0.2 and apart["other_threads"] == pytest.approx(0.3, abs=1e-3)


def test_another_threads_cpu_is_not_counted() -> None:
    st = StageCpu()
    t = threading.Thread(target=_spin, args=(0.2,))
    t.start()
    t.join()
    st.lap("frames_sinks")
    assert st.seconds["frames_sinks"] < 0.05
    st.restart()
    assert all(v == 0.0 for v in st.seconds.values())


@pytest.mark.root
@pytest.mark.engine
def test_a_full_recording_says_where_its_cpu_went(llama_engine: Engine, tmp_path: Path) -> None:
    out = tmp_path / "rec"
    rec = Recorder(llama_engine.pid, out)
    for _ in range(3):
        llama_engine.generate(["hello the expert router", "one two three four"], max_tokens=24)
    rc, err = rec.stop(signal.SIGINT)
    assert rc == 0, err
    meta = json.loads((out / recording.META_FILE).read_text())
    by_stage = meta["consumer"]["cpu_s_by_stage"]
    assert set(by_stage) == {*STAGES, "model_hash", "other_threads"}  # (meta.json sorts its keys)
    assert all(v >= 0 for v in by_stage.values())
    # a full recording of 144 tokens: records correlated, logits rows' statistics, columns made
    assert by_stage["correlate"] > 0 and by_stage["logits"] > 0 and by_stage["rows"] > 0
    assert by_stage["frames_sinks"] + by_stage["flush"] > 0
    # the stages cover the span from the first drain, inside the run's whole CPU time (attach's
    # BPF compile included): the two clocks are read a few statements apart
    assert sum(by_stage.values()) <= meta["profiler_cpu_s"] + 0.5
    # the drains that took records, and of them those that read the logits rows in the ring
    cons = meta["consumer"]
    assert cons["drains"] >= 1 and 0 <= cons["drains_logits_by_ref"] <= cons["drains"]


@pytest.mark.root
@pytest.mark.engine
def test_the_recorder_drains_at_the_interval_asked(llama_engine: Engine, tmp_path: Path) -> None:
    out = tmp_path / "rec"
    rec = Recorder(llama_engine.pid, out, "--drain-interval", "0.2")
    end = time.monotonic() + 3.0
    while time.monotonic() < end:
        llama_engine.generate(["hello the expert router"], max_tokens=16)
    rc, err = rec.stop(signal.SIGINT)
    assert rc == 0, err
    cons = json.loads((out / recording.META_FILE).read_text())["consumer"]
    assert cons["drain_interval_s"] == 0.2
    # three seconds of generation drained at most 0.2 s apart; the default (1 s) would take 3 or 4
    assert cons["drains"] >= 8, cons
    assert cons["drain_wait_min_ms"] <= 200.0
