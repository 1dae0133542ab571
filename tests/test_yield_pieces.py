"""scripts/yield_pieces.py, performed: a consumer that gives its core back after every 200 µs of
work must leave the spinner it shares the core with shorter waits than one that does its burst at
once; the waits are the BPF tracer's, charged to the consumer."""

from __future__ import annotations

import os

import pytest

from scripts.preempt_stalls import Stalls
from scripts.yield_pieces import run_way


def _long_share(st: Stalls) -> float:
    total = st.total_ns.get("recorder", 0)
    assert total > 0, st
    return st.long_ns.get("recorder", 0) / total


@pytest.mark.root
def test_giving_the_core_back_shortens_the_waits_it_causes() -> None:
    cpu = min(os.sched_getaffinity(0))
    at_once = run_way("none", 3.0, 200.0, 16.0, cpu)
    paced = run_way("yield", 3.0, 200.0, 16.0, cpu)
    assert at_once.given_back == 0 and paced.given_back > 20
    # the burst (16 ms every 0.5 s) reaches the spinner as waits either way
    assert sum(at_once.stalls.hist["recorder"].values()) > 0
    assert sum(paced.stalls.hist["recorder"].values()) > 0
    # at once, the waits run to the scheduler's slice or tick (about 1-4 ms here); given back
    # after 200 µs of work, most of the time is in waits shorter than 1 ms
    assert _long_share(paced.stalls) < 0.5 < _long_share(at_once.stalls)
