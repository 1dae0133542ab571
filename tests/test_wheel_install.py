"""The package as a user installs it: `python -m build` makes the sdist and, from the unpacked sdist,
the wheel (as pip and pipx do with an sdist); the wheel goes into a fresh venv of Debian's python3
made with --system-site-packages (that is where BCC comes from), and the installed `sparseety-prof`
records a real engine from a temporary directory, with no checkout on the path.

The build and the venv are made once per session (13-20 s each here: both fetch packages from the
configured index, setuptools for the build and numpy/polars/rich/gguf for the venv)."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import sysconfig
import tarfile
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
from conftest import PY, ROOT, Engine

import sparseety_prof
from sparseety_prof.commands.exit_codes import DOCTOR_FAILED

# The interpreter BCC belongs to: Debian's python3-bpfcc installs into its dist-packages.
DEBIAN_PYTHON = os.environ.get("SPARSEETY_BCC_PYTHON", "/usr/bin/python3")


def _env(**extra: str) -> dict[str, str]:
    """This environment without anything that would put the checkout or another venv on the path."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    return {**env, **extra}


def _run(cmd: list[str], cwd: Path, timeout: float = 600, **env: str) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(cmd, cwd=cwd, env=_env(**env), capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{shlex.join(cmd)} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}"
    return r


