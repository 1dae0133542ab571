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
from sparseety_prof.commands.exit_codes import CUPTI_LIBRARY_MISSING
from sparseety_prof.commands.help_text import command_epilog, description

EXAMPLES = """\
  sparseety-prof build-cupti                 # into the folder `launch` looks in
  sparseety-prof build-cupti /opt/cupti      # elsewhere: then start engines with
                                             # SPARSEETY_CUPTI_LIB=/opt/cupti/libsparseety_cupti.so
"""


def _writable(folder: Path) -> bool:
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    return os.access(existing, os.W_OK)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    bc = sub.add_parser(
        "build-cupti",
        help="build the CUPTI injection library `launch` loads (needs the CUDA 13 headers)",
        description=description((__doc__ or "").split("\n\n")[0]),
        epilog=command_epilog("build-cupti", EXAMPLES),
        formatter_class=argparse.RawDescriptionHelpFormatter,
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
        return CUPTI_LIBRARY_MISSING
    env = {**os.environ, "VENV": os.environ.get("VENV", sys.prefix)}
    rc = subprocess.run(["bash", str(CUPTI_DIR / "build.sh"), str(out)], env=env).returncode
    if rc != 0:  # build.sh's own status (3: no CUDA headers) would read as another code of ours
        print(f"sparseety-prof build-cupti: the build failed (build.sh exited {rc})", file=sys.stderr)
        return CUPTI_LIBRARY_MISSING
    if out != CUPTI_LIBRARY.parent.resolve():
        print(
            f"sparseety-prof build-cupti: `launch` looks in {CUPTI_LIBRARY.parent}: "
            f"set SPARSEETY_CUPTI_LIB={out / CUPTI_LIBRARY.name}",
            file=sys.stderr,
        )
    return 0
