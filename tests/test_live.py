"""The live view renders immutable snapshots: tested with fixed snapshots at fixed widths."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest

from sparseety_prof.views.live import LiveState, Snapshot, render, shade

DATA = Path(__file__).parent / "data"


def _state() -> LiveState:
    st = LiveState(pid=4242, engine="llama-cpp-python 0.3.36", model="moe.gguf", recording="/tmp/rec")
    t0 = 10_000_000_000
    st.update(
        {
            "request_id": ["r0-0-1"] * 4 + ["r0-0-2"] * 3,
            "token_id": [5, 6, 7, 8, 9, 10, 11],
            "token_text": [" the", " sparse", " router", "\n", " again", None, " x"],
            "log_prob": [-0.1, -1.0, -3.0, -7.5, None, -0.2, -0.4],
            "partial": [False] * 4 + [True] * 3,
            "t_end_ns": [t0 + i * 100_000_000 for i in range(7)],
        },
        {
            "t_start_ns": [t0 + i * 100_000_000 for i in range(7)],
            "t_end_ns": [t0 + i * 100_000_000 + 2_000_000 for i in range(7)],
        },
        {"cpu_s": 0.5, "lag_ms": 12.0, "kernel_drops": 0, "seq_gaps": 2, "logits_incomplete": 0},
    )
    return st


def _snapshot() -> Snapshot:
    return _state().snapshot(now_ns=10_700_000_000, elapsed_s=10.0)


def _text(width: int) -> str:
    from rich.console import Console

    buf = io.StringIO()
    Console(file=buf, width=width, color_system=None, legacy_windows=False).print(render(_snapshot()))
    return buf.getvalue()


def test_snapshot_numbers() -> None:
    s = _snapshot()
    assert s.tokens == 7 and s.steps == 7
    assert s.tokens_per_s == pytest.approx(7 / 5)
    assert s.step_p50_ms == pytest.approx(2.0)
    assert [r.request_id for r in s.requests] == ["r0-0-1", "r0-0-2"]
    assert s.requests[1].partial and s.requests[1].tokens[1] == ("<10>", -0.2)


@pytest.mark.parametrize("width", [80, 120])
def test_view_at_fixed_width(width: int) -> None:
    text = _text(width)
    assert all(len(line) <= width for line in text.splitlines())
    golden = DATA / f"live_view_{width}.txt"
    if os.environ.get("UPDATE_GOLDEN"):
        golden.write_text(text)
    assert text == golden.read_text()


def test_view_without_tokens_says_it_waits() -> None:
    st = LiveState(pid=1, engine="e", model="m", recording=None)
    from rich.console import Console

    buf = io.StringIO()
    Console(file=buf, width=80, color_system=None).print(render(st.snapshot(0, 1.0)))
    assert "waiting for tokens" in buf.getvalue() and "not recording" in buf.getvalue()


def test_shading_marks_unlikely_tokens() -> None:
    assert (
        shade(-0.1) == "green" and shade(-1.0) == "yellow" and "red" in shade(-3.0) and "on red" in shade(-9)
    )
    assert shade(None) == "dim"
