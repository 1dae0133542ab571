"""Each doctor check, passing on this machine and failing when the thing it checks is broken."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ENGINES, ROOT, Engine, MappingProcess, run_cli, run_cli_without_capabilities

from sparseety_prof.capture import preflight
from sparseety_prof.commands.exit_codes import DOCTOR_FAILED


@pytest.mark.root
def test_all_checks_pass_here() -> None:
    r = run_cli("doctor")
    assert r.returncode == 0, r.stdout + r.stderr
    for name in ("privileges", "bcc", "kernel headers", "tracefs", "BPF load"):
        assert name in r.stdout


@pytest.mark.root
def test_privileges_and_bpf_load_fail_without_capabilities() -> None:
    r = run_cli_without_capabilities("doctor")
    assert r.returncode == DOCTOR_FAILED
    lines = {line.split("│")[1].strip(): line for line in r.stdout.splitlines() if line.count("│") >= 4}
    assert "FAIL" in lines["privileges"] and "FAIL" in lines["BPF load"]
    assert "privileges" in r.stderr


def test_bcc_check_fails_when_bcc_is_not_importable(tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['bcc'] = None\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}:{ROOT}"}
    code = "from sparseety_prof.capture import preflight; c = preflight.check_bcc(); print(c.ok, c.fix)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert r.stdout.startswith("False") and "python3-bpfcc" in r.stdout


def test_kernel_headers_check(tmp_path: Path) -> None:
    c = preflight.check_kernel_headers(tmp_path, "9.9.9-test")
    assert not c.ok and "linux-headers" in c.fix and "9.9.9-test" in c.fix
    good = tmp_path / "9.9.9-test" / "build" / "include" / "generated"
    good.mkdir(parents=True)
    (good / "autoconf.h").write_text("")
    assert preflight.check_kernel_headers(tmp_path, "9.9.9-test").ok


def test_tracefs_check(tmp_path: Path) -> None:
    c = preflight.check_tracefs(tmp_path)
    assert not c.ok and "mount -t tracefs" in c.fix
    (tmp_path / "uprobe_events").write_text("")
    assert preflight.check_tracefs(tmp_path).ok


def test_process_check_with_a_wrong_pid() -> None:
    p = subprocess.Popen(["true"])
    p.wait()
    checks = preflight.check_engine(p.pid)
    assert [c.name for c in checks] == ["process"] and not checks[0].ok


@pytest.mark.root
def test_engine_checks_fail_on_a_process_that_is_not_an_engine() -> None:
    p = subprocess.Popen(["sleep", "30"])
    try:
        checks = {c.name: c for c in preflight.check_engine(p.pid)}
    finally:
        p.kill()
        p.wait()
    assert checks["process"].ok and not checks["engine library"].ok


@pytest.mark.root
@pytest.mark.engine
def test_engine_checks_name_the_build_from_its_binary_and_the_capture_layers(
    models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    e = Engine([str(ENGINES / "llama_engine.py"), str(models["moe"])])
    try:
        good = {c.name: c for c in preflight.check_engine(e.pid)}
    finally:
        e.close()
    assert all(c.ok for c in good.values()), good
    assert (
        "ggml 0.25.3" in good["engine build"].detail
        and "llama-cpp-python 0.3.36" in good["engine build"].detail
    )
    assert good["layer: tokens"].ok and "degraded" in good["layer: server requests"].detail
    import llama_cpp

    # the same libraries outside any package: still identified, from the binary alone
    libdir = tmp_path / "lib"
    shutil.copytree(Path(llama_cpp.__file__).parent / "lib", libdir)
    monkeypatch.setenv("LLAMA_CPP_LIB_PATH", str(libdir))
    e = Engine([str(ENGINES / "llama_engine.py"), str(models["moe"])])
    try:
        moved = {c.name: c for c in preflight.check_engine(e.pid)}
    finally:
        e.close()
    assert moved["engine build"].ok and "ggml 0.25.3" in moved["engine build"].detail
    assert "llama-cpp-python" not in moved["engine build"].detail


@pytest.mark.root
@pytest.mark.engine
def test_model_check_fails_when_no_model_file_is_open(models: dict[str, Path], tmp_path: Path) -> None:
    copy = tmp_path / "gone.gguf"
    shutil.copy(models["moe"], copy)
    e = Engine([str(ENGINES / "llama_engine.py"), str(copy)])
    copy.unlink()  # still mapped by the engine, but no longer a file anyone can open
    try:
        checks = {c.name: c for c in preflight.check_engine(e.pid)}
    finally:
        e.close()
    assert not checks["model file"].ok and "--model" in checks["model file"].fix


# ---------------------------------------------------------------- doctor --gpu


def test_gpu_injection_library_check(tmp_path: Path) -> None:
    from sparseety_prof.gpu import diagnose
    from sparseety_prof.gpu.launch import library_path

    assert diagnose.check_injection_library().ok, "scripts/setup.sh builds cupti_ext"
    assert diagnose.check_injection_library(library_path()).ok
    missing = diagnose.check_injection_library(tmp_path / "nope.so")
    assert not missing.ok and "sparseety-prof build-cupti" in missing.fix
    garbage = tmp_path / "garbage.so"
    garbage.write_bytes(b"not an ELF file at all")
    assert not diagnose.check_injection_library(garbage).ok
    other = diagnose.check_injection_library(Path(shutil.which("true") or "/bin/true"))
    assert not other.ok and "InitializeInjection" in other.detail


def test_gpu_libcupti_check(tmp_path: Path) -> None:
    from sparseety_prof.gpu import diagnose

    assert not diagnose.check_libcupti(None, search=False).ok
    assert diagnose.check_libcupti(tmp_path / "libcupti.so.13").ok


def test_gpu_cupti_python_and_driver_checks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from sparseety_prof.gpu import diagnose

    absent = diagnose.check_cupti_python("sparseety_no_such_module")
    assert not absent.ok and "pip install cupti-python" in absent.fix
    pkg = tmp_path / "fakecupti"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        "__version__ = '13.4.0'\nimport os\n"
        "class cupti:\n    @staticmethod\n    def get_timestamp():\n"
        "        if os.environ.get('FAKE_NO_DRIVER'):\n"
        "            raise RuntimeError('CUDA driver is not found')\n"
        "        return 1\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert diagnose.check_cupti_python("fakecupti").detail == "cupti-python 13.4.0"
    assert diagnose.check_cuda_driver("fakecupti").ok
    monkeypatch.setenv("FAKE_NO_DRIVER", "1")
    no_driver = diagnose.check_cuda_driver("fakecupti")
    assert not no_driver.ok and "driver is not found" in no_driver.detail
    # without cupti-python: the kernel driver's /proc entry decides
    assert not diagnose.check_cuda_driver("sparseety_no_such_module", tmp_path / "no-driver").ok
    assert diagnose.check_cuda_driver("sparseety_no_such_module", tmp_path).ok


def test_gpu_ring_check(tmp_path: Path) -> None:
    from sparseety_prof.gpu import diagnose
    from sparseety_prof.gpu.shm_ring import SHM_PREFIX

    p = subprocess.Popen(["sleep", "30"])
    try:
        none = diagnose.check_rings(p.pid)
        assert not none.ok and "sparseety-prof launch" in none.fix
    finally:
        p.kill()
        p.wait()
    (tmp_path / "blank").write_bytes(b"\0" * 8192)  # a ring that was never initialised
    engine = MappingProcess(Path("/dev/shm") / f"{SHM_PREFIX}{{pid}}", copy_from=tmp_path / "blank")
    try:
        bad = diagnose.check_rings(engine.pid)
        assert not bad.ok and "magic" in bad.detail
    finally:
        engine.close()


# ---------------------------------------------------------------- --json


def test_doctor_json_parses_and_its_counts_are_the_checks_run() -> None:
    import json

    r = run_cli("doctor", "--json")
    assert r.returncode in (0, DOCTOR_FAILED), r.stderr
    got = json.loads(r.stdout)
    names = [c().name for c in preflight.SYSTEM_CHECKS] + [c.name for c in preflight.check_capabilities()]
    assert [c["name"] for c in got["checks"]] == names
    assert got["capabilities"]["uid"] == os.getuid()
    failed = [c["name"] for c in got["checks"] if not c["ok"]]
    assert (got["passed"], got["failed"]) == (len(names) - len(failed), len(failed))
    assert got["ok"] is (not failed) is (r.returncode == 0)
    assert all(set(c) == {"name", "ok", "detail", "fix"} for c in got["checks"])


def test_check_json_has_the_shape_of_doctor_json() -> None:
    from sparseety_prof.checks import Check
    from sparseety_prof.commands.check import check_json
    from sparseety_prof.commands.doctor import checks_json
    from sparseety_prof.session.request_check import LayerResult

    results = [
        LayerResult("server request", True, "seen"),
        LayerResult("slot", False, "no slot took it"),
        LayerResult("tokens", False, "no tokens"),
    ]
    got = check_json(42, "sparseety-check-1", results)
    assert (got["ok"], got["passed"], got["failed"], got["lost_at"]) == (False, 1, 2, "slot")
    assert (got["pid"], got["request_id"]) == (42, "sparseety-check-1")
    assert [c["name"] for c in got["checks"]] == ["server request", "slot", "tokens"]
    doc = checks_json([Check("a", True, "fine"), Check("b", False, "broken", "fix it")])
    assert (doc["ok"], doc["passed"], doc["failed"]) == (False, 1, 1)
    shared = {"command", "ok", "passed", "failed", "checks"}
    assert shared <= set(got) and shared <= set(doc)
    assert {"name", "ok", "detail"} <= set(got["checks"][0]) & set(doc["checks"][0])
