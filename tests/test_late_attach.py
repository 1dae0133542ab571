"""Late attach without a GPU: `record --late-attach` on a running process that loaded the stub
libcuda (cupti_ext/tests/late_target.c, started WITHOUT CUDA_INJECTION64_PATH) loads the injection
library into it with ptrace, the process starts publishing to its ring, and it runs on unchanged:
its checksums equal those of a run nobody attached to, and it exits normally. The kernel rows are
exactly the launches the process itself reports CUPTI saw. Then the refusals, each for real: a
statically linked target, a recorder without CAP_SYS_PTRACE, a target already traced, a target in
another mount namespace, a process without libcuda (falls back to what exists without a ring)."""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import CLI, PY, ROOT, run_cli

from sparseety_prof.errors import InjectionRefused, NotAnEngine, PtraceNotPermitted
from sparseety_prof.gpu import late_attach as la
from sparseety_prof.gpu import ptrace_call
from sparseety_prof.gpu.shm_ring import find_rings
from sparseety_prof.store import recording

NAMES = ("late_gemm_kernel", "late_topk_kernel", "late_norm_kernel")  # late_target.c: by i % 3
ITERATIONS, PERIOD_MS = 0, 40  # late_target runs until its stdin closes (recorders start slowly)


@pytest.fixture(scope="module")
def build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("late_build")
    r = subprocess.run(
        ["bash", str(ROOT / "cupti_ext" / "build.sh"), str(out)], capture_output=True, text=True
    )
    if r.returncode != 0:
        pytest.fail(f"cupti_ext/build.sh failed (exit {r.returncode}):\n{r.stderr}")
    # A "CUDA process" maps libcuda.so.1: the stub under that name, next to the stub libcupti it needs.
    cuda = out / "cuda"
    cuda.mkdir()
    shutil.copy(out / "libcuda_stub.so", cuda / "libcuda.so.1")
    shutil.copy(out / "libcupti_stub.so", cuda / "libcupti_stub.so")
    return out


