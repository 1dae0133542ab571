"""The model file's hash on its own thread (session/model_hasher.py): its result, a file that
cannot be read, and a read that stops making progress, which close must not wait on for ever."""

from __future__ import annotations

import hashlib
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from sparseety_prof.capture.untrusted_files import PinnedFile
from sparseety_prof.session import model_hasher
from sparseety_prof.session.model_hasher import ModelHasher


def test_the_hash_of_a_readable_file_is_its_sha256(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    model = tmp_path / "m.gguf"
    model.write_bytes(b"not a gguf file" * 1000)
    pinned = PinnedFile(model)
    try:
        h = ModelHasher(pinned)
        h.start()
        said: list[str] = []
        sha256, weights = h.finish(said.append)
    finally:
        pinned.close()
    assert sha256 == hashlib.sha256(model.read_bytes()).hexdigest()
    assert weights is not None and "error" in weights  # not a GGUF: the scan says why, nothing raised
    assert h.cpu_s > 0.0


def test_a_file_that_cannot_be_read_is_recorded_as_not_hashed(monkeypatch: pytest.MonkeyPatch) -> None:
    def unreadable(_f: Any, *, progress: Any = None) -> str:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(model_hasher, "model_sha256", unreadable)
    h = ModelHasher(object())
    h.start()
    sha256, weights = h.finish(lambda _s: None)
    assert sha256 is None
    assert weights == {"error": "model file not hashed: [Errno 5] Input/output error"}


def test_a_read_that_stops_making_progress_is_abandoned_after_the_stall_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    release = threading.Event()

    def hangs_after_a_while(_f: Any, *, progress: Any = None) -> str:
        for i in range(3):  # reads that move on...
            progress(i, 10)
            time.sleep(0.2)
        release.wait(30)  # ...then one that hangs (a network file system gone away)
        return "0" * 64

    monkeypatch.setattr(model_hasher, "model_sha256", hangs_after_a_while)
    h = ModelHasher(object(), stall_s=1.0)
    h.start()
    said: list[str] = []
    t0 = time.monotonic()
    try:
        sha256, weights = h.finish(said.append)
        waited = time.monotonic() - t0
    finally:
        release.set()
    assert sha256 is None
    assert weights == {"error": "model file not hashed: reading it stalled"}
    # it waited while the reads moved on (0.6 s), then gave up one stall time after the last
    assert 1.0 <= waited < 10.0
    assert said[0] == "sparseety-prof: finishing the model file's sha256 ..."
    assert said[-1] == "sparseety-prof: model file's sha256 abandoned (no progress for 1 s)"
