"""Files the root recorder reads that others control (issue 18, items 1 and 6), each attack
performed for real: rings planted in /dev/shm by another user, symlinked rings, a ring whose
write position is near 2^62, a ring truncated while in use, stale rings, model paths that are
FIFOs or symlinks to /dev/zero, nm found through PATH, a containerised engine's files."""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from conftest import CLI, PY, ROOT, MappingProcess, run_cli
from test_cupti_ext import write_ring

from sparseety_prof.capture import target as tg
from sparseety_prof.capture.gguf_info import Vocab, read_model_info, read_tensor_infos, sha256_file
from sparseety_prof.capture.untrusted_files import (
    RefusedFile,
    open_untrusted,
    target_path,
    trusted_tool,
)
from sparseety_prof.capture.weight_sparsity import analyze
from sparseety_prof.errors import ProfError
from sparseety_prof.gpu.capture import GpuCapture
from sparseety_prof.gpu.shm_ring import (
    HEADER_SIZE,
    REC_PAD,
    SHM_DIR,
    SHM_PREFIX,
    RingError,
    ShmRing,
    find_rings,
    open_ring,
    remove_stale_rings,
)

NOBODY = 65534


def within(seconds: float, fn: Callable[[], Any]) -> Any:
    """fn's result or exception, failing the test when it takes longer (it would block forever)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still blocked after {seconds} s"
    if "error" in box:
        raise box["error"]
    return box["value"]


def pad_ring(path: Path, *, head: int, capacity: int = 1 << 16, pid: int = 1) -> None:
    """A valid ring header whose data area is PAD records from end to end (every length word set)."""
    write_ring(path, capacity=capacity, data=struct.pack("<IHH", 8, REC_PAD, 0) * (capacity // 8), head=head)
    raw = bytearray(path.read_bytes())
    struct.pack_into("<I", raw, 24, pid)
    path.write_bytes(bytes(raw))


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    """A real process that is not under `launch`: a CPU engine, as far as rings go."""
    p = subprocess.Popen(["sleep", "120"])
    yield p
    p.kill()
    p.wait()


# ---------------------------------------------------------------- item 1: planted rings


@pytest.mark.root
def test_ring_planted_by_another_user_for_a_real_target_is_not_read(
    sleeper: subprocess.Popen[bytes], tmp_path: Path
) -> None:
    planted = SHM_DIR / f"{SHM_PREFIX}{sleeper.pid}"
    write_ring(planted, data=struct.pack("<IHH", 8, REC_PAD, 0))
    os.chown(planted, NOBODY, NOBODY)
    try:
        # the target does not map it: it is nobody's ring, whatever its name
        assert find_rings(sleeper.pid) == []
        assert GpuCapture.open(sleeper.pid) is None
        r = run_cli("record", "--pid", str(sleeper.pid), "-o", str(tmp_path / "rec"), "--duration", "1")
        assert r.returncode == 4, r.stderr  # not an engine: no GPU-only recording from a planted file
        assert "GPU only" not in r.stderr
        assert planted.exists()  # another user's file, its named process alive: left alone
    finally:
        planted.unlink(missing_ok=True)


@pytest.mark.root
def test_ring_owned_by_another_user_is_refused_even_when_mapped(tmp_path: Path) -> None:
    write_ring(tmp_path / "src")
    engine = MappingProcess(SHM_DIR / f"{SHM_PREFIX}{{pid}}", copy_from=tmp_path / "src")
    try:
        (found,) = find_rings(engine.pid)
        os.chown(engine.path, NOBODY, NOBODY)  # the engine runs as root; the file is nobody's
        with pytest.raises(RingError, match=f"owned by uid {NOBODY}"):
            open_ring(found)
        os.chown(engine.path, 0, 0)
        os.chmod(engine.path, 0o666)  # anyone may write it: refused too
        with pytest.raises(RingError, match="may be written by other users"):
            open_ring(found)
        os.chmod(engine.path, 0o600)
        open_ring(found).close()
    finally:
        engine.close()


@pytest.mark.root
def test_symlinked_ring_is_refused(tmp_path: Path) -> None:
    real = SHM_DIR / f"sparseety-test-real-{os.getpid()}"
    write_ring(real)
    engine = MappingProcess(SHM_DIR / f"{SHM_PREFIX}{{pid}}", copy_from=real)
    try:
        (found,) = find_rings(engine.pid)
        # the name the engine mapped is swapped for a symlink to another valid ring
        os.unlink(engine.path)
        os.symlink(real, engine.path)
        with pytest.raises(RingError, match="symbolic link"):
            open_ring(found)
        with pytest.raises(RingError, match="symbolic link"):
            ShmRing(engine.path)
        # ... or for another regular file: not the inode the engine maps
        os.unlink(engine.path)
        shutil.copyfile(real, engine.path)
        with pytest.raises(RingError, match="not the file the process has mapped"):
            open_ring(found)
        # a symlink named for a process that maps nothing of that name is never considered
        sleeper = subprocess.Popen(["sleep", "60"])
        link = SHM_DIR / f"{SHM_PREFIX}{sleeper.pid}"
        try:
            os.symlink(real, link)
            assert find_rings(sleeper.pid) == []
        finally:
            link.unlink(missing_ok=True)
            sleeper.kill()
            sleeper.wait()
    finally:
        engine.close()
        real.unlink(missing_ok=True)


def test_write_position_near_2_62_ends_in_an_error_not_a_loop(tmp_path: Path) -> None:
    pad_ring(tmp_path / "ring", head=1 << 62)
    with ShmRing(tmp_path / "ring") as ring, pytest.raises(RingError, match="corrupt write position"):
        within(5, ring.drain)
    # the largest honest write position (a full ring of PAD records): one bounded pass
    pad_ring(tmp_path / "full", head=1 << 16)
    with ShmRing(tmp_path / "full") as ring:
        assert within(5, ring.drain) == [] and ring.read_tail == 1 << 16


def _gpu_only_recorder(pid: int, out: Path, *extra: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [*CLI, "record", "--pid", str(pid), "-o", str(out), *extra],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        cwd=ROOT,
    )
    assert proc.stderr is not None
    lines = [proc.stderr.readline()]  # (the recorder's placement line comes first)
    if "GPU only" not in lines[0]:
        lines.append(proc.stderr.readline())
    assert "GPU only" in lines[-1], "".join(lines) + proc.stderr.read()
    return proc


@pytest.mark.root
@pytest.mark.parametrize("stop", ["duration", "SIGTERM"])
def test_recorder_on_a_hostile_ring_honours_duration_and_sigterm(tmp_path: Path, stop: str) -> None:
    pad_ring(tmp_path / "src", head=(1 << 62) + 8)
    engine = MappingProcess(SHM_DIR / f"{SHM_PREFIX}{{pid}}", copy_from=tmp_path / "src")
    try:
        t0 = time.monotonic()
        extra = ("--duration", "1.5") if stop == "duration" else ()
        rec = _gpu_only_recorder(engine.pid, tmp_path / "rec", *extra)
        if stop == "SIGTERM":
            time.sleep(1.5)
            rec.send_signal(signal.SIGTERM)
        try:
            rec.wait(timeout=15)
        finally:
            rec.kill()
        err = rec.stderr.read() if rec.stderr else ""
        assert rec.returncode == 0, err
        assert time.monotonic() - t0 < 15
    finally:
        engine.close()
    meta = json.loads((tmp_path / "rec" / "meta.json").read_text())
    assert meta["complete"] is True
    assert meta["stop_reason"] == ("duration reached" if stop == "duration" else "SIGTERM")
    assert any("corrupt write position" in e for e in meta["gpu"]["errors"])
    assert meta["gpu"]["rings_dropped"] == 1


def test_ring_truncated_while_open_is_an_error_not_sigbus(tmp_path: Path) -> None:
    path = tmp_path / "ring"
    write_ring(path, data=struct.pack("<IHH", 8, REC_PAD, 0))
    # in a child: a SIGBUS there shows up as its exit status instead of killing the test run
    code = f"""