def start_target(
    build: Path, iterations: int = ITERATIONS, prefix: tuple[str, ...] = (), period_ms: int = PERIOD_MS
) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPARSEETY_", "CUDA_INJECTION"))}
    p = subprocess.Popen(
        [
            *prefix,
            str(build / "late_target"),
            str(build / "cuda" / "libcuda.so.1"),
            str(iterations),
            str(period_ms),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert p.stdout is not None
    # the first line byte by byte from the pipe itself: readline() on the text wrapper may buffer
    # the lines after it too, and communicate() reads the pipe, not that buffer (a fast target's
    # first iteration went missing so)
    line = b""
    while not line.endswith(b"\n"):
        byte = os.read(p.stdout.fileno(), 1)
        if not byte:
            break
        line += byte
    assert line.startswith(b"ready "), "late_target did not start"
    return p


def cli_env(build: Path) -> dict[str, str]:
    # the library's settings come from sparseety-prof's environment, as launch passes them on
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "SPARSEETY_CUPTI_LIB": str(build / "libsparseety_cupti.so"),
        "SPARSEETY_CUPTI_PATH": str(build / "cuda" / "libcupti_stub.so"),  # the copy the target mapped
        "SPARSEETY_FLUSH_MS": "10",
    }


def late_record(pid: int, tmp: Path) -> list[str]:
    return ["record", "--pid", str(pid), "--late-attach", "-o", str(tmp / "rec")]


def fired(stderr: str) -> dict[int, str]:
    """correlation id -> kernel name of the launches CUPTI's stub reported to a subscriber."""
    out = {}
    for line in stderr.splitlines():
        _, _i, corr, name, seen = line.split()
        if seen == "1":
            out[int(corr)] = name
    return out


def record_until_target_ends(
    target: subprocess.Popen[str], cmd: list[str], env: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    """Run a recorder on `target` (a late_target started with ITERATIONS 0) until the target ends:
    once the recorder says it is attached and a few launches went by, close the target's stdin."""
    rec = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    assert rec.stderr is not None and target.stdin is not None
    lines = []
    for line in rec.stderr:
        lines.append(line)
        if "attached to PID" in line:
            break
    time.sleep(0.5)
    target.stdin.close()
    rest = rec.communicate(timeout=120)[1]
    return subprocess.CompletedProcess(cmd, rec.returncode, "", "".join(lines) + rest)


def ended(target: subprocess.Popen[str]) -> tuple[str, str]:
    """stdout and stderr of a target whose stdin was closed (communicate would flush stdin)."""
    assert target.stdout is not None and target.stderr is not None
    out, err = target.stdout.read(), target.stderr.read()
    target.wait(timeout=60)
    return out, err


@pytest.fixture(scope="module")
def attached(build: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """One target, attached late twice: `record --late-attach --duration 1` (injects), then
    `record --late-attach` again (finds the ring, injects nothing) until the target ends. Then
    the same number of iterations run untouched, for reference."""
    tmp = tmp_path_factory.mktemp("late")
    target = start_target(build, iterations=0)
    time.sleep(0.5)
    maps_before = Path(f"/proc/{target.pid}/maps").read_text()
    first = subprocess.run(
        [*CLI, "record", "--pid", str(target.pid), "--late-attach", "-o", str(tmp / "r1"), "--duration", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        env=cli_env(build),
        cwd=ROOT,
    )
    maps_after = Path(f"/proc/{target.pid}/maps").read_text()
    second = record_until_target_ends(
        target,
        [*CLI, "record", "--pid", str(target.pid), "--late-attach", "-o", str(tmp / "r2")],
        cli_env(build),
    )
    out, err = ended(target)
    n = len(out.splitlines())
    ref = start_target(build, iterations=n)
    ref_out, ref_err = ref.communicate(timeout=120)
    assert ref.returncode == 0 and not fired(ref_err)  # nobody subscribed
    yield {
        "ref": ref_out,
        "first": first,
        "second": second,
        "out": out,
        "err": err,
        "n": n,
        "rc": target.returncode,
        "maps_before": maps_before,
        "maps_after": maps_after,
        "tmp": tmp,
    }


@pytest.mark.root
def test_late_attach_loads_the_library_and_the_process_runs_on_unchanged(attached: dict, build: Path) -> None:
    first = attached["first"]
    assert first.returncode == 0, first.stderr
    assert "late attach to PID" in first.stderr and "CUPTI subscribed" in first.stderr, first.stderr
    assert "Not seen: kernels launched before the attach" in first.stderr
    # the process exits normally and printed exactly what an untouched run prints
    assert attached["rc"] == 0, attached["err"]
    assert attached["out"] == attached["ref"] and attached["n"] >= 50
    # it had no ring and no library before; afterwards the root-owned copy is mapped, once
    assert "libsparseety_cupti" not in attached["maps_before"]
    mapped = {
        line.split()[-1] for line in attached["maps_after"].splitlines() if "libsparseety_cupti" in line
    }
    assert len(mapped) == 1
    lib = Path(mapped.pop())
    assert lib.parent == la.RUN_DIR
    st, dst = lib.stat(), la.RUN_DIR.stat()
    assert st.st_uid == 0 and stat.S_IMODE(st.st_mode) == 0o644
    assert dst.st_uid == 0 and stat.S_IMODE(dst.st_mode) == 0o755
    lib_sha = hashlib.sha256(lib.read_bytes()).hexdigest()
    assert lib_sha == hashlib.sha256((build / "libsparseety_cupti.so").read_bytes()).hexdigest()


@pytest.mark.root
def test_kernel_rows_are_the_launches_after_the_attach(attached: dict) -> None:
    """The launches CUPTI saw are a tail of the run (everything from the attach on), and the two
    recordings hold exactly those, by correlation id and name, split at the second attach."""
    seen = fired(attached["err"])
    corrs = sorted(seen)
    assert len(corrs) >= 20, attached["err"]
    assert corrs == list(range(corrs[0], 1000 + attached["n"]))  # nothing missed after the attach
    assert corrs[0] > 1000  # and the launches before it were not seen
    rows = []
    for name in ("r1", "r2"):
        k = recording.open(attached["tmp"] / name).kernels()
        rows.append(dict(zip(k["correlation_id"].to_list(), k["name"].to_list(), strict=True)))
        assert k["api"].unique().to_list() == ["cuLaunchKernel"]
        assert (k["end_ns"] - k["start_ns"] == 1000).all()
    assert rows[0] and rows[1] and not rows[0].keys() & rows[1].keys()
    assert {**rows[0], **rows[1]} == seen
    assert all(name == NAMES[(c - 1000) % 3] for c, name in seen.items())


@pytest.mark.root
def test_second_attach_uses_the_existing_ring(attached: dict) -> None:
    second = attached["second"]
    assert second.returncode == 0, second.stderr
    assert "already publish to a CUPTI ring" in second.stderr and "loaded," not in second.stderr
    meta = recording.open(attached["tmp"] / "r2").meta
    late = meta["gpu"]["late_attach"]
    assert len(late) == 1 and late[0]["ring"].startswith("/dev/shm/sparseety-prof-cupti.")
    assert late[0]["not_seen"] == la.NOT_SEEN


@pytest.mark.root
def test_static_target_is_refused(tmp_path: Path) -> None:
    src = tmp_path / "spin.c"
    src.write_text(
        '#include <stdio.h>\n#include <unistd.h>\nint main(void){puts("ready");fflush(stdout);sleep(30);}\n'
    )
    exe = tmp_path / "spin"
    r = subprocess.run(["gcc", "-static", "-O1", "-o", str(exe), str(src)], capture_output=True, text=True)
    assert r.returncode == 0, f"gcc -static needs libc6-dev's libc.a: {r.stderr}"
    p = subprocess.Popen([str(exe)], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline() == "ready\n"
        r = run_cli(*late_record(p.pid, tmp_path))
        assert r.returncode == InjectionRefused.exit_code, r.stderr
        assert "maps no libc.so.6 (statically linked" in r.stderr
        assert p.poll() is None  # untouched
    finally:
        p.kill()
        p.wait()


@pytest.mark.root
def test_without_cap_sys_ptrace_is_refused(build: Path, tmp_path: Path) -> None:
    setpriv = shutil.which("setpriv")
    assert setpriv, "setpriv (util-linux) is part of the base system"
    target = start_target(build)
    try:
        r = subprocess.run(
            [
                setpriv,
                "--inh-caps=-all",
                "--bounding-set=-sys_ptrace",
                *CLI,
                *late_record(target.pid, tmp_path),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            env=cli_env(build),
            cwd=ROOT,
        )
        assert r.returncode == PtraceNotPermitted.exit_code, r.stderr
        assert "lacks CAP_SYS_PTRACE" in r.stderr
        assert not find_rings(target.pid)
    finally:
        target.kill()
        target.wait()


@pytest.mark.root
def test_already_traced_target_is_refused(build: Path, tmp_path: Path) -> None:
    target = start_target(build)
    # another tracer (a debugger) holds the target: PTRACE_SEIZE from a helper process
    holder = subprocess.Popen(
        [PY, "-c", _TRACER, str(target.pid)], stdout=subprocess.PIPE, stdin=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "seized\n"
        r = subprocess.run(
            [*CLI, *late_record(target.pid, tmp_path)],
            capture_output=True,
            text=True,
            timeout=120,
            env=cli_env(build),
            cwd=ROOT,
        )
        assert r.returncode == PtraceNotPermitted.exit_code, r.stderr
        assert f"already traced by PID {holder.pid}" in r.stderr
    finally:
        holder.kill()
        holder.wait()
        target.kill()
        target.wait()


_TRACER = """
import ctypes, sys, time
libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
assert libc.ptrace(0x4206, int(sys.argv[1]), None, None) == 0, ctypes.get_errno()
print("seized", flush=True)
sys.stdin.read()
"""


@pytest.mark.root
def test_target_in_another_mount_namespace_is_refused(build: Path, tmp_path: Path) -> None:
    unshare = shutil.which("unshare")
    assert unshare, "unshare (util-linux) is part of the base system"
    target = start_target(build, prefix=(unshare, "--mount", "--propagation", "private"))
    try:
        r = subprocess.run(
            [*CLI, *late_record(target.pid, tmp_path)],
            capture_output=True,
            text=True,
            timeout=120,
            env=cli_env(build),
            cwd=ROOT,
        )
        assert r.returncode == InjectionRefused.exit_code, r.stderr
        assert "another mount namespace" in r.stderr
        assert "libsparseety_cupti" not in Path(f"/proc/{target.pid}/maps").read_text()
    finally:
        target.kill()
        target.wait()


@pytest.mark.root
def test_process_without_libcuda_falls_back(tmp_path: Path) -> None:
    """Not a CUDA process: nothing injected, and the recorder does what it does for any process
    without a ring (this one is no engine either: exit 4)."""
    p = subprocess.Popen(["sleep", "30"])
    try:
        r = run_cli(*late_record(p.pid, tmp_path))
        assert "no libcuda loaded (not a CUDA process, nor its children)" in r.stderr
        assert r.returncode == NotAnEngine.exit_code, r.stderr
        assert "libsparseety_cupti" not in Path(f"/proc/{p.pid}/maps").read_text()
    finally:
        p.kill()
        p.wait()


def test_yama_scope_3_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Scope 3 cannot be lowered until a reboot, so the machine's own is never set to it here: the
    check reads a file that says 3."""
    scope = tmp_path / "ptrace_scope"
    scope.write_text("3\n")
    monkeypatch.setattr(la, "YAMA_SCOPE", scope)
    with pytest.raises(PtraceNotPermitted, match="Yama forbids ptrace"):
        la.check_ptrace_allowed()


def test_settings_text_refuses_what_the_library_would_misread() -> None:
    assert la.settings_text({"SPARSEETY_WATCH": "k:0:int32:arg1"}) == b"SPARSEETY_WATCH=k:0:int32:arg1\n\0"
    with pytest.raises(InjectionRefused):
        la.settings_text({"SPARSEETY_WATCH": "a\nSPARSEETY_SHM_NAME=x"})
    with pytest.raises(InjectionRefused):
        la.settings_text({"LD_PRELOAD": "/tmp/x.so"})


@pytest.mark.root
def test_call_restores_a_thread_stopped_in_user_code(build: Path) -> None:
    """The hard case for restoring: a thread stopped in the middle of arithmetic whose values live
    in general-purpose and vector registers (late_target's spin mode), made to call libc's strtod
    (which returns in xmm0) 30 times. Its output equals an untouched run's."""
    n = 400  # long enough for 30 calls on a quiet machine (an iteration takes ~10 ms there)
    ref = start_target(build, iterations=n, period_ms=0)
    target = start_target(build, iterations=n, period_ms=0)
    calls = in_user_code = 0
    try:
        maps = la.read_maps(target.pid)
        libc = la._mapped_file(maps, la._LIBC)
        assert libc is not None
        strtod = la._symbol_address(target.pid, libc, ("strtod",))
        assert strtod is not None
        while calls < 30 and target.poll() is None:
            th = ptrace_call.StoppedThread(target.pid, target.pid)
            try:
                in_user_code += not th.in_syscall
                r = th.call(strtod, [b"3.25\0", 0], timeout=5)
                assert r.seconds < 5
                calls += 1
            finally:
                th.restore_and_detach()
            time.sleep(0.03)
        out, _ = target.communicate(timeout=60)
        ref_out, _ = ref.communicate(timeout=60)
    finally:
        for p in (target, ref):
            p.kill()
            p.wait()
    assert calls == 30 and in_user_code >= 20, (calls, in_user_code)
    assert target.returncode == 0 and out == ref_out and len(out.splitlines()) == n


@pytest.mark.root
def test_cuda_worker_of_a_non_cuda_parent_receives_the_library(build: Path, tmp_path: Path) -> None:
    """vLLM/SGLang shape: the PID given is a parent without libcuda, the GPU work runs in a child."""
    target = start_target(build, iterations=0, prefix=("sh", "-c", '"$0" "$@"; echo parent-done'))
    try:
        child = [int(c) for c in Path(f"/proc/{target.pid}/task/{target.pid}/children").read_text().split()]
        assert len(child) == 1
        r = record_until_target_ends(target, [*CLI, *late_record(target.pid, tmp_path)], cli_env(build))
        out, err = ended(target)
    finally:
        target.kill()
        target.wait()
    assert r.returncode == 0, r.stderr
    assert (
        f"late attach to PID {child[0]} " in r.stderr and f"late attach to PID {target.pid} " not in r.stderr
    )
    assert out.endswith("parent-done\n") and len(out.splitlines()) >= 10
    k = recording.open(tmp_path / "rec").kernels()
    assert k["pid"].unique().to_list() == [child[0]]
    assert dict(zip(k["correlation_id"].to_list(), k["name"].to_list(), strict=True)) == fired(err)
