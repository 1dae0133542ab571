"""The project's one error hierarchy. Each class owns an exit code; cli.main turns them into
messages and exit codes in one place (documented in the README, asserted in tests)."""

from __future__ import annotations


class ProfError(Exception):
    """Base class: a failure the user can act on. The message says what happened and what to do."""

    exit_code = 1


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