import os, sys
sys.path.insert(0, {str(ROOT)!r})
from sparseety_prof.gpu.shm_ring import RingError, ShmRing
from sparseety_prof.gpu.capture import GpuCapture
gpu = GpuCapture.open(1, paths=[{str(path)!r}])
os.truncate({str(path)!r}, {HEADER_SIZE} + 100)
try:
    gpu.rings[0].drain()
except RingError as e:
    print("error:", e)
gpu.poll(final=True)  # the ring is dropped, the capture goes on
print("errors:", gpu.meta()["errors"])
os.truncate({str(path)!r}, 16)
try:
    ShmRing({str(path)!r})
except RingError as e:
    print("reopen:", e)
"""
    r = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"exit {r.returncode} (-7 is SIGBUS): {r.stderr}"
    assert "error:" in r.stdout and "truncated" in r.stdout
    assert "errors: ['ring dropped:" in r.stdout
    assert "reopen:" in r.stdout and "truncated" in r.stdout


@pytest.mark.root
def test_stale_rings_removed_only_when_proven(tmp_path: Path) -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()
    dead = gone.pid
    live = subprocess.Popen(["sleep", "60"])
    try:
        proven = tmp_path / f"{SHM_PREFIX}{dead}"
        pad_ring(proven, head=0, pid=dead, capacity=4096)
        kept: dict[str, Path] = {}
        # a ring of a live process
        pad_ring(kept.setdefault("live", tmp_path / f"{SHM_PREFIX}{live.pid}"), head=0, pid=live.pid)
        other = tmp_path / "elsewhere"
        other.write_bytes(b"someone's data")
        gone2 = subprocess.Popen(["true"])
        gone2.wait()
        # the header names another process: not proven
        pad_ring(kept.setdefault("pid", tmp_path / f"{SHM_PREFIX}{gone2.pid}"), head=0, pid=dead)
        gone3 = subprocess.Popen(["true"])
        gone3.wait()
        # not a ring at all (another user's file)
        f = kept.setdefault("file", tmp_path / f"{SHM_PREFIX}{gone3.pid}")
        f.write_bytes(b"\0" * 8192)
        os.chown(f, NOBODY, NOBODY)
        gone4 = subprocess.Popen(["true"])
        gone4.wait()
        link = kept.setdefault("link", tmp_path / f"{SHM_PREFIX}{gone4.pid}")
        os.symlink(other, link)  # a symlink: never followed, never removed
        gone5 = subprocess.Popen(["true"])
        gone5.wait()
        hard = kept.setdefault("hardlink", tmp_path / f"{SHM_PREFIX}{gone5.pid}")
        pad_ring(tmp_path / "victim", head=0, pid=gone5.pid, capacity=4096)
        os.link(tmp_path / "victim", hard)  # a second name of someone's file
        kept.setdefault("name", tmp_path / f"{SHM_PREFIX}x{dead}")
        pad_ring(kept["name"], head=0, pid=dead)
        # the name a library takes when its plain one was planted: PID + 16 hex digits
        renamed = tmp_path / f"{SHM_PREFIX}{dead}.0123456789abcdef"
        pad_ring(renamed, head=0, pid=dead, capacity=4096)
        pad_ring(kept.setdefault("suffix", tmp_path / f"{SHM_PREFIX}{dead}.planted"), head=0, pid=dead)
        assert sorted(remove_stale_rings(shm_dir=tmp_path)) == sorted([proven, renamed])
        assert not proven.exists() and not renamed.exists()
        for why, p in kept.items():
            assert os.path.lexists(p), why
        assert other.read_bytes() == b"someone's data"
    finally:
        live.kill()
        live.wait()


# ---------------------------------------------------------------- item 6: the target's paths


@pytest.fixture
def model(models: dict[str, Path]) -> Path:
    return models["dense"]


def test_model_path_fifo_and_dev_zero_are_refused_at_once(tmp_path: Path, model: Path) -> None:
    fifo = tmp_path / "fifo.gguf"
    os.mkfifo(fifo)
    zero = tmp_path / "zero.gguf"
    zero.symlink_to("/dev/zero")
    for bad in (fifo, zero):
        readers: list[Callable[[Path], object]] = [read_model_info, read_tensor_infos, Vocab.from_gguf]
        for fn in readers:
            with pytest.raises(ProfError, match="not a regular file"):
                within(5, partial(fn, bad))
        with pytest.raises(RefusedFile, match="not a regular file"):
            within(5, partial(sha256_file, bad))
        with pytest.raises(RefusedFile):
            within(5, partial(analyze, bad, cache_dir=tmp_path / "cache"))
        with pytest.raises(OSError, match="not a regular file"):
            within(5, partial(tg.elf_symbols, bad))
        assert tg.build_id(bad) is None
    # a regular file is still read, symlinks to it included (HF caches link models)
    link = tmp_path / "link.gguf"
    link.symlink_to(model)
    assert sha256_file(link) == sha256_file(model)
    with pytest.raises(RefusedFile, match="symbolic link"):
        open_untrusted(link, follow=False)


def test_model_truncated_while_read_is_an_error_not_sigbus(tmp_path: Path, model: Path) -> None:
    victim = tmp_path / "model.gguf"
    shutil.copyfile(model, victim)
    header = min(t.offset for t in read_tensor_infos(victim))  # the weights are cut off
    code = f"""
