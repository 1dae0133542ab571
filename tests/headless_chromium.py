"""Open a local HTML file in Debian's headless Chromium: its console messages, the DOM the browser
built, and a screenshot.

Console capture: Chromium run with `--enable-logging=stderr --v=0` writes every console message of
the page to stderr as `[pid:tid:date:INFO:CONSOLE:LINE] "message", source: URL (LINE)` (older
builds: `CONSOLE(LINE)`): console.log/error calls, uncaught exceptions ("Uncaught ...") and the
browser's own complaints, among them every Content-Security-Policy refusal (an injected script,
a load from elsewhere). No DevTools client is needed, and `test_the_console_capture_sees_errors`
checks that this build still reports them. The DOM comes from a second run with `--dump-dom`
(the serialised document after parsing), the screenshot from `--screenshot`."""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

CONSOLE_RE = re.compile(r":CONSOLE(?::\d+|\(\d+\))\] (.*)")
WINDOW = "1400,4000"  # tall enough for the page's panels in one screenshot


@dataclass
class Opened:
    console: list[str]  # every console message, whatever its level
    dom: str  # document.documentElement.outerHTML after parsing
    screenshot: Path


def chromium() -> str:
    exe = shutil.which("chromium")
    assert exe, "chromium is missing: scripts/setup.sh step 1 installs Debian's chromium package"
    return exe


def open_page(page: Path, screenshot: Path, timeout: float = 120) -> Opened:
    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile:
        base = [
            chromium(),
            "--headless=new",
            "--disable-gpu",
            "--no-sandbox",  # the tests run as root
            "--no-first-run",
            f"--user-data-dir={profile}",
            "--enable-logging=stderr",
            "--v=0",
            f"--window-size={WINDOW}",
        ]
        url = page.resolve().as_uri()
        shot = subprocess.run(
            [*base, f"--screenshot={screenshot}", url], capture_output=True, text=True, timeout=timeout
        )
        dump = subprocess.run([*base, "--dump-dom", url], capture_output=True, text=True, timeout=timeout)
    assert shot.returncode == 0 and dump.returncode == 0, shot.stderr[-2000:] + dump.stderr[-2000:]
    assert screenshot.stat().st_size > 0, "chromium wrote no screenshot"
    console = [m.group(1) for r in (shot, dump) for m in CONSOLE_RE.finditer(r.stderr)]
    return Opened(console, dump.stdout, screenshot)


class Dom(HTMLParser):
    """What the tests look at in a serialised DOM: element names, attributes, the text of each
    <section id=...> and the cells of its tables, the tooltips (<title>) of its charts."""

    def __init__(self, markup: str) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[str] = []
        self.attrs: list[tuple[str, str, str]] = []  # (tag, name, value)
        self.section: str | None = None
        self.text: dict[str | None, list[str]] = {}
        self.rows: dict[str | None, list[list[str]]] = {}
        self.titles: dict[str | None, list[str]] = {}
        self.missing: dict[str | None, list[str]] = {}
        self._cell: list[str] | None = None
        self._into: str | None = None  # "title" / "missing" while inside one
        self._buf: list[str] = []
        self.feed(markup)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        for k, v in attrs:
            self.attrs.append((tag, k, v or ""))
        a = dict(attrs)
        if tag == "section":
            self.section = a.get("id")
        elif tag == "tr":
            self.rows.setdefault(self.section, []).append([])
        elif tag in ("td", "th"):
            self._cell = []
        elif tag == "title" and self.section is not None:
            self._into, self._buf = "title", []
        elif tag == "p" and a.get("class") == "missing":
            self._into, self._buf = "missing", []

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self._cell is not None:
            self.rows[self.section][-1].append("".join(self._cell))
            self._cell = None
        elif tag == "section":
            self.section = None
        elif tag in ("title", "p") and self._into is not None:
            target = self.titles if self._into == "title" else self.missing
            target.setdefault(self.section, []).append("".join(self._buf))
            self._into = None

    def handle_data(self, data: str) -> None:
        self.text.setdefault(self.section, []).append(data)
        if self._cell is not None:
            self._cell.append(data)
        if self._into is not None:
            self._buf.append(data)

    def table(self, section: str) -> list[list[str]]:
        """The rows of the section's table, its header row left out."""
        return [r for r in self.rows.get(section, [])[1:] if r]
