"""`record --max-disk`: a recording that stays within its disk budget on a real engine, keeping
the latest stretch of the run exactly (token ids equal to the engine's), the rows it removed
counted apart from losses; and the flag's bad values refused before anything is attached."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
from conftest import Engine, Recorder, run_cli

import sparseety_prof
from sparseety_prof.store import recording, recording_writer

PROMPTS = ["hello the expert router", "one two three four", "the sparse decode sample", "what is the time"]


def _disk_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


@pytest.mark.root
@pytest.mark.engine
def test_recording_stays_within_max_disk_and_keeps_the_latest_tokens_exactly(
    llama_engine: Engine, tmp_path: Path
) -> None:
    out = tmp_path / "rec"
    # frequent flushes: many small segments, so that a short run outgrows the smallest budget
    rec = Recorder(llama_engine.pid, out, "--max-disk", "1M", "--flush-interval", "0.5")
    truth: list[list[int]] = []
    peak = 0
    rounds_after_rotation = None
    for _ in range(200):  # until the budget has been hit, and then some
        truth += [r["ids"] for r in llama_engine.generate(PROMPTS, max_tokens=60)]
        peak = max(peak, _disk_bytes(out))
        live = json.loads((out / recording.META_FILE).read_text())
        if rounds_after_rotation is None and live.get("rotation", {}).get("segments_removed"):
            rounds_after_rotation = 0
        if rounds_after_rotation is not None:
            rounds_after_rotation += 1
            if rounds_after_rotation > 2:
                break
    rc, err = rec.stop(signal.SIGINT)
    assert rc == 0, err
    r = sparseety_prof.open(out)
    assert r.complete
    rotation = r.meta["rotation"]
    assert rotation["max_disk_bytes"] == recording_writer.MIN_MAX_DISK and rotation["segments_removed"] > 0
    largest = max(p.stat().st_size for p in out.rglob("part-*.parquet"))
    assert (
        peak <= recording_writer.MIN_MAX_DISK + largest
        and _disk_bytes(out) <= recording_writer.MIN_MAX_DISK + largest
    )
    tokens = r.tokens()
    generated = sum(len(ids) for ids in truth)
    assert tokens.height + rotation["rows_removed"].get("tokens", 0) == generated  # counted, not lost
    assert r.meta["losses"]["kernel_drops"] == 0 and r.meta["losses"]["seq_gaps"] == 0
    # what is kept is the end of the run: the last requests whole, the first kept one's tail
    kept = [tokens.filter(tokens["request_id"] == q)["token_id"].to_list() for q in _request_order(tokens)]
    assert len(kept) >= 2
    assert kept[1:] == truth[len(truth) - len(kept) + 1 :]
    first_truth = truth[len(truth) - len(kept)]
    assert kept[0] == first_truth[len(first_truth) - len(kept[0]) :]
    # every flush went in pieces between drains (session/flush_round.py), the longest named
    cons = r.meta["consumer"]
    assert cons["flushes"] >= 2 and cons["flush_pieces"] > cons["flushes"]
    pieces = {"rows", "policy", "aggregates", "segment", recording.META_FILE, "collector", "memory"}
    assert cons["flush_piece_max"].split(" ")[0] in pieces, cons["flush_piece_max"]


def _request_order(tokens: object) -> list[str]:
    import polars as pl

    assert isinstance(tokens, pl.DataFrame)
    order = tokens.group_by("request_id").agg(pl.col("t_end_ns").min()).sort("t_end_ns")
    return [str(q) for q in order["request_id"]]


@pytest.mark.parametrize(
    ("value", "message"),
    [("lots", "not a size"), ("10K", "at least 1 MiB"), ("0", "at least 1 MiB")],
)
def test_bad_max_disk_is_a_usage_error(tmp_path: Path, value: str, message: str) -> None:
    r = run_cli("record", "--pid", "1", "-o", str(tmp_path / "rec"), "--max-disk", value)
    assert r.returncode == 2 and message in r.stderr
    assert not (tmp_path / "rec").exists()
