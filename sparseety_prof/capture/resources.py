"""Where the package's own files are, the same code for an installed wheel and for a checkout.

A wheel carries the BPF sources and the CUPTI library's sources inside the package
(sparseety_prof/probes/, sparseety_prof/cupti_ext/: setup.py copies them there); a checkout, and
so an editable install, keeps them at the top of the repository. The native helpers are built
into sparseety_prof/native/build/ in both (by setup.py at install time, or by
sparseety_prof/native/build.sh). Standard library only: logits.py and gpu/launch.py import it too.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["CUPTI_DIR", "CUPTI_LIBRARY", "NATIVE_BUILD_DIR", "PACKAGE_DIR", "PROBES_DIR", "native_library"]

PACKAGE_DIR = Path(__file__).resolve().parents[1]


def _shipped(name: str) -> Path:
    """The folder `name` inside the package (an installed wheel), else at the repository root."""
    inside = PACKAGE_DIR / name
    return inside if inside.is_dir() else PACKAGE_DIR.parent / name


PROBES_DIR = _shipped("probes")  # *.bpf.c and events.h
CUPTI_DIR = _shipped("cupti_ext")  # build.sh, src/, tests/ (the stubs build.sh also builds)
CUPTI_LIBRARY = CUPTI_DIR / "build" / "libsparseety_cupti.so"  # where `cupti_ext/build.sh` puts it
NATIVE_BUILD_DIR = PACKAGE_DIR / "native" / "build"


def native_library(name: str) -> Path:
    """A helper library of sparseety_prof/native (librowstats.so, libringwalk.so,
    libringwatch.so): loaded with ctypes, and optional to its callers, which fall back to numpy or
    Python without it."""
    return NATIVE_BUILD_DIR / name
