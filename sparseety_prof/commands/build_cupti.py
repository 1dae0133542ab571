"""`build-cupti [OUTDIR]`: build the CUPTI injection library that `launch` loads into
CUDA engines, from the sources the package ships (cupti_ext/), into the folder `launch` looks in.

The library is not built at install time: it needs the CUDA 13 headers, which most machines
that only profile CPU engines lack. cupti_ext/build.sh says where it looks for them (here, VENV
defaults to the running environment, so the header wheels nvidia-cuda-* installed next to the
profiler are found) and exits 3 when there are none."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from sparseety_prof.capture.resources import CUPTI_DIR, CUPTI_LIBRARY


def _writable(folder: Path) -> bool:
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    return os.access(existing, os.W_OK)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    bc = sub.add_parser(
        "build-cupti",
        help="build the CUPTI injection library `launch` loads (needs the CUDA 13 headers)",
        description=(__doc__ or "").split("\n\n")[0],
    )
    bc.add_argument(
        "outdir", nargs="?", type=Path, default=CUPTI_LIBRARY.parent, help=f"default: {CUPTI_LIBRARY.parent}"
    )
    bc.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    out: Path = args.outdir.resolve()
    if not _writable(out):
        print(
            f"sparseety-prof build-cupti: {out} is not writable: run it as the owner of this installation, "
            "or give another OUTDIR and start engines with SPARSEETY_CUPTI_LIB=OUTDIR/libsparseety_cupti.so",
            file=sys.stderr,
        )
        return 1
    env = {**os.environ, "VENV": os.environ.get("VENV", sys.prefix)}
    rc = subprocess.run(["bash", str(CUPTI_DIR / "build.sh"), str(out)], env=env).returncode
    if rc == 0 and out != CUPTI_LIBRARY.parent.resolve():
        print(
            f"sparseety-prof build-cupti: `launch` looks in {CUPTI_LIBRARY.parent}: "
            f"set SPARSEETY_CUPTI_LIB={out / CUPTI_LIBRARY.name}",
            file=sys.stderr,
        )
    return rc
