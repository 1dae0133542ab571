"""The follower as a service (issue 61), without an engine: the metrics endpoint across runs, the
output directory a restarted follower goes on in, --max-disk across runs, --follow-unit, and the
periodic status line."""

from __future__ import annotations

import io
import json
import os
import threading
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from conftest import ENGINES, Engine, Recorder
from prometheus_client.parser import text_string_to_metric_families

import sparseety_prof
from sparseety_prof.capture.process_match import Candidate, ProcessRule
from sparseety_prof.errors import NoSuchProcess, UsageError
from sparseety_prof.session import follow_target
from sparseety_prof.session.follow import Follower
from sparseety_prof.session.follow_dir import FOLLOW_FILE, check_follow_output, open_follow_dir
from sparseety_prof.session.follow_disk import make_room
from sparseety_prof.session.follow_metrics import FollowPrometheusSink
from sparseety_prof.session.follow_target import UnitMainProcess
from sparseety_prof.session.options import Options, Progress
from sparseety_prof.session.status_line import (
    DEFAULT_INTERVAL_S,
    ProgressTotals,
    StatusReading,
    StatusTicker,
    format_status,
    status_interval,
)
from sparseety_prof.store import schema
from sparseety_prof.store.output_dir import OutputDir

META: dict[str, Any] = {
    "layers": {"moe": [1], "ffn": [0, 1], "attn": [0, 1]},
    "capture": {"routes": True, "activations": True},
    "model": {"hyperparameters": {"expert_count": 4, "expert_used_count": 2}},
}
OTHER_MODEL: dict[str, Any] = {**META, "layers": {"moe": [0, 2], "ffn": [0, 1, 2], "attn": [0]}}


# ---------------------------------------------------------------- the metrics endpoint across runs


def _scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in ("model", "engine"))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def _run(sink: FollowPrometheusSink, meta: dict[str, Any], tokens: int, requests: int, drops: int) -> None:
    """One engine run as the Recorder feeds its sinks: open, frames, drains, close."""
    sink.open(meta)
    cols: schema.Columns = {c: [None] * tokens for c in schema.TOKENS}
    cols["log_prob"] = [-0.5] * tokens
    sink.take("tokens", schema.frame("tokens", cols))
    sink.take("requests", schema.frame("requests", {c: [None] * requests for c in schema.REQUESTS}))
    sink.drained(Progress(tokens=tokens, cpu_s=1.0, kernel_drops=drops))
    sink.close(meta)


def test_one_endpoint_counts_on_across_runs_and_counts_the_restarts() -> None:
    sink = FollowPrometheusSink("127.0.0.1", 0)
    try:
        before = _scrape(sink.port)  # waiting for the first engine: the endpoint answers already
        assert before["sparseety_follow_runs_total"] == 0 and before["sparseety_follow_attached"] == 0
        seen = []
        for tokens, requests, drops, meta in ((5, 1, 2, META), (7, 2, 0, META), (3, 1, 1, OTHER_MODEL)):
            _run(sink, meta, tokens, requests, drops)
            seen.append(_scrape(sink.port))  # between runs: the totals so far
        assert [s["sparseety_tokens_total"] for s in seen] == [5, 12, 15]
        assert [s["sparseety_requests_total"] for s in seen] == [1, 3, 4]
        assert [s["sparseety_losses_total{kind=kernel_drops}"] for s in seen] == [2, 2, 3]
        assert [s["sparseety_profiler_cpu_seconds_total"] for s in seen] == [1.0, 2.0, 3.0]
        assert [s["sparseety_follow_runs_total"] for s in seen] == [1, 2, 3]
        assert [s["sparseety_engine_restarts_total"] for s in seen] == [0, 1, 2]
        assert all(s["sparseety_follow_attached"] == 0 for s in seen)
        assert [s["sparseety_token_nll_count"] for s in seen] == [5, 12, 15]
    finally:
        sink.shutdown()


# ---------------------------------------------------------------- the output directory


