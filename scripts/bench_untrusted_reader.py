"""What reading recordings as untrusted costs and saves (docs/threat-model.md, "Recordings from
elsewhere"): the peak memory of decoding a list bomb without the checks and of `report` refusing
it, and the time to read a valid 500,000-row tokens table through `open()` against plain
`pl.read_parquet`. Needs the test helpers (run from the repository root):

    .venv/bin/python scripts/bench_untrusted_reader.py
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import polars as pl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from test_hardening_escapes import small_recording
from test_hardening_recordings import _RSS_PARENT, SEGMENT, _set_rows
from test_recording import META, tokens_frame

import sparseety_prof
from sparseety_prof.store.recording_writer import RecordingWriter


def peak_mib(cmd: list[str], scratch: Path) -> int:
    subprocess.run([sys.executable, "-c", _RSS_PARENT, str(scratch / "rss"), *cmd], capture_output=True)
    return int((scratch / "rss").read_text()) // 1024


def bomb(scratch: Path) -> None:
    rec = small_recording(scratch / "bomb")
    rows = pl.read_parquet(rec / SEGMENT).select(pl.all().gather(np.zeros(5_000, np.int64)))
    lists = pl.Series("top_ids", np.zeros(300_000_000, np.int32)).reshape((5_000, 60_000))
    rows.with_columns(lists.cast(pl.List(pl.Int32))).write_parquet(rec / SEGMENT, compression="zstd")
    del lists
    _set_rows(rec, "tokens", 5_000)
    print(f"list bomb segment: {(rec / SEGMENT).stat().st_size} bytes")
    plain = f"import polars as pl; pl.read_parquet({str(rec / SEGMENT)!r})"
    print(f"  pl.read_parquet: peak {peak_mib([sys.executable, '-c', plain], scratch)} MiB")
    report = [sys.executable, "-m", "sparseety_prof.cli", "report", str(rec)]
    print(f"  sparseety-prof report (refuses it): peak {peak_mib(report, scratch)} MiB")
    imports = [sys.executable, "-c", "import polars, sparseety_prof.cli"]
    print(f"  import polars, sparseety_prof.cli: peak {peak_mib(imports, scratch)} MiB")


def read_time(scratch: Path) -> None:
    rec = scratch / "valid"
    with RecordingWriter(rec, META) as w:
        for i in range(10):
            w.append("tokens", tokens_frame(50_000, start=i * 50_000))
    segs = sorted((rec / "tokens").glob("*.parquet"))
    plain = checked = sort = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        df = pl.concat([pl.read_parquet(s) for s in segs])
        plain = min(plain, time.perf_counter() - t)
        t = time.perf_counter()
        sparseety_prof.open(rec).tokens()
        checked = min(checked, time.perf_counter() - t)
        t = time.perf_counter()
        df.sort(["t_end_ns", "seq_id"], nulls_last=True, maintain_order=True)
        sort = min(sort, time.perf_counter() - t)
    size = sum(s.stat().st_size for s in segs)
    print(f"valid tokens table: {df.height} rows in {len(segs)} segments, {size} bytes (best of 3)")
    print(f"  pl.read_parquet + concat: {plain:.2f} s; open().tokens(): {checked:.2f} s", end="")
    print(f" (its sort: {sort:.2f} s)")


def main() -> None:
    scratch = Path(tempfile.mkdtemp(prefix="sparseety-untrusted-"))
    try:
        bomb(scratch)
        read_time(scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
