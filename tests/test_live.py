"""The live view renders immutable snapshots: tested with fixed snapshots at fixed widths (panels,
marks, hostile text), the keys' effect on the view settings, and the key reader on a real pty."""

from __future__ import annotations

import io
import itertools
import os
import pty
import re
import signal
import termios
import time
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from sparseety_prof.views.live import (
    JUMP_MARK,
    SPIKE_MARK,
    LiveState,
    Snapshot,
    ViewSettings,
    apply_key,
    render,
    shade,
)
from sparseety_prof.views.live_keys import KeyReader

DATA = Path(__file__).parent / "data"
N = 16  # tokens of the routed request
JUMP_AT = 10  # every layer switches to other experts here, and keeps them
SPIKE_AT, SPIKE_LAYER = 13, 2  # one layer's activations almost all zero
LAYERS = {"moe": [0, 1, 2, 3], "ffn": [0, 1, 2, 3], "attn": [0, 1, 2, 3]}
HOSTILE_ID = "evil\x1b]52;c;cHduZWQ=\x07[red]id[/red]"
HOSTILE_TEXTS = ["\x1b[2J", "\x9b31m", "\u202egnp.exe", "[/x]", "[link=http://x]y", "\r\x07ok"]


def _routed() -> dict[str, Any]:
    """Request r0-0-1: top-2 routing over 8 experts in 4 layers, the same experts token after token
    but for a little drift in layer 3, and every layer on other experts from JUMP_AT on."""
    experts, zero = [], []
    for i in range(N):
        base = 4 if i >= JUMP_AT else 0
        experts.append(
            [[base, base + 1], [base + 1, base + 2], [base + 2, base + 3], [base, 2 + i % 2 + base]]
        )
        z = [0.5 + 0.01 * ((i * 7 + k) % 3) for k in range(4)]
        if i == SPIKE_AT:
            z[SPIKE_LAYER] = 0.97
        zero.append(z)
    return {
        "request_id": ["r0-0-1"] * N,
        "seq_id": [0] * N,
        "decode_order": list(range(N)),
        "step_id": list(range(N)),
        "token_id": list(range(100, 100 + N)),
        "token_text": [f" w{i}" for i in range(N)],
        "log_prob": [-0.1 - 0.5 * (i % 4) for i in range(N)],
        "partial": [False] * N,
        "expert_ids": experts,
        "act_zero_ratio": zero,
        "act_below_ratio": [[min(1.0, x + 0.2) for x in z] for z in zero],
        # the step's slowest layer: layer 2 but in the last three steps (layer 3), the first
        # token's step (a prompt) without layer times
        "slowest_layer": [None] + [2 if i < N - 3 else 3 for i in range(1, N)],
        "slowest_layer_ms": [None] + [0.5 + 0.25 * (i % 3) for i in range(1, N)],
        "slowest_tid": [None] + [4243] * (N - 1),
    }


def _hostile() -> dict[str, Any]:
    n = len(HOSTILE_TEXTS)
    return {
        "request_id": [HOSTILE_ID] * n,
        "seq_id": [1] * n,
        "decode_order": list(range(n)),
        "step_id": list(range(N, N + n)),
        "token_id": list(range(n)),
        "token_text": HOSTILE_TEXTS,
        "log_prob": [-9.0] * n,
        "partial": [True] * n,
        "expert_ids": [None] * n,
        "act_zero_ratio": [None] * n,
        "act_below_ratio": [None] * n,
    }


def _state() -> LiveState:
    st = LiveState(
        pid=4242,
        engine="llama-cpp-python 0.3.36",
        model="moe.gguf",
        recording="/tmp/rec",
        layers=LAYERS,
        n_experts=8,
    )
    t0 = 10_000_000_000
    for k, batch in enumerate((_routed(), _hostile())):
        n = len(batch["token_id"])
        batch["t_end_ns"] = [t0 + (k * N + i) * 100_000_000 for i in range(n)]
        st.update(
            batch,
            {
                "t_start_ns": [t0 + i * 100_000_000 for i in range(n)],
                "t_end_ns": [t0 + i * 100_000_000 + 2_000_000 for i in range(n)],
            },
            {
                "cpu_s": 0.5,
                "lag_ms": 12.0,
                "rss_bytes": 160 << 20,
                "kernel_drops": 0,
                "seq_gaps": 2,
                "logits_incomplete": 0,
            },
        )
    return st


