"""The README's picture: a recording's HTML report (`sparseety-prof report REC --html`) rendered in
Debian's headless Chromium and written to docs/img/report.png.

    .venv/bin/python scripts/readme_samples.py --keep /tmp/rec     # the samples' recording, kept
    .venv/bin/python scripts/make_readme_assets.py /tmp/rec        # -> docs/img/report.png

The page is drawn at a fixed size, top first (the expert load, the routing of one request, the
sparsity), at a reduced scale: the PNG stays small enough to live in the repository.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "img" / "report.png"
#: the viewport (CSS pixels) and the scale it is drawn at: the picture's top of the page
WINDOW = (920, 1560)
SCALE = 0.8


def render_report(recording: Path, page: Path) -> None:
    """The recording's HTML report, written by the package's own command."""
    cmd = [sys.executable, "-m", "sparseety_prof.cli", "report", str(recording), "--html", str(page)]
    subprocess.run(cmd, check=True, cwd=ROOT, timeout=300)


def screenshot(page: Path, png: Path) -> None:
    """`page` in headless Chromium, the viewport's picture into `png`."""
    exe = shutil.which("chromium")
    if exe is None:
        raise SystemExit("chromium is missing (Debian's chromium package; scripts/setup.sh installs it)")
    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile:
        cmd = [
            exe,
            "--headless=new",
            "--disable-gpu",
            "--no-sandbox",  # run as root
            "--no-first-run",
            "--hide-scrollbars",
            f"--user-data-dir={profile}",
            f"--window-size={WINDOW[0]},{WINDOW[1]}",
            f"--force-device-scale-factor={SCALE}",
            f"--screenshot={png}",
            page.resolve().as_uri(),
        ]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if r.returncode != 0 or not png.exists() or png.stat().st_size == 0:
        raise SystemExit(f"chromium wrote no screenshot:\n{r.stderr[-2000:]}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recording", type=Path)
    ap.add_argument("-o", "--output", type=Path, default=OUT)
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="readme-assets-") as tmp:
        page = Path(tmp) / "report.html"
        render_report(a.recording, page)
        a.output.parent.mkdir(parents=True, exist_ok=True)
        screenshot(page, a.output)
    print(f"{a.output}: {a.output.stat().st_size // 1024} KiB", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
