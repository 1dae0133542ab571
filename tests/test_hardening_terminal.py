"""Terminal injection (issue 18, item 4): strings from the target, its clients or a recording
reach the terminal with hidden characters spelled out and Rich markup shown as text, by every
view; the recording keeps the exact bytes. Each test plants the hostile strings where an attacker
can: a client's X-Request-Id on a real llama-server, the model's file name, a recording's files."""

from __future__ import annotations

import io
import json
import os
import pty
import re
import shutil
import signal
import struct
import subprocess
import termios
import threading
import time
import urllib.request
from fcntl import ioctl
from pathlib import Path
from typing import Any, cast

import polars as pl
import pytest
from conftest import CLI, ENGINES, ROOT, Engine, free_port, run_cli
from rich.console import Console
from test_diff import request, tokens, write

import sparseety_prof
from sparseety_prof.checks import Check
from sparseety_prof.store import schema
from sparseety_prof.store.recording_writer import RecordingWriter
from sparseety_prof.terminal_text import json_dumps, line, markup, text, visible
from sparseety_prof.views.diff import diff_recordings, render
from sparseety_prof.views.live import LiveState
from sparseety_prof.views.live import render as render_live
from sparseety_prof.views.report import print_report

MARKUP = "[link=http://x]a[/link][/x][bold]"
# clear screen, window title, clipboard write (7-bit and 8-bit C1 forms), a C1 CSI, a bidi override
ESCAPES = "\x1b[2J\x1b]0;title\x07\x1b]52;c;SGVsbG8=\x07\x9d52;c;SGVsbG8=\x9c\x9b31m\u202e\x7f"
HOSTILE = f"evil{ESCAPES}{MARKUP}"
# what a llama-server (cpp-httplib) lets through in a header: no C0/DEL, but C1 and bidi as UTF-8
HEADER_ID = f"{MARKUP}\u202e\u009d52;c;SGVsbG8=\u009c\u009b2J\tEND"
INJECTED = ("\x1b]", "\x1b[2J", "\x07", "\x9b", "\x9c", "\x9d", "\u202e", "\x7f")


def assert_shown_safely(out: str, *shown: str) -> None:
    """`out` (a terminal's bytes, decoded) carries none of the injected sequences, no hyperlink,
    and shows each of `shown` spelled out."""
    for seq in INJECTED:
        assert seq not in out, (seq, out)
    plain = without_styles(out)
    for s in shown:
        assert visible(s) in plain, (visible(s), plain)


def without_styles(out: str) -> str:
    """The text of a terminal's output: Rich's own colour codes (SGR) removed."""
    return re.sub(r"\x1b\[[0-9;]*m", "", out)


def terminal() -> tuple[Console, io.StringIO]:
    """A Console that writes what a colour terminal gets (links become OSC 8 sequences)."""
    buf = io.StringIO()
    return Console(file=buf, force_terminal=True, color_system="truecolor", width=1000), buf


# ------------------------------------------------------------------ the helper itself
def test_every_hidden_character_is_spelled_out_and_markup_escaped() -> None:
    assert visible("a\x1b[2Jb") == "a\\x1b[2Jb"
    assert visible("\x07\x7f\x9b\x00") == "\\x07\\x7f\\x9b\\x00"
    assert visible("\u202e\u2066\u200b\ufeff\u2028\U000e0041") == (
        "\\u202e\\u2066\\u200b\\ufeff\\u2028\\U000e0041"
    )
    assert visible("a\nb\tc\r") == "a\\nb\\tc\\r"
    assert line("one\ntwo\x1b]0;t\x07") == "one\ntwo\\x1b]0;t\\x07"
    assert visible("ünïcødé ▁the 猫 👩\u200d💻") == "ünïcødé ▁the 猫 👩\u200d💻"  # text stays text
    assert visible(visible(HOSTILE)) == visible(HOSTILE)
    assert markup(MARKUP) == "\\[link=http://x]a\\[/link]\\[/x]\\[bold]"
    con, buf = terminal()
    con.print(markup(HOSTILE))
    con.print(text(HOSTILE, "bold"))
    assert_shown_safely(buf.getvalue(), HOSTILE)
    assert without_styles(buf.getvalue()).count(visible(HOSTILE)) == 2
    data = {"id": HOSTILE, "t": "\u2028"}
    assert json.loads(json_dumps(data, ensure_ascii=False)) == data  # the same data, escaped
    assert_shown_safely(json_dumps(data, ensure_ascii=False))