def _snapshot() -> Snapshot:
    return _state().snapshot(now_ns=12_300_000_000, elapsed_s=10.0)


def _text(width: int, v: ViewSettings | None = None, s: Snapshot | None = None) -> str:
    buf = io.StringIO()
    Console(file=buf, width=width, color_system=None, legacy_windows=False).print(
        render(s or _snapshot(), v, width)
    )
    return buf.getvalue()


def _ansi(width: int, v: ViewSettings | None = None) -> str:
    """The bytes a colour terminal would receive."""
    buf = io.StringIO()
    Console(file=buf, width=width, color_system="truecolor", force_terminal=True).print(
        render(_snapshot(), v, width)
    )
    return buf.getvalue()


def test_snapshot_numbers() -> None:
    s = _snapshot()
    assert s.tokens == N + len(HOSTILE_TEXTS) and s.steps == s.tokens
    assert s.step_p50_ms == pytest.approx(2.0)
    assert [r.request_id for r in s.requests] == ["r0-0-1", HOSTILE_ID]
    assert s.requests[1].partial and s.requests[0].tokens[3].text == " w3"
    assert s.requests[0].tokens[5].experts == tuple(tuple(x) for x in _routed()["expert_ids"][5])
    assert s.moe_layers == (0, 1, 2, 3) and s.n_experts == 8
    # layer 2 was the slowest in 12 of the 15 steps with layer times, at 0.5, 0.75, 1.0 ms in turn
    assert (s.slowest_layer, s.slowest_layer_steps) == (2, (12, 15))
    assert s.slowest_layer_ms == pytest.approx(0.75)
    assert re.search(r"slowest layer +L2 0.75 ms \(12/15 steps\)", _text(120))


def test_marks_are_the_detectors_tokens() -> None:
    """The planted jump and spike, and nothing else, are marked."""
    toks = _snapshot().requests[0].tokens
    assert [i for i, t in enumerate(toks) if t.jump] == [JUMP_AT]
    assert [i for i, t in enumerate(toks) if t.spike] == [SPIKE_AT]
    text = _text(120)
    assert f"{JUMP_MARK} w{JUMP_AT} " in text and f"{SPIKE_MARK} w{SPIKE_AT} " in text
    stream = next(ln for ln in text.splitlines() if "r0-0-1 16 tok" in ln)
    assert stream.count(JUMP_MARK) == 1 and stream.count(SPIKE_MARK) == 1


@pytest.mark.parametrize("width", [80, 120])
def test_view_at_fixed_width(width: int) -> None:
    text = _text(width)
    assert all(len(line) <= width for line in text.splitlines())
    assert "expert load · r0-0-1 · last 16 tokens" not in text  # the newest request is in focus
    golden = DATA / f"live_view_{width}.txt"
    if os.environ.get("UPDATE_GOLDEN"):
        golden.write_text(text)
    assert text == golden.read_text()


@pytest.mark.parametrize("width", [80, 120])
def test_heat_map_and_sparsity_of_the_focused_request(width: int) -> None:
    text = _text(width, ViewSettings(selected="r0-0-1"))
    assert all(len(line) <= width for line in text.splitlines())
    lines = text.splitlines()
    assert "▶ r0-0-1 16 tok" in text
    # the heat map: a row per MoE layer, a column per expert; ground truth from the planted routing
    head = next(i for i, ln in enumerate(lines) if "expert load · r0-0-1 · last 16 tokens" in ln)
    ids = lines[head + 1].strip("│ ").split()
    assert ids == [str(e) for e in range(8)]
    routed = _routed()["expert_ids"]
    for li in range(4):
        row = lines[head + 2 + li].strip("│").split()
        assert row[0] == f"L{li}"
        used = {e for tok in routed for e in tok[li]}
        assert [c != "·" for c in row[1:]] == [e in used for e in range(8)]
    # sparsity: the mean act_zero_ratio per layer, rounded as shown
    zero = _routed()["act_zero_ratio"]
    for li in range(4):
        bars = next(ln for ln in lines if re.search(rf"│ L{li} +zero ", ln))
        mean = sum(z[li] for z in zero) / N
        assert re.search(rf"zero [█░]+ +{mean:.0%}", bars), bars


