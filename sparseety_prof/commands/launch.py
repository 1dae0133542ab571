"""`launch -- COMMAND`: start a CUDA engine with the CUPTI injection library."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from sparseety_prof.commands.help_text import command_epilog, description
from sparseety_prof.errors import UsageError

EXAMPLES = """\
  sparseety-prof launch -- llama-server -m model.gguf -ngl 99     # then: sparseety-prof record -p PID -o rec
  sparseety-prof launch --preset vllm -- vllm serve MODEL              # watch its fused-MoE routing kernels
  sparseety-prof launch --preset llamacpp -- llama-server -m moe.gguf -ngl 99   # its ggml-cuda's routing
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
    from sparseety_prof.gpu.launch import launch

    opts = options_from(args)
    return launch(opts.command, **opts.settings)


@dataclass(frozen=True)
class LaunchOptions:
    """What `launch` is asked to do: the engine's command, and build_env's settings."""

    command: list[str]
    settings: dict[str, Any]


def options_from(args: argparse.Namespace) -> LaunchOptions:
    """LaunchOptions from the flags add_arguments (gpu/launch.py) set up; UsageError for a
    --watch or --preset that cannot work."""
    from sparseety_prof.gpu.launch import SETTINGS
    from sparseety_prof.gpu.llamacpp_kernels import engine_files
    from sparseety_prof.gpu.presets import watch_spec
    from sparseety_prof.gpu.watch_rules import WatchSpecError

    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    settings = {name: getattr(args, name) for name in SETTINGS}
    # the llamacpp preset is read from the engine's own kernels (UnsupportedEngineBuild, exit 6,
    # for a kernel layout it does not know)
    files = engine_files(command) if "llamacpp" in (args.preset or []) else []
    try:
        settings["watch"] = watch_spec(args.watch, args.preset, files)
    except WatchSpecError as e:
        raise UsageError(f"--watch/--preset: {e}") from None
    return LaunchOptions(command, settings)