import os, sys
from sparseety_prof.capture.weight_sparsity import analyze
from sparseety_prof.errors import ProfError
def shrink(done, total):
    os.truncate({str(victim)!r}, {header})
try:
    analyze({str(victim)!r}, sha256="0" * 64, cache_dir={str(tmp_path / "cache")!r}, progress=shrink)
except ProfError as e:
    print("error:", e)
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([PY, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, f"exit {r.returncode} (-7 is SIGBUS): {r.stderr}"
    assert "error:" in r.stdout and "shrank while its weights were read" in r.stdout


def test_gguf_header_read_in_growing_prefixes(monkeypatch: pytest.MonkeyPatch, model: Path) -> None:
    from sparseety_prof.capture import gguf_info

    whole, texts = read_model_info(model), Vocab.from_gguf(model).texts(range(10))
    monkeypatch.setattr(gguf_info, "HEADER_READ_BYTES", 64)  # every header runs past its first read
    assert read_model_info(model) == whole
    assert Vocab.from_gguf(model).texts(range(10)) == texts


def test_engine_with_a_fifo_named_gguf_open_is_not_read(tmp_path: Path, model: Path) -> None:
    fifo = tmp_path / "evil.gguf"
    os.mkfifo(fifo)
    # a real process holding the FIFO open (O_RDWR: its own open does not block) and the model mapped
    code = f"""
import mmap, os, time
fd = os.open({str(fifo)!r}, os.O_RDWR)
m = mmap.mmap(os.open({str(model)!r}, os.O_RDONLY), 0, prot=mmap.PROT_READ)
print("ready", flush=True)
time.sleep(60)
"""
    p = subprocess.Popen([PY, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline() == "ready\n"
        t = within(10, lambda: tg.inspect(p.pid))
        assert t.model_paths == [model.resolve()]
    finally:
        p.kill()
        p.wait()


def test_nm_and_cxxfilt_are_never_found_through_path(tmp_path: Path) -> None:
    assert trusted_tool("nm") in ("/usr/bin/nm", "/bin/nm")
    assert trusted_tool("c++filt") in ("/usr/bin/c++filt", "/bin/c++filt")
    fake = tmp_path / "bin"
    fake.mkdir()
    marker = tmp_path / "ran"
    for tool in ("nm", "c++filt"):
        (fake / tool).write_text(f"#!/bin/sh\ntouch {marker}\n")
        (fake / tool).chmod(0o755)
    lib = Path(sys.executable).resolve()
    code = f"""
from pathlib import Path
from sparseety_prof.capture import target as tg
syms = tg._symbol_table(Path({str(lib)!r}), 0, 0)
names = tg._demangle(["_ZN13llama_context6decodeERK11llama_batch"])
print(len(syms) > 0, names[0])
"""
    env = {**os.environ, "PATH": f"{fake}:{os.environ.get('PATH', '')}", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([PY, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "llama_context::decode(llama_batch", "const&)"]
    assert not marker.exists()


def test_privilege_hints_do_not_hand_path_to_root() -> None:
    # root running the user's PATH would run the user's nm: the hints name the tool's own path
    from sparseety_prof.capture import preflight

    for mod in (preflight, tg):
        text = Path(mod.__file__ or "").read_text()
        assert "PATH=$PATH" not in text and 'sudo "$(command -v sparseety-prof)"' in text


def test_target_path_is_proc_root_relative_for_a_containerised_engine(tmp_path: Path, model: Path) -> None:
    # same mount namespace: the path itself (the same file either way)
    assert target_path(os.getpid(), "/usr/lib/x.so") == Path("/usr/lib/x.so")
    unshare = shutil.which("unshare")
    if os.geteuid() != 0 or unshare is None:
        pytest.skip("needs root and util-linux unshare for a private mount namespace")
    inside = tmp_path / "container"
    inside.mkdir()
    # the engine's own files: a tmpfs only its mount namespace sees, holding its model
    script = (
        f"mount -t tmpfs none {inside} && cp {model} {inside}/model.gguf && "
        f"exec {PY} -c \"import os, time; fd = os.open('{inside}/model.gguf', os.O_RDONLY); "
        f"print('ready', flush=True); time.sleep(60)\""
    )
    p = subprocess.Popen(
        [unshare, "--mount", "--propagation", "private", "sh", "-c", script],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert p.stdout is not None and p.stdout.readline() == "ready\n"
        assert not (inside / "model.gguf").exists()  # not in our namespace
        t = tg.inspect(p.pid)
        assert t.model_paths == [Path(f"/proc/{p.pid}/root{inside}/model.gguf")]
        assert all(str(lib.path).startswith(f"/proc/{p.pid}/root/") for lib in t.libs)
        info = read_model_info(t.model_paths[0])
        assert info.architecture == read_model_info(model).architecture
        assert sha256_file(t.model_paths[0]) == sha256_file(model)
        # and read through the process's own descriptor, as the recorder reads it
        from sparseety_prof.session.attach import pin_model

        with pin_model(t) as pinned:
            assert pinned.path == t.model_paths[0] and sha256_file(pinned) == sha256_file(model)
    finally:
        p.kill()
        p.wait()


# ------------------------------------------------------------------ the model file, pinned
_HOLDER = """
import mmap, os, sys, time
fd = os.open(sys.argv[1], os.O_RDONLY)
if sys.argv[2] == "mapped":  # as llama.cpp does by default; the descriptor is closed after mapping
    m = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
    os.close(fd)
print("ready", flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("held", ["mapped", "open"])
def test_model_name_swapped_after_inspect_does_not_redirect_root(
    tmp_path: Path, models: dict[str, Path], held: str
) -> None:
    """The engine's user swaps the model's name for another file once the recorder has found it:
    every later read as root (header, vocabulary, tensors, hash, weights) is still of the file the
    engine holds, never of what the name now leads to."""
    from sparseety_prof.session.attach import pin_model

    served_from, other = models["moe"], models["dense"]
    d = tmp_path / "models"
    d.mkdir()
    served = d / "model.gguf"
    shutil.copy(served_from, served)
    p = subprocess.Popen([PY, "-c", _HOLDER, str(served), held], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline() == "ready\n"
        t = tg.inspect(p.pid)
        (m,) = t.models
        assert m.path == served.resolve()
        assert m.source.startswith(f"/proc/{p.pid}/{'map_files' if held == 'mapped' else 'fd'}/")
        # the attack: the name now leads to another model (renamed over it), then to a root-only file
        os.rename(served, d / "moved.gguf")
        shutil.copy(other, served)
        want = read_model_info(served_from)
        assert read_model_info(served).hyperparameters != want.hyperparameters  # the swap took
        with pin_model(t) as pinned:
            info = read_model_info(pinned)
            assert info.path == served.resolve()  # shown by its name
            assert info.hyperparameters == want.hyperparameters and info.sha256 == sha256_file(served_from)
            assert [ti.name for ti in read_tensor_infos(pinned)] == [
                ti.name for ti in read_tensor_infos(served_from)
            ]
            vocab, want_vocab = Vocab.from_gguf(pinned), Vocab.from_gguf(served_from)
            assert vocab.texts(range(len(vocab))) == want_vocab.texts(range(len(want_vocab)))
            served.unlink()
            secret = tmp_path / "secret"
            secret.write_bytes(b"root only\n")
            secret.chmod(0o600)
            served.symlink_to(secret)
            assert sha256_file(pinned) == want.sha256
            weights = analyze(pinned, cache_dir=tmp_path / "cache")
            assert weights["sha256"] == want.sha256
            assert weights == analyze(served_from, cache_dir=tmp_path / "cache2")
    finally:
        p.kill()
        p.wait()


def test_pinned_model_named_by_the_operator_survives_a_swap_and_closes_for_good(
    tmp_path: Path, models: dict[str, Path]
) -> None:
    from sparseety_prof.capture.untrusted_files import PinnedFile

    path = tmp_path / "m.gguf"
    shutil.copy(models["moe"], path)
    pinned = PinnedFile(path)
    other = tmp_path / "d.gguf"
    shutil.copy(models["dense"], other)
    os.rename(other, path)
    assert sha256_file(pinned) == sha256_file(models["moe"]) != sha256_file(path)
    pinned.close()
    # its descriptor number, taken by another file, is never read as the model
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(ValueError, match="closed"):
            pinned.reopen()
    finally:
        os.close(fd)


def test_pinned_file_refuses_what_open_untrusted_refuses(tmp_path: Path) -> None:
    from sparseety_prof.capture.untrusted_files import PinnedFile

    fifo = tmp_path / "fifo.gguf"
    os.mkfifo(fifo)
    with pytest.raises(RefusedFile, match="FIFO"):
        within(10, lambda: PinnedFile(fifo))
    with pytest.raises(RefusedFile, match="character device"):
        within(10, lambda: PinnedFile("/dev/zero"))


# ------------------------------------------------------------------ libraries: probes land on what is mapped
_LIBZ = Path("/usr/lib/x86_64-linux-gnu/libz.so.1")
_LOADER = """
import ctypes, sys, time
lib = ctypes.CDLL(sys.argv[1])
print("ready", flush=True)
while True:
    lib.zlibVersion()
    time.sleep(0.002)
"""


@pytest.mark.root
def test_library_swapped_after_inspect_gets_no_uprobe(tmp_path: Path) -> None:
    """The engine's user renames a mapped library and puts a link to another library (libc) in
    its place once the recorder has inspected the process: uprobes go through the process's own
    mapping, so they land on the file it maps, or, when that name no longer names a mapping,
    nowhere (refused), never on the file the name now leads to."""
    import bcc

    from sparseety_prof.capture.bpf_loader import _attach
    from sparseety_prof.errors import NotAnEngine

    if not _LIBZ.exists():
        pytest.skip(f"{_LIBZ} (zlib) is not installed")
    victim = tmp_path / "libvictim.so"
    shutil.copy(_LIBZ, victim)
    p = subprocess.Popen([PY, "-c", _LOADER, str(victim)], stdout=subprocess.PIPE, text=True)
    b = bcc.BPF(text='int hit(void *ctx) { bpf_trace_printk("hit\\n"); return 0; }')
    try:
        assert p.stdout is not None and p.stdout.readline() == "ready\n"
        (lib,) = [m.path for m in tg.inspect(p.pid).libs if m.path.name == victim.name]
        assert tg.pinned_path(p.pid, lib).startswith(f"/proc/{p.pid}/map_files/")
        vaddr = tg.elf_symbols(lib)["zlibVersion"][0]
        _attach(b.attach_uprobe, lib, vaddr, "hit", p.pid)  # placed through the mapping: it fires
        assert b.num_open_uprobes() == 1
        b.trace_fields()  # blocks until the first hit
        b.detach_uprobe(name=tg.pinned_path(p.pid, lib), addr=vaddr, pid=p.pid)
        # the attack
        os.rename(victim, tmp_path / "moved.so")
        victim.symlink_to("/usr/lib/x86_64-linux-gnu/libc.so.6")
        with pytest.raises(NotAnEngine, match="no longer maps"):
            _attach(b.attach_uprobe, lib, vaddr, "hit", p.pid)
        assert b.num_open_uprobes() == 0
    finally:
        b.cleanup()
        p.kill()
        p.wait()


@pytest.mark.root
def test_model_pinned_by_name_when_the_mapping_links_are_closed_to_the_recorder(
    tmp_path: Path, models: dict[str, Path]
) -> None:
    """A recorder given CAP_BPF and CAP_PERFMON but not CAP_SYS_ADMIN (or CAP_CHECKPOINT_RESTORE)
    may not open /proc/PID/map_files: it still reads the model, pinned at its first open."""
    setpriv = shutil.which("setpriv")
    assert setpriv, "setpriv (util-linux) is part of the base system"
    served = tmp_path / "model.gguf"
    shutil.copy(models["moe"], served)
    p = subprocess.Popen([PY, "-c", _HOLDER, str(served), "mapped"], stdout=subprocess.PIPE, text=True)
    code = f"""
from sparseety_prof.capture import target as tg
from sparseety_prof.capture.gguf_info import sha256_file
from sparseety_prof.session.attach import pin_model
t = tg.inspect({p.pid})
try:
    open(t.models[0].source, "rb")
    print("links open")
except PermissionError:
    print("links closed")
with pin_model(t) as pinned:
    print(sha256_file(pinned))
"""
    try:
        assert p.stdout is not None and p.stdout.readline() == "ready\n"
        r = subprocess.run(
            [setpriv, "--inh-caps=-all", "--bounding-set=-sys_admin,-checkpoint_restore", PY, "-c", code],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            timeout=120,
        )
        assert r.returncode == 0, r.stderr
        assert r.stdout.split() == ["links", "closed", sha256_file(models["moe"])]
    finally:
        p.kill()
        p.wait()
