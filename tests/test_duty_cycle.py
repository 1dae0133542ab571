"""--duty-cycle: the flag, the schedule and the controller (session/duty_cycle.py), on synthetic
times and token counts."""

from __future__ import annotations

import os
import subprocess

import pytest
from conftest import PY, ROOT

from sparseety_prof.cli import build_parser
from sparseety_prof.commands.attach_options import options_from
from sparseety_prof.session.duty_cycle import (
    MIN_ON_S,
    DutyController,
    DutyCycle,
    DutySpec,
    WindowRates,
    parse_duty_cycle,
)


def test_flag_values() -> None:
    assert parse_duty_cycle("2s/20s") == DutySpec(2.0, 20.0)
    assert parse_duty_cycle("2/20") == DutySpec(2.0, 20.0)
    assert parse_duty_cycle("500ms/10s") == DutySpec(0.5, 10.0)
    assert parse_duty_cycle("1m/10m") == DutySpec(60.0, 600.0)
    assert parse_duty_cycle("2s/20s").share == pytest.approx(0.1)
    assert parse_duty_cycle("2s/20s").text == "2s/20s"
    for bad in ("2s", "20s/2s", "2s/2s", "x/20s", f"{MIN_ON_S / 2}s/10s", "2s/2h", "1s/7200s"):
        with pytest.raises(ValueError):
            parse_duty_cycle(bad)


def _cycle(on: float = 2.0, period: float = 20.0) -> DutyCycle:
    return DutyCycle(DutySpec(on, period), start=100.0)


def test_schedule_arms_and_disarms_on_time_and_counts_coverage() -> None:
    c = _cycle()
    assert c.armed and c.tick(101.9) is None
    assert c.tick(102.0) == "disarm"
    c.disarmed(102.0, 102.1)
    assert c.next_change() == pytest.approx(120.0)  # the period counts from the window's start
    assert c.tick(119.0) is None and c.tick(120.0) == "arm"
    c.armed_again(120.0, 120.01)
    assert c.next_change() == pytest.approx(122.01)
    c.disarmed(122.01, 122.1)
    c.close(130.0)
    meta = c.meta(130.0)
    assert meta["windows"] == 2
    assert meta["covered_s"] == pytest.approx(4.0)
    assert meta["coverage"] == pytest.approx(4.0 / 30.0, abs=1e-4)
    assert meta["windows_ns"][0] == [100_000_000_000, 100_000_000_000, 102_000_000_000, 102_100_000_000]
    assert meta["windows_ns"][1][1] == 120_010_000_000


def test_coverage_so_far_counts_the_open_window_up_to_now() -> None:
    c = _cycle()  # starts at 100, armed
    assert c.coverage(101.0) == pytest.approx(1.0)
    assert c.tick(102.0) == "disarm"
    c.disarmed(102.0, 102.1)
    assert c.coverage(110.0) == pytest.approx(2.0 / 10.0)
    c.armed_again(120.0, 120.5)
    assert c.coverage(121.5) == pytest.approx((2.0 + 1.0) / 21.5)  # the open window since armed
    c.close(121.5)
    assert c.meta(121.5)["coverage"] == pytest.approx(c.coverage(121.5), abs=1e-4)


def test_a_window_open_at_the_end_is_closed_and_counted() -> None:
    c = _cycle()
    c.close(101.0)
    meta = c.meta(101.0)
    assert meta["covered_s"] == pytest.approx(1.0) and meta["coverage"] == pytest.approx(1.0)
    assert meta["windows_ns"][0][2] == 101_000_000_000


def test_tokens_split_between_windows_and_outside() -> None:
    c = _cycle()
    c.observe(100.0, 0, 0.0, 0)
    c.observe(101.0, 90, 0.0, 0)  # in the window
    r = c._rates
    assert (r.tokens_in, r.seconds_in, r.tokens_out, r.seconds_out) == (90, 1.0, 0, 0)
    c.disarmed(102.0, 102.1)  # the window's comparison done: a new one begins
    c.observe(103.0, 180, 0.0, 0)  # (the drain after the edge: its tokens count for outside)
    c.observe(105.0, 380, 0.0, 0)
    assert (c._rates.tokens_in, c._rates.tokens_out, c._rates.seconds_out) == (0, 290, 4.0)


def test_controller_keeps_a_cheap_duty_cycle() -> None:
    ctl = DutyController(DutySpec(2.0, 20.0))
    # windows 5% slower: 0.1 x 5% = 0.5% of the engine's tokens/s, under the 1% target
    for _ in range(5):
        assert ctl.after_window((95.0, 100.0), lagging=False) == pytest.approx(0.1)
    assert ctl.lowered == 0 and ctl.period_s == pytest.approx(20.0)


def test_controller_lowers_the_share_when_windows_slow_the_engine() -> None:
    ctl = DutyController(DutySpec(2.0, 20.0))
    share = ctl.after_window((70.0, 100.0), lagging=False)  # 30% slower in windows: 3% cost
    assert share == pytest.approx(0.1 * 0.01 / 0.03)
    assert ctl.lowered == 1 and "lower in windows" in ctl.last_reason
    assert ctl.period_s == pytest.approx(2.0 / share)  # the window keeps its length
    # the cost now within the target: it stays
    assert ctl.after_window((70.0, 100.0), lagging=False) == pytest.approx(share)


