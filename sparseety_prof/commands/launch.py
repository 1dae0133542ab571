"""`launch -- COMMAND`: start a CUDA engine with the CUPTI injection library."""

from __future__ import annotations

import argparse

from sparseety_prof.commands.help_text import command_epilog, description

EXAMPLES = """\
  sparseety-prof launch -- llama-server -m model.gguf -ngl 99     # then: sparseety-prof record -p PID -o rec
  sparseety-prof launch --preset vllm -- vllm serve MODEL              # watch its fused-MoE routing kernels
"""


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from sparseety_prof.gpu.launch import add_arguments

    la = sub.add_parser(
        "launch",
        help="start a CUDA engine with the CUPTI injection library (GPU path), to attach to later",
        description=description(
            """Start COMMAND with CUDA_INJECTION64_PATH set to cupti_ext's library: CUPTI cannot
            attach to a running process, so GPU kernels are only visible for engines started this
            way (or later with --late-attach). Then, as root: sparseety-prof record -p PID -o DIR
            (the kernels table)."""
        ),
        epilog=command_epilog("launch", EXAMPLES),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(la)
    la.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from sparseety_prof.gpu.launch import run as launch

    return launch(args)
