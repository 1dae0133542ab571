"""Each failure class has its own message and exit code (documented in the README)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from conftest import ENGINES, Engine, run_cli, run_cli_without_capabilities

from sparseety_prof.errors import (
    BpfUnavailable,
    CorruptRecording,
    InjectionRefused,
    MetricsEndpointError,
    MissingPrivileges,
    NoSuchProcess,
    NotAnEngine,
    PtraceNotPermitted,
    RecordingWriteError,
    UnsupportedEngineBuild,
    UsageError,
)


def test_exit_codes_are_distinct() -> None:
    classes = [
        UsageError,
        NoSuchProcess,
        NotAnEngine,
        MissingPrivileges,
        UnsupportedEngineBuild,
        CorruptRecording,
        BpfUnavailable,
        RecordingWriteError,
        PtraceNotPermitted,
        InjectionRefused,
        MetricsEndpointError,
    ]
    codes = [c.exit_code for c in classes]
    assert len(set(codes)) == len(codes) and 0 not in codes and 1 not in codes


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_wrong_pid(tmp_path: Path) -> None:
    r = run_cli("record", "--pid", str(_dead_pid()), "-o", str(tmp_path / "x"))
    assert r.returncode == NoSuchProcess.exit_code
    assert "no process with PID" in r.stderr
    assert not (tmp_path / "x").exists()
    r = run_cli("record", "--pid", "-5", "-o", str(tmp_path / "x"))
    assert r.returncode == NoSuchProcess.exit_code and "invalid PID" in r.stderr


@pytest.mark.root
def test_process_that_is_not_an_engine(tmp_path: Path) -> None:
    p = subprocess.Popen(["sleep", "60"])
    try:
        r = run_cli("record", "--pid", str(p.pid), "-o", str(tmp_path / "x"))
    finally:
        p.kill()
        p.wait()
    assert r.returncode == NotAnEngine.exit_code, r.stderr
    assert "maps no llama.cpp library" in r.stderr


@pytest.mark.root
def test_missing_privileges(models: dict[str, Path], tmp_path: Path) -> None:
    """Root with every capability dropped (as in a locked-down container) may not load BPF."""
    e = Engine([str(ENGINES / "llama_engine.py"), str(models["moe"])])
    try:
        r = run_cli_without_capabilities("record", "--pid", str(e.pid), "-o", str(tmp_path / "x"))
    finally:
        e.close()
    assert r.returncode == MissingPrivileges.exit_code, r.stderr
    assert "CAP_BPF" in r.stderr and "--cap-add" in r.stderr
    assert not (tmp_path / "x").exists()


def test_corrupt_recording(tmp_path: Path) -> None:
    d = tmp_path / "rec"
    d.mkdir()
    (d / "meta.json").write_text("{not json")
    r = run_cli("report", str(d))
    assert r.returncode == CorruptRecording.exit_code
    assert "meta.json" in r.stderr and "Traceback" not in r.stderr


def test_truncated_segment(tmp_path: Path) -> None:
    import polars as pl

    from sparseety_prof.store import schema
    from sparseety_prof.store.recording_writer import RecordingWriter

    w = RecordingWriter(tmp_path / "rec", {"note": "test"})
    w.append("steps", pl.DataFrame(schema=schema.STEPS))
    cols: dict[str, list[object]] = {"token_id": [1, 2, 3], "seq_id": [0, 0, 0], "t_end_ns": [1, 2, 3]}
    w.append("tokens", schema.frame("tokens", cols, absent=schema.TOKENS.keys() - cols.keys()))
    w.close()
    seg = next((tmp_path / "rec" / "tokens").glob("*.parquet"))
    seg.write_bytes(seg.read_bytes()[: seg.stat().st_size // 2])
    r = run_cli("report", str(tmp_path / "rec"))
    assert r.returncode == CorruptRecording.exit_code
    assert seg.name in r.stderr and "Traceback" not in r.stderr


def test_missing_recording(tmp_path: Path) -> None:
    r = run_cli("report", str(tmp_path / "nothing"))
    assert r.returncode in (UsageError.exit_code, CorruptRecording.exit_code)
    assert "Traceback" not in r.stderr
