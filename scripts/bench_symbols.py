"""How long naming a process's libraries takes: the CPU sampler's in-process symbol reader
(capture/elf_symbols.py) against what it replaced, two `nm --defined-only -S -C` runs per file
(the full table, then the dynamic one), on every ELF file a process maps.

    .venv/bin/python scripts/bench_symbols.py [--pid PID]

Without --pid, the process is this one after importing what the llama-cpp-python engine imports
(llama_cpp, numpy): the libraries a sample can land in under that engine. Prints each file's
time both ways and the totals (wall time: the nm runs are child processes).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sparseety_prof.capture.elf_symbols import NotElf, read_symbols
from sparseety_prof.capture.proc_maps import read_maps


def _files(pid: int) -> list[str]:
    seen: dict[tuple[int, int], str] = {}
    for m in read_maps(pid):
        if m.file_backed and not m.deleted and m.path.startswith("/") and "x" in m.perms:
            seen.setdefault((m.dev, m.inode), f"/proc/{pid}/map_files/{m.map_files_name}")
    return list(seen.values())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pid", type=int, help="the process whose mapped files are read (default: this one)")
    args = ap.parse_args()
    if args.pid is None:
        import llama_cpp  # noqa: F401
        import numpy  # noqa: F401
    pid = args.pid or os.getpid()
    total_nm = total_native = 0.0
    print("| file | symbols | nm -S -C, twice | in-process |")
    print("| --- | --- | --- | --- |")
    for link in _files(pid):
        name = os.path.basename(os.readlink(link))
        t0 = time.perf_counter()
        for extra in ([], ["-D"]):
            subprocess.run(
                ["/usr/bin/nm", *extra, "--defined-only", "-S", "-C", link], capture_output=True, check=False
            )
        t1 = time.perf_counter()
        fd = os.open(link, os.O_RDONLY | os.O_NONBLOCK)
        try:
            n = len(read_symbols(fd))
        except NotElf:
            n = 0
        finally:
            os.close(fd)
        t2 = time.perf_counter()
        total_nm += t1 - t0
        total_native += t2 - t1
        print(f"| {name} | {n} | {(t1 - t0) * 1e3:.1f} ms | {(t2 - t1) * 1e3:.1f} ms |")
    print(f"| all {len(_files(pid))} files | | {total_nm:.2f} s | {total_native:.2f} s |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
