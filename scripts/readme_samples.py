"""The README's sample outputs, from a real run: xllamacpp's llama-server on a generated MoE model,
the quick start's commands run against it, and each command's output written into README.md
between its markers (<!-- sample:NAME --> ... <!-- /sample -->).

    .venv/bin/python scripts/readme_samples.py            # run, and rewrite the samples
    .venv/bin/python scripts/readme_samples.py --check    # run, and compare (exit 1 on a difference)

Needs a root shell (the commands attach to the engine). What differs from run to run (times, PIDs,
counts, hashes, paths, column widths) is normalised before comparing (`normalise`), so `--check`
fails when a command prints other lines or other words, not other numbers. tests/test_readme_samples.py
runs the check.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sparseety_prof.synthetic import make_model  # noqa: E402

README = ROOT / "README.md"
#: the terminal the samples are printed for: the README's code blocks stay within it
COLUMNS, LINES = 100, 34
#: the run's scratch directory: a fixed path, so that the samples show it as it is (a table cell
#: that wraps a path wraps it the same way in every run); one run at a time holds it (a lock file)
WORK = Path("/tmp/sparseety-readme")
#: what the samples show in place of the engine's PID (it differs in every run), as many digits as
#: it has, so that the tables around it keep their borders
SHOWN_PID = "4242424242"
#: the requests sent while attached: client ids and prompts, greedy, a few tokens each
REQUESTS = (
    ("chat-1", "hello the expert router"),
    ("chat-2", "the sparse decode sample"),
    ("chat-3", "one two three"),
)
N_PREDICT = 24
#: the curl the README shows for one request (the samples send each as it does)
CURL = (
    "curl -s localhost:8080/completion -H 'X-Request-Id: chat-1' "
    '-d \'{"prompt": "hello the expert router", "n_predict": 24}\''
)


@dataclass(frozen=True)
class Sample:
    """One command of the quick start: its marker name, its arguments as the README shows them
    ($PID for the engine's PID), how it runs (at once, or attached while requests are sent and
    then stopped with Ctrl-C, SIGINT), and what in its output the check ignores besides numbers:
    the generated model's token text, which another CPU's kernels may round into other tokens,
    and which of the requests' tokens were the slowest."""

    name: str
    args: tuple[str, ...]
    attached: bool = False
    volatile: tuple[str, ...] = ()

    def shown(self) -> str:
        return " ".join(["sparseety-prof", *self.args])


#: `--status-interval`'s line (session/status_line.py format_status), wrapped or not
STATUS_LINE = r"(?s)sparseety-prof: status:.*?ring peak \d+%"

SAMPLES = (
    Sample("doctor", ("doctor", "-p", "$PID")),
    # each request's token text: after its line's head up to the next request's line or the legend
    Sample(
        "attach",
        ("attach", "-p", "$PID"),
        attached=True,
        volatile=(r"(?ms)(?<=\): ).*?(?=^[ ▶] \S+ \d+ tok\b|^log-prob:)", STATUS_LINE),
    ),
    # and the status line a service's log gets every 30 s, which a slow attach may reach
    Sample("record", ("record", "-p", "$PID", "-o", "rec"), attached=True, volatile=(STATUS_LINE,)),
    # the slowest tokens' text, quoted
    Sample("report", ("report", "rec"), volatile=(r"(?<=│ )(['\"]).*?\1(?= *│)",)),
)


# ------------------------------------------------------------------ normalising
_NORMALISE: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"\x1b\[[0-9;?]*[A-Za-z]"), ""),  # terminal escapes, should any slip through
    (re.compile(r"\b(?=[0-9a-f]*[a-f])[0-9a-f]{7,64}\b"), "H"),  # hashes, build ids, commits
    (re.compile(r"\d+(?:[.,:]\d+)*"), "N"),  # every number: times, PIDs, counts, sizes, versions
    (re.compile(r"N\s*(?:ns|µs|us|ms|s|min|h|B|KiB|MiB|GiB|kB|MB|GB)\b"), "N"),  # and its unit
    (re.compile(r"N(?:\s*[-–/x×]\s*N)+"), "N"),  # ranges and ratios of numbers
    (re.compile(r"[─━═│┃┆┊╭╮╯╰┌┐└┘├┤┬┴┼╇╈╋┡┩┏┓┗┛┳┻╸╺|+-]+"), " "),  # table rules and borders
    (re.compile(r"[▁▂▃▄▅▆▇█░▒▓■·•]+"), "#"),  # bars and shades of the live view
)


