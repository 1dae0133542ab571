"""session/drain_batches.py: when drains go to the correlator, and what they hold then."""

from __future__ import annotations

import numpy as np
import pytest

from sparseety_prof.capture import events as ev
from sparseety_prof.correlate import logits as logits_module
from sparseety_prof.session.drain_batches import DrainBatches


def _batch(seqs: list[int], *, agg_layers: int | None = None) -> ev.EventBatch:
    """Small records with these sequence numbers (and one step aggregate record of that size)."""
    b = ev.EventBatch()
    b.small = np.zeros(len(seqs), ev.SMALL_DTYPE)
    b.small["seq"] = seqs
    b.small["kind"] = ev.EV_DECODE_BEGIN
    if agg_layers is not None:
        b.step_agg = np.zeros(1, ev.STEP_AGG_DTYPES[agg_layers])
        b.step_agg["seq"] = seqs[-1] + 1000
    return b


@pytest.fixture
def drains() -> DrainBatches:
    if logits_module.BACKEND != "c":
        pytest.skip("the C backend is not built (sparseety_prof/native/build.sh)")
    return DrainBatches(correlate_s=1.0)


def test_drains_wait_for_the_interval_a_flush_or_a_consumer_behind(drains: DrainBatches) -> None:
    assert not drains.due(1e12, flush_due=True, behind=True)  # nothing waits
    drains.add(_batch([1, 2]))
    t0 = drains._since
    assert not drains.due(t0 + 0.5, flush_due=False)
    assert drains.due(t0 + 1.0, flush_due=False)
    assert drains.due(t0 + 0.1, flush_due=True)
    assert drains.due(t0 + 0.1, flush_due=False, behind=True)
    out = drains.take()
    assert len(out) == 1 and out[0].small["seq"].tolist() == [1, 2]
    assert drains.take() == [] and not drains.due(1e12, flush_due=True)
    assert drains.correlations == 1


def test_drains_are_gathered_in_order_and_the_buffers_start_over_after_a_take(drains: DrainBatches) -> None:
    for k in range(40):  # past the buffers' first size: they grow
        drains.add(_batch([3 * k, 3 * k + 1, 3 * k + 2]))
    (first,) = drains.take()
    assert first.small["seq"].tolist() == list(range(120))
    drains.add(_batch([500]))
    drains.add(_batch([501, 502]))
    (second,) = drains.take()
    assert second.small["seq"].tolist() == [500, 501, 502]  # nothing of the first window again


def test_a_layout_of_another_size_starts_another_batch(drains: DrainBatches) -> None:
    """A step aggregate record sized for another model between two drains: the drains before
    it are one batch (copied), those after another; a drain without such records joins any."""
    sizes = sorted(ev.STEP_AGG_DTYPES)
    drains.add(_batch([1], agg_layers=sizes[0]))
    drains.add(_batch([2]))
    drains.add(_batch([3], agg_layers=sizes[1]))
    a, b = drains.take()
    assert a.small["seq"].tolist() == [1, 2] and b.small["seq"].tolist() == [3]
    assert a.step_agg.dtype == ev.STEP_AGG_DTYPES[sizes[0]] and len(a.step_agg) == 1
    assert b.step_agg.dtype == ev.STEP_AGG_DTYPES[sizes[1]] and len(b.step_agg) == 1
    assert drains.correlations == 2
