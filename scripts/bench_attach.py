"""Attach time: how long `sparseety-prof record` takes from its start until the probes record,
with the llama_ubatch layout from the verified table and learned on live data (--discover-layout),
on a generating engine (llama-cpp-python, the `bench` model of sparseety_prof/synthetic).

    sudo .venv/bin/python scripts/bench_attach.py [--runs 6] [--threads 2]

Runs alternate table / discovery. For each it prints the wall time from starting the recorder to
its "attached to PID" line, and for discovery the recorder's own split: the discovery probe's
compile, the forward passes watched and the time they took (the main BPF compile is in both), and
for both the ggml_tensor layout check in the engine's memory.
"""

from __future__ import annotations

import argparse
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scripts.bench_overhead import EngineProc  # noqa: E402
from sparseety_prof.synthetic import make_model  # noqa: E402

DISCOVERED = re.compile(r"discovered from (\d+) forward passes in ([\d.]+) s \(\+([\d.]+) s compile\)")
COMPILED = re.compile(r"compiled in ([\d.]+)s")
TENSOR_CHECKED = re.compile(r"ggml_tensor layout .*, ([\d.]+) s\)")


def attach_once(pid: int, out: Path, discover: bool) -> dict[str, float]:
    cmd = [sys.executable, "-m", "sparseety_prof.cli", "record", "--pid", str(pid), "-o", str(out)]
    t0 = time.monotonic()
    rec = subprocess.Popen(
        [*cmd, *(["--discover-layout"] if discover else [])], stderr=subprocess.PIPE, text=True, cwd=ROOT
    )
    assert rec.stderr is not None
    got: dict[str, float] = {}
    for line in rec.stderr:
        if m := DISCOVERED.search(line):
            got |= {"passes": float(m[1]), "discovery_s": float(m[2]), "discovery_compile_s": float(m[3])}
        if m := TENSOR_CHECKED.search(line):
            got["tensor_check_s"] = float(m[1])
        if "attached to PID" in line:
            got["attach_s"] = time.monotonic() - t0
            if m := COMPILED.search(line):
                got["main_compile_s"] = float(m[1])
            break
    else:
        raise RuntimeError(f"recorder exited with {rec.wait()} before attaching")
    rec.send_signal(signal.SIGINT)
    rec.communicate(timeout=120)
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=6, help="runs of each kind (default 6)")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(Path(tmp) / "bench.gguf", "bench")
        engine = EngineProc(model, a.threads)
        stop = threading.Event()

        def generate() -> None:  # a working engine: discovery learns from its forward passes
            while not stop.is_set():
                engine.run(16)

        worker = threading.Thread(target=generate, daemon=True)
        worker.start()
        results: dict[bool, list[dict[str, float]]] = {False: [], True: []}
        try:
            for i in range(a.runs):
                for discover in (False, True) if i % 2 == 0 else (True, False):
                    r = attach_once(engine.pid, Path(tmp) / f"rec-{i}-{int(discover)}", discover)
                    results[discover].append(r)
                    print(
                        f"run {i} {'discovery' if discover else 'table    '}: {r}",
                        file=sys.stderr,
                        flush=True,
                    )
        finally:
            stop.set()
            worker.join(timeout=30)
            engine.close()
    for discover, rs in results.items():
        print(f"{'discovery' if discover else 'table'} ({len(rs)} runs):")
        for key in (
            "attach_s",
            "main_compile_s",
            "discovery_compile_s",
            "discovery_s",
            "passes",
            "tensor_check_s",
        ):
            v = np.array([r[key] for r in rs if key in r])
            if v.size:
                print(f"  {key:20s} median {np.median(v):6.2f}  min {v.min():6.2f}  max {v.max():6.2f}")


if __name__ == "__main__":
    main()
