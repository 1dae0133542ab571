"""Who took the CPU (issue 62): the scheduler program's records joined to steps (thread_waits),
and planted causes found on a real engine: a SIGSTOP inside a step is that step's stopped time,
a busy process on an engine thread's CPU is named in its waits and in slow_step's reason."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pytest
from conftest import ENGINES, Engine, Recorder, free_port

from sparseety_prof.capture.sched_waits import WAIT_DTYPE
from sparseety_prof.session.thread_waits import ThreadWaits
from sparseety_prof.store import recording, schema
from sparseety_prof.store.anomalies.steps import slow_steps
from sparseety_prof.store.anomalies.waits import wait_causes


class _NoWaits:
    pid = 42
    compile_s = 0.0

    def __init__(self) -> None:
        self.recs = np.zeros(0, WAIT_DTYPE)

    def take(self) -> np.ndarray:
        out, self.recs = self.recs, np.zeros(0, WAIT_DTYPE)
        return out

    def losses(self) -> dict[str, int]:
        return {}

    def program_costs(self) -> dict[str, dict[str, int]]:
        return {}

    def close(self) -> None:
        pass


def _rec(step_tid: int, tid: int, t0: int, t1: int, **ns: object) -> np.void:
    r = np.zeros(1, WAIT_DTYPE)[0]
    r["step_tid"], r["tid"], r["t_start"], r["t_end"] = step_tid, tid, t0, t1
    for k, v in ns.items():
        r[k] = v
    return r


def _steps(*rows: tuple[int, int, int, int]) -> dict[str, list[Any]]:
    return {
        "step_id": [r[0] for r in rows],
        "tid": [r[1] for r in rows],
        "t_start_ns": [r[2] for r in rows],
        "t_end_ns": [r[3] for r in rows],
    }


def test_records_join_the_step_of_their_thread_and_wait_for_steps_not_yet_seen() -> None:
    waits = _NoWaits()
    tw = ThreadWaits(waits, clock=lambda: 10_000)  # type: ignore[arg-type]
    # the program's step windows are a few microseconds off the token probes'
    waits.recs = np.array(
        [
            _rec(7, 7, 1003, 1998, on_ns=900, run_ns=95, top_tgid=881, top_ns=95, top_comm=b"stress"),
            _rec(7, 8, 1003, 1998, on_ns=500, sleep_ns=495),
            _rec(7, 7, 3001, 3999, stop_ns=998),  # its step comes with the next drain
        ],
        WAIT_DTYPE,
    )
    out = tw.rows(_steps((1, 7, 1000, 2000), (2, 9, 3000, 4000)))["thread_waits"]
    schema.check_columns("thread_waits", out)
    assert out["step_id"] == [1, 1]
    assert out["tid"] == [7, 8]
    assert out["step_thread"] == [True, False]
    assert (out["on_cpu_ns"], out["runnable_ns"], out["sleep_ns"]) == ([900, 500], [95, 0], [0, 495])
    assert (out["top_pid"], out["top_comm"], out["top_ns"]) == ([881, None], ["stress", None], [95, None])
    out = tw.rows(_steps((5, 7, 3000, 4000)))["thread_waits"]
    assert (out["step_id"], out["stopped_ns"]) == ([5], [998])
    assert tw.joined == 3 and tw.unjoined == 0


def test_a_record_whose_step_never_comes_is_counted_unjoined() -> None:
    waits = _NoWaits()
    tw = ThreadWaits(waits, clock=lambda: 10_000)  # type: ignore[arg-type]
    waits.recs = np.array([_rec(7, 7, 1003, 1998, on_ns=5), _rec(7, 7, 5003, 5998, on_ns=5)], WAIT_DTYPE)
    # a later step of its thread arrived without the first one: that one is not coming
    assert tw.rows(_steps((2, 7, 3000, 4000))) == {}
    assert (tw.joined, tw.unjoined) == (0, 1)
    assert tw.rows({}, final=True) == {}  # the end: nothing more is coming
    assert (tw.joined, tw.unjoined) == (0, 2)


def _waits_frame(**cols: list[Any]) -> pl.DataFrame:
    n = len(next(iter(cols.values())))
    base: dict[str, list[Any]] = {c: [0] * n for c in schema.THREAD_WAITS}
    base.update(
        {"top_pid": [None] * n, "top_comm": [None] * n, "top_ns": [None] * n, "step_thread": [True] * n}
    )
    base.update(cols)
    return schema.frame("thread_waits", base)


def test_the_cause_names_the_longest_wait_or_stop_and_escapes_the_process_name() -> None:
    waits = _waits_frame(
        step_id=[1, 1, 2, 3],
        tid=[10, 11, 10, 10],
        runnable_ns=[4_100_000, 200_000, 0, 50_000],
        top_pid=[881, 882, None, 883],
        top_comm=["stress\x1b[31m", "x", None, "y"],
        top_ns=[4_100_000, 200_000, None, 50_000],
        stopped_ns=[0, 0, 500_000_000, 0],
    )
    causes = wait_causes(waits, {1: 5_000_000, 2: 501_000_000, 3: 10_000_000})
    assert causes[1] == "thread 10 waited 4.1 ms for PID 881 (stress\\x1b[31m)"
    assert causes[2] == "thread 10 stopped 500.0 ms (SIGSTOP or a tracer)"
    assert 3 not in causes  # a wait that is not a large part of its step names nothing


# ---------------------------------------------------------------- on a real engine

PROMPT = "Once upon a time, in a land far away, there lived a"


def _tids(pid: int) -> list[int]:
    return [int(t) for t in os.listdir(f"/proc/{pid}/task")]


def _read(out: Path) -> tuple[pl.DataFrame, pl.DataFrame, dict[str, Any]]:
    rec = recording.open(out)
    return rec.table("steps"), rec.table("thread_waits"), dict(rec.meta)


def _stop_and_continue(pid: int, stops: list[tuple[int, int, int]], rng: random.Random) -> None:
    """SIGSTOP then SIGCONT to `pid`, at random times: (before SIGSTOP, after it, before SIGCONT)."""
    for _ in range(40):
        time.sleep(rng.uniform(0.002, 0.02))
        t0 = time.monotonic_ns()
        os.kill(pid, signal.SIGSTOP)
        t1 = time.monotonic_ns()
        time.sleep(0.03)
        t2 = time.monotonic_ns()
        os.kill(pid, signal.SIGCONT)
        stops.append((t0, t1, t2))


@pytest.mark.root
@pytest.mark.engine
def test_a_sigstop_inside_a_step_is_that_steps_stopped_time(models: dict[str, Path], tmp_path: Path) -> None:
    # a larger context and long prompts: steps long enough for stops to land inside some
    engine = Engine([str(ENGINES / "llama_engine.py"), str(models["moe"]), "--n-ctx", "2048"])
    try:
        rec = Recorder(engine.pid, tmp_path / "rec")
        engine.generate([PROMPT], max_tokens=4)  # warm: the first steps build their graphs
        engine.send({"prompts": [PROMPT * 20] * 3, "max_tokens": 200, "temp": 0.0, "seed": 1})
        stops: list[tuple[int, int, int]] = []  # (sent before, sent after, SIGCONT sent)
        rng = random.Random(62)
        # A thread stops when it next runs: on a busy machine it may first wait for its CPU (the
        # table counts that wait as runnable, not stopped). Real-time priority for the engine
        # and, above it, for this test's signals makes both prompt, so the stop the test sends
        # is the stop the engine gets.
        for tid in _tids(engine.pid):
            os.sched_setscheduler(tid, os.SCHED_FIFO, os.sched_param(1))
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(2))
        try:
            _stop_and_continue(engine.pid, stops, rng)
        finally:
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
            for tid in _tids(engine.pid):
                os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
        engine.read(timeout=600)
        rc, err = rec.stop(signal.SIGINT)
        assert rc == 0, err
    finally:
        os.kill(engine.pid, signal.SIGCONT)
        engine.close()
    steps, waits, meta = _read(tmp_path / "rec")
    assert meta["sched_waits"]["rows"] == waits.height > 0
    own = waits.filter(pl.col("step_thread"))
    landed = 0
    stopped_steps: list[int] = []
    for t0, t1, t2 in stops:
        inside = steps.filter((pl.col("t_start_ns") < t0) & (pl.col("t_end_ns") > t2))
        if inside.height != 1:
            continue  # between steps (sampling, the Python loop): no step holds it
        sid = inside["step_id"][0]
        # one stop only in that step
        if sum(1 for a, _, c in stops if inside["t_start_ns"][0] < a and c < inside["t_end_ns"][0]) != 1:
            continue
        row = own.filter(pl.col("step_id") == sid)
        assert row.height == 1, (sid, own)
        stopped = row["stopped_ns"][0]
        # the stop as the test saw it: from SIGSTOP sent to SIGCONT sent
        assert abs(stopped - (t2 - t1)) < 1_000_000, str(
            (
                sid,
                stopped,
                t2 - t1,
                [
                    {k: v for k, v in d.items() if v}
                    for d in waits.filter(pl.col("step_id") == sid).to_dicts()
                ],
            )
        )
        landed += 1
        stopped_steps.append(sid)
    assert landed >= 1, "no stop landed inside a step"
    # slow_step names the stop where it flags a stopped step
    r = recording.open(tmp_path / "rec")
    slow = slow_steps(r.steps(), r.tokens(), waits=waits).filter(pl.col("step_id").is_in(stopped_steps))
    assert slow.height > 0
    assert all("stopped" in reason and "(SIGSTOP or a tracer)" in reason for reason in slow["reason"]), slow[
        "reason"
    ].to_list()
    # the steps no stop touched were never stopped
    touched = {
        s
        for s, a, b in steps.select("step_id", "t_start_ns", "t_end_ns").iter_rows()
        for t0, _, t2 in stops
        if a < t2 and t0 < b
    }
    assert waits.filter(~pl.col("step_id").is_in(list(touched)))["stopped_ns"].sum() == 0


# busy most of the time, and back on its CPU every few milliseconds: a higher priority task that
# wakes preempts the engine wherever it is, inside steps too
HOG = (
    "import sys, time\nend = time.monotonic() + float(sys.argv[1])\nprint('spinning', flush=True)\n"
    "while time.monotonic() < end:\n"
    "    t = time.monotonic()\n"
    "    while time.monotonic() - t < 0.004: pass\n"
    "    time.sleep(0.001)\n"
)


@pytest.mark.root
@pytest.mark.engine
def test_a_busy_process_on_an_engine_threads_cpu_is_named_in_its_waits_and_slow_steps(
    models: dict[str, Path], tmp_path: Path
) -> None:
    engine = Engine([str(ENGINES / "llama_engine.py"), str(models["moe"])])
    cpu = min(os.sched_getaffinity(0))
    hog: subprocess.Popen[bytes] | None = None
    try:
        for tid in _tids(engine.pid):
            os.sched_setaffinity(tid, {cpu})
        rec = Recorder(engine.pid, tmp_path / "rec")
        engine.generate([PROMPT], max_tokens=64)  # steady steps first: the usual step time
        hog = subprocess.Popen(
            [sys.executable, "-c", HOG, "120"], preexec_fn=lambda: os.nice(-10), stdout=subprocess.PIPE
        )
        os.sched_setaffinity(hog.pid, {cpu})
        assert hog.stdout is not None and hog.stdout.readline() == b"spinning\n"
        engine.generate([PROMPT], max_tokens=64)
        hog.kill()
        hog.wait()
        rc, err = rec.stop(signal.SIGINT)
        assert rc == 0, err
    finally:
        if hog is not None and hog.poll() is None:
            hog.kill()
            hog.wait()
        engine.close()
    r = recording.open(tmp_path / "rec")
    waits = r.table("thread_waits")
    named = waits.filter(pl.col("top_pid") == hog.pid)
    who = waits.group_by("top_pid", "top_comm").agg(pl.col("top_ns").sum())
    assert named.height > 0, (hog.pid, str(who.to_dicts()))
    assert set(named["top_comm"]) <= {"python3", os.path.basename(sys.executable)[:15]}
    slow = slow_steps(r.steps(), r.tokens(), waits=waits)
    assert slow.height > 0
    assert any(f"for PID {hog.pid} (" in reason for reason in slow["reason"]), slow["reason"].to_list()


def _record_server(model: Path, out: Path) -> None:
    e = Engine([str(ENGINES / "server_engine.py"), str(model), "--port", str(free_port()), "--threads", "2"])
    try:
        rec = Recorder(e.pid, out)
        body = {"prompt": PROMPT, "n_predict": 24, "temperature": 0, "ignore_eos": True}
        req = urllib.request.Request(
            e.ready["url"] + "/completion",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=300) as resp:
            assert resp.status == 200
        rc, err = rec.stop(signal.SIGTERM)
        assert rc == 0, err
    finally:
        e.close()


def _record_llama(model: Path, out: Path) -> None:
    e = Engine([str(ENGINES / "llama_engine.py"), str(model), "--threads", "2"])
    try:
        rec = Recorder(e.pid, out)
        e.generate([PROMPT], max_tokens=24)
        rc, err = rec.stop(signal.SIGINT)
        assert rc == 0, err
    finally:
        e.close()


@pytest.mark.root
@pytest.mark.engine
@pytest.mark.parametrize("engine", ["llama-cpp-python", "llama-server"])
def test_each_step_has_its_threads_time_split_over_its_window(
    models: dict[str, Path], tmp_path: Path, engine: str
) -> None:
    """Two graph threads: every step has one row of the thread that ran it, the other graph thread
    has rows too, and each row's states add up to the step's window (the program's own timestamps
    at the same trap, microseconds from the steps'; a state change racing with the step's end may
    move a sliver)."""
    out = tmp_path / "rec"
    (_record_server if engine == "llama-server" else _record_llama)(models["moe"], out)
    steps, waits, meta = _read(out)
    assert meta["sched_waits"]["records_unjoined"] == 0
    assert meta["sched_waits"]["threads_not_counted"] == meta["sched_waits"]["records_lost"] == 0
    own = waits.filter(pl.col("step_thread"))
    assert sorted(own["step_id"]) == sorted(steps["step_id"])
    assert (own.join(steps, on="step_id")["tid"] == own.join(steps, on="step_id")["tid_right"]).all()
    assert waits.filter(~pl.col("step_thread"))["step_id"].n_unique() > 0  # the other graph thread
    # a thread's first step may be the one it was made in: counted from when it was made
    firsts = waits.group_by("tid").agg(pl.col("step_id").min())
    joined = waits.join(firsts, on=["tid", "step_id"], how="anti").join(
        steps.select("step_id", "t_start_ns", "t_end_ns"), on="step_id"
    )
    assert joined.height > steps.height
    total = pl.col("on_cpu_ns") + pl.col("runnable_ns") + pl.col("sleep_ns") + pl.col("stopped_ns")
    off = joined.select(
        (total - (pl.col("t_end_ns") - pl.col("t_start_ns"))).abs().alias("off"), "tid", "step_id"
    )
    assert off.filter(pl.col("off") >= 200_000).is_empty(), off.sort("off").tail(5).to_dicts()
    shares = pl.col("waited_recorder_ns") + pl.col("waited_engine_ns") + pl.col("waited_other_ns")
    over = joined.filter(shares > pl.col("runnable_ns") + 1000)
    assert over.is_empty(), str(over.to_dicts())


def test_no_sched_waits_turns_the_table_off_and_it_is_on_by_default() -> None:
    from sparseety_prof.cli import build_parser
    from sparseety_prof.commands.attach_options import options_from

    for command in ("record", "attach"):
        given = ["-p", "7", "-o", "rec"]
        assert options_from(build_parser().parse_args([command, *given])).sched_waits is True
        assert (
            options_from(build_parser().parse_args([command, *given, "--no-sched-waits"])).sched_waits
            is False
        )