def _follow_dir(tmp_path: Path, runs: list[dict[str, Any]], follow: dict[str, Any]) -> Path:
    out = tmp_path / "out"
    folder, earlier = open_follow_dir(out, follow, None)
    assert earlier is None
    doc = {
        "follow": follow,
        "start_unix_ms": 1,
        "end_unix_ms": 2,
        "stop_reason": "SIGTERM",
        "recordings": runs,
    }
    folder.write_atomic(FOLLOW_FILE, lambda f: f.write(json.dumps(doc).encode()))
    for r in runs:
        (out / r["dir"]).mkdir()
        (out / r["dir"] / "meta.json").write_bytes(b"x" * 10000)
    folder.close()
    return out


FOLLOW = {"name": "llama-server", "match": "comm", "uid": os.getuid()}
RUNS = [
    {"n": 1, "pid": 10, "dir": "1-10", "stop_reason": "target exited", "start_unix_ms": 1, "end_unix_ms": 2},
    {"n": 2, "pid": 20, "dir": "2-20", "stop_reason": None, "start_unix_ms": 3, "end_unix_ms": None},
]


def test_a_followers_own_directory_is_taken_back_and_others_are_refused(tmp_path: Path) -> None:
    out = _follow_dir(tmp_path, RUNS, FOLLOW)
    check_follow_output(out, FOLLOW, None)
    folder, earlier = open_follow_dir(out, FOLLOW, None)
    folder.close()
    assert earlier is not None and [r["dir"] for r in earlier["recordings"]] == ["1-10", "2-20"]
    with pytest.raises(UsageError, match="give this follow its own output directory"):
        open_follow_dir(out, {**FOLLOW, "name": "other"}, None)
    (out / "notes.txt").write_text("someone else's")
    with pytest.raises(UsageError, match=r"notes\.txt"):
        check_follow_output(out, FOLLOW, None)
    (out / "notes.txt").unlink()
    os.chmod(out / FOLLOW_FILE, 0o644)
    with pytest.raises(UsageError, match="mode 0600"):
        check_follow_output(out, FOLLOW, None)
    os.chmod(out / FOLLOW_FILE, 0o600)
    (out / FOLLOW_FILE).rename(out / "real.json")
    (out / FOLLOW_FILE).symlink_to(out / "real.json")
    with pytest.raises(UsageError):
        check_follow_output(out, FOLLOW, None)
    # a directory with a recording and no follow.json: refused as before
    other = tmp_path / "other"
    other.mkdir()
    (other / "meta.json").write_text("{}")
    with pytest.raises(UsageError, match="is not empty"):
        check_follow_output(other, FOLLOW, None)


class _OneRun:
    """A Recorder stand-in that 'records' until its process is gone from the fake /proc."""

    def __init__(self, opts: Options, proc: Path) -> None:
        self.opts, self.proc = opts, proc
        self.attached = threading.Event()
        self.meta: dict[str, Any] = {}
        self.progress = Progress(tokens=4, requests=1)
        self._stop = threading.Event()

    def stop(self, reason: str) -> None:
        self._stop.set()

    def run(self) -> dict[str, Any]:
        if not (self.proc / str(self.opts.pid)).exists():
            raise NoSuchProcess("gone")
        assert self.opts.out is not None
        self.opts.out.mkdir()
        self.attached.set()
        self._stop.wait(30)
        return {"stop_reason": "SIGTERM", "start_unix_ms": 5, "end_unix_ms": 6, "counts": {"tokens": 4}}


