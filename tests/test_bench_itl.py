"""scripts/bench_sustained.py's figures (tests/bench_figures.py): the inter-token gaps of a step
that ran another request's prompt are told from the decode steps' (Side.prefill_gaps), whichever
side of the other slots' tokens the new request's first token reaches its client; the answer
lengths both sides ask for; the engine threads' preemptions it counts; and its losses cell, which
keeps the ring's records apart from rows the probes did not count."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from bench_figures import (
    STALL_ROWS,
    AnswerLengths,
    Side,
    Stalls,
    idle_cpu_s,
    losses_text,
    preemptions,
    stall_figures,
)

MS = 1_000_000


def side(*requests: tuple[int, list[int]]) -> Side:
    s = Side()
    for t_request, times in requests:
        s.add(t_request * MS, [t * MS for t in times])
    return s


@pytest.mark.parametrize("first", [288, 290, 291, 300])
def test_the_gap_that_waited_for_another_prompt_is_set_apart(first: int) -> None:
    # request 1 streams every 30 ms; request 2 arrives, and its prompt's step holds request 1's
    # token 4 back by 170 ms; request 2's first token reaches its client about then
    s = side((-20, [0, 30, 60, 90, 290, 320, 350]), (95, [first, first + 30, first + 60]))
    gaps = s.itl_ms()
    assert gaps.tolist() == [30, 30, 30, 200, 30, 30, 30, 30]
    assert s.prefill_gaps().tolist() == [False, False, False, True, False, False, False, False]
    assert s.itl_decode_ms().tolist() == [30.0] * 7


def test_one_request_at_a_time_has_no_prefill_gaps() -> None:
    s = side((0, [10, 40, 75, 100]), (110, [150, 180, 400]))  # one after the other: no overlap
    assert not s.prefill_gaps().any()
    assert np.array_equal(s.itl_decode_ms(), s.itl_ms())


def test_a_lone_request_keeps_every_gap() -> None:
    s = side((0, [10, 40, 300]))
    assert s.prefill_gaps().tolist() == [False, False]


def test_answer_lengths_are_the_same_sequence_on_every_side() -> None:
    lengths = AnswerLengths(64, 0.5)
    drawn = [[lengths(k, i) for i in range(200)] for k in range(4)]
    again = AnswerLengths(64, 0.5)
    assert drawn == [[again(k, i) for i in range(200)] for k in range(4)]  # both sides, every pair
    flat = np.array(drawn).ravel()
    assert flat.min() >= 32 and flat.max() <= 96
    assert abs(flat.mean() - 64) < 3  # about --tokens on average
    assert drawn[0] != drawn[1]  # each client its own sequence: they do not end together
    assert len(set(flat.tolist())) > 40
    assert {AnswerLengths(64)(k, i) for k in range(4) for i in range(50)} == {64}  # --spread 0


_THREADS = """
import sys, threading, time
spun = threading.Barrier(3)
def spin():
    t = time.monotonic() + 0.3
    while time.monotonic() < t: pass
    spun.wait()
    threading.Event().wait()  # alive, asleep: its counts stand still
for _ in range(2): threading.Thread(target=spin, daemon=True).start()
t = time.monotonic() + 0.3
while time.monotonic() < t: pass
spun.wait()
print("done", flush=True)
sys.stdin.read()
"""


def _sched_involuntary(pid: int) -> int:
    """The same count from another file of the kernel's: /proc/PID/task/TID/sched."""
    total = 0
    for sched in Path(f"/proc/{pid}/task").glob("*/sched"):
        for line in sched.read_text().splitlines():
            if line.startswith("nr_involuntary_switches"):
                total += int(line.split(":")[1])
    return total


@pytest.mark.skipif(not Path("/proc/self/sched").exists(), reason="no /proc/PID/sched (CONFIG_SCHED_DEBUG)")
def test_preemptions_sum_the_involuntary_switches_of_every_thread() -> None:
    """bench_sustained.preemptions: a process of three threads, stopped (its counts stand still),
    against the kernel's scheduler statistics of each of its threads."""
    p = subprocess.Popen(
        [sys.executable, "-c", _THREADS], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert p.stdout is not None and p.stdout.readline() == "done\n"
        os.kill(p.pid, signal.SIGSTOP)
        assert len(list(Path(f"/proc/{p.pid}/task").iterdir())) == 3
        assert preemptions(p.pid) == _sched_involuntary(p.pid)
    finally:
        p.kill()
        p.wait()


def _cpu_line_idle_s() -> float:
    with open("/proc/stat") as f:
        fields = f.readline().split()
    return (int(fields[4]) + int(fields[5])) / os.sysconf("SC_CLK_TCK")


def test_idle_cpu_is_the_idle_and_iowait_time_of_the_cpu_line() -> None:
    """bench_sustained.idle_cpu_s: the machine's idle and iowait ticks of /proc/stat's cpu line,
    read independently before and after (what the machine's load leaves of it is a measurement,
    made by the benchmark, not checked here)."""
    before = _cpu_line_idle_s()
    got = idle_cpu_s()
    after = _cpu_line_idle_s()
    assert before <= got <= after


def test_the_losses_cell_never_adds_rows_not_counted_to_the_rings_lost_records() -> None:
    assert losses_text({"losses": 0, "records": 290_000, "not_captured": {}}) == "0 of 290000 records"
    cell = losses_text(
        {
            "losses": 3,
            "records": 290_000,
            "not_captured": {"sparse_rows_not_captured": 7182, "program_misses": 2},
        }
    )
    assert cell == "3 of 290000 records; sparse_rows_not_captured 7182; program_misses 2"


def test_stall_figures_are_per_generated_token_and_split_by_culprit() -> None:
    a = side((0, list(range(0, 1000, 10))))  # 100 tokens
    b = side((0, list(range(0, 2000, 10))))  # 200 tokens
    a.stalls = Stalls({"other": {6: 10}}, {"other": 4_000_000}, {"other": 0}, {"other": 0}, {1}, set(), [])
    # the recorder: 4 waits of 2-4 ms (slot 12) and 100 of 16-32 µs (slot 5)
    b.stalls = Stalls(
        {"recorder": {12: 4, 5: 100}, "other": {6: 10}, "unknown": {3: 1}},
        {"recorder": 14_000_000, "other": 3_000_000, "unknown": 1_000_000},
        {"recorder": 12_000_000},
        {"recorder": 4},
        {1},
        {2},
        [],
    )
    rows: dict[str, list[float]] = {k: [] for k in STALL_ROWS}
    stall_figures(rows, a, b)
    assert rows["wait_rec_b"] == [70.0]  # 14 ms over 200 tokens
    assert rows["wait_rec_long_share_b"] == [12 / 14]
    assert rows["long_waits_rec_b"] == [2.0]  # 4 waits per 200 tokens
    assert rows["wait_other_a"] == [40.0] and rows["wait_other_b"] == [20.0]
