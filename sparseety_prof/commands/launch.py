"""`launch -- COMMAND`: start a CUDA engine with the CUPTI injection library."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from sparseety_prof.gpu.launch import add_arguments

    la = sub.add_parser(
        "launch",
        help="start a CUDA engine with the CUPTI injection library (GPU path), to attach to later",
        description="Start `COMMAND` with CUDA_INJECTION64_PATH set to cupti_ext's library: CUPTI cannot "
        "attach to a running process, so GPU kernels are only visible for engines started this way. "
        "Then: sudo sparseety-prof record --pid N -o DIR (the kernels table).",
    )
    add_arguments(la)
    la.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from sparseety_prof.gpu.launch import run as launch

    return launch(args)
