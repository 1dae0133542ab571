"""Shared fixtures. Tests that need root and BPF run for real (CI is root); they skip only when
the machine truly lacks the capability, and say why."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
ENGINES = ROOT / "tests" / "engines"
PY = sys.executable
CLI = [PY, "-m", "sparseety_prof.cli"]

sys.path.insert(0, str(ROOT))

# This process runs the correlator's Python source: tests here replace its functions and read its
# objects' attributes (monkeypatch, vars()), which mypyc's compiled classes do not allow. The
# recorders the tests start as processes run the compiled build where it is built and current;
# tests/test_compiled_correlator.py checks that both make the same tables.
# (build_stamp.PURE_ENV, spelled out: importing it would import the package first)
os.environ["SPARSEETY_PROF_PURE_PYTHON"] = "1"
from sparseety_prof.correlate import build_stamp  # noqa: E402

del os.environ[build_stamp.PURE_ENV]
_pure = f"source: {build_stamp.PURE_ENV} is set"
assert _pure == build_stamp.STATE, build_stamp.STATE

# Tests run cli.main and the Recorder in this process: one thread per pool, as the recorder's
# process has (cli.main sets them there), before anything imports numpy or polars.
from sparseety_prof.session.thread_pools import limit_thread_pools  # noqa: E402

limit_thread_pools()

from sparseety_prof.synthetic import make_model  # noqa: E402


def _bpf_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root for eBPF uprobes (run the tests with sudo; CI runs as root)"
    try:
        import bcc  # noqa: F401
    except ImportError:
        return "BCC is not importable: run scripts/setup.sh"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = _bpf_reason()
    if reason is None:
        return
    for item in items:
        if "root" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("models")
    return {name: make_model(d / f"{name}.gguf", name) for name in ("moe", "dense")}


class EngineDied(RuntimeError):
    """The engine process ended before it answered; `returncode` as Popen reports it (-N: killed
    by signal N), None if it closed its output without ending."""

    def __init__(self, returncode: int | None) -> None:
        super().__init__(f"engine exited with {returncode}")
        self.returncode = returncode


class Engine:
    """A child engine process speaking the JSON-lines protocol of tests/engines/*.py."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [PY, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env={**os.environ, **env} if env else None,
        )
        self.ready = self.read()
        self.pid = int(self.ready["ready"])

    def read(self, timeout: float = 120) -> dict[str, Any]:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                try:  # its output closed as it died: reaped in a moment
                    code: int | None = self.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    code = None
                raise EngineDied(code)
            line = line.strip()
            if line.startswith("{"):
                return dict(json.loads(line))
        raise TimeoutError("engine did not answer")

    def send(self, obj: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def generate(
        self, prompts: list[str], max_tokens: int, temp: float = 0.0, seed: int = 1
    ) -> list[dict[str, Any]]:
        self.send({"prompts": prompts, "max_tokens": max_tokens, "temp": temp, "seed": seed})
        return list(self.read(timeout=600)["results"])

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send({"exit": True})
                self.proc.stdin.close()  # type: ignore[union-attr]
                self.proc.wait(timeout=20)
            except (BrokenPipeError, subprocess.TimeoutExpired, OSError):
                self.proc.kill()
                self.proc.wait()


MATRIX_DIR = Path(os.environ.get("SPARSEETY_MATRIX_DIR", ROOT / ".cache" / "engines"))


SERVER_CACHE = Path(os.environ.get("SPARSEETY_CACHE", "/var/cache/sparseety-prof")) / "llama-server"


def _matrix_lines(name: str) -> list[list[str]]:
    lines = (ROOT / "scripts" / name).read_text().splitlines()
    return [line.split() for line in lines if line.strip() and not line.startswith("#")]


def server_builds() -> list[tuple[str, dict[str, str] | None]]:
    """llama-server builds to test against: the pinned xllamacpp of the venv, every release of
    scripts/matrix-xllamacpp.txt (scripts/setup.sh unpacks each into MATRIX_DIR), and every
    executable of scripts/matrix-llama-server.txt (set-up builds each into SERVER_CACHE)."""
    builds: list[tuple[str, dict[str, str] | None]] = [("xllamacpp-pinned", None)]
    for (v,) in _matrix_lines("matrix-xllamacpp.txt"):
        builds.append((f"xllamacpp-{v}", {"PYTHONPATH": str(MATRIX_DIR / f"xllamacpp-{v}")}))
    for build, kind in _matrix_lines("matrix-llama-server.txt"):
        where = str(SERVER_CACHE / f"b{build}-{kind}")
        builds.append((f"llama-server-b{build}-{kind}", {"LLAMA_SERVER_BIN": where}))
    return builds


def llama_cpp_python_builds() -> list[tuple[str, dict[str, str]]]:
    """Older llama-cpp-python releases to run the in-process engine on: every release of
    scripts/matrix-llama-cpp-python.txt (set-up builds each from its sdist into MATRIX_DIR, put
    first on the engine's PYTHONPATH). The pinned release of the venv: test_llama_cpp_python.py."""
    return [
        (f"llama-cpp-python-{v}", {"PYTHONPATH": str(MATRIX_DIR / f"llama-cpp-python-{v}")})
        for (v,) in _matrix_lines("matrix-llama-cpp-python.txt")
    ]


def start_build(name: str, args: list[str], env: dict[str, str] | None) -> Engine:
    """A build-matrix engine, skipped where this machine's CPU cannot run the build at all: a
    release compiled for an instruction set the CPU lacks (xllamacpp 2026.4.8672's wheel holds
    AVX-512 code outside any CPU dispatch) dies of SIGILL while it loads the model."""
    try:
        return Engine(args, env=env)
    except EngineDied as e:
        if e.returncode != -signal.SIGILL:
            raise
        cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
        has = "avx512f" in next((ln for ln in cpuinfo if ln.startswith("flags")), "").split()
        pytest.skip(
            f"{name} dies of SIGILL on this CPU (an instruction it was built for is missing here; "
            f"avx512f {'present' if has else 'absent'} in /proc/cpuinfo)"
        )


def require_build(env: dict[str, str] | None) -> None:
    """A matrix build that set-up did not install is a failure, not a skip: run scripts/setup.sh."""
    if env is not None:
        path = Path(env.get("PYTHONPATH") or env["LLAMA_SERVER_BIN"])
        assert (path / ".complete").exists(), (
            f"{path} missing: run scripts/setup.sh (it installs the build matrix)"
        )


def server_engine_args(env: dict[str, str] | None, model: Path, port: int) -> list[str]:
    """The test engine for a server build: xllamacpp in-process, or a built llama-server."""
    if env is not None and "LLAMA_SERVER_BIN" in env:
        binary = Path(env["LLAMA_SERVER_BIN"]) / "llama-server"
        return [str(ENGINES / "llama_server_binary.py"), str(binary), str(model), "--port", str(port)]
    return [str(ENGINES / "server_engine.py"), str(model), "--port", str(port)]


@pytest.fixture
def llama_engine(models: dict[str, Path]) -> Iterator[Engine]:
    e = Engine([str(ENGINES / "llama_engine.py"), str(models["moe"])])
    yield e
    e.close()


def http_post(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """POST a JSON body to an engine's HTTP endpoint and return its JSON answer."""
    req = urllib.request.Request(
        url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        return dict(json.loads(r.read()))


def align_server_probs(ids: list[int], probs: list[dict[str, Any]]) -> list[tuple[int, dict[str, Any]]]:
    """llama-server folds a token that ends inside a UTF-8 character into the next one's
    probability entry: pair its entries with the generated tokens by id -> (token index, entry)."""
    out, j = [], 0
    for i, t in enumerate(ids):
        if j < len(probs) and probs[j]["id"] == t:
            out.append((i, probs[j]))
            j += 1
    assert j == len(probs), "server probabilities out of step with its tokens"
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Recorder:
    """`sparseety-prof record` as a child process, as a user would run it."""

    def __init__(self, pid: int, out: Path, *extra: str) -> None:
        self.out = out
        self.proc = subprocess.Popen(
            [*CLI, "record", "--pid", str(pid), "-o", str(out), *extra],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            # a recorder that hangs is sent SIGABRT before it is killed (wait): its threads'
            # stacks then reach stderr, and the failing test's message
            env={**os.environ, "PYTHONFAULTHANDLER": "1"},
        )
        self.banner = self._wait_attached()
        # the rest of stderr, read as it comes (wait_for looks at it while the recorder runs)
        self._lines: list[str] = []
        self._new_line = threading.Condition()
        self._reader = threading.Thread(target=self._read_stderr, daemon=True)
        self._reader.start()

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            with self._new_line:
                self._lines.append(line)
                self._new_line.notify_all()

    def wait_for(self, text: str, timeout: float = 30) -> str:
        """The first stderr line containing `text` (TimeoutError when none comes in time)."""
        deadline = time.monotonic() + timeout
        with self._new_line:
            while True:
                for line in self._lines:
                    if text in line:
                        return line
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not self._reader.is_alive()):
                    raise TimeoutError(f"recorder printed no {text!r}: {''.join(self._lines)}")
                self._new_line.wait(min(left, 0.5))

    def _wait_attached(self, timeout: float = 60) -> str:
        assert self.proc.stderr is not None
        deadline = time.monotonic() + timeout
        seen: list[str] = []
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if not line:
                tail = "".join(seen[-40:])
                raise RuntimeError(f"recorder exited with {self.proc.wait()} before attaching:\n{tail}")
            seen.append(line)
            if "attached to PID" in line:
                return line
        raise TimeoutError("recorder did not attach")

    def stop(self, sig: int = signal.SIGINT, timeout: float = 60) -> tuple[int, str]:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.wait(timeout)

    def wait(self, timeout: float = 60) -> tuple[int, str]:
        """Exit status and stderr (after the banner) of the recorder, once it exits."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGABRT)  # the stacks of where it hangs (faulthandler)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(timeout=10)
        if self.proc.stdout is not None:
            self.proc.stdout.read()
        return self.proc.returncode, "".join(self._lines)


def run_cli(*args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, cwd=ROOT, timeout=120, **kw)


def run_cli_without_capabilities(*args: str) -> subprocess.CompletedProcess[str]:
    """The CLI as root with every capability dropped, as in a locked-down container."""
    setpriv = shutil.which("setpriv")
    assert setpriv, "setpriv (util-linux) is part of the base system"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    return subprocess.run(
        [setpriv, "--inh-caps=-all", "--bounding-set=-all", *CLI, *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        env=env,
    )


def bpf_prog_ids() -> set[int]:
    """IDs of every BPF program loaded in the kernel (BPF_PROG_GET_NEXT_ID)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    sys_bpf = 321
    bpf_prog_get_next_id = 11
    attr = (ctypes.c_uint32 * 32)()
    ids: set[int] = set()
    start = 0
    while True:
        attr[0] = start
        if libc.syscall(sys_bpf, bpf_prog_get_next_id, ctypes.byref(attr), ctypes.sizeof(attr)) != 0:
            return ids
        start = attr[1]
        ids.add(start)


def uprobe_events() -> str:
    p = Path("/sys/kernel/tracing/uprobe_events")
    return p.read_text() if p.exists() else ""


def which(name: str) -> str:
    path = shutil.which(name)
    assert path, f"{name} not installed"
    return path


_MAPPER = r"""
import mmap, os, shutil, sys, time
path = sys.argv[1].replace("{pid}", str(os.getpid()))
if sys.argv[2]:
    shutil.copyfile(sys.argv[2], path)
fd = os.open(path, os.O_RDWR)
m = mmap.mmap(fd, 0)
print(path, flush=True)
time.sleep(600)
"""


class MappingProcess:
    """A process that maps a file (shared, read-write) and sleeps: an engine whose CUPTI library
    mapped its ring. `path` may contain "{pid}" (the process's own PID); `copy_from`: the file's
    content, copied there by the process before it maps it."""

    def __init__(self, path: str | Path, copy_from: Path | None = None) -> None:
        self.proc = subprocess.Popen(
            [PY, "-c", _MAPPER, str(path), str(copy_from or "")], stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        assert line, f"the mapping process exited with {self.proc.wait()}"
        self.path = Path(line)
        self.pid = self.proc.pid

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.path.unlink(missing_ok=True)