def test_a_restarted_follower_numbers_its_runs_after_the_earlier_ones(tmp_path: Path) -> None:
    out = _follow_dir(tmp_path, RUNS, FOLLOW)
    (out / "3-77").mkdir()  # made, not yet listed, when the earlier follower was killed
    proc = tmp_path / "proc"
    (proc / "30").mkdir(parents=True)
    (proc / "30" / "comm").write_text("llama-server\n")
    uid = os.getuid()
    (proc / "30" / "status").write_text(f"Uid:\t{uid}\t{uid}\t{uid}\t{uid}\n")
    (proc / "30" / "stat").write_text("30 (llama-server) S " + " ".join(["0"] * 18) + " 99 0\n")
    logs: list[str] = []
    follower = Follower(
        ProcessRule("llama-server", uid),
        Options(pid=0, out=out),
        lambda o: _OneRun(o, proc),  # type: ignore[arg-type,return-value]
        logs.append,
        proc=proc,
    )
    runner = threading.Thread(target=follower.run)
    runner.start()
    try:
        for _ in range(400):
            if len(follower.recordings) == 3 and follower.status().attached_pid == 30:
                break
            threading.Event().wait(0.05)
        status = follower.status()
    finally:
        follower.stop("SIGTERM")
        runner.join(timeout=30)
    doc = json.loads((out / FOLLOW_FILE).read_text())
    assert [(r["n"], r["dir"], r["stop_reason"]) for r in doc["recordings"]] == [
        (1, "1-10", "target exited"),
        (2, "2-20", "follower ended"),  # the earlier follower was killed while recording it
        (4, "4-30", "SIGTERM"),
    ]
    assert sorted(p.name for p in out.iterdir()) == ["1-10", "2-20", "3-77", "4-30", FOLLOW_FILE]
    assert (out / "1-10" / "meta.json").read_bytes() == b"x" * 10000  # never written over
    assert status.runs == 1 and status.attached_pid == 30 and status.tokens == 4 and status.requests == 1


def test_max_disk_across_runs_removes_the_oldest_runs_first(tmp_path: Path) -> None:
    runs: list[dict[str, Any]] = [
        {"n": i, "pid": i, "dir": f"{i}-{i}", "stop_reason": "target exited", "end_unix_ms": 1}
        for i in (1, 2, 3)
    ]
    out = tmp_path / "out"
    out.mkdir()
    for r in runs:
        (out / r["dir"]).mkdir()
        (out / r["dir"] / "seg").write_bytes(os.urandom(1 << 20))  # 1 MiB each
    folder = OutputDir(os.open(out, os.O_RDONLY | os.O_DIRECTORY), out, None)
    logs: list[str] = []
    try:
        left = make_room(folder, runs, 4 << 20, logs.append)  # the earlier runs: at most 2 MiB
    finally:
        folder.close()
    assert [r.get("removed", False) for r in runs] == [True, False, False]
    assert sorted(p.name for p in out.iterdir()) == ["2-2", "3-3"]
    used = sum(f.stat().st_blocks * 512 for f in out.rglob("*") if f.is_file())
    assert left == (4 << 20) - used  # what the next run may take: the bound less what is kept
    assert "removed the oldest run 1-1" in logs[0]


# ---------------------------------------------------------------- --follow-unit