# ------------------------------------------------------------------ views on planted strings
def _planted_frame(table: str, given: dict[str, list[object]]) -> pl.DataFrame:
    """A table of one row: the given columns, every other column null."""
    return schema.frame(table, given, absent=[c for c in schema.TABLES[table] if c not in given])


def _hostile_recording(path: Path) -> Path:
    """A recording whose every string (meta.json, ids, token text, kernel names) is hostile."""
    meta = {
        "engine": {"name": HOSTILE, "version": HOSTILE},
        "model": {"path": f"/m/{HOSTILE}.gguf", "architecture": HOSTILE, "sha256": HOSTILE},
        "target": {"pid": HOSTILE},
        "layers": {"moe": [3, 7], "ffn": [0, 3, 7], "attn": [0, 1]},
    }
    w = RecordingWriter(path, meta)
    w.append("tokens", tokens(request(HOSTILE, mutate=lambda k, row: row.update(token_text=HOSTILE))))
    w.append(
        "requests",
        _planted_frame(
            "requests",
            {"request_id": [HOSTILE], "id_source": [HOSTILE], "ttft_ms": [1.0], "end_reason": [HOSTILE]},
        ),
    )
    w.append(
        "kernels",
        _planted_frame("kernels", {"name": [HOSTILE], "start_ns": [0], "end_ns": [10], "step_id": [1]}),
    )
    w.close(losses={HOSTILE: 1})
    return path


def test_report_on_a_planted_recording_shows_every_string_escaped(tmp_path: Path) -> None:
    rec = _hostile_recording(tmp_path / "rec")
    con, buf = terminal()
    print_report(rec, console=con)
    assert_shown_safely(buf.getvalue(), HOSTILE, f"/m/{HOSTILE}.gguf")
    # and through the command, as a person runs it: no MarkupError, exit 0
    r = run_cli("report", str(rec), env={"COLUMNS": "1000", "PATH": "/usr/bin:/bin", "FORCE_COLOR": "1"})
    assert r.returncode == 0, r.stderr
    assert_shown_safely(r.stdout, HOSTILE)
    # the recording keeps the exact bytes
    stored = sparseety_prof.open(rec)
    assert stored.meta["model"]["path"] == f"/m/{HOSTILE}.gguf"
    assert set(stored.tokens()["request_id"]) == {HOSTILE} and set(stored.kernels()["name"]) == {HOSTILE}


def test_diff_of_planted_recordings_shows_every_string_escaped(tmp_path: Path) -> None:
    def change(k: int, row: dict[str, Any]) -> None:
        row["token_text"] = HOSTILE
        if k >= 3:
            row["token_id"] += 50

    a = write(tmp_path / "a", tokens(request(HOSTILE, mutate=lambda k, row: row.update(token_text=HOSTILE))))
    b = write(tmp_path / f"b{ESCAPES}[link=x]a[bold]", tokens(request(f"{HOSTILE}2", mutate=change)))
    con, buf = terminal()
    render(diff_recordings(a, b), con, name_a=str(a), name_b=str(b))
    assert_shown_safely(buf.getvalue(), HOSTILE, f"{HOSTILE}2", str(b))
    r = run_cli("diff", str(a), str(b), env={"COLUMNS": "1000", "PATH": "/usr/bin:/bin", "FORCE_COLOR": "1"})
    assert r.returncode == 1, r.stderr
    assert_shown_safely(r.stdout, HOSTILE)
    r = run_cli("diff", str(a), str(b), "--json")
    assert r.returncode == 1, r.stderr
    assert_shown_safely(r.stdout)
    assert json.loads(r.stdout)["pairs"][0]["request_a"] == HOSTILE  # the JSON keeps the exact string


def test_live_view_shows_planted_ids_tokens_and_model_name_escaped() -> None:
    st = LiveState(pid=1, engine=HOSTILE, model="evil[/x].gguf", recording=f"/tmp/{HOSTILE}")
    st.update(
        {
            "request_id": [HOSTILE, HOSTILE],
            "token_id": [5, 6],
            "token_text": [HOSTILE, "[/x]"],
            "log_prob": [-0.1, -9.0],
            "partial": [False, False],
            "t_end_ns": [1, 2],
        },
        {"t_start_ns": [0], "t_end_ns": [1]},
        {},
    )
    con, buf = terminal()
    con.print(render_live(st.snapshot(now_ns=3, elapsed_s=1.0)))
    assert_shown_safely(buf.getvalue(), HOSTILE, "evil[/x].gguf", f"/tmp/{HOSTILE}")