def test_panels_follow_the_toggles() -> None:
    full = _text(80, ViewSettings(selected="r0-0-1"))
    assert "expert load ·" in full and "sparsity ·" in full and "r0-0-1 16 tok" in full
    v = ViewSettings(selected="r0-0-1")
    for key, gone in (("h", "expert load ·"), ("s", "sparsity ·"), ("t", "r0-0-1 16 tok")):
        off = apply_key(v, key, [])
        shown = _text(80, off)
        assert gone not in shown and all(
            p in shown for p in ("expert load ·", "sparsity ·", "r0-0-1 16 tok") if p != gone
        )
        assert apply_key(off, key, []) == v  # the same key brings it back
    assert "PAUSED" in _text(80, apply_key(v, " ", [])) and "PAUSED" not in full
    assert "p resume" in _text(80, apply_key(v, "p", []))


def test_keys_cycle_the_requests() -> None:
    ids = ["a", "b", "c"]
    v = ViewSettings()
    seen = []
    for _ in range(4):
        v = apply_key(v, "n", ids)
        seen.append(v.selected)
    assert seen == ["a", "b", "c", "a"]  # from the newest (c) on to the oldest
    assert apply_key(ViewSettings(selected="b"), "\t", ids).selected == "c"
    assert apply_key(ViewSettings(), "x", ids) == ViewSettings()
    assert apply_key(ViewSettings(), "n", []) == ViewSettings()


def test_hostile_text_never_reaches_the_terminal() -> None:
    for width in (80, 120):
        for v in (ViewSettings(), ViewSettings(selected="r0-0-1")):
            out = _ansi(width, v)
            # the only escapes are Rich's own SGR colour sequences
            assert not re.sub(r"\x1b\[[0-9;]*m", "", out).count("\x1b")
            assert not any(c in out for c in "\x07\x9b\u202e\r")
            plain = _text(width, v)
            assert "\\x1b[2J" in plain and "\\x9b31m" in plain and "\\u202egnp.exe" in plain
            assert "[/x]" in plain and "[link=http://x]y" in plain  # markup shown, not interpreted
            assert "\\x1b]52;c;cHduZWQ=\\x07[red]id[/red]" in plain.replace("\n", "")


