"""Compile the correlator (sparseety_prof/correlate) with mypyc, for the interpreter running this.

    python sparseety_prof/native/compile_correlator.py OUT [--require]

OUT is the compiled tree's root (sparseety_prof/native/build/compiled): its
sparseety_prof/correlate/ gets one extension module per source module and the group's shared
library, and OUT/stamp.json what they were built from (correlate/build_stamp.py, which decides at
import whether they are used). Nothing is done when the stamp already matches the sources, this
interpreter and this mypyc. Run by scripts/setup.sh for a checkout (with --require), by
scripts/install.sh where mypyc is at hand, and by setup.py into a wheel.

Without mypyc or a C compiler and the interpreter's headers, it says so and leaves the correlator
to run as Python (exit 0), unless --require (exit 1). The new tree replaces the old by renames: a
process that has the old modules loaded keeps them intact.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PKG = HERE.parent / "correlate"


# (build_stamp is loaded by its path: importing it through the package would import
# sparseety_prof's own dependencies, which a wheel's build environment does not have)
def _stamp_module():  # type: ignore[no-untyped-def]
    import importlib.util

    spec = importlib.util.spec_from_file_location("_sparseety_build_stamp", PKG / "build_stamp.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _say(msg: str) -> None:
    print(f"[compile_correlator] {msg}", file=sys.stderr)


def compile_to(out: Path) -> str | None:
    """Build the compiled tree into `out`. None when done (or up to date), else why not."""
    bs = _stamp_module()
    try:
        import mypyc  # noqa: F401
        from mypy.version import __version__ as mypy_version
        from mypyc.build import mypycify
        from setuptools import setup
    except ImportError as e:
        return f"mypyc is not importable ({e}): pip install mypy"
    want = bs.make_stamp(PKG, mypy_version)
    try:
        if json.loads((out / bs.STAMP_NAME).read_text()) == want:
            _say(f"{out} is up to date")
            return None
    except (OSError, ValueError):
        pass
    sources = [str(p) for p in bs.source_modules(PKG)]
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="sparseety-mypyc-") as tmp_name:
        tmp = Path(tmp_name)
        staging = Path(tempfile.mkdtemp(prefix=".compiled-", dir=out.parent))
        cwd = Path.cwd()
        said = io.StringIO()
        try:
            # mypy reads its configuration from the working folder: none here, the options below
            os.chdir(tmp)
            # mypy's messages (a few "Treating generator comprehension as list" notes on success)
            # are kept, and shown when it fails
            with contextlib.redirect_stdout(said):
                ext = mypycify(
                    ["--ignore-missing-imports", *sources],
                    group_name=bs.GROUP,
                    target_dir=str(tmp / "c"),
                )
            setup(
                name="sparseety-prof-correlator",
                ext_modules=ext,
                script_args=["-q", "build_ext", "--build-lib", str(staging), "--build-temp", str(tmp / "t")],
            )
        except (SystemExit, Exception) as e:  # (mypyc and distutils exit on an error)
            shutil.rmtree(staging, ignore_errors=True)
            sys.stderr.write(said.getvalue())
            return f"mypyc failed ({type(e).__name__}: {e})"
        finally:
            os.chdir(cwd)
        (staging / bs.STAMP_NAME).write_text(json.dumps(want, indent=1) + "\n")
        old = out.with_name(out.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        if out.exists():
            out.rename(old)
        staging.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    _say(f"compiled {len(sources)} modules into {out}")
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--require", action="store_true", help="fail (exit 1) when it cannot compile")
    a = ap.parse_args()
    why = compile_to(a.out.resolve())
    if why is None:
        return 0
    _say(f"{why}; the correlator runs as Python")
    return 1 if a.require else 0


if __name__ == "__main__":
    sys.exit(main())
