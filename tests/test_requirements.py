"""The pinned requirement files of the two set-ups: scripts/requirements.txt (what running needs,
installed by scripts/install.sh) pins exactly the package's runtime dependencies (pyproject.toml)
plus the demo's engine, each within the range pyproject.toml declares; scripts/requirements-dev.txt
(scripts/setup.sh) includes it and pins everything else."""

from __future__ import annotations

import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"
#: what scripts/requirements.txt adds to the package's dependencies: the demo's engine
DEMO_ENGINE = "xllamacpp"


def _lines(path: Path) -> list[str]:
    return [ln.strip() for ln in path.read_text().splitlines() if ln.strip() and not ln.startswith("#")]


def _pins(lines: list[str]) -> dict[str, Requirement]:
    pins: dict[str, Requirement] = {}
    for line in lines:
        req = Requirement(line)
        spec = list(req.specifier)
        assert len(spec) == 1 and spec[0].operator == "==", f"not pinned to one version: {line}"
        name = canonicalize_name(req.name)
        assert name not in pins, f"{name} pinned twice"
        pins[name] = req
    return pins


def _declared() -> dict[str, Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(d) for d in project["dependencies"]]
    return {canonicalize_name(r.name): r for r in reqs}


def test_runtime_file_pins_the_package_dependencies_and_the_demo_engine() -> None:
    pins = _pins(_lines(SCRIPTS / "requirements.txt"))
    declared = _declared()
    assert set(pins) == set(declared) | {DEMO_ENGINE}
    for name, want in declared.items():
        version = next(iter(pins[name].specifier)).version
        assert want.specifier.contains(version), f"{name}=={version} is outside pyproject's {want}"


def test_dev_file_includes_the_runtime_file_and_pins_the_rest() -> None:
    lines = _lines(SCRIPTS / "requirements-dev.txt")
    assert lines[0] == "-r requirements.txt"
    dev = _pins(lines[1:])
    runtime = _pins(_lines(SCRIPTS / "requirements.txt"))
    assert not set(dev) & set(runtime), "a runtime package pinned again in the dev file"
    # what the test set-up builds from source and compiles with is pinned here
    assert {"llama-cpp-python", "pytest", "mypy", "ruff"} <= set(dev)
    # the build backend's mypy (pyproject.toml [build-system]) is the one the dev file pins
    build = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
    mypy = [Requirement(r) for r in build if canonicalize_name(Requirement(r).name) == "mypy"]
    assert len(mypy) == 1 and str(mypy[0].specifier) == str(dev["mypy"].specifier)
