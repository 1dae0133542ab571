"""`attach` on a live engine, driven through tmux and read off the screen as a person would."""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from conftest import CLI, ROOT, Engine

import sparseety_prof

pytestmark = [pytest.mark.root, pytest.mark.engine]


def _tmux(*args: str) -> str:
    return subprocess.run(["tmux", *args], capture_output=True, text=True, check=True).stdout


def _screen(session: str) -> str:
    """The pane's text with wrapped lines joined back (the summary line is longer than the pane)."""
    return " ".join(_tmux("capture-pane", "-p", "-J", "-t", session).split())


def test_attach_shows_live_tokens_and_records(llama_engine: Engine, tmp_path: Path) -> None:
    assert shutil.which("tmux"), "tmux is installed by scripts/setup.sh"
    session = f"sp{llama_engine.pid}"
    out = tmp_path / "rec"
    # the pane's own size, not LINES/COLUMNS inherited from whoever runs the tests (Rich prefers them)
    cmd = " ".join(
        ["env -u LINES -u COLUMNS", *CLI, "attach", "--pid", str(llama_engine.pid), "-o", str(out)]
    )
    _tmux("new-session", "-d", "-s", session, "-x", "120", "-y", "40", "-c", str(ROOT), f"{cmd}; sleep 60")
    try:
        deadline = time.monotonic() + 60
        while "waiting for tokens" not in _screen(session) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "waiting for tokens" in _screen(session)
        results = llama_engine.generate(["hello the expert router"], max_tokens=24)
        deadline = time.monotonic() + 20
        while "24 tok" not in _screen(session) and time.monotonic() < deadline:
            time.sleep(0.2)
        screen = _screen(session)
        assert f"PID {llama_engine.pid}" in screen and "llama-cpp-python" in screen
        assert re.search(r"r0-0-1 24 tok · [0-9.]+ tok/s", screen), screen
        assert "tokens/s" in screen and "step p99" in screen and "profiler CPU" in screen
        _tmux("send-keys", "-t", session, "C-c")
        deadline = time.monotonic() + 20
        while "stopped: SIGINT" not in _screen(session) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "24 tokens" in _screen(session) and "stopped: SIGINT" in _screen(session)
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
    rec = sparseety_prof.open(out)
    assert rec.tokens()["token_id"].to_list() == results[0]["ids"]
    shown = [
        t for t in rec.tokens()["token_text"].to_list() if t and t.strip().isascii() and len(t.strip()) > 2
    ]
    assert shown and any(t.strip() in screen for t in shown)
