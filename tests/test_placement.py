"""--recorder-cpus: the placement decided on synthetic affinity sets (session/placement.py), and a
real recorder against an engine pinned to core 0 ending up on core 1."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import ENGINES, PY, ROOT, Engine, Recorder, run_cli

from sparseety_prof.errors import UsageError
from sparseety_prof.session.placement import (
    EngineCpus,
    cpu_list_text,
    decide,
    parse_cpu_list,
    parse_recorder_cpus,
    placement_check,
    read_engine_cpus,
)
from sparseety_prof.store import recording

ALL4 = frozenset({0, 1, 2, 3})


def _engine(threads: set[int], process: set[int] | None = None, ran_on: set[int] | None = None) -> EngineCpus:
    return EngineCpus(
        frozenset(process if process is not None else threads),
        frozenset(threads),
        frozenset(ran_on if ran_on is not None else threads),
        4,
    )


def test_cpu_lists_read_and_written_as_the_kernel_does() -> None:
    assert parse_cpu_list("0-2,5") == {0, 1, 2, 5}
    assert parse_cpu_list("3") == {3}
    assert cpu_list_text({0, 1, 2, 5}) == "0-2,5"
    assert cpu_list_text({1, 3}) == "1,3"
    assert cpu_list_text(set()) == ""
    for bad in ("", "a", "2-1", "1,,2", "-1", "1-"):
        with pytest.raises(ValueError):
            parse_cpu_list(bad)


def test_flag_values() -> None:
    assert parse_recorder_cpus("auto") == "auto"
    assert parse_recorder_cpus("none") == "none"
    assert parse_recorder_cpus("3,1-2") == "1-3"
    with pytest.raises(UsageError):
        parse_recorder_cpus("all")


def test_auto_takes_the_cores_no_engine_thread_may_use() -> None:
    p = decide("auto", ALL4, _engine({0, 1, 2}))
    assert p.cores == {3}
    assert p.to_meta()["pinned"] == "3" and p.to_meta()["engine_threads_allowed"] == "0-2"


def test_auto_counts_threads_pinned_apart_from_their_process() -> None:
    # the process is on core 0, one of its threads was moved to core 2
    p = decide("auto", ALL4, _engine({0, 2}, process={0}))
    assert p.cores == {1, 3}


def test_auto_pins_nothing_when_the_engine_may_run_everywhere_the_recorder_may() -> None:
    # the engine ran on two cores lately, but may run on all: a core it left is no free core
    p = decide("auto", ALL4, _engine(set(ALL4), ran_on={0, 1}))
    assert p.cores is None and "low priority" in p.reason
    assert p.to_meta()["engine_ran_on"] == "0-1"


def test_auto_within_the_recorders_own_affinity() -> None:
    # the recorder itself may only use cores 0-1, the engine's free core 3 is not its to take
    assert decide("auto", frozenset({0, 1}), _engine({0, 1, 2})).cores is None
    assert decide("auto", frozenset({0, 1}), _engine({0})).cores == {1}


def test_auto_without_the_engines_affinity() -> None:
    p = decide("auto", ALL4, None)
    assert p.cores is None and p.to_meta()["engine_allowed"] is None


def test_none_and_lists() -> None:
    assert decide("none", ALL4, _engine({0})).cores is None
    p = decide("2-3", ALL4, _engine({0, 1, 2}))
    assert p.cores == {2, 3} and "engine may run there too" in p.reason
    assert decide("3", ALL4, _engine({0})).reason == "as asked"
    with pytest.raises(UsageError):
        decide("7", ALL4, _engine({0}))


def test_read_engine_cpus_of_a_pinned_process() -> None:
    cores = sorted(os.sched_getaffinity(0))
    proc = subprocess.Popen(["taskset", "-c", str(cores[0]), PY, "-c", "import time; time.sleep(30)"])
    try:
        e = read_engine_cpus(proc.pid)
        for _ in range(100):  # until taskset has set the affinity and exec'd python
            if e.process == {cores[0]} and e.ran_on == {cores[0]}:
                break
            time.sleep(0.05)
            e = read_engine_cpus(proc.pid)
        assert e.process == {cores[0]} and e.threads == {cores[0]} and e.ran_on == {cores[0]}
        assert e.n_threads == 1
    finally:
        proc.kill()
        proc.wait()


def _recorder_threads_allowed(pid: int) -> set[str]:
    out = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            status = (task / "status").read_text()
        except OSError:
            continue
        out |= {
            ln.split(":", 1)[1].strip() for ln in status.splitlines() if ln.startswith("Cpus_allowed_list")
        }
    return out


@pytest.mark.root
@pytest.mark.engine
def test_recorder_goes_to_the_core_the_pinned_engine_leaves(models: dict[str, Path], tmp_path: Path) -> None:
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip(f"needs 2 cores to leave one to the recorder; this process may use {cores}")
    engine = PinnedEngine(cores[0], models["moe"])
    try:
        assert os.sched_getaffinity(engine.pid) == {cores[0]}
        rec = Recorder(engine.pid, tmp_path / "rec")
        engine.generate(["hello the expert router"], max_tokens=8)
        # every thread of the recorder, those made after the pinning included (Polars', the ring
        # watch's, the model hasher's): on the cores the engine may not use
        allowed = _recorder_threads_allowed(rec.proc.pid)
        rc, err = rec.stop(signal.SIGINT)
        assert rc == 0, err
    finally:
        engine.close()
    free = cpu_list_text(set(cores) - {cores[0]})
    assert allowed == {free}
    meta = json.loads((tmp_path / "rec" / recording.META_FILE).read_text())
    placed = meta["recorder_placement"]
    assert placed["asked"] == "auto" and placed["pinned"] == free
    assert placed["engine_allowed"] == str(cores[0]) and placed["engine_threads_allowed"] == str(cores[0])


class PinnedEngine(Engine):
    """The test engine started as `taskset -c CORE python llama_engine.py MODEL`."""

    def __init__(self, core: int, model: Path) -> None:  # (Engine's, with taskset in front)
        self.proc = subprocess.Popen(
            ["taskset", "-c", str(core), PY, str(ENGINES / "llama_engine.py"), str(model)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        self.ready = self.read()
        self.pid = int(self.ready["ready"])


def _pinned_sleeper(core: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(["taskset", "-c", str(core), PY, "-c", "import time; time.sleep(60)"])
    for _ in range(100):  # until taskset has set the affinity
        if os.sched_getaffinity(proc.pid) == {core}:
            break
        time.sleep(0.05)
    return proc


def test_doctor_says_where_the_recorder_would_run() -> None:
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip(f"needs 2 cores to leave one to the recorder; this process may use {cores}")
    proc = _pinned_sleeper(cores[0])
    try:
        check = placement_check(proc.pid)
        free = cpu_list_text(set(cores) - {cores[0]})
        assert check.ok and check.detail.startswith(f"recorder on core(s) {free}: ")
        assert check.fix == ""
        everywhere = placement_check(os.getpid())  # (this process may run on every core)
        assert everywhere.ok and everywhere.detail.startswith("recorder not pinned: ")
        assert "taskset" in everywhere.fix
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.root
def test_doctor_json_holds_the_placement() -> None:
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip(f"needs 2 cores to leave one to the recorder; this process may use {cores}")
    proc = _pinned_sleeper(cores[0])
    try:
        done = run_cli("doctor", "-p", str(proc.pid), "--json")
    finally:
        proc.kill()
        proc.wait()
    checks = {c["name"]: c for c in json.loads(done.stdout)["checks"]}
    free = cpu_list_text(set(cores) - {cores[0]})
    assert checks["recorder placement"]["detail"].startswith(f"recorder on core(s) {free}: ")


# a follower placing itself for one engine, then for the next (one process, as --follow runs)
_FOLLOWER = """
import os, sys
from sparseety_prof.session.placement import place_recorder
pinned, unpinned = int(sys.argv[1]), int(sys.argv[2])
first = place_recorder("auto", pinned)
after_first = sorted(os.sched_getaffinity(0))
second = place_recorder("auto", unpinned)
print(sorted(first.cores or ()), after_first, second.cores, sorted(os.sched_getaffinity(0)))
"""


def test_a_follower_places_itself_again_among_the_cores_it_started_with() -> None:
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip(f"needs 2 cores to leave one to the recorder; this process may use {cores}")
    pinned = _pinned_sleeper(cores[0])
    unpinned = subprocess.Popen([PY, "-c", "import time; time.sleep(60)"])
    try:
        done = subprocess.run(
            [PY, "-c", _FOLLOWER, str(pinned.pid), str(unpinned.pid)],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=60,
        )
    finally:
        for p in (pinned, unpinned):
            p.kill()
            p.wait()
    assert done.returncode == 0, done.stderr
    rest = cores[1:]
    # pinned apart from the first engine, then back on every core for the one that may use them all
    assert done.stdout.split("\n")[0] == f"{rest} {rest} None {cores}"