def test_many_experts_are_bucketed_to_fit() -> None:
    st = LiveState(pid=1, engine="e", model="m", recording=None, layers={"moe": [1, 3]}, n_experts=256)
    chosen = [[[0, 255], [7, 8]], [[0, 128], [9, 200]]]
    st.update(
        {
            "request_id": ["r"] * 2,
            "token_id": [1, 2],
            "log_prob": [-1.0, -1.0],
            "partial": [False] * 2,
            "t_end_ns": [1, 2],
            "expert_ids": chosen,
        },
        {},
        {},
    )
    for width, per_col in ((80, 4), (120, 3)):
        text = _text(width, s=st.snapshot(3, 1.0))
        assert all(len(line) <= width for line in text.splitlines())
        assert f"experts 0-255, {per_col} per column" in text
        rows = {ln.strip("│ ").split()[0]: ln.strip("│ ")[3:] for ln in text.splitlines() if "│ L" in ln}
        cols = -(-256 // per_col)
        for layer, label in enumerate(("L1", "L3")):
            cells = rows[label].rstrip()[:cols]
            want = {e // per_col for tok in chosen for e in tok[layer]}
            assert {i for i, c in enumerate(cells) if c != "·"} == want, (label, cells)


def test_view_without_tokens_says_it_waits() -> None:
    st = LiveState(pid=1, engine="e", model="m", recording=None)
    text = _text(80, s=st.snapshot(0, 1.0))
    assert "waiting for tokens" in text and "not recording" in text


def test_shading_marks_unlikely_tokens() -> None:
    assert (
        shade(-0.1) == "green" and shade(-1.0) == "yellow" and "red" in shade(-3.0) and "on red" in shade(-9)
    )
    assert shade(None) == "dim"


def test_key_reader_on_a_terminal_restores_it() -> None:
    master, slave = os.openpty()
    try:
        stream = os.fdopen(slave, "r", closefd=False)
        before = termios.tcgetattr(slave)
        got: list[str] = []
        with pytest.raises(RuntimeError), KeyReader(got.append, stream) as keys:
            assert keys.active
            assert not termios.tcgetattr(slave)[3] & termios.ICANON  # cbreak: a key at a time
            os.write(master, b"pn\th")
            deadline = time.monotonic() + 5
            while len(got) < 4 and time.monotonic() < deadline:
                time.sleep(0.01)
            raise RuntimeError("the view failed")
        assert got == ["p", "n", "\t", "h"]
        assert termios.tcgetattr(slave) == before  # restored on the exception too
    finally:
        os.close(master)
        os.close(slave)


def test_key_reader_ignores_a_stdin_that_is_no_terminal() -> None:
    r, w = os.pipe()
    try:
        with os.fdopen(r, "r", closefd=False) as stream, KeyReader(lambda _k: None, stream) as keys:
            assert not keys.active
    finally:
        os.close(r)
        os.close(w)


def test_many_layers_are_merged_to_fit_the_height() -> None:
    """48 MoE/FFN layers in a 40-line terminal: consecutive layers share rows, all of them shown."""
    n_layers, n = 48, 12
    zero = [[(li % 10) / 10 + 0.001 * t for li in range(n_layers)] for t in range(n)]
    st = LiveState(
        pid=1,
        engine="e",
        model="m",
        recording=None,
        layers={"moe": list(range(n_layers)), "ffn": list(range(n_layers))},
        n_experts=8,
    )
    st.update(
        {
            "request_id": ["r"] * n,
            "seq_id": [0] * n,
            "decode_order": list(range(n)),
            "step_id": list(range(n)),
            "token_id": list(range(n)),
            "log_prob": [-1.0] * n,
            "partial": [False] * n,
            "t_end_ns": list(range(n)),
            "expert_ids": [[[li % 8, (li + 1) % 8] for li in range(n_layers)] for _ in range(n)],
            "act_zero_ratio": zero,
            "act_below_ratio": zero,
        },
        {},
        {},
    )
    s = st.snapshot(n, 1.0)
    unlimited = _text(80, s=s)
    assert all(f"│ L{li} " in unlimited for li in range(n_layers))
    for width in (80, 120):
        buf = io.StringIO()
        Console(file=buf, width=width, color_system=None).print(render(s, ViewSettings(), width, 40))
        lines = buf.getvalue().splitlines()
        assert len(lines) <= 40 and all(len(line) <= width for line in lines)
        heat = [ln for ln in lines if re.match(r"│ L\d+-\d+ +[·░▒▓█]", ln)]
        bars = [ln for ln in lines if re.match(r"│ L\d+-\d+ +zero ", ln)]
        assert heat and len(heat) == len(bars)
        spans = [tuple(map(int, re.findall(r"L(\d+)-(\d+)", ln)[0])) for ln in bars]
        per = spans[0][1] - spans[0][0] + 1
        assert f"{per} layers per row" in buf.getvalue()
        assert [a for a, _ in spans] == list(range(0, n_layers, per)) and spans[-1][1] == n_layers - 1
        for (a, b), ln in zip(spans, bars, strict=True):
            mean = sum(z[li] for z in zero for li in range(a, b + 1)) / (n * (b - a + 1))
            assert re.search(rf"zero [█░]+ +{mean:.0%}", ln), (ln, mean)


def test_key_reader_leaves_the_terminal_alone_in_the_background() -> None:
    """A background job (`attach ... &`) must not touch its terminal: setting it would stop it
    (SIGTTOU). Child on a pty as its controlling terminal; grandchild in another process group."""
    pid, master = pty.fork()
    if pid == 0:  # the child: session leader, the pty its controlling terminal
        code = 1
        try:
            tty_in = os.fdopen(0, "r", closefd=False)  # the pty (sys.stdin is pytest's stand-in)
            g = os.fork()
            if g == 0:
                os.setpgid(0, 0)  # a process group that is not the terminal's foreground one
                with KeyReader(lambda _k: None, tty_in) as keys:
                    os._exit(10 if keys.active else 0)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                done, status = os.waitpid(g, os.WNOHANG | os.WUNTRACED)
                if done:
                    code = 2 if os.WIFSTOPPED(status) else os.waitstatus_to_exitcode(status)
                    if os.WIFSTOPPED(status):
                        os.kill(g, signal.SIGKILL)
                    break
                time.sleep(0.01)
            else:
                os.kill(g, signal.SIGKILL)
                code = 3
            with KeyReader(lambda _k: None, tty_in) as keys:  # the foreground one does read keys
                code = code if keys.active else 4
        finally:
            os._exit(code)
    try:
        _, status = os.waitpid(pid, 0)
        # 0: inactive in the background and not stopped, active in the foreground
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        os.close(master)


def test_each_request_shows_its_rate_and_worst_gap_with_the_steps_batch() -> None:
    """Two requests decoding together; B's prompt shares one step with A's decode: A's worst gap
    is that step's, named with its batch (sequences, rows, prompt rows); the rates are the tokens
    after the first over the time since the first, computed here from the same times."""
    ms = 1_000_000
    # step: (end ms, sequences, rows, prompt rows)
    steps = {0: (5, [0], 6, 6), 1: (7, [0], 1, 0), 2: (16, [0, 1], 9, 8), 3: (18, [0, 1], 2, 0)}
    toks = [("A", 0), ("A", 1), ("A", 2), ("B", 2), ("A", 3), ("B", 3)]
    st = LiveState(pid=1, engine="e", model="m", recording=None)
    st.update(
        {
            "request_id": [r for r, _ in toks],
            "token_id": list(range(len(toks))),
            "token_text": ["x"] * len(toks),
            "log_prob": [-0.1] * len(toks),
            "partial": [False] * len(toks),
            "step_id": [s for _, s in toks],
            "t_end_ns": [steps[s][0] * ms for _, s in toks],
        },
        {
            "step_id": list(steps),
            "t_start_ns": [(v[0] - 1) * ms for v in steps.values()],
            "t_end_ns": [v[0] * ms for v in steps.values()],
            "seq_ids": [v[1] for v in steps.values()],
            "n_tokens": [v[2] for v in steps.values()],
            "prompt_rows": [v[3] for v in steps.values()],
        },
        {},
    )
    views = {r.request_id: r for r in st.snapshot(now_ns=20 * ms, elapsed_s=1.0).requests}
    for rid in ("A", "B"):
        own = [s for r, s in toks if r == rid]
        ends = [steps[s][0] for s in own]
        worst, worst_step = max((steps[b][0] - steps[a][0], b) for a, b in itertools.pairwise(own))
        v = views[rid]
        assert v.tokens_per_s == pytest.approx((len(ends) - 1) / ((ends[-1] - ends[0]) / 1e3))
        assert v.worst_gap_ms == pytest.approx(worst)
        _, seqs, rows, prompt = steps[worst_step]
        assert v.worst_gap_step is not None
        assert (v.worst_gap_step.seqs, v.worst_gap_step.rows, v.worst_gap_step.prompt_rows) == (
            len(seqs),
            rows,
            prompt,
        )
    text = _text(160, s=st.snapshot(now_ns=20 * ms, elapsed_s=1.0))
    assert "A 4 tok · 230.8 tok/s · worst gap 9 ms (2 seqs, 9 rows, 8 prompt)" in text
