"""What the pieces of the recording's journal cost (store/journal.py), each alone: a table's rows
framed (schema.frame) at a drain's size and at a batch's, written as a Parquet file or as an Arrow
IPC stream, or as gathered, unframed (store/gathered_codec.py, and its reading back), and a flush
interval's records written as a file each or appended to one file.

    .venv/bin/python scripts/bench_journal.py [--rows 11 165 2048] [--repeat 20]

CPU time of this process (`time.process_time`: Polars's own threads included), the best of
`--repeat` rounds, with POLARS_MAX_THREADS=1 as in the recorder (session/thread_pools.py). The
rows are synthetic, of the tokens table's columns and dtypes (lists of 8 values).
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

os.environ.setdefault("POLARS_MAX_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import polars as pl

from sparseety_prof.store import gathered_codec, schema
from sparseety_prof.store.ipc_stream import write_stream


def _columns(table: str, n: int) -> dict[str, list[object]]:
    cols: dict[str, list[object]] = {}
    for name, dtype in schema.TABLES[table].items():
        text = str(dtype)
        if text.startswith("List(List"):
            cols[name] = [[[1, 2]] * 4 for _ in range(n)]
        elif text.startswith("List"):
            cols[name] = [list(range(8)) for _ in range(n)]
        elif text in ("String", "Binary"):
            cols[name] = [f"t{i}" if text == "String" else b"t" for i in range(n)]
        elif text == "Boolean":
            cols[name] = [True] * n
        else:
            cols[name] = list(range(n))
    return cols


def _parquet(df: pl.DataFrame) -> None:
    df.write_parquet(io.BytesIO(), compression="lz4", statistics=False)


def _best(fn: Callable[[], object], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.process_time()
        fn()
        best = min(best, time.process_time() - t)
    return best


def _files_against_append(payload: bytes, n: int) -> tuple[float, float]:
    """CPU of `n` payloads as a file each (create, write, rename, fsync, remove) and appended to
    one file (one fsync)."""
    with tempfile.TemporaryDirectory() as d:
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        t = time.process_time()
        for i in range(n):
            f = os.open(f".c{i}.tmp", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=fd)
            os.write(f, payload)
            os.close(f)
            os.replace(f".c{i}.tmp", f"c{i}", src_dir_fd=fd, dst_dir_fd=fd)
        for i in range(n):
            f = os.open(f"c{i}", os.O_RDONLY, dir_fd=fd)
            os.fsync(f)
            os.close(f)
        os.fsync(fd)
        for i in range(n):
            os.unlink(f"c{i}", dir_fd=fd)
        files = time.process_time() - t
        t = time.process_time()
        f = os.open("log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600, dir_fd=fd)
        for _ in range(n):
            os.write(f, payload)
        os.fsync(f)
        os.close(f)
        appended = time.process_time() - t
        os.close(fd)
    return files, appended


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[11, 165, 2048])
    ap.add_argument("--repeat", type=int, default=20)
    a = ap.parse_args()
    print("rows | frame | Parquet (LZ4) | IPC stream | per row, framed | as gathered | read back")
    for n in a.rows:
        cols = _columns("tokens", n)
        df = schema.frame("tokens", cols)
        framed = _best(partial(schema.frame, "tokens", cols), a.repeat)
        pq = _best(partial(_parquet, df), a.repeat)
        ipc = _best(partial(write_stream, df), a.repeat)
        gathered = _best(partial(gathered_codec.encode, [cols]), a.repeat)
        back = _best(partial(gathered_codec.decode, "tokens", gathered_codec.encode([cols])), 3)
        print(
            f"{n} | {framed * 1e6:.0f} µs | {pq * 1e6:.0f} µs | {ipc * 1e6:.0f} µs | "
            f"{framed / n * 1e6:.2f} µs | {gathered * 1e6:.0f} µs | {back * 1e6:.0f} µs"
        )
    payload = write_stream(schema.frame("tokens", _columns("tokens", 165)))
    files, appended = _files_against_append(payload, 40)
    print(
        f"40 records of {len(payload)} bytes: a file each {files * 1e3:.1f} ms (create, write, rename, "
        f"fsync, remove); appended to one file {appended * 1e3:.1f} ms (one fsync)"
    )


if __name__ == "__main__":
    main()
