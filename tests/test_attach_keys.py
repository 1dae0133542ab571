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


def _all_in(screen: str, *parts: str) -> bool:
    return all(part in screen for part in parts)


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
        # the newest request is in focus: its heat map (a row per MoE layer) and sparsity bars
        focus = ["expert load · r0-0-2 · last 24 tokens", "sparsity · r0-0-2", "▶ r0-0-2 24 tok"]
        focus += ["experts 0-7, one per column", *(f"│ L{i} " for i in range(4))]
        screen = _until(session, lambda s: _all_in(s, *focus))
        assert all(len(line) <= WIDTH for line in screen.splitlines())

        _tmux("send-keys", "-t", session, "n")
        # the whole predicate, not one line of it: tmux may catch the view mid-redraw
        _until(session, lambda s: _all_in(s, "expert load · r0-0-1", "▶ r0-0-1 24 tok", "sparsity · r0-0-1"))

        _tmux("send-keys", "-t", session, "h")
        _until(session, lambda s: "expert load" not in s and _all_in(s, "sparsity · r0-0-1", "r0-0-2 24 tok"))

        _tmux("send-keys", "-t", session, "p")
        _until(session, lambda s: "PAUSED" in s)
        third = llama_engine.generate(["the sparse decode sample"], max_tokens=24)
        time.sleep(1.5)  # several refreshes' worth: the screen stays as it was
        assert "r0-0-3" not in _screen(session) and "PAUSED" in _screen(session)
        _tmux("send-keys", "-t", session, "p")
        screen = _until(session, lambda s: "r0-0-3 24 tok" in s and "PAUSED" not in s)

        _tmux("send-keys", "-t", session, "q")
        _until(session, lambda s: _all_in(" ".join(s.split()), "stopped: q pressed", "72 tokens"))
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
    rec = sparseety_prof.open(out)
    assert rec.complete and rec.meta["stop_reason"] == "q pressed"
    ids = rec.tokens().sort("request_id", "decode_order").group_by("request_id", maintain_order=True)
    assert [g["token_id"].to_list() for _, g in ids] == [r["ids"] for r in [*first, *third]]
