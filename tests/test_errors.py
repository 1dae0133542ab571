"""Each failure class has its own message and exit code (documented in docs/exit-codes.md)."""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

import pytest
from conftest import ENGINES, ROOT, Engine, run_cli, run_cli_without_capabilities

from sparseety_prof import cli
from sparseety_prof.cli import build_parser
from sparseety_prof.commands.exit_codes import EXIT_CODES, EXIT_CODES_HELP, INTERRUPTED, markdown_table
from sparseety_prof.errors import (
    INTERNAL_ERROR,
    BpfUnavailable,
    CorruptRecording,
    InjectionRefused,
    MetricsEndpointError,
    MissingPrivileges,
    ModelFileError,
    NoSuchProcess,
    NotAnEngine,
    ProfError,
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


def _profile_errors() -> list[type[ProfError]]:
    found: list[type[ProfError]] = []
    todo = [ProfError]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo += cls.__subclasses__()
    return found


def test_one_meaning_per_exit_code_in_one_table() -> None:
    """commands/exit_codes.py lists every code once; every error class's code is in it; the
    top-level --help and docs/exit-codes.md show that table, 130 included."""
    codes = [c.code for c in EXIT_CODES]
    assert len(set(codes)) == len(codes)
    assert {c.exit_code for c in _profile_errors()} <= set(codes)
    assert {0, 1, 2, 70, 130} <= set(codes)
    for c in EXIT_CODES:
        assert f"{c.code:>3} {c.label()}\n" in EXIT_CODES_HELP
    assert markdown_table() in (ROOT / "docs" / "exit-codes.md").read_text()
    assert EXIT_CODES_HELP in build_parser().format_help()


def test_no_module_raises_the_unclassified_base_error() -> None:
    """A ProfError raised as such would exit as an internal error: every failure has its class."""
    bare = []
    for path in sorted((ROOT / "sparseety_prof").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
                func = node.exc.func
                if isinstance(func, ast.Name) and func.id == "ProfError":
                    bare.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not bare


def test_an_unexpected_exception_and_ctrl_c_have_their_own_codes(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from sparseety_prof.commands import report

    def boom(_args: object) -> int:
        raise RuntimeError("planted bug")

    def interrupted(_args: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(report, "run", boom)
    assert cli.main(["report", str(tmp_path)]) == INTERNAL_ERROR == 70
    err = capsys.readouterr().err
    assert "Traceback" in err and "planted bug" in err and "internal error" in err
    monkeypatch.setattr(report, "run", interrupted)
    assert cli.main(["report", str(tmp_path)]) == INTERRUPTED == 130


def test_a_model_file_that_is_not_gguf_has_its_own_code(tmp_path: Path) -> None:
    from sparseety_prof.capture.gguf_info import read_model_info

    bad = tmp_path / "not.gguf"
    bad.write_bytes(b"this is not a model file at all" * 4)
    with pytest.raises(ModelFileError) as e:
        read_model_info(bad, with_sha256=False)
    assert e.value.exit_code == 17


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
def test_the_optional_programs_compile_only_once_the_target_is_an_engine(llama_engine: Engine) -> None:
    """The recorder compiles the CPU sampler and the scheduler program in attach's before_probes:
    a process that is no engine is refused before it runs, an engine runs it once."""
    from sparseety_prof.session.attach import attach
    from sparseety_prof.session.options import Options

    calls: list[int] = []
    p = subprocess.Popen(["sleep", "60"])
    try:
        with pytest.raises(NotAnEngine):
            attach(
                Options(pid=p.pid, out=None), log=lambda _s: None, before_probes=lambda: calls.append(p.pid)
            )
    finally:
        p.kill()
        p.wait()
    assert calls == []
    a = attach(
        Options(pid=llama_engine.pid, out=None),
        log=lambda _s: None,
        before_probes=lambda: calls.append(llama_engine.pid),
    )
    try:
        assert calls == [llama_engine.pid]
    finally:
        a.session.close()
        a.model_file.close()


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
