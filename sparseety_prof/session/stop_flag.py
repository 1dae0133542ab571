"""A stop request that a signal handler may raise.

threading.Event cannot be set from a signal handler: Python runs handlers on the main thread
between two bytecodes, and when the main thread is inside Event.wait() at that moment it holds
the lock that Event.set() takes, so the handler waits for itself for ever (measured: 7 hangs in
300 Ctrl-C's on a loop of short waits; one of them hung a test of the recorder's stop). Here
setting takes no lock: a plain attribute store, then one byte written to a non-blocking pipe that
the waiter selects on (a select interrupted by the signal is retried, and finds the byte)."""

from __future__ import annotations

import contextlib
import os
import select


class StopFlag:
    """set() from anywhere (a signal handler, another thread), is_set() anywhere, wait() on one
    thread at a time. close() when done with it (two file descriptors)."""

    def __init__(self) -> None:
        self._set = False
        self._r, self._w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    def set(self) -> None:
        self._set = True
        # full (a byte is pending already) or closed: the waiter is woken or gone either way
        with contextlib.suppress(OSError):
            os.write(self._w, b"!")

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float) -> bool:
        """Until set or `timeout` seconds passed: whether it is set."""
        if not self._set and timeout > 0:
            with contextlib.suppress(OSError, ValueError):
                select.select([self._r], [], [], timeout)
        return self._set

    def close(self) -> None:
        for fd in (self._r, self._w):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._r = self._w = -1

    def __del__(self) -> None:
        if self._r >= 0:
            self.close()
