"""`record --follow NAME`: the matching rule, the refused usages, and a real follow across an
engine restart (engine A records, exits; engine B under the same name is re-attached)."""

from __future__ import annotations

import itertools
import json
import os
import secrets
import shutil
import signal
import stat
import subprocess
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import polars as pl
import pytest
from conftest import CLI, ENGINES, PY, ROOT, Engine, bpf_prog_ids, free_port
from otlp_receiver import OtlpReceiver
from prometheus_client.parser import text_string_to_metric_families

import sparseety_prof
from sparseety_prof.capture.process_match import Candidate, ProcessRule, matching_processes
from sparseety_prof.cli import main
from sparseety_prof.errors import NotAnEngine
from sparseety_prof.session.follow import Follower
from sparseety_prof.session.options import Options, Progress

# Runs a script under a process name of our choosing (prctl PR_SET_NAME), as setproctitle does:
# a Python engine is otherwise named "python3", like every other Python on the machine.
NAMED = (
    "import ctypes, runpy, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(15, sys.argv[1].encode(), 0, 0, 0)\n"
    "sys.argv = sys.argv[2:]\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
)


# ---------------------------------------------------------------- refused usages


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["record", "--follow", "", "-o", "x"], "--follow needs a process name"),
        (["record", "--follow", " llama", "-o", "x"], "--follow needs a process name"),
        (["record", "--follow", "a-very-long-engine-name", "-o", "x"], "at most 15 bytes"),
        (["record", "--pid", "1", "--follow-user", "0", "-o", "x"], "--follow-user needs --follow"),
        (["record", "--follow", "llama-server", "--follow-user", "no-such-user-x", "-o", "x"], "no user"),
        (["record", "--follow-unit", "a/b", "-o", "x"], "--follow-unit needs a systemd unit name"),
        (["record", "--follow", "llama-server", "--status-interval", "-1", "-o", "x"], "--status-interval"),
        (["record", "--follow", "llama-server", "--late-attach", "-o", "x"], "--late-attach"),
        (["attach", "--follow", ""], "--follow needs a process name"),
    ],
)
def test_bad_follow_usage_is_refused_with_exit_code_2(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [str(tmp_path / a) if a == "x" else a for a in argv]
    assert main(argv) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("command", ["record", "attach"])
def test_follow_with_pid_is_refused_by_the_cli(command: str, tmp_path: Path) -> None:
    p = subprocess.run(
        [*CLI, command, "--follow", "llama-server", "--pid", "1", "-o", str(tmp_path / "r")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert p.returncode == 2
    assert "not allowed with argument" in p.stderr
    assert not (tmp_path / "r").exists()


# ---------------------------------------------------------------- the matching rule


def _fake_process(proc: Path, pid: int, comm: str, uid: int, euid: int, start: int, state: str = "S") -> None:
    d = proc / str(pid)
    d.mkdir()
    (d / "comm").write_text(comm + "\n")
    (d / "status").write_text(f"Name:\t{comm}\nUid:\t{uid}\t{euid}\t{euid}\t{euid}\n")
    rest = " ".join(["0"] * 18)
    # a name holding ") " must not shift the fields: they are read after the last ')'
    (d / "stat").write_text(f"{pid} ({comm}) x) {state} {rest} {start} 0 0\n")


def test_rule_is_the_exact_name_and_the_user_oldest_first(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    proc.mkdir()
    _fake_process(proc, 300, "llama-server", 1000, 1000, start=500)
    _fake_process(proc, 200, "llama-server", 1000, 1000, start=900)
    _fake_process(proc, 100, "llama-server", 1000, 1000, start=500)  # same start: lower PID first
    _fake_process(proc, 400, "llama-server2", 1000, 1000, start=10)  # a longer name
    _fake_process(proc, 401, "llama", 1000, 1000, start=10)  # a prefix
    _fake_process(proc, 402, "llama-server", 1001, 1001, start=10)  # another user
    _fake_process(proc, 403, "llama-server", 1000, 0, start=10)  # set-uid to root
    _fake_process(proc, 404, "llama-server", 1000, 1000, start=10, state="Z")  # exited
    (proc / "self").mkdir()  # not a PID
    rule = ProcessRule(name="llama-server", uid=1000)
    assert matching_processes(rule, proc) == [Candidate(500, 100), Candidate(500, 300), Candidate(900, 200)]
    assert [c.pid for c in matching_processes(rule, proc, exclude=100)] == [300, 200]
    assert [c.pid for c in matching_processes(ProcessRule("llama-server", 1001), proc)] == [402]


def test_rule_finds_a_real_process_by_its_name(tmp_path: Path) -> None:
    name = "spf-" + secrets.token_hex(4)
    script = tmp_path / "sleep.py"
    script.write_text("import time\ntime.sleep(120)\n")
    child = subprocess.Popen([PY, "-c", NAMED, name, str(script)])
    try:
        rule = ProcessRule(name=name, uid=os.getuid())
        deadline = time.monotonic() + 30
        found: list[Candidate] = []
        while not found and time.monotonic() < deadline:
            found = matching_processes(rule)
            time.sleep(0.05)
        assert [c.pid for c in found] == [child.pid]
        ticks = int(Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        assert found[0].start_ticks == ticks
        assert matching_processes(ProcessRule(name=name, uid=os.getuid() + 1)) == []
    finally:
        child.kill()
        child.wait()


# ---------------------------------------------------------------- the follow loop, on a fake /proc


class _FakeRecorder:
    """Stands in for session.recorder.Recorder: PID 100 is never an engine; any other PID is
    "recorded" until it leaves the fake /proc (the engine exits)."""

    def __init__(self, opts: Options, proc: Path, attempts: list[tuple[int, float]]) -> None:
        self.opts, self.proc = opts, proc
        self.attached = threading.Event()
        self.meta: dict[str, Any] = {}
        self.progress = Progress()  # what the follower's status line reads
        self._stop = threading.Event()
        attempts.append((opts.pid, time.monotonic()))

    def stop(self, reason: str) -> None:
        self.meta["stop_reason"] = reason
        self._stop.set()

    def run(self) -> dict[str, Any]:
        if self.opts.pid == 100:
            raise NotAnEngine("PID 100 maps no llama.cpp library")
        self.attached.set()
        self.meta.update(start_unix_ms=1, counts={"tokens": 7})
        while not self._stop.wait(0.05):
            if not (self.proc / str(self.opts.pid)).exists():
                self.meta["stop_reason"] = "target exited"
                break
        self.meta["end_unix_ms"] = 2
        return self.meta


def test_a_process_that_never_becomes_an_engine_does_not_hold_back_a_newer_one(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    proc.mkdir()
    uid = os.getuid()
    _fake_process(proc, 100, "llama-server", uid, uid, start=10)  # oldest: refused again and again
    attempts: list[tuple[int, float]] = []
    logs: list[str] = []
    follower = Follower(
        ProcessRule("llama-server", uid),
        Options(pid=0, out=tmp_path / "follow"),
        lambda o: _FakeRecorder(o, proc, attempts),  # type: ignore[arg-type,return-value]
        logs.append,
        proc=proc,
    )
    runner = threading.Thread(target=follower.run)
    runner.start()
    try:
        time.sleep(4.0)  # PID 100 is retried meanwhile, less and less often
        alone = list(attempts)
        _fake_process(proc, 200, "llama-server", uid, uid, start=20)
        deadline = time.monotonic() + 20
        while not any("attaching" in x and "PID 200" in x for x in logs) and time.monotonic() < deadline:
            time.sleep(0.05)
        shutil.rmtree(proc / "200")  # the engine exits
        while not any("PID 200 exited" in x for x in logs) and time.monotonic() < deadline:
            time.sleep(0.05)
        _fake_process(proc, 300, "llama-server", uid, uid, start=30)  # ... and is started again
        while len(follower.recordings) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        follower.stop("SIGINT")
        runner.join(timeout=10)
    index = json.loads((tmp_path / "follow" / "follow.json").read_text())
    assert [(r["n"], r["pid"], r["dir"], r["stop_reason"]) for r in index["recordings"]] == [
        (1, 200, "1-200", "target exited"),
        (2, 300, "2-300", "SIGINT"),
    ]
    assert index["stop_reason"] == "SIGINT"
    # the refused process: said once, retried from 0.5 s apart to at most 5 s, never more often
    assert sum("PID 100 not attachable yet" in x for x in logs) == 1
    gaps = [b - a for (_, a), (_, b) in itertools.pairwise(alone)]
    assert {pid for pid, _ in alone} == {100} and len(gaps) >= 2, alone
    assert all(0.45 <= g <= 5.5 for g in gaps) and gaps == sorted(gaps), gaps


# ---------------------------------------------------------------- following an engine that restarts


class _Follower:
    """`sparseety-prof record|attach --follow NAME -o DIR` as a child process; stderr read as it
    comes (attach's live view draws there too, wide enough that no message is wrapped)."""

    def __init__(self, command: str, name: str, out: Path, *extra: str) -> None:
        self.proc = subprocess.Popen(
            [*CLI, command, "--follow", name, "-o", str(out), *extra],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env={**os.environ, "COLUMNS": "400"},
        )
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            with self._cond:
                self.lines.append(line)
                self._cond.notify_all()

    def wait_for(self, text: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not any(text in line for line in self.lines):
                left = deadline - time.monotonic()
                if left <= 0 or not self._reader.is_alive():
                    raise TimeoutError(f"follower printed no {text!r}: {''.join(self.lines)}")
                self._cond.wait(min(left, 0.5))

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(timeout=120)
        finally:
            self._reader.join(timeout=10)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _held_prog_ids(pid: int) -> set[int]:
    """IDs of the BPF programs process `pid` holds open (its fdinfo)."""
    ids = set()
    for fd in Path(f"/proc/{pid}/fdinfo").iterdir():
        try:
            text = fd.read_text()
        except OSError:
            continue
        for row in text.splitlines():
            if row.startswith("prog_id:"):
                ids.add(int(row.split()[1]))
    return ids


def _niceness(pid: int) -> int:
    """The nice value of process `pid`'s main thread, where the consumer loop runs."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[16])


def _wait_listed(index: Path, pid: int, timeout: float = 10) -> dict[str, object]:
    deadline = time.monotonic() + timeout
    while True:
        runs = json.loads(index.read_text())["recordings"]
        if runs and runs[-1]["pid"] == pid:
            return dict(runs[-1])
        assert time.monotonic() < deadline, runs
        time.sleep(0.05)


def _requests(tokens: pl.DataFrame) -> list[list[int]]:
    order = tokens.group_by("request_id", maintain_order=True).agg(pl.col("t_end_ns").min()).sort("t_end_ns")
    return [
        tokens.filter(pl.col("request_id") == r).sort("t_end_ns")["token_id"].to_list()
        for r in order["request_id"]
    ]


@pytest.mark.root
@pytest.mark.engine
@pytest.mark.parametrize("command", ["record", "attach"])
def test_follow_records_each_run_of_a_restarted_engine(
    command: str, models: dict[str, Path], tmp_path: Path
) -> None:
    name = "spf-" + secrets.token_hex(4)  # no other process on the machine has it
    out = tmp_path / "follow"
    engine_args = ["-c", NAMED, name, str(ENGINES / "llama_engine.py"), str(models["moe"])]
    follower = _Follower(command, name, out)
    engines: list[Engine] = []
    try:
        follower.wait_for(f"waiting for a process named {name!r}")
        truth, held, nice = [], [], []
        for prompts in (["hello the expert router", "one two three"], ["the sparse decode sample"]):
            e = Engine(engine_args)
            engines.append(e)
            follower.wait_for(f"attached to PID {e.pid} ")
            # listed while it records: a follower killed outright leaves it listed too
            listed = _wait_listed(out / "follow.json", e.pid)
            assert listed["stop_reason"] is None and listed["end_unix_ms"] is None
            held.append(_held_prog_ids(follower.proc.pid))
            nice.append(_niceness(follower.proc.pid))
            truth.append(e.generate(prompts, max_tokens=24))
            if len(engines) == 1:
                e.close()  # the engine exits: the follower closes its recording and waits again
                follower.wait_for(f"PID {e.pid} exited; waiting for {name!r} again")
        # the first engine's programs were unloaded when it exited, while the follower ran on
        assert held[0] and held[1] and not held[0] & held[1]
        assert not held[0] & bpf_prog_ids()
        # each attach runs at --nice (default 10): the first run's lowering was undone, not added to
        assert nice == [10, 10]
        rc = follower.stop()
        assert rc == 0, "".join(follower.lines)
    finally:
        follower.kill()
        for e in engines:
            e.close()
    assert not (held[0] | held[1]) & bpf_prog_ids(), "BPF programs left loaded"

    index_path = out / "follow.json"
    assert stat.S_IMODE(index_path.stat().st_mode) == 0o600
    index = json.loads(index_path.read_text())
    assert index["follow"] == {"name": name, "match": "comm", "uid": os.getuid()}
    assert index["stop_reason"] == "SIGINT" and index["end_unix_ms"] >= index["start_unix_ms"]
    runs = index["recordings"]
    assert [(r["n"], r["pid"], r["dir"]) for r in runs] == [
        (i + 1, e.pid, f"{i + 1}-{e.pid}") for i, e in enumerate(engines)
    ]
    assert [r["stop_reason"] for r in runs] == ["target exited", "SIGINT"]
    assert runs[0]["end_unix_ms"] <= runs[1]["start_unix_ms"] <= runs[1]["end_unix_ms"]
    assert sorted(p.name for p in out.iterdir()) == sorted(["follow.json", *(r["dir"] for r in runs)])
    for run, want in zip(runs, truth, strict=True):
        r = sparseety_prof.open(out / run["dir"])
        assert r.complete and r.meta["target"]["pid"] == run["pid"]
        assert r.meta["stop_reason"] == run["stop_reason"]
        assert _requests(r.tokens()) == [w["ids"] for w in want]
        assert run["tokens"] == sum(len(w["ids"]) for w in want)
        assert r.meta["losses"]["kernel_drops"] == 0 and r.meta["losses"]["seq_gaps"] == 0


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(sample name, labels) -> value, from the follower's endpoint over HTTP."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for fam in text_string_to_metric_families(text)
        for sample in fam.samples
    }


def _total(scrape: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str) -> float:
    return sum(v for (n, _labels), v in scrape.items() if n == name)


@pytest.mark.root
@pytest.mark.engine
def test_one_endpoint_and_exporter_live_across_three_engine_restarts(
    models: dict[str, Path], tmp_path: Path
) -> None:
    """Issue 61's acceptance: the engine restarted three times under `record --follow` with
    --metrics-port and --otlp: three recordings, the endpoint answers at every scrape in between,
    its counters never go back, and every request of every run reaches the collector."""
    name = "spf-" + secrets.token_hex(4)
    out = tmp_path / "follow"
    port = free_port()
    receiver = OtlpReceiver()
    engine_args = ["-c", NAMED, name, str(ENGINES / "llama_engine.py"), str(models["moe"])]
    follower = _Follower(
        "record", name, out, "--metrics-port", str(port), "--otlp", receiver.url, "--status-interval", "1"
    )
    engines: list[Engine] = []
    scrapes = []
    try:
        follower.wait_for(f"waiting for a process named {name!r}")
        scrapes.append(_scrape(port))  # before the first engine: it answers already
        for i in range(3):
            e = Engine(engine_args)
            engines.append(e)
            follower.wait_for(f"attached to PID {e.pid} ")
            scrapes.append(_scrape(port))
            e.generate([f"run {i} of the expert router", "one two three"], max_tokens=12)
            scrapes.append(_scrape(port))
            e.close()
            follower.wait_for(f"PID {e.pid} exited; waiting for {name!r} again")
            scrapes.append(_scrape(port))  # between two engines
        rc = follower.stop()
        assert rc == 0, "".join(follower.lines)
    finally:
        follower.kill()
        receiver.close()
        for e in engines:
            e.close()

    runs = json.loads((out / "follow.json").read_text())["recordings"]
    assert [(r["pid"], r["stop_reason"]) for r in runs] == [(e.pid, "target exited") for e in engines]
    recordings = [sparseety_prof.open(out / r["dir"]) for r in runs]
    assert all(r.complete for r in recordings)
    tokens = sum(r.tokens().height for r in recordings)
    request_ids = [rid for r in recordings for rid in r.requests()["request_id"].to_list()]
    assert tokens > 0 and len(request_ids) == 6

    # counters and histogram samples never go back, from one scrape to the next
    for before, after in itertools.pairwise(scrapes):
        for key, value in before.items():
            if key[0].endswith(("_total", "_count", "_sum", "_bucket")) and key in after:
                assert after[key] >= value, (key, value, after[key])
    restarts = [_total(s, "sparseety_engine_restarts_total") for s in scrapes]
    assert restarts == [0, 0, 0, 0, 1, 1, 1, 2, 2, 2]
    attached = [_total(s, "sparseety_follow_attached") for s in scrapes]
    assert attached == [0, *[1, 1, 0] * 3]
    last = scrapes[-1]
    assert _total(last, "sparseety_tokens_total") == tokens
    assert _total(last, "sparseety_requests_total") == len(request_ids)

    # every request of every run, as a span the collector received
    spans = [s for s in receiver.spans if s["name"] != "sparseety.step"]
    assert receiver.bad == []
    assert sorted(s["attributes"]["sparseety.request_id"] for s in spans) == sorted(request_ids)
    assert {s["resource"].get("process.pid") for s in spans} <= {e.pid for e in engines}
    assert any("status: runs 3" in line for line in follower.lines), "".join(follower.lines)


@pytest.mark.root
@pytest.mark.engine
def test_a_restarted_follower_goes_on_in_its_directory_collecting_each_run(
    models: dict[str, Path], tmp_path: Path
) -> None:
    """A follower stopped and started again on its -o (as a service manager does) adds its run
    beside the first, never over it; --dataset collects each closed run; --max-disk holds."""
    name = "spf-" + secrets.token_hex(4)
    out, dest = tmp_path / "follow", tmp_path / "ds"
    engine_args = ["-c", NAMED, name, str(ENGINES / "llama_engine.py"), str(models["moe"])]
    flags = ("--dataset", str(dest), "--max-disk", "64M", "--status-interval", "0")
    engines: list[Engine] = []
    truth = []
    for i in range(2):
        follower = _Follower("record", name, out, *flags)
        try:
            follower.wait_for(f"waiting for a process named {name!r}")
            if i == 1:
                assert any(
                    "going on in" in line and "the next is number 2" in line for line in follower.lines
                )
            e = Engine(engine_args)
            engines.append(e)
            follower.wait_for(f"attached to PID {e.pid} ")
            truth.append(e.generate([f"restart {i} of the follower"], max_tokens=10))
            e.close()
            follower.wait_for(f"PID {e.pid} exited; waiting for {name!r} again")
            rc = follower.stop()
            assert rc == 0, "".join(follower.lines)
            assert not any("status:" in line for line in follower.lines)  # --status-interval 0
        finally:
            follower.kill()
            for x in engines:
                x.close()
    runs = json.loads((out / "follow.json").read_text())["recordings"]
    assert [(r["n"], r["dir"], r["stop_reason"]) for r in runs] == [
        (i + 1, f"{i + 1}-{e.pid}", "target exited") for i, e in enumerate(engines)
    ]
    used = 0
    for run, want in zip(runs, truth, strict=True):
        r = sparseety_prof.open(out / run["dir"])
        assert r.complete and r.meta["target"]["pid"] == run["pid"]
        assert _requests(r.tokens()) == [w["ids"] for w in want]
        used += sum(f.stat().st_blocks * 512 for f in (out / run["dir"]).rglob("*") if f.is_file())
    assert used <= 64 << 20
    collected = pl.read_parquet(dest / "tokens" / "**" / "*.parquet", hive_partitioning=True)
    assert sorted(collected["token_id"].to_list()) == sorted(i for w in truth for x in w for i in x["ids"])
