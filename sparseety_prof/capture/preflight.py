"""What attaching needs from the host and the target, each as one check that says how to fix what
is missing: privileges, bcc, kernel headers, tracefs, a trivial BPF load, and (given a PID) the
engine's libraries, symbols, build and model. Every check is a small function that can be
pointed at another path, so tests can break the very thing it checks."""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Callable
from pathlib import Path

from sparseety_prof.capture import capabilities as caps
from sparseety_prof.capture import layouts
from sparseety_prof.capture import target as tg
from sparseety_prof.capture.bpf_loader import bcc_fix
from sparseety_prof.capture.capabilities import Capability
from sparseety_prof.checks import Check
from sparseety_prof.errors import ProfError


def check_privileges() -> Check:
    try:
        tg.check_privileges()
    except ProfError as e:
        fix = (  # sudo only for a user who is not root (a root shell in a container has none)
            "give the container the capabilities: --cap-add SYS_ADMIN --cap-add SYS_PTRACE "
            "--cap-add DAC_READ_SEARCH (docs/privileges.md)"
            if os.geteuid() == 0
            else 'run as root: sudo "$(command -v sparseety-prof)" doctor'
        )
        return Check("privileges", False, str(e), fix)
    return Check("privileges", True, "CAP_BPF + CAP_PERFMON (or CAP_SYS_ADMIN) in the effective set")


def check_capabilities(pid: int | None = None, status: Path = Path("/proc/self/status")) -> list[Check]:
    """One check per capability a non-root recorder needs (capture/capabilities.py): held, or
    what is lost without it. CAP_SYS_PTRACE and CAP_DAC_READ_SEARCH are needed only for an
    engine of another user: with `pid` of an engine of our own user they are not asked for."""
    mask = caps.effective_capabilities(status)
    same_user = pid is not None and caps.engine_uid(pid) == os.getuid()
    out = []
    for cap in caps.CAPABILITIES:
        name = f"capability: {cap.name}"
        if caps.has_capability(mask, cap):
            out.append(Check(name, True, f"held: {cap.needed_for}"))
        elif cap.other_user_only and same_user:
            out.append(Check(name, True, f"not held, not needed: PID {pid} runs as this user"))
        elif not cap.required:
            out.append(Check(name, True, f"not held: {cap.cost}", f"optional: {_grant(cap)}"))
        else:
            who = " (when the engine runs as another user)" if cap.other_user_only else ""
            out.append(Check(name, False, f"not held{who}: {cap.cost}", _grant(cap)))
    return out


def _grant(cap: Capability) -> str:
    short = cap.name.removeprefix("CAP_")
    return (
        f"add {cap.name} to the service's AmbientCapabilities= (packaging/systemd), "
        f"docker run --cap-add {short}, or setpriv --ambient-caps +{short.lower()} "
        f"(docs/privileges.md)"
    )


def check_bcc() -> Check:
    try:
        import bcc
    except ImportError as e:
        return Check("bcc", False, f"the bcc module is not importable by {sys.executable} ({e})", bcc_fix())
    return Check("bcc", True, f"bcc {getattr(bcc, '__version__', '?')} from {Path(bcc.__file__).parent}")


def check_kernel_headers(modules: Path = Path("/lib/modules"), release: str | None = None) -> Check:
    rel = release or platform.release()
    conf = modules / rel / "build" / "include" / "generated" / "autoconf.h"
    if conf.exists():
        return Check(
            "kernel headers", True, f"{modules / rel / 'build'} -> {(modules / rel / 'build').resolve()}"
        )
    return Check(
        "kernel headers",
        False,
        f"{conf} is missing: BCC compiles every program against a kernel header tree",
        f"apt-get install linux-headers-amd64, then "
        f"ln -sfn /usr/src/linux-headers-*-amd64 {modules / rel}/build "
        f"and the matching -common tree as {modules / rel}/source (scripts/install.sh)",
    )


def check_tracefs(tracing: Path = Path("/sys/kernel/tracing")) -> Check:
    if (tracing / "uprobe_events").exists():
        return Check("tracefs", True, f"mounted at {tracing}")
    return Check(
        "tracefs",
        False,
        f"{tracing} is not mounted (attaching works, but BCC's detach path reads it)",
        f"mount -t tracefs nodev {tracing}",
    )


def check_bpf_load() -> Check:
    """Compile and load a trivial uprobe program: the real thing, once."""
    try:
        import bcc
    except ImportError:
        return Check("BPF load", False, "skipped: bcc is not importable", "fix the bcc check first")
    try:
        b = bcc.BPF(text="int noop(struct pt_regs *ctx) { return 0; }")
        b.load_func("noop", bcc.BPF.KPROBE)
        b.cleanup()
    except Exception as e:  # BCC raises bare Exception
        return Check(
            "BPF load",
            False,
            f"the kernel or BCC refused a trivial program: {e}",
            "run as root with CAP_BPF/CAP_PERFMON; check the kernel headers",
        )
    return Check("BPF load", True, "a uprobe program compiles and loads")


def check_engine(pid: int) -> list[Check]:
    out: list[Check] = []
    try:
        t = tg.inspect(pid)
    except ProfError as e:
        return [Check("process", False, str(e), "give the PID of a running engine (pgrep -f llama)")]
    out.append(Check("process", True, f"PID {pid}: {t.exe}"))
    try:
        where = tg.find_engine_libs(t)
    except ProfError as e:
        return [
            *out,
            Check("engine library", False, str(e), "start the engine through llama-cpp-python or xllamacpp"),
        ]
    libs = sorted({str(p) for p in where.values()})
    out.append(Check("engine library", True, ", ".join(libs)))
    missing = [s for s in (tg.SYM_LOGITS_ITH,) if s not in where]
    if tg.SYM_LLAMA_SAMPLER not in where and tg.SYM_COMMON_SAMPLER not in where:
        missing.append("a sampler entry point")
    out.append(
        Check(
            "symbols",
            not missing,
            f"missing: {', '.join(missing)}" if missing else f"{len(where)} probe points found",
            "" if not missing else "this engine build does not export what the profiler needs",
        )
    )
    b = layouts.identify_build(t, where)
    lo, hi = layouts.supported_range()
    if b.ubatch is not None:
        out.append(
            Check(
                "engine build",
                True,
                f"{b.identity.describe()}: llama_ubatch layout from the {b.layout_source}",
            )
        )
    else:
        out.append(
            Check(
                "engine build",
                True,
                f"{b.identity.describe()}: not in the verified range {lo}..{hi}; the "
                f"llama_ubatch layout will be learned from live forward passes at attach",
                "send the engine a request while attaching",
            )
        )
    for layer in tg.capture_layers(where):
        out.append(
            Check(
                f"layer: {layer.name}",
                layer.available or layer.name != "tokens",
                layer.detail if layer.available else f"degraded: {layer.detail}",
            )
        )
    if t.model_paths:
        out.append(Check("model file", True, ", ".join(str(p) for p in t.model_paths)))
    else:
        out.append(
            Check("model file", False, "no .gguf mapped or open", "pass --model PATH to record/attach")
        )
    return out


SYSTEM_CHECKS: list[Callable[[], Check]] = [
    check_privileges,
    check_bcc,
    check_kernel_headers,
    check_tracefs,
    check_bpf_load,
]