def normalise(text: str, volatile: tuple[str, ...] = ()) -> set[str]:
    """The words of a command's output with what differs between runs and hosts taken out:
    numbers (and their units), hashes, table rules and bar shades, the `volatile` patterns, and
    every word with a slash or a dot in it (paths: the checkout's, the interpreter's, the kernel's,
    and their pieces where a table cell wraps them). A set, not lines: a longer number makes a
    log line or a table cell wrap elsewhere, and a table split into parts repeats its first
    column. Two outputs that normalise alike print the same words: a new, renamed or missing
    column, check, counter or message is a difference."""
    s = text
    for volatile_pattern in volatile:
        s = re.sub(volatile_pattern, " ", s)
    s = unfold_cells(s)
    for pattern, repl in _NORMALISE:
        s = pattern.sub(repl, s)
    return {w for w in s.split() if "/" not in w and "." not in w}


_CELL_BORDER = re.compile(r"[│┃]")


def unfold_cells(text: str) -> str:
    """The cells of every table, each as one line, with the words a narrow cell folded across
    lines put back together. Rich folds a word longer than its column (a path, a long name) into
    pieces that fill the column to its edge, one a line; where it is cut depends on the column's
    width, which depends on the longest cell, often a path (the checkout's, the interpreter's: the
    host's). A cell line that is one piece without a space and reaches the edge (one space of
    padding) is continued without a space on the row's next line (whose first cell is empty).
    Lines outside tables are kept; a table's cells come after them (the comparison is of words)."""
    kept: list[str] = []
    columns: list[str] = []
    folded: list[bool] = []
    out_cells: list[str] = []

    def end_table() -> None:
        out_cells.extend(columns)
        columns.clear()
        folded.clear()

    for raw in text.splitlines():
        parts = _CELL_BORDER.split(raw)
        if len(parts) < 3:
            end_table()
            kept.append(raw)
            continue
        cells = parts[1:-1]
        if len(cells) != len(columns):
            end_table()
            columns.extend("" for _ in cells)
            folded.extend(False for _ in cells)
        continued = not cells[0].strip()  # a row's next line: its first cell is empty
        for j, cell in enumerate(cells):
            content = cell.strip()
            columns[j] += ("" if folded[j] and continued else " ") + content
            # a piece of one long word (no space) that reaches the edge (one space of padding)
            folded[j] = (
                bool(content) and " " not in content and cell.endswith(" ") and not cell.endswith("  ")
            )
    end_table()
    return "\n".join([*kept, *out_cells])


# ------------------------------------------------------------------ the run
@contextmanager
def scratch(path: Path) -> Iterator[Path]:
    """`path`, emptied, for this run alone (a lock beside it: runs take turns); removed after."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(mode=0o700)
        try:
            yield path
        finally:
            shutil.rmtree(path, ignore_errors=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cli() -> list[str]:
    exe = Path(sys.executable).with_name("sparseety-prof")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "sparseety_prof.cli"]


def _env() -> dict[str, str]:
    env = dict(os.environ, COLUMNS=str(COLUMNS), LINES=str(LINES), NO_COLOR="1", TERM="dumb")
    env.pop("FORCE_COLOR", None)
    return env


@contextmanager
def engine(work: Path) -> Iterator[tuple[int, str]]:
    """xllamacpp's llama-server on a generated MoE model with ReGLU experts, whose activations
    are exactly zero about half the time (scripts/demo_server.py): (pid, url)."""
    model = make_model(work / "models" / "smallthinker.gguf", "smallthinker")
    cmd = [sys.executable, str(ROOT / "scripts" / "demo_server.py"), str(model), "--port", str(_free_port())]
    p = subprocess.Popen(
        cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    try:
        assert p.stdout is not None
        ready: dict[str, object] = {}
        for line in p.stdout:
            if line.startswith("{"):
                ready = json.loads(line)
                break
        if not ready:
            raise SystemExit(f"the engine did not start: {' '.join(cmd)}")
        yield int(str(ready["ready"])), str(ready["url"])
    finally:
        if p.stdin is not None:
            p.stdin.close()
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def send_requests(url: str) -> None:
    """The samples' requests, one after the other, as CURL sends one; each answer read whole."""
    for request_id, prompt in REQUESTS:
        body = json.dumps({"prompt": prompt, "n_predict": N_PREDICT, "temperature": 0}).encode()
        req = urllib.request.Request(f"{url}/completion", data=body, headers={"X-Request-Id": request_id})
        with urllib.request.urlopen(req, timeout=300) as r:
            r.read()


