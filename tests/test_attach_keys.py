"""`attach`'s keys on a live engine, through tmux at a fixed 80 columns: pause, next request, panel
toggles and q, read off the screen as a person would; q closes the recording complete."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import CLI, ROOT, Engine

import sparseety_prof

pytestmark = [pytest.mark.root, pytest.mark.engine]

WIDTH, HEIGHT = 80, 70


def _tmux(*args: str) -> str:
    return subprocess.run(["tmux", *args], capture_output=True, text=True, check=True).stdout


def _screen(session: str) -> str:
    return _tmux("capture-pane", "-p", "-t", session)


def _until(session: str, ok: Callable[[str], bool], timeout: float = 30) -> str:
    deadline = time.monotonic() + timeout
    screen = _screen(session)
    while not ok(screen) and time.monotonic() < deadline:
        time.sleep(0.2)
        screen = _screen(session)
    assert ok(screen), screen
    return screen


def test_keys_pause_switch_toggle_and_quit(llama_engine: Engine, tmp_path: Path) -> None:
    assert shutil.which("tmux"), "tmux is installed by scripts/setup.sh"
    session = f"spk{llama_engine.pid}"
    out = tmp_path / "rec"
    # the pane's own size, not LINES/COLUMNS inherited from whoever runs the tests (Rich prefers them)
    cmd = " ".join(
        ["env -u LINES -u COLUMNS", *CLI, "attach", "--pid", str(llama_engine.pid), "-o", str(out)]
    )
    size = ["-x", str(WIDTH), "-y", str(HEIGHT)]
    _tmux("new-session", "-d", "-s", session, *size, "-c", str(ROOT), f"{cmd}; sleep 60")
    try:
        _until(session, lambda s: "waiting for tokens" in s, 60)
        first = llama_engine.generate(["hello the expert router", "one two three"], max_tokens=24)
        screen = _until(session, lambda s: "r0-0-2 24 tok" in s)
        assert all(len(line) <= WIDTH for line in screen.splitlines())
        # the newest request is in focus: its heat map (a row per MoE layer) and sparsity bars
        assert "expert load · r0-0-2 · last 24 tokens" in screen and "sparsity · r0-0-2" in screen
        assert "▶ r0-0-2 24 tok" in screen and "experts 0-7, one per column" in screen
        assert all(f"│ L{i} " in screen for i in range(4))

        _tmux("send-keys", "-t", session, "n")
        screen = _until(session, lambda s: "expert load · r0-0-1" in s)
        assert "▶ r0-0-1 24 tok" in screen and "sparsity · r0-0-1" in screen

        _tmux("send-keys", "-t", session, "h")
        screen = _until(session, lambda s: "expert load" not in s)
        assert "sparsity · r0-0-1" in screen and "r0-0-2 24 tok" in screen

        _tmux("send-keys", "-t", session, "p")
        _until(session, lambda s: "PAUSED" in s)
        third = llama_engine.generate(["the sparse decode sample"], max_tokens=24)
        time.sleep(1.5)  # several refreshes' worth: the screen stays as it was
        assert "r0-0-3" not in _screen(session) and "PAUSED" in _screen(session)
        _tmux("send-keys", "-t", session, "p")
        screen = _until(session, lambda s: "r0-0-3 24 tok" in s and "PAUSED" not in s)

        _tmux("send-keys", "-t", session, "q")
        screen = _until(session, lambda s: "stopped: q pressed" in " ".join(s.split()))
        assert "72 tokens" in " ".join(screen.split())
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
    rec = sparseety_prof.open(out)
    assert rec.complete and rec.meta["stop_reason"] == "q pressed"
    ids = rec.tokens().sort("request_id", "decode_order").group_by("request_id", maintain_order=True)
    assert [g["token_id"].to_list() for _, g in ids] == [r["ids"] for r in [*first, *third]]
