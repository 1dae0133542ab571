"""The project's one error hierarchy. Each class owns an exit code; cli.main turns them into
messages and exit codes in one place. The table of every exit code, with what each means, is
commands/exit_codes.py (docs/exit-codes.md is made from it)."""

from __future__ import annotations

#: what cli.main exits with for an exception no class below describes (a bug: the traceback is
#: printed); EX_SOFTWARE of sysexits.h, so that 1 keeps its one meaning (`diff`: the runs differ)
INTERNAL_ERROR = 70


class ProfError(Exception):
    """Base class: a failure the user can act on. The message says what happened and what to do.
    Raise a subclass: each says which failure it is by its exit code; the base class itself is
    unclassified, so it exits like an internal error."""

    exit_code = INTERNAL_ERROR


class UsageError(ProfError):
    exit_code = 2


class NoSuchProcess(ProfError):
    exit_code = 3


class NotAnEngine(ProfError):
    """The process exists but maps no llama.cpp library the profiler knows how to probe."""

    exit_code = 4


class MissingPrivileges(ProfError):
    exit_code = 5


class UnsupportedEngineBuild(ProfError):
    """The engine's library is recognised but its private struct layout is unknown or failed
    verification: recording would produce garbage, so we refuse."""

    exit_code = 6


class CorruptRecording(ProfError):
    exit_code = 7


class BpfUnavailable(ProfError):
    """BCC missing, kernel headers missing, or the kernel refused the program."""

    exit_code = 8


class RecordingWriteError(ProfError):
    """The recording could not be written (disk full, I/O error). What was written before stays
    readable; meta.json says complete: false, why, and how many rows were not written."""

    exit_code = 10


class PtraceNotPermitted(ProfError):
    """Late attach: the kernel does not let us ptrace the target (Yama ptrace_scope, no
    CAP_SYS_PTRACE, another tracer already attached)."""

    exit_code = 12


class InjectionRefused(ProfError):
    """Late attach: the target cannot take the injection library (statically linked, no dlopen in
    its libc, another mount namespace, not x86_64, or its dlopen/initialisation failed)."""

    exit_code = 13


class MetricsEndpointError(ProfError):
    """--metrics-port cannot be served (port in use, address not on this host): refused before
    attaching."""

    exit_code = 14


class ModelFileError(ProfError):
    """The model file cannot be read, or is not a GGUF file this profiler reads (damaged,
    truncated, another format or version, shrunk while read)."""

    exit_code = 17


class CheckRequestFailed(ProfError):
    """`check`: the tagged request could not be made (the engine did not answer it), or attaching
    took longer than --timeout."""

    exit_code = 18


class GpuRingUnreadable(ProfError):
    """The target has a CUPTI ring (started with `launch` or --late-attach) that cannot be read."""

    exit_code = 19


class CuptiLibraryMissing(ProfError):
    """`launch`: the CUPTI injection library is not built (`build-cupti` builds it, and exits
    with this code when it cannot)."""

    exit_code = 20


class CommandNotStarted(ProfError):
    """`launch`: the engine command could not be started (not found, not executable), the code
    env(1) and nice(1) exit with for it."""

    exit_code = 127
