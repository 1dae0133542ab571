"""--bpf-stats: the probe programs' runs and run time, counted by the kernel while the recorder is
attached (capture/bpf_stats.py), on a real engine; and the machine's own setting left alone."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
from conftest import Engine, Recorder

from sparseety_prof.capture.bpf_stats import program_runs
from sparseety_prof.store import recording

PROMPTS = ["hello the expert router", "one two three four"]
SYSCTL = Path("/proc/sys/kernel/bpf_stats_enabled")


def test_run_counts_are_read_off_a_programs_fdinfo() -> None:
    fdinfo = (
        "pos:\t0\nflags:\t02000002\nprog_type:\t2\nrun_time_ns:\t123456\nrun_cnt:\t78\nrecursion_misses:\t0\n"
    )
    assert program_runs(fdinfo) == (78, 123456)
    assert program_runs("pos:\t0\nprog_type:\t2\n") == (0, 0)  # a kernel that does not report them


def _record(engine: Engine, out: Path, *extra: str) -> tuple[dict[str, object], int]:
    rec = Recorder(engine.pid, out, *extra)
    generated = sum(len(r["ids"]) for r in engine.generate(PROMPTS, max_tokens=16))
    rc, err = rec.stop(signal.SIGINT)
    assert rc == 0, err
    return json.loads((out / recording.META_FILE).read_text()), generated


@pytest.mark.root
@pytest.mark.engine
def test_bpf_stats_count_the_probes_while_attached_only(llama_engine: Engine, tmp_path: Path) -> None:
    machine_setting = SYSCTL.read_text()
    meta, generated = _record(llama_engine, tmp_path / "on", "--bpf-stats")
    bpf = meta["bpf_programs"]
    assert isinstance(bpf, dict) and bpf["stats"] == "on"
    progs = bpf["programs"]
    # every forward pass runs the micro-batch probe once, every sampled token the sampler's
    assert progs["ubatch_enter"]["runs"] >= generated
    assert progs["any_sampler_return"]["runs"] >= generated
    assert all(p["runs"] > 0 and p["run_ns"] > 0 for p in progs.values())
    assert bpf["runs"] == sum(p["runs"] for p in progs.values())
    assert bpf["run_ns"] == sum(p["run_ns"] for p in progs.values())
    assert SYSCTL.read_text() == machine_setting  # the machine's setting was never touched
    # without the flag nothing is counted (and the statistics went with the last recorder)
    meta, _ = _record(llama_engine, tmp_path / "off")
    assert meta["bpf_programs"] == {"stats": "off", "runs": 0, "run_ns": 0, "programs": {}}