def test_a_units_main_process_is_read_from_its_cgroup_without_systemctl(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(follow_target.shutil, "which", lambda _name: None)
    cg = tmp_path / "cg"
    (cg / "llama.service").mkdir(parents=True)
    proc = tmp_path / "proc"
    uid = os.getuid()
    for pid, start in ((41, 500), (40, 100)):
        (proc / str(pid)).mkdir(parents=True)
        (proc / str(pid) / "status").write_text(f"Uid:\t{uid}\t{uid}\t{uid}\t{uid}\n")
        (proc / str(pid) / "stat").write_text(f"{pid} (llama) S " + " ".join(["0"] * 18) + f" {start} 0\n")
    unit = UnitMainProcess("llama.service", cgroup_root=cg)
    assert unit.find(proc, os.getpid()) == []  # no cgroup.procs: the unit runs nothing
    (cg / "llama.service" / "cgroup.procs").write_text("41\n40\n")
    assert unit.find(proc, os.getpid()) == [Candidate(start_ticks=100, pid=40)]  # the oldest
    assert UnitMainProcess("llama.service", uid=uid + 1, cgroup_root=cg).find(proc, 1) == []
    assert unit.to_meta() == {"unit": "llama.service", "match": "unit", "uid": None}


def test_a_units_main_process_is_asked_of_systemctl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`systemctl show -p MainPID --value UNIT` answers the unit's main process (0: none)."""
    answer = tmp_path / "answer"
    fake = tmp_path / "systemctl"
    fake.write_text(
        f'#!/bin/sh\n[ "$*" = "show -p MainPID --value -- llama.service" ] || exit 9\ncat "{answer}"\n'
    )
    fake.chmod(0o755)
    monkeypatch.setattr(follow_target.shutil, "which", lambda _name: str(fake))
    proc = tmp_path / "proc"
    uid = os.getuid()
    (proc / "41").mkdir(parents=True)
    (proc / "41" / "status").write_text(f"Uid:\t{uid}\t{uid}\t{uid}\t{uid}\n")
    (proc / "41" / "stat").write_text("41 (llama) S " + " ".join(["0"] * 18) + " 7 0\n")
    unit = UnitMainProcess("llama.service", cgroup_root=tmp_path / "no-cgroup")
    answer.write_text("0\n")  # the unit runs nothing now
    assert unit.find(proc, os.getpid()) == []
    answer.write_text("41\n")
    assert unit.find(proc, os.getpid()) == [Candidate(start_ticks=7, pid=41)]


# ---------------------------------------------------------------- the status line


class _Stream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self._tty = tty

    def isatty(self) -> bool:
        return self._tty


def test_status_interval_is_on_for_a_log_and_off_on_a_terminal_unless_given() -> None:
    assert status_interval(None, _Stream(tty=False)) == DEFAULT_INTERVAL_S
    assert status_interval(None, _Stream(tty=True)) == 0
    assert status_interval(5, _Stream(tty=True)) == 5
    assert status_interval(0, _Stream(tty=False)) == 0


def test_status_line_sums_the_runs_and_says_every_counter() -> None:
    totals = ProgressTotals()
    totals.add_closed(Progress(tokens=100, requests=3, kernel_drops=1, seq_gaps=2))
    now = totals.reading(
        Progress(tokens=20, requests=1, logits_incomplete=4, rss_bytes=50 << 20, ring_fill_peak=0.25),
        runs=2,
        attached_pid=1234,
    )
    assert (now.tokens, now.requests, now.losses) == (120, 4, 7)
    text = format_status(now, 0.031)
    assert text == (
        "sparseety-prof: status: runs 2 (recording PID 1234), tokens 120, requests 4, losses 7 "
        "(kernel_drops 1, seq_gaps 2, logits_incomplete 4), cpu "
        f"{now.cpu_s:.1f} s (3.1% of a core), rss 50 MiB, ring peak 25%"
    )
    assert "\n" not in text
    covered = totals.reading(Progress(tokens=1, sparse_coverage=0.085))
    assert format_status(covered, None).endswith("ring peak 0%, sparse coverage 8.5%")


def test_status_ticker_writes_lines_until_stopped() -> None:
    lines: list[str] = []
    got = threading.Event()

    def write(s: str) -> None:
        lines.append(s)
        if len(lines) >= 2:
            got.set()

    reading = StatusReading(1, 0, 0, 0, 0, 0.0, 0, 0.0)
    ticker = StatusTicker(0.05, lambda: reading, write).start()
    assert got.wait(30)
    ticker.stop()
    n = len(lines)
    assert all(s.startswith("sparseety-prof: status: tokens 1, requests 0, losses 0") for s in lines)
    threading.Event().wait(0.2)
    assert len(lines) == n  # stopped: no more lines
    off = StatusTicker(0, lambda: reading, write).start()
    off.stop()
    assert len(lines) == n


# ---------------------------------------------------------------- the status line of a real record


@pytest.mark.root
@pytest.mark.engine
def test_record_prints_status_lines_that_match_its_recording(models: dict[str, Path], tmp_path: Path) -> None:
    """`record --pid` with its stderr in a pipe (a service's log): status lines come, counting up
    to what the recording holds; no control character reaches them."""
    e = Engine([str(ENGINES / "llama_engine.py"), str(models["moe"])])
    try:
        rec = Recorder(e.pid, tmp_path / "rec", "--status-interval", "0.5")
        e.generate(["the status line counts these tokens", "and these"], max_tokens=12)
        rec.wait_for("sparseety-prof: status: tokens ")
        rc, err = rec.stop()
    finally:
        e.close()
    assert rc == 0, err
    r = sparseety_prof.open(tmp_path / "rec")
    lines = [x for x in err.splitlines() if "status:" in x]
    counts = [int(x.split("tokens ", 1)[1].split(",", 1)[0]) for x in lines]
    assert counts == sorted(counts) and counts[-1] <= r.tokens().height
    assert all(ch.isprintable() for x in lines for ch in x.rstrip("\n"))
    assert "runs" not in lines[0]  # only a follower counts runs