def run_attached(cmd: list[str], cwd: Path, url: str) -> str:
    """A command that attaches: started, the requests sent once it says it is attached, then
    stopped as Ctrl-C stops it; its stdout and stderr together."""
    p = subprocess.Popen(
        cmd, cwd=cwd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    assert p.stdout is not None
    lines: list[str] = []
    attached = threading.Event()

    def read() -> None:
        assert p.stdout is not None
        for line in p.stdout:
            lines.append(line)
            if "attached to PID" in line:
                attached.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 120
        while not attached.wait(0.2):
            if p.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"{' '.join(cmd)} did not attach:\n{''.join(lines)}")
        send_requests(url)
        time.sleep(1.5)  # a drain after the last token: the live view's last frame shows it
        p.send_signal(signal.SIGINT)
        p.wait(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    reader.join(timeout=10)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {p.returncode}:\n{''.join(lines)}")
    return "".join(lines)


def run_samples(work: Path) -> dict[str, str]:
    """Every sample's output as the README shows it (scratch directory and PID replaced)."""
    outputs: dict[str, str] = {}
    with engine(work) as (pid, url):
        for s in SAMPLES:
            cmd = [*_cli(), *(str(pid) if a == "$PID" else a for a in s.args)]
            if s.attached:
                text = run_attached(cmd, work, url)
            else:
                r = subprocess.run(cmd, cwd=work, env=_env(), capture_output=True, text=True, timeout=300)
                if r.returncode != 0:
                    raise SystemExit(f"{' '.join(cmd)} exited {r.returncode}:\n{r.stdout}{r.stderr}")
                text = r.stdout + r.stderr
            if s.name == "record":
                shutil.copytree(work / "rec", work / "rec-kept")  # for make_readme_assets.py
            outputs[s.name] = shown(text, pid)
    return outputs


def shown(text: str, pid: int) -> str:
    """A command's output as the README shows it: the engine's PID replaced by a fixed one,
    trailing spaces gone."""
    text = re.sub(rf"\b{pid}\b", SHOWN_PID[: len(str(pid))], text)
    return "\n".join(line.rstrip() for line in text.splitlines()).strip("\n")


# ------------------------------------------------------------------ the README's blocks
def _block(name: str) -> re.Pattern[str]:
    return re.compile(rf"(<!-- sample:{re.escape(name)} -->\n)(.*?)(<!-- /sample -->)", re.S)


def block_text(sample: Sample, output: str) -> str:
    return f"```console\n$ {sample.shown()}\n{output}\n```\n"


def readme_output(readme: str, sample: Sample) -> str:
    """The output the README shows for a sample (its block without the fence and command)."""
    m = _block(sample.name).search(readme)
    if m is None:
        raise SystemExit(f"README.md has no <!-- sample:{sample.name} --> block")
    body = m.group(2).strip("\n").splitlines()
    if len(body) < 3 or body[0] != "```console" or body[-1] != "```":
        raise SystemExit(f"the {sample.name} sample is not a console block")
    if body[1] != f"$ {sample.shown()}":
        raise SystemExit(f"the {sample.name} sample shows {body[1]!r}, not '$ {sample.shown()}'")
    return "\n".join(body[2:-1])


def _replace_body(text: str) -> Callable[[re.Match[str]], str]:
    """A block's new body between its markers."""
    return lambda m: m.group(1) + text + m.group(3)


def write_samples(readme: str, outputs: dict[str, str]) -> str:
    for s in SAMPLES:
        pattern = _block(s.name)
        if pattern.search(readme) is None:
            raise SystemExit(f"README.md has no <!-- sample:{s.name} --> block")
        text = block_text(s, outputs[s.name])
        readme = pattern.sub(_replace_body(text), readme)
    return readme


def differences(readme: str, outputs: dict[str, str]) -> list[str]:
    """Per sample whose normalised output differs from the README's, the words only one side has."""
    out = []
    for s in SAMPLES:
        was = normalise(readme_output(readme, s), s.volatile)
        now = normalise(outputs[s.name], s.volatile)
        if was != now:
            out.append(
                f"{s.name}: only in README.md: {sorted(was - now)}\n"
                f"{s.name}: only in the output now: {sorted(now - was)}"
            )
    return out


def main(argv: list[str] | None = None, run: Callable[[Path], dict[str, str]] = run_samples) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="compare with README.md instead of rewriting it")
    ap.add_argument("--readme", type=Path, default=README)
    ap.add_argument(
        "--keep", type=Path, help="copy the recording made by `record` here (for make_readme_assets.py)"
    )
    a = ap.parse_args(argv)
    with scratch(WORK) as work:
        outputs = run(work)
        if a.keep is not None:
            shutil.copytree(work / "rec-kept", a.keep)
    readme = a.readme.read_text()
    if a.check:
        diffs = differences(readme, outputs)
        for d in diffs:
            print(d)
        print("samples differ" if diffs else "samples match", file=sys.stderr)
        return 1 if diffs else 0
    a.readme.write_text(write_samples(readme, outputs))
    print(f"wrote {len(SAMPLES)} samples into {a.readme}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
