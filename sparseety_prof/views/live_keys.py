"""Keys for the live view: stdin read one key at a time (cbreak mode: no Enter needed, Ctrl-C
still a signal) on a thread, only when stdin is a terminal we are in the foreground of; the
terminal's settings come back on exit, exceptions included."""

from __future__ import annotations

import os
import select
import sys
import threading
from collections.abc import Callable
from types import TracebackType
from typing import IO, Any

POLL_S = 0.1  # how often the reader looks whether it should stop


def _foreground(fd: int) -> bool:
    """Whether our process group is the terminal's foreground one (True for a terminal that is
    not our controlling terminal: job control, and its stop signals, only concern that one)."""
    try:
        return os.tcgetpgrp(fd) == os.getpgrp()
    except OSError:
        return True


class KeyReader:
    """`with KeyReader(on_key):` calls `on_key(character)` from its thread for each key pressed."""

    def __init__(self, on_key: Callable[[str], None], stream: IO[str] | None = None) -> None:
        self.on_key = on_key
        self.stream = stream if stream is not None else sys.stdin
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._saved: list[Any] | None = None

    @property
    def active(self) -> bool:
        return self._thread is not None

    def __enter__(self) -> KeyReader:
        try:
            fd = self.stream.fileno()
            # a job in the background (`attach ... &`) that set or read its terminal would be
            # stopped (SIGTTOU, SIGTTIN): keys only for the foreground
            usable = os.isatty(fd) and _foreground(fd)
        except (AttributeError, OSError, ValueError):  # closed, redirected or a pseudo-file
            return self
        if not usable:
            return self
        import termios
        import tty

        self._saved = termios.tcgetattr(fd)
        tty.setcbreak(fd, termios.TCSANOW)
        self._thread = threading.Thread(target=self._read, args=(fd,), name="live-keys", daemon=True)
        self._thread.start()
        return self

    def __exit__(
        self, _t: type[BaseException] | None, _e: BaseException | None, _tb: TracebackType | None
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * POLL_S + 1)
        if self._saved is not None:
            import termios

            termios.tcsetattr(self.stream.fileno(), termios.TCSADRAIN, self._saved)
            self._saved = None

    def _read(self, fd: int) -> None:
        while not self._stop.is_set():
            ready, _, _ = select.select([fd], [], [], POLL_S)
            if not ready:
                continue
            data = os.read(fd, 64)
            if not data:  # the terminal went away
                return
            for ch in data.decode("utf-8", "replace"):
                self.on_key(ch)