@pytest.fixture(scope="session")
def dist(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """{"sdist": ..., "wheel": ...}, built by the PyPA `build` front end in its isolated envs."""
    d = tmp_path_factory.mktemp("dist")
    _run([PY, "-m", "pip", "install", "-q", "--target", str(d / "tools"), "build"], cwd=d)
    _run([PY, "-m", "build", "--outdir", str(d / "out"), str(ROOT)], cwd=d, PYTHONPATH=str(d / "tools"))
    (sdist,) = (d / "out").glob("*.tar.gz")
    (wheel,) = (d / "out").glob("*.whl")
    return {"sdist": sdist, "wheel": wheel}


@pytest.fixture(scope="session")
def venv(dist: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv of Debian's python3 (--system-site-packages) with the wheel installed."""
    r = subprocess.run([DEBIAN_PYTHON, "-c", "import bcc"], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.fail(f"{DEBIAN_PYTHON} cannot import bcc (run scripts/setup.sh): {r.stderr}")
    return _install(dist["wheel"], tmp_path_factory.mktemp("venv"), "--system-site-packages")


def _install(wheel: Path, venv: Path, *venv_args: str) -> Path:
    """`venv` made by Debian's python3 with the wheel and its dependencies installed."""
    # --without-pip: no ensurepip needed (python3-venv); this pip installs into it with --python
    _run([DEBIAN_PYTHON, "-m", "venv", *venv_args, "--without-pip", str(venv)], cwd=venv.parent)
    _run([PY, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q", str(wheel)], cwd=venv)
    return venv


def test_sdist_ships_every_source_a_wheel_is_built_from(dist: dict[str, Path]) -> None:
    with tarfile.open(dist["sdist"]) as t:
        names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    want = {
        "setup.py",
        "MANIFEST.in",
        "pyproject.toml",
        "sparseety_prof/native/build.sh",
        "sparseety_prof/native/rowstats.c",
        "sparseety_prof/native/ringwalk.c",
        "cupti_ext/build.sh",
        *(str(p.relative_to(ROOT)) for p in (ROOT / "probes").glob("*.[ch]")),
        *(str(p.relative_to(ROOT)) for p in (ROOT / "cupti_ext").glob("src/*.[ch]")),
        *(str(p.relative_to(ROOT)) for p in (ROOT / "cupti_ext").glob("tests/*.[ch]")),
        *(str(p.relative_to(ROOT)) for p in (ROOT / "sparseety_prof").rglob("*.py")),
    }
    assert len([n for n in want if n.startswith("probes/")]) >= 5
    assert not want - names, sorted(want - names)
    assert not [n for n in names if n.endswith(".so") or "/build/" in n], "build outputs in the sdist"


def test_wheel_holds_every_subpackage_the_probes_and_the_built_helpers(dist: dict[str, Path]) -> None:
    # the correlator compiled by mypyc: extension modules of the interpreter that built the wheel
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    assert dist["wheel"].name.startswith(f"sparseety_prof-{sparseety_prof.__version__}-{tag}-{tag}-linux_")
    with zipfile.ZipFile(dist["wheel"]) as z:
        names = set(z.namelist())
    compiled = "sparseety_prof/native/build/compiled/"
    assert compiled + "stamp.json" in names
    ext = sysconfig.get_config_var("EXT_SUFFIX")
    built = {n for n in names if n.startswith(compiled + "sparseety_prof/correlate/") and n.endswith(ext)}
    sources = [p for p in (ROOT / "sparseety_prof" / "correlate").glob("*.py")]
    # one module per source but __init__ and build_stamp, and the group's shared library
    assert len(built) == len(sources) - 2 + 1, sorted(built)
    modules = {str(p.relative_to(ROOT)) for p in (ROOT / "sparseety_prof").rglob("*.py")}
    probes = {f"sparseety_prof/{p.relative_to(ROOT)}" for p in (ROOT / "probes").glob("*.[ch]")}
    cupti = {f"sparseety_prof/{p.relative_to(ROOT)}" for p in (ROOT / "cupti_ext").glob("*/*.[ch]")}
    libs = ("librowstats.so", "libringwalk.so", "libringwatch.so")
    native = {f"sparseety_prof/native/build/{n}" for n in libs}
    want = modules | probes | cupti | native | {"sparseety_prof/cupti_ext/build.sh"}
    assert not want - names, sorted(want - names)


def _where(venv: Path, cwd: Path) -> dict[str, str]:
    """Where the installed package finds its parts, asked from outside any checkout."""
    code = """if True:
        import json, os, bcc, sparseety_prof
        from sparseety_prof.capture import bpf_loader, resources
        from sparseety_prof.correlate import build_stamp, correlator, logits
        from sparseety_prof.gpu.launch import library_path
        print(json.dumps({"package": sparseety_prof.__file__, "bcc": os.path.realpath(bcc.__file__),
            "probes": str(resources.PROBES_DIR), "cupti": str(library_path()),
            "rowstats": logits.BACKEND, "ringwalk": bpf_loader._ring_walk is not None,
            "correlator": build_stamp.STATE, "correlator_file": correlator.__file__}))
    """
    return dict(json.loads(_run([str(venv / "bin" / "python"), "-c", code], cwd=cwd).stdout))


@pytest.mark.root
@pytest.mark.engine
def test_installed_tool_records_a_running_engine(venv: Path, llama_engine: Engine, tmp_path: Path) -> None:
    where = _where(venv, tmp_path)
    site = str(venv / "lib")
    assert where["package"].startswith(site) and where["probes"].startswith(site), where
    assert where["cupti"].startswith(site) and where["bcc"].startswith("/usr/lib/python3/"), where
    assert where["rowstats"] == "c" and where["ringwalk"], "the native helpers were not built"
    # the wheel's compiled correlator runs under Debian's python3 (another 3.11 than the build's)
    assert where["correlator"] == "compiled" and where["correlator_file"].startswith(site), where

    cmd = [str(venv / "bin" / "sparseety-prof"), "record", "--pid", str(llama_engine.pid), "-o", "rec"]
    rec = subprocess.Popen(cmd, cwd=tmp_path, env=_env(), stderr=subprocess.PIPE, text=True)
    assert rec.stderr is not None
    deadline = time.monotonic() + 60
    seen = ""
    while "attached to PID" not in seen and time.monotonic() < deadline and rec.poll() is None:
        seen += rec.stderr.readline()
    try:
        assert "attached to PID" in seen, f"the installed recorder did not attach: {seen}"
        truth = llama_engine.generate(["hello the expert router", "one two three"], max_tokens=24)
    finally:
        rec.send_signal(signal.SIGINT)
        _, err = rec.communicate(timeout=60)
    assert rec.returncode == 0, seen + err
    r = sparseety_prof.open(tmp_path / "rec")
    tokens = r.tokens().sort("t_end_ns")
    assert r.complete and tokens.height == sum(len(t["ids"]) for t in truth) == 48
    assert sorted(tokens["token_id"].to_list()) == sorted(i for t in truth for i in t["ids"])
    want = np.sort(np.concatenate([t["log_probs"] for t in truth]))
    assert np.abs(np.sort(tokens["log_prob"].to_numpy()) - want).max() < 1e-3
    assert json.loads((tmp_path / "rec" / "meta.json").read_text())["correlator"] == {"build": "compiled"}


@pytest.mark.root
@pytest.mark.engine
def test_without_bcc_the_tool_says_the_command_that_fixes_it(
    dist: dict[str, Path], llama_engine: Engine, tmp_path: Path
) -> None:
    """Installed into a venv made without --system-site-packages, which cannot see Debian's bcc:
    every attaching command exits 8 with one command, and that command makes bcc importable."""
    bare = _install(dist["wheel"], tmp_path / "bare")
    purelib = _run(
        [str(bare / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        cwd=tmp_path,
    ).stdout.strip()
    cli = [str(bare / "bin" / "sparseety-prof")]
    pid = str(llama_engine.pid)
    fixes = set()
    for args in (["record", "--pid", pid, "-o", "rec"], ["attach", "--pid", pid], ["check", "--pid", pid]):
        r = subprocess.run(
            [*cli, *args], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120
        )
        assert r.returncode == 8, (args, r.stderr)
        assert "bcc" in r.stderr and "to make it importable run: " in r.stderr, r.stderr
        fixes.add(r.stderr.split("to make it importable run: ", 1)[1].split("   (", 1)[0].strip())
    (fix,) = fixes
    assert fix == f"ln -sfn /usr/lib/python3/dist-packages/bcc {purelib}/bcc"
    doctor = subprocess.run(
        [*cli, "doctor"], cwd=tmp_path, env=_env(COLUMNS="400"), capture_output=True, text=True
    )
    assert doctor.returncode == DOCTOR_FAILED and fix in doctor.stdout, doctor.stdout

    subprocess.run(fix, shell=True, check=True)
    assert _where(bare, tmp_path)["bcc"].startswith("/usr/lib/python3/dist-packages/bcc")


@pytest.mark.root  # the venv is the one with BCC
def test_build_cupti_command_builds_where_launch_looks(venv: Path, tmp_path: Path) -> None:
    """`sparseety-prof build-cupti` from the installed package (CUDA 13 headers from the toolkit or
    the nvidia-cuda-* wheels of the test interpreter's environment, as cupti_ext/build.sh finds them)."""
    r = subprocess.run(
        [str(venv / "bin" / "sparseety-prof"), "build-cupti"],
        cwd=tmp_path,
        env=_env(VENV=sys.prefix),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    lib = Path(_where(venv, tmp_path)["cupti"])
    assert lib.is_file() and r.stdout.strip().endswith(str(lib))
