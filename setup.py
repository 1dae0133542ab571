"""The build steps pyproject.toml cannot declare (everything else is there).

- The BPF sources (probes/) and the CUPTI library's sources (cupti_ext/) live at the top of the
  repository; a wheel carries them inside the package, as sparseety_prof/probes/ and
  sparseety_prof/cupti_ext/ (sparseety_prof/capture/resources.py finds either place).
- The native helpers (sparseety_prof/native/*.c, shared libraries loaded with ctypes, not
  extension modules) are compiled by sparseety_prof/native/build.sh into the wheel, or into the
  checkout for an editable install. The wheel is then platform-specific but fits any Python 3.
- The correlator (sparseety_prof/correlate) is compiled by mypyc into the wheel
  (sparseety_prof/native/compile_correlator.py, next to the helpers; the package uses it where
  its stamp matches: correlate/build_stamp.py). Those are extension modules of this interpreter,
  so the wheel is then tagged for it (cp311-cp311-...). Where mypyc cannot compile (no C
  compiler or Python headers), the wheel carries the source only and fits any Python 3 as
  before. A checkout's editable install leaves it to scripts/setup.sh.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_py import build_py
from setuptools.errors import SetupError

HERE = Path(__file__).resolve().parent

# Top-level folders shipped inside the package: folder -> the files it ships (glob patterns).
SHIPPED = {
    "probes": ["*.c", "*.h"],
    # build.sh also builds the test stubs of cupti_ext/tests/, so they come along
    "cupti_ext": ["build.sh", "README.md", "src/*.c", "src/*.h", "tests/*.c", "tests/*.h"],
}


def build_native(out: Path) -> None:
    script = HERE / "sparseety_prof" / "native" / "build.sh"
    try:
        subprocess.run(["bash", str(script), str(out)], check=True, stdout=subprocess.DEVNULL)
    except (OSError, subprocess.CalledProcessError) as e:
        raise SetupError(
            f"sparseety-prof: building the native helpers failed ({script}: {e}). They need a C "
            "compiler and the C library headers: apt-get install gcc libc6-dev (or set CC)"
        ) from None


class BuildPy(build_py):
    def run(self) -> None:
        super().run()
        if self.editable_mode:  # a checkout: sources stay at the top, the helpers build in place
            build_native(HERE / "sparseety_prof" / "native" / "build")
            return
        pkg = Path(self.build_lib) / "sparseety_prof"
        for folder, patterns in SHIPPED.items():
            files = [src for pattern in patterns for src in sorted((HERE / folder).glob(pattern))]
            if not files:  # an sdist made without MANIFEST.in: the wheel would not work
                raise SetupError(f"sparseety-prof: {HERE / folder} is missing from the source tree")
            for src in files:
                dst = pkg / folder / src.relative_to(HERE / folder)
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dst)
        build_native(pkg / "native" / "build")
        compile_correlator(pkg / "native")


# whether this build compiled the correlator (BuildPy, then PlatformWheel in the same process)
_compiled = False


def compile_correlator(native: Path) -> None:
    global _compiled
    script = HERE / "sparseety_prof" / "native" / "compile_correlator.py"
    shutil.copy2(script, native / script.name)  # (shipped: an installed package can rebuild it)
    out = native / "build" / "compiled"
    # not --require: without mypyc's needs the wheel carries the source (the script says why)
    subprocess.run([sys.executable, str(script), str(out)], check=True)
    _compiled = (out / "stamp.json").is_file()


class WithSharedLibraries(Distribution):
    """Platform-specific (installed into platlib, a platform wheel) without extension modules."""

    def has_ext_modules(self) -> bool:
        return True


class PlatformWheel(bdist_wheel):
    """Tied to the platform by the helpers, but to no Python ABI (they do not link libpython),
    unless the correlator was compiled: its modules are this interpreter's extension modules."""

    def get_tag(self) -> tuple[str, str, str]:
        tag = super().get_tag()
        return tag if _compiled else ("py3", "none", tag[2])


setup(distclass=WithSharedLibraries, cmdclass={"build_py": BuildPy, "bdist_wheel": PlatformWheel})
