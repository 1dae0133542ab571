"""`sparseety-prof launch [options] -- <engine command>`: start an engine with the CUPTI injection
library, so that `sparseety-prof attach --pid N` can later drain its GPU ring.

CUPTI has no attach-by-PID: the library is named in CUDA_INJECTION64_PATH when the engine starts
(child processes such as vLLM/SGLang workers inherit it), or loaded into a running process with
ptrace by `--late-attach` (gpu/late_attach.py). Standard library only. Failures are the
project's errors (errors.py), which cli.main turns into their message and exit code.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import sysconfig
from pathlib import Path
from types import FrameType
from typing import Any

from sparseety_prof.capture.resources import CUPTI_LIBRARY
from sparseety_prof.errors import CommandNotStarted, CuptiLibraryMissing, UsageError
from sparseety_prof.gpu.presets import PRESETS

__all__ = ["add_arguments", "build_env", "find_libcupti", "launch", "library_path"]


def library_path() -> Path:
    """The built injection library (`SPARSEETY_CUPTI_LIB` overrides `cupti_ext/build/`)."""
    env = os.environ.get("SPARSEETY_CUPTI_LIB")
    return Path(env) if env else CUPTI_LIBRARY


def find_libcupti() -> Path | None:
    """libcupti.so.13 from the nvidia-cuda-cupti wheel or a CUDA toolkit, or None (then the
    library tries the soname on the loader's path)."""
    purelib = Path(sysconfig.get_paths()["purelib"])
    candidates = [
        *sorted(purelib.glob("nvidia/*/lib/libcupti.so.13")),
        *sorted(purelib.glob("nvidia/*/*/lib/libcupti.so.13")),
        Path("/usr/local/cuda/lib64/libcupti.so.13"),
        Path("/usr/local/cuda/extras/CUPTI/lib64/libcupti.so.13"),
    ]
    return next((p for p in candidates if p.exists()), None)


def build_env(
    base: dict[str, str],
    library: Path,
    *,
    watch: str | None = None,
    watch_file: str | None = None,
    sample_every: int | None = None,
    buffer_bytes_per_s: int | None = None,
    ring_bytes: int | None = None,
    staging_bytes: int | None = None,
    flush_ms: int | None = None,
) -> dict[str, str]:
    """The engine's environment: `base` plus CUDA_INJECTION64_PATH and the SPARSEETY_* settings."""
    env = dict(base)
    env["CUDA_INJECTION64_PATH"] = str(library.resolve())
    if "SPARSEETY_CUPTI_PATH" not in env and (cupti := find_libcupti()) is not None:
        env["SPARSEETY_CUPTI_PATH"] = str(cupti)
    settings = {
        "SPARSEETY_WATCH": watch,
        "SPARSEETY_WATCH_FILE": str(Path(watch_file).resolve()) if watch_file else None,
        "SPARSEETY_SAMPLE_EVERY": sample_every,
        "SPARSEETY_BUFFER_BYTES_PER_S": buffer_bytes_per_s,
        "SPARSEETY_RING_BYTES": ring_bytes,
        "SPARSEETY_STAGING_BYTES": staging_bytes,
        "SPARSEETY_FLUSH_MS": flush_ms,
    }
    env.update({k: str(v) for k, v in settings.items() if v is not None})
    return env


#: build_env's settings, as `launch`'s options read them from its flags (commands/launch.py)
SETTINGS = (
    "watch",
    "watch_file",
    "sample_every",
    "buffer_bytes_per_s",
    "ring_bytes",
    "staging_bytes",
    "flush_ms",
)


def launch(argv: list[str], *, library: Path | None = None, **settings: Any) -> int:
    """Run `argv` with the injection library and return its exit code (128 + N when killed by
    signal N). SIGINT and SIGTERM are forwarded to it. `settings`: build_env's keywords.
    UsageError without a command or with a watch file that is not there, CuptiLibraryMissing
    without the library, CommandNotStarted when the command cannot be started."""
    if not argv:
        raise UsageError("launch: no command given (usage: launch [options] -- <command>)")
    lib = library if library is not None else library_path()
    if not lib.is_file():
        raise CuptiLibraryMissing(
            f"launch: the CUPTI injection library {lib} is not built: run `sparseety-prof build-cupti`"
        )
    watch_file = settings.get("watch_file")
    if watch_file is not None and not Path(watch_file).is_file():
        raise UsageError(f"launch: watch file {watch_file} does not exist")
    env = build_env(dict(os.environ), lib, **settings)
    try:
        proc = subprocess.Popen(argv, env=env)
    except OSError as e:
        raise CommandNotStarted(f"launch: cannot start {argv[0]}: {e.strerror}") from None
    print(
        f"sparseety-prof: started pid {proc.pid} with {lib.name} injected; "
        f"attach with: {'' if os.geteuid() == 0 else 'sudo '}sparseety-prof attach -p {proc.pid}",
        file=sys.stderr,
    )

    def forward(signum: int, _frame: FrameType | None) -> None:
        if proc.poll() is None:
            proc.send_signal(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        rc = proc.wait()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    return 128 - rc if rc < 0 else rc


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `sparseety-prof launch`; the command follows `--`."""
    parser.add_argument(
        "--watch",
        metavar="SPEC",
        help="watched kernels: 'name_substring:arg:dtype:rule;...', e.g. "
        "'moe_align_block_size_kernel:0:int32:arg3*arg4' (rule: constants, argN, argN.i64, grid.x|y|z, "
        "block.x|y|z joined by '*'; ',' separates dimensions)",
    )
    parser.add_argument("--watch-file", metavar="FILE", help="the same entries, one per line, '#' comments")
    add_preset_flag(parser)
    parser.add_argument(
        "--sample-every", type=int, metavar="N", help="copy every Nth watched launch (default 1)"
    )
    parser.add_argument(
        "--buffer-bytes-per-s", type=int, metavar="B", help="byte budget of buffer copies per second (64 MiB)"
    )
    parser.add_argument(
        "--ring-bytes", type=int, metavar="B", help="shared-memory ring size (default 64 MiB)"
    )
    parser.add_argument("--staging-bytes", type=int, metavar="B", help="pinned staging area (default 4 MiB)")
    parser.add_argument("--flush-ms", type=int, metavar="MS", help="activity flush period (default 100 ms)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- <engine command and arguments>")


def add_preset_flag(parser: argparse._ActionsContainer) -> None:
    """--preset, shared by `launch` and `record`/`attach --late-attach`."""
    parser.add_argument(
        "--preset",
        action="append",
        choices=sorted(PRESETS),
        help="watch the fused-MoE routing kernels of this engine (repeatable; after the --watch entries, "
        "which win where both match; docs: GPU path, presets)",
    )
