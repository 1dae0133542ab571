"""RingHold: whether a drain may hold the ring's space while it is handled (its logits records
read in place), from the pending share, the producers' rate and the last drains' handling times."""

from __future__ import annotations

from sparseety_prof.capture.ring_hold import RingHold


def _handled(hold: RingHold, at: float, seconds: float) -> None:
    hold.taken(at)
    hold.released(at + seconds)


def test_before_any_drain_was_handled_the_fixed_share_decides() -> None:
    hold = RingHold(0.25)
    assert hold.allows(0.2, 10.0) and not hold.allows(0.3, 10.0)
    hold.taken(10.0)  # taken, not yet handled: still no handling time
    assert hold.allows(0.2, 10.5) and not hold.allows(0.26, 10.5)


def test_a_quick_drain_at_a_moderate_rate_holds_past_the_fixed_share() -> None:
    """Four llama-server clients: ~30% of the ring filled in half a second, handled in 50 ms."""
    hold = RingHold(0.25)
    _handled(hold, 10.0, 0.05)
    # 0.3 + 2 x (0.3 / 0.5 s) x 0.05 s = 0.36
    assert hold.allows(0.3, 10.5)
    assert not hold.allows(0.45, 10.5)  # 0.45 + 0.09: past half the ring


def test_a_fast_producer_and_a_slow_drain_copy_even_a_small_backlog() -> None:
    """A small model at thousands of tokens a second: a tenth of the ring in 0.1 s, drains
    handled in 0.3 s: 0.1 + 2 x 1.0 x 0.3 = 0.7."""
    hold = RingHold(0.25)
    _handled(hold, 10.0, 0.3)
    assert not hold.allows(0.1, 10.1)
    assert hold.allows(0.01, 10.1)  # a hundredth of the ring in 0.1 s: 0.01 + 0.06


def test_the_longest_of_the_last_handling_times_counts_until_it_is_forgotten() -> None:
    hold = RingHold(0.25)
    t = 10.0
    _handled(hold, t, 0.4)  # one slow drain (the consumer preempted)
    for _ in range(RingHold.KEEP - 1):
        t += 0.5
        _handled(hold, t, 0.01)
    t += 0.5
    assert not hold.allows(0.3, t + 0.5)  # 0.3 + 2 x 0.6 x 0.4
    _handled(hold, t, 0.01)  # KEEP quick drains since: the slow one is forgotten
    assert hold.allows(0.3, t + 0.5)


def test_release_without_a_take_records_nothing() -> None:
    hold = RingHold(0.25)
    hold.released(5.0)
    assert not hold.allows(0.3, 6.0)  # still unmeasured
