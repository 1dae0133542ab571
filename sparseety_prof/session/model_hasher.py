"""The model file's sha256 and static weight sparsity, made on a thread of their own while the
recording runs: a large model takes minutes to read, and the consumer must drain from the start.

The file is the target's (capture/target.py opened it pinned): it may vanish, be swapped or hang
on a read. A failure is recorded in meta.json `weight_sparsity` instead of a result; at close the
recorder waits for as long as the hash makes progress, never for a read that hangs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from sparseety_prof.capture.weight_sparsity import analyze as analyze_weights
from sparseety_prof.capture.weight_sparsity import model_sha256

HASH_STALL_S = 30.0  # close gives up on the model's sha256 after this long without progress


class ModelHasher:
    """`start()` hashes and scans `model_file` (a PinnedFile) on a daemon thread; `finish()`
    waits for it and returns what it found."""

    def __init__(self, model_file: Any, *, stall_s: float = HASH_STALL_S) -> None:
        self._file = model_file
        self._stall_s = stall_s
        self._found: dict[str, Any] = {}
        self._moved = time.monotonic()  # when the thread last read something
        self.cpu_s = 0.0  # the thread's CPU time, from its start (meta.json cpu_s_by_stage model_hash)
        self._thread = threading.Thread(target=self._run, name="model-sha256", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def finish(self, log: Callable[[str], None]) -> tuple[str | None, dict[str, Any] | None]:
        """The sha256 (None when the file could not be read) and the weight scan's result (or
        {"error": ...}), once the thread is done, or abandoned after `stall_s` without progress."""
        if self._thread.is_alive():
            log("sparseety-prof: finishing the model file's sha256 ...")
        while self._thread.is_alive() and time.monotonic() - self._moved < self._stall_s:
            self._thread.join(0.5)
        if self._thread.is_alive():
            log(f"sparseety-prof: model file's sha256 abandoned (no progress for {self._stall_s:.0f} s)")
            return None, {"error": "model file not hashed: reading it stalled"}
        return self._found.get("sha256"), self._found.get("weights")

    def _progress(self, _done: int, _total: int) -> None:
        self._moved = time.monotonic()

    def _run(self) -> None:
        try:
            self._hash_and_scan()
        finally:
            self.cpu_s = time.thread_time()

    def _hash_and_scan(self) -> None:
        # the model's sha256, then its static weight sparsity (cached per sha256)
        try:
            self._found["sha256"] = model_sha256(self._file, progress=self._progress)
        except OSError as e:  # the file is the target's: gone, swapped, unreadable
            self._found["weights"] = {"error": f"model file not hashed: {e}"}
            return
        try:
            self._found["weights"] = analyze_weights(
                self._file, sha256=self._found["sha256"], progress=self._progress
            )
        except Exception as e:  # a cache problem must not lose the recording
            self._found["weights"] = {"error": str(e)}
