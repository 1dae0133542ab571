"""Every exit code of `sparseety-prof`, one meaning each: the table below is the one source. The
ProfError subclasses carry their codes (errors.py); the codes that are a command's answer rather
than an error are defined here. Each command's --help lists the codes it can give, the top-level
--help all of them, and docs/exit-codes.md is this table (tests/test_errors.py checks both)."""

from __future__ import annotations

from dataclasses import dataclass

from sparseety_prof.errors import (
    INTERNAL_ERROR,
    BpfUnavailable,
    CheckRequestFailed,
    CommandNotStarted,
    CorruptRecording,
    CuptiLibraryMissing,
    GpuRingUnreadable,
    InjectionRefused,
    MetricsEndpointError,
    MissingPrivileges,
    ModelFileError,
    NoSuchProcess,
    NotAnEngine,
    PtraceNotPermitted,
    RecordingWriteError,
    UnsupportedEngineBuild,
    UsageError,
)

SUCCESS = 0
DIFFERENT = 1  # `diff`: the runs differ, as diff(1) and cmp say it
CHECK_FAILED = 9  # `check`: the request id did not reach every capture layer
COLLECT_REFUSED = 11  # `collect`: at least one recording was refused (the rest were collected)
DOCTOR_FAILED = 15  # `doctor`: at least one check failed
SPANS_NOT_SENT = 16  # `export --otlp`: the collector did not take every span
CUPTI_LIBRARY_MISSING = CuptiLibraryMissing.exit_code  # `build-cupti` exits with it too
INTERRUPTED = 130  # Ctrl-C (SIGINT) before the command finished: 128 + SIGINT, as shells report it

RECORDING_COMMANDS = ("record", "attach")
ATTACHING_COMMANDS = ("record", "attach", "check")
READING_COMMANDS = ("report", "diff", "audit", "redact", "export", "collect")


@dataclass(frozen=True)
class ExitCode:
    code: int
    meaning: str
    #: the commands that exit with it; () = any command
    commands: tuple[str, ...] = ()

    def label(self) -> str:
        """The meaning, named after its command when only one command gives it."""
        return f"{self.commands[0]}: {self.meaning}" if len(self.commands) == 1 else self.meaning


EXIT_CODES: tuple[ExitCode, ...] = (
    ExitCode(SUCCESS, "success"),
    ExitCode(
        DIFFERENT, "the runs differ (tokens, log-probs, routing, sparsity, attention or requests)", ("diff",)
    ),
    ExitCode(UsageError.exit_code, "usage error: a flag, a combination of flags or a path that cannot work"),
    ExitCode(NoSuchProcess.exit_code, "no such process", (*ATTACHING_COMMANDS, "doctor")),
    ExitCode(
        NotAnEngine.exit_code,
        "not a supported engine (no llama.cpp library in the process)",
        ATTACHING_COMMANDS,
    ),
    ExitCode(
        MissingPrivileges.exit_code,
        "missing privileges (root, or the capabilities docs/privileges.md names)",
        ATTACHING_COMMANDS,
    ),
    ExitCode(
        UnsupportedEngineBuild.exit_code,
        "unsupported engine build (its layout, or with `launch --preset llamacpp` its routing kernels' "
        "argument layout, is unknown or failed verification)",
        (*ATTACHING_COMMANDS, "launch"),
    ),
    ExitCode(CorruptRecording.exit_code, "not a recording, or a corrupt one", READING_COMMANDS),
    ExitCode(
        BpfUnavailable.exit_code,
        "BPF unavailable (BCC, kernel headers, or the kernel refused the program)",
        ATTACHING_COMMANDS,
    ),
    ExitCode(CHECK_FAILED, "a capture layer lost the request id", ("check",)),
    ExitCode(
        RecordingWriteError.exit_code,
        "the recording could not be written (disk full, I/O error): meta.json says complete: false",
        (*RECORDING_COMMANDS, "redact"),
    ),
    ExitCode(
        COLLECT_REFUSED,
        "some recordings were refused (each is named); the others were collected",
        ("collect",),
    ),
    ExitCode(
        PtraceNotPermitted.exit_code,
        "--late-attach: ptrace not permitted (Yama ptrace_scope, no CAP_SYS_PTRACE, already traced)",
        RECORDING_COMMANDS,
    ),
    ExitCode(
        InjectionRefused.exit_code,
        "--late-attach: the target cannot load the library (static, other mount namespace, dlopen failed)",
        RECORDING_COMMANDS,
    ),
    ExitCode(
        MetricsEndpointError.exit_code,
        "--metrics-port cannot be served (port in use, address not on this host)",
        RECORDING_COMMANDS,
    ),
    ExitCode(DOCTOR_FAILED, "at least one check failed (each says how to fix it)", ("doctor",)),
    ExitCode(SPANS_NOT_SENT, "--otlp: the collector did not take every span", ("export",)),
    ExitCode(
        ModelFileError.exit_code,
        "the model file cannot be read or is not a GGUF file this profiler reads",
        ATTACHING_COMMANDS,
    ),
    ExitCode(
        CheckRequestFailed.exit_code,
        "the tagged request failed, or attaching took longer than --timeout",
        ("check",),
    ),
    ExitCode(GpuRingUnreadable.exit_code, "the target's CUPTI ring cannot be read", RECORDING_COMMANDS),
    ExitCode(
        CUPTI_LIBRARY_MISSING,
        "the CUPTI injection library is not built, or could not be built",
        ("build-cupti", "launch"),
    ),
    ExitCode(INTERNAL_ERROR, "internal error: an unexpected exception (a bug; the traceback is printed)"),
    ExitCode(CommandNotStarted.exit_code, "the engine command could not be started", ("launch",)),
    ExitCode(
        INTERRUPTED,
        "interrupted (Ctrl-C) before the command finished; record and attach close the recording and exit 0",
    ),
)


def code_lines(codes: tuple[ExitCode, ...] | list[ExitCode]) -> str:
    return "".join(f"  {c.code:>3} {c.label()}\n" for c in codes)


#: the top-level --help's epilog: every code
EXIT_CODES_HELP = "exit codes:\n" + code_lines(EXIT_CODES)


def codes_of(command: str) -> list[ExitCode]:
    """The codes `command` can exit with."""
    return [c for c in EXIT_CODES if not c.commands or command in c.commands]


def markdown_table() -> str:
    """docs/exit-codes.md's table: code, meaning (with its command in backticks), commands."""
    rows = ["| code | meaning | commands |", "|---:|---|---|"]
    for c in EXIT_CODES:
        meaning = f"`{c.commands[0]}`: {c.meaning}" if len(c.commands) == 1 else c.meaning
        given = ", ".join(f"`{n}`" for n in c.commands) if c.commands else "any"
        rows.append(f"| {c.code} | {meaning} | {given} |")
    return "\n".join(rows) + "\n"
