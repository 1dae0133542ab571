"""Faults a recorder meets in production, each performed for real: a burst that overflows the
ring while the consumer cannot run (the drops counted, the capture back to exact afterwards), and
an engine killed in the middle of a request (the recording closed, complete up to the kill, and
marked with why it ended); the ring watch woken by the producers as the ring fills."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import polars as pl
import pytest
from conftest import ENGINES, Engine, Recorder, bpf_prog_ids

import sparseety_prof
from sparseety_prof.capture.events import decode_groups

pytestmark = [pytest.mark.root, pytest.mark.engine]

PROMPT = "hello the expert router"


def _requests(tokens: pl.DataFrame) -> list[list[int]]:
    order = tokens.group_by("request_id").agg(pl.col("t_end_ns").min()).sort("t_end_ns")
    return [
        tokens.filter(pl.col("request_id") == q).sort("t_end_ns")["token_id"].to_list()
        for q in order["request_id"]
    ]


def test_a_burst_that_overflows_the_ring_is_counted_and_the_capture_recovers(
    llama_engine: Engine, tmp_path: Path
) -> None:
    # a small ring (16 MiB holds a few hundred tokens of full capture of this model, and half a
    # second of its decode with room to spare), and a consumer stopped while the engine
    # generates: the probes find the ring full and drop (they never wait), the consumer counts
    # every drop when it runs again
    rec = Recorder(llama_engine.pid, tmp_path / "rec", "--ring-mb", "16")
    os.kill(rec.proc.pid, signal.SIGSTOP)
    try:
        burst = [r["ids"] for r in llama_engine.generate([PROMPT, "one two three four"] * 6, max_tokens=300)]
    finally:
        os.kill(rec.proc.pid, signal.SIGCONT)
    time.sleep(2)  # a drain or two: the ring is empty again
    after = [
        r["ids"]
        for r in llama_engine.generate(["the sparse decode sample", "what is the time"], max_tokens=40)
    ]
    rc, err = rec.stop(signal.SIGINT)
    assert rc == 0, err
    r = sparseety_prof.open(tmp_path / "rec")
    assert r.complete
    losses = r.meta["losses"]
    assert losses["kernel_drops"] > 0, "the burst should have overflowed the ring"
    tokens = r.tokens()
    assert tokens.height < sum(len(ids) for ids in burst) + sum(len(ids) for ids in after)
    # after the burst, every token again, exactly
    assert _requests(tokens)[-2:] == after
    # what the drops cut is never passed off as whole: a request seen whole equals the engine's,
    # one whose start was lost is partial (no decode order) and a stretch of one engine request
    # and one whose end was lost says so (end_reason records_lost) and is a start of one
    truth = [",".join(map(str, ids)) + "," for ids in burst + after]
    ends = dict(r.requests().select("request_id", "end_reason").iter_rows())
    cut = 0
    for (rid,), q in tokens.sort("t_end_ns").group_by("request_id", maintain_order=True):
        ids = ",".join(map(str, q["token_id"].to_list())) + ","
        if q["partial"].any():
            cut += 1
            assert q["partial"].all() and q["decode_order"].is_null().all()
            assert any(ids in t for t in truth), ids
            continue
        assert q["decode_order"].to_list() == list(range(q.height))
        if ends[rid] == "records_lost":
            cut += 1
            assert any(t.startswith(ids) for t in truth), ids
        else:
            assert ids in truth, (rid, ends[rid], ids)
    assert cut > 0
    assert "lost" in err or "drop" in err  # the summary line says so


def test_an_engine_killed_mid_request_leaves_a_closed_recording_marked_with_why(
    models: dict[str, Path], tmp_path: Path
) -> None:
    before = bpf_prog_ids()
    e = Engine([str(ENGINES / "llama_engine.py"), str(models["moe"]), "--n-ctx", "4096"])
    try:
        t0 = time.monotonic()
        base = e.generate([PROMPT], max_tokens=4000)[0]["ids"]  # greedy: what the request would give
        took = time.monotonic() - t0
        rec = Recorder(e.pid, tmp_path / "rec")
        e.send({"prompts": [PROMPT], "max_tokens": 4000, "temp": 0.0, "seed": 1})
        time.sleep(took / 3)  # the request is running
        os.kill(e.pid, signal.SIGKILL)
        e.proc.wait(timeout=10)
        rc, err = rec.wait(timeout=60)
    finally:
        e.close()
    assert rc == 0, err
    assert "target exited" in err
    r = sparseety_prof.open(tmp_path / "rec")
    assert r.complete and r.meta["stop_reason"] == "target exited"
    got = r.tokens()["token_id"].to_list()
    assert 0 < len(got) < len(base)
    assert got == base[: len(got)]  # up to the kill, exactly the request's tokens
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and bpf_prog_ids() - before:
        time.sleep(0.2)
    assert not (bpf_prog_ids() - before), "BPF programs left loaded"


def test_the_producers_wake_the_ring_watch_once_per_arming(llama_engine: Engine) -> None:
    """The ring watch sleeps until a producer passes the mark it was armed with (rb_wake() in
    token_probes.bpf.c), performed with the real probes: attached in this process to a real
    engine, a 1 MiB ring that nobody drains wakes the watch once (early: before the first drain
    the mark assumes the largest records); not rearmed, no producer wakes it again however full
    the ring gets, and the watch follows the ring on its own instead (readings without a wakeup,
    seeing it fill); rearmed at a drain's position, it sleeps again, a few records do not wake
    it, and the ring filling again wakes it at about RING_WAKE_FILL."""
    from sparseety_prof.capture.bpf_loader import RING_WAKE_FILL, RingReader
    from sparseety_prof.session.attach import attach
    from sparseety_prof.session.options import Options
    from sparseety_prof.session.ring_watch import FOLLOW_MAX_S, RingWatch

    a = attach(Options(pid=llama_engine.pid, out=None, ring_mb=1), log=lambda _s: None)
    try:
        reader = RingReader(a.session)
        woke: list[float] = []
        watch = RingWatch(reader.pending_share, woke.append, reader.wake_fd, reader.arm_watch)
        try:
            llama_engine.generate([PROMPT] * 4, max_tokens=200)  # fills the ring past the mark
            time.sleep(0.3)
            assert watch.wakeups == 1 and watch.polls > 0  # woken, and following since
            # armed from sequence 0 with no drain yet, at the largest record's size: early
            assert 0 < woke[0] <= RING_WAKE_FILL
            llama_engine.generate([PROMPT], max_tokens=40)  # disarmed: no more wakeups
            time.sleep(0.3)
            assert watch.wakeups == 1
            assert woke[-1] > woke[0]  # but the watch saw the ring fill by its own readings
            records = reader.take(by_ref=False)  # a drain, then armed at its position
            reader.release()
            assert len(decode_groups(records, a.session.logits_chunk))
            watch.rearm()
            time.sleep(FOLLOW_MAX_S + 0.1)  # (the reading under way at the rearm still comes)
            polls, n = watch.polls, len(woke)
            llama_engine.generate([PROMPT], max_tokens=4)  # a few records: far from the mark
            time.sleep(0.3)
            assert watch.wakeups == 1 and watch.polls == polls and len(woke) == n  # asleep
            llama_engine.generate([PROMPT] * 4, max_tokens=200)
            time.sleep(0.3)
            assert watch.wakeups == 2
            # armed with the mean record size that drain measured: about at the threshold
            assert 0.5 * RING_WAKE_FILL < woke[n] < 2 * RING_WAKE_FILL
        finally:
            watch.close()
            reader.stop()
    finally:
        a.session.close()
        a.model_file.close()