def test_controller_halves_the_share_when_the_consumer_lags_and_recovers_after() -> None:
    ctl = DutyController(DutySpec(2.0, 20.0))
    assert ctl.after_window(None, lagging=True) == pytest.approx(0.05)
    assert ctl.after_window(None, lagging=True) == pytest.approx(0.025)
    assert "lagged" in ctl.last_reason and ctl.lowered == 2
    shares = [ctl.after_window((100.0, 100.0), lagging=False) for _ in range(10)]
    assert shares == sorted(shares) and shares[-1] == pytest.approx(0.1)  # back to the asked, never over


def test_controller_never_goes_below_its_floor() -> None:
    ctl = DutyController(DutySpec(2.0, 20.0))
    for _ in range(20):
        ctl.after_window((10.0, 100.0), lagging=True)
    assert ctl.share == pytest.approx(DutyController.MIN_SHARE)


def test_controller_decides_nothing_from_too_few_tokens() -> None:
    assert WindowRates(3, 2.0, 100, 18.0).rates(DutyController.MIN_TOKENS) is None
    assert WindowRates(30, 2.0, 100, 0.0).rates(DutyController.MIN_TOKENS) is None
    assert WindowRates(30, 2.0, 180, 18.0).rates(DutyController.MIN_TOKENS) == (15.0, 10.0)
    ctl = DutyController(DutySpec(2.0, 20.0))
    assert ctl.after_window(None, lagging=False) == pytest.approx(0.1) and ctl.slowdown is None


def test_a_lagging_window_lowers_the_next_period_of_the_schedule() -> None:
    c = _cycle()
    c.observe(100.1, 0, 0.9, 0)  # the first drain: what piled up while attaching, not a lag
    c.observe(100.5, 10, 0.0, 0)
    c.observe(101.5, 20, DutyController.LAG_FILL + 0.1, 0)  # the ring filling during the window
    c.disarmed(102.0, 102.1)
    assert c.controller.share == pytest.approx(0.05)
    assert c.next_change() == pytest.approx(102.0 + 40.0 - 2.0)
    # losses seen during the next window lag it too
    c.armed_again(140.0, 140.0)
    c.observe(140.5, 30, 0.0, 0)
    c.observe(141.0, 40, 0.0, 3)
    c.disarmed(142.0, 142.0)
    assert c.controller.share == pytest.approx(0.025)


def test_the_first_drain_alone_is_no_lag() -> None:
    c = _cycle()
    c.observe(100.1, 0, 0.9, 0)
    c.observe(101.0, 10, 0.01, 0)
    c.disarmed(102.0, 102.0)
    assert c.controller.share == pytest.approx(0.1) and c.controller.lowered == 0


def test_the_flags_reach_the_options() -> None:
    p = build_parser()
    for command in ("record", "attach"):
        o = options_from(
            p.parse_args([command, "-p", "7", "-o", "rec", "--duty-cycle", "2s/20s", "--recorder-cpus", "1"])
        )
        assert (o.duty_cycle, o.recorder_cpus) == (DutySpec(2.0, 20.0), "1")
        o = options_from(
            p.parse_args([command, "-p", "7", "-o", "rec", "--duty-cycle", "2s/20s", "--duty-logits"])
        )
        assert o.duty_cycle == DutySpec(2.0, 20.0, logits=True)
        o = options_from(p.parse_args([command, "-p", "7", "-o", "rec"]))
        assert (o.duty_cycle, o.recorder_cpus) == (None, "auto")  # always in, placed by the engine's cores


# the driver's thread with a switch that only counts, in a process at the consumer's niceness
_DRIVER = """
import os, threading, time
from sparseety_prof.capture.probe_switch import SwitchCost
from sparseety_prof.session.duty_cycle import DutySpec
from sparseety_prof.session.duty_driver import DutyDriver

class CountingSwitch:
    def __init__(self):
        self.calls, self.cost, self.symbols, self.probes = [], SwitchCost(), ["mul"], [object()]
    def disarm(self):
        self.calls.append("disarm")
    def arm(self):
        self.calls.append("arm")

os.nice(10)  # the recorder's threads after attaching (--nice)
switch = CountingSwitch()
driver = DutyDriver(DutySpec(0.5, 1.0), switch, print)
driver.start()
while switch.calls.count("arm") < 1:  # out at 0.5 s, in again at 1.0 s (later on a busy host)
    time.sleep(0.05)
nice = os.getpriority(os.PRIO_PROCESS, driver._thread.native_id)
driver.close()
calls = switch.calls
print(calls[:2], calls == ["disarm", "arm"] * (len(calls) // 2) + ["disarm"] * (len(calls) % 2),
      nice, driver.meta()["windows"] == calls.count("arm") + 1, threading.active_count())
"""


def test_the_driver_switches_on_schedule_at_the_engines_priority() -> None:
    if os.geteuid() != 0:
        pytest.skip("raising a thread back to nice 0 needs CAP_SYS_NICE (run as root)")
    done = subprocess.run([PY, "-c", _DRIVER], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stderr
    # out, then in again, alternating; its thread at nice 0 though the process is at 10; a window
    # listed for each time in; the thread gone once closed
    assert done.stdout.strip() == "['disarm', 'arm'] True 0 True 1"