def test_doctor_and_errors_show_target_strings_escaped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from sparseety_prof.commands.doctor import print_checks

    monkeypatch.setenv("FORCE_COLOR", "1")
    monkeypatch.setenv("COLUMNS", "1000")
    print_checks([Check(HOSTILE, False, f"exe {HOSTILE}", f"fix {HOSTILE}")])
    assert_shown_safely(capsys.readouterr().out, HOSTILE)
    # an error message naming a planted path (not a recording): one escaped line, exit 7
    planted = Path(f"{tmp_path}/{HOSTILE}")  # its slashes make folders: "[/x]" is in the path
    planted.mkdir(parents=True)
    r = run_cli("report", str(planted))
    assert r.returncode == 7, r.stderr
    assert r.stderr.startswith("sparseety-prof: error:")
    assert_shown_safely(r.stderr, str(planted))


# ------------------------------------------------------------------ a real engine and client
def _read_all(fd: int, into: bytearray, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            return
        if not chunk:
            return
        into += chunk


def _wait(buf: bytearray, text: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        screen = buf.decode("utf-8", "replace")
        if text in screen:
            return screen
        time.sleep(0.2)
    raise TimeoutError(f"{text!r} not on the terminal: {buf.decode('utf-8', 'replace')[-3000:]}")


@pytest.mark.root
@pytest.mark.engine
def test_attach_on_a_real_server_with_a_hostile_header_and_model_name(
    models: dict[str, Path], tmp_path: Path
) -> None:
    """llama-server serving a model file named `evil[/x]<ESC>]0;t<BEL>.gguf`, a client sending an
    X-Request-Id with markup, C1 clipboard writes and a bidi override: `attach` in a terminal (a
    pty) neither crashes nor passes them, the recording holds the exact bytes, `report` shows
    them escaped."""
    evil_model = tmp_path / "evil[/x]\x1b]0;t\x07.gguf"  # the slash makes a folder "evil["
    evil_model.parent.mkdir()
    shutil.copy(models["moe"], evil_model)
    server = Engine([str(ENGINES / "server_engine.py"), str(evil_model), "--port", str(free_port())])
    out = tmp_path / "rec"
    master, slave = pty.openpty()
    ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 60, 400, 0, 0))
    env = {**os.environ, "TERM": "xterm-256color", "PYTHONPATH": str(ROOT)}
    env.pop("COLUMNS", None)
    env.pop("LINES", None)
    attach = subprocess.Popen(
        [*CLI, "attach", "--pid", str(server.pid), "-o", str(out)],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        cwd=ROOT,
        env=env,
        start_new_session=True,
    )
    os.close(slave)
    seen = bytearray()
    stop = threading.Event()
    reader = threading.Thread(target=_read_all, args=(master, seen, stop), daemon=True)
    reader.start()
    try:
        _wait(seen, "waiting for tokens", 120)
        req = urllib.request.Request(
            server.ready["url"] + "/completion",
            data=json.dumps(
                {"prompt": "hello the expert", "n_predict": 8, "ignore_eos": True, "return_tokens": True}
            ).encode(),
            # bytes: http.client sends them as they are (a str would have to be latin-1)
            headers={"Content-Type": "application/json", "X-Request-Id": cast(str, HEADER_ID.encode())},
        )
        with urllib.request.urlopen(req, timeout=120) as r:
            answer = json.loads(r.read())
        _wait(seen, visible(HEADER_ID), 30)
        attach.send_signal(signal.SIGINT)
        assert attach.wait(timeout=60) == 0, seen.decode("utf-8", "replace")[-3000:]
    finally:
        if attach.poll() is None:
            attach.kill()
            attach.wait()
        stop.set()
        os.close(master)
        reader.join(timeout=5)
        server.close()
    screen = seen.decode("utf-8", "replace")
    assert "stopped: SIGINT" in screen
    assert_shown_safely(screen, HEADER_ID, evil_model.name)  # live view and the attach log line
    assert "\x1b]0;t" not in screen

    rec = sparseety_prof.open(out)
    assert rec.meta["model"]["path"] == str(evil_model)  # exact bytes, ESC and BEL included
    got = rec.tokens()
    assert set(got["request_id"]) == {HEADER_ID}
    assert got["token_id"].to_list() == answer["tokens"] and got.height == 8

    r = run_cli("report", str(out), env={"COLUMNS": "1000", "PATH": "/usr/bin:/bin", "FORCE_COLOR": "1"})
    assert r.returncode == 0, r.stderr
    assert_shown_safely(r.stdout, HEADER_ID, str(evil_model))
    assert not re.search(r"\x1b\]8;", r.stdout)  # no hyperlink made of [link=...]
